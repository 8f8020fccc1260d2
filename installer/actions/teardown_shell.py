"""The shell side of a host's teardown: the functions every teardown script starts with (``PRELUDE``:
stop a unit of ours, put back or remove one of our files, remove a tree but keep what was
there before us, find the processes of our cgroups and binaries, drop our firewall rules) and
``exe_pids``. installer/actions/teardown_script.py writes the steps that call them."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from installer.core.render.worker import KUBELET_DIR
from installer.core.shellfiles import shell_file
from installer.host.hostops import BACKUP_INFIX

CONTAINERD_RUN = "/run/containerd"
CONTAINERD_DATA = "/var/lib/containerd"
CNI_NETNS = "/run/netns/cni-"           # network namespaces containerd's CRI makes for pods


PRELUDE = shell_file("teardown-prelude.sh", BACKUP_INFIX=BACKUP_INFIX, CONTAINERD_RUN=CONTAINERD_RUN,
                     CONTAINERD_DATA=CONTAINERD_DATA, KUBELET_DIR=KUBELET_DIR, CNI_NETNS=CNI_NETNS)


def exe_pids(binaries: Sequence[str]) -> str:
    """A shell function printing the PIDs whose executable is one of ``binaries`` (also once
    the file is deleted), with one find for all."""
    tests = " -o ".join(f"-lname {shlex.quote(b)} -o -lname {shlex.quote(b + ' (deleted)')}" for b in binaries)
    if not tests:
        return "exe_pids() { :; }"
    return (f'exe_pids() {{ find "$R"/proc/[0-9]*/exe -maxdepth 0 \\( {tests} \\) -print 2>/dev/null '
            "| sed -n 's|.*/proc/\\([0-9]*\\)/exe$|\\1|p'; }")
