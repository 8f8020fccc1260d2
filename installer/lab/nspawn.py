"""systemd-nspawn hosts: an overlay root over the cached base, booted in its own netns.

Started with --register=no (no machined, no system D-Bus here) and --keep-unit, detached with
setsid; the nspawn PID is kept in the host's directory. SIGTERM to nspawn shuts the container
down cleanly (it asks the container's systemd to halt).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .model import LabError, LabHost
from .seed import write_files


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def _mounted(path: Path) -> bool:
    return str(path.resolve()) in _mount_points()


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    return [m for m in _mount_points() if m.startswith(prefix)]


def mount_root(base: Path, host_dir: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    upper, work, root = host_dir / "upper", host_dir / "work", host_dir / "root"
    for d in (upper, work, root):
        d.mkdir(parents=True, exist_ok=True)
    # seed files go into the upper layer before the mount: they shadow the base's
    write_files(upper, files)
    if not _mounted(root):
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                               f"lowerdir={base},upperdir={upper},workdir={work}", str(root)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise LabError(f"mount overlay for {host_dir.name}: {proc.stderr.strip()}")
    return root


def unmount_root(host_dir: Path) -> None:
    root = host_dir / "root"
    if root.exists() and _mounted(root):
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def pid_of(host_dir: Path) -> int | None:
    """The running nspawn PID of this host, or None (a stale pidfile counts as not running)."""
    try:
        pid = int((host_dir / "pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):     # gone, or exiting right now (ESRCH)
        return None
    # the PID may have been reused by an unrelated process since
    if not cmdline or not cmdline[0].endswith(b"systemd-nspawn") or str(host_dir / "root").encode() not in cmdline:
        return None
    return pid


def boot(host: LabHost, host_dir: Path, root: Path, binds: list[tuple[Path, str]] = ()) -> int:
    if (pid := pid_of(host_dir)) is not None:
        return pid
    cmd = ["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit", "-b",
           f"--network-namespace-path=/run/netns/{host.netns}", f"--machine={host.name}",
           # routes, the CNI bridge and iptables of the pod network, like any real host: the
           # capability acts on the host's own network namespace (the machine's is out of reach)
           "--capability=CAP_NET_ADMIN"]
    cmd += [f"--bind={src}:{dst}" for src, dst in binds]
    # /proc/sys/net is per network namespace: writable for the host's own forwarding and
    # bridge settings, harmless to the machine; the rest of /proc/sys stays read-only
    env = {**os.environ, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "network"}
    with open(host_dir / "console.log", "ab") as console, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=console, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    (host_dir / "pid").write_text(f"{proc.pid}\n")
    return proc.pid


def stop(host_dir: Path, timeout: float = 30) -> None:
    pid = pid_of(host_dir)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_of(host_dir) is None:
            break
        time.sleep(0.2)
    else:
        os.killpg(pid, signal.SIGKILL)
        time.sleep(0.5)
    try:
        os.waitpid(pid, os.WNOHANG)   # reap it when we are its parent
    except ChildProcessError:
        pass
    (host_dir / "pid").unlink(missing_ok=True)
