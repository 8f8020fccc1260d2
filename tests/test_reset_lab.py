"""`installer reset` on a real lab (1 control + 1 worker, nspawn): after `reset --yes` every host
matches the snapshot taken of it fresh, before the first apply: files, units, accounts, routes,
links, iptables rules, the sysctls the installer sets, mounts. A foreign file apply replaced
(backed up) comes back. Without --yes nothing changes; the local state is kept unless --purge;
a second reset is a no-op."""

from __future__ import annotations

import difflib
import subprocess

import pytest

from .labfixtures import standin_lab
from .test_apply_lab import apply_json, run_installer

pytestmark = pytest.mark.lab

NAME, SUBNET = "reset", "10.213.244.0/24"
FOREIGN = "/etc/containerd/config.toml"       # on w1 before apply: the admin's own file
FOREIGN_TEXT = "# containerd config of the admin, there before hiddenplane\n"

# One section per aspect of the host, each a sorted or ordered listing.
#
# files: every path under / with its type, mode and owner (content is compared for the account
# files below; the installer's files are all gone or restored, which type+path already shows).
# Left out, with the reasons:
#   /proc /sys /dev: kernel views, not files; /run and /tmp: tmpfs emptied at each boot (what
#     the installer's components put in /run is checked on its own in the `run` section);
#   /var/log/journal: journald's own files grow and rotate while units log (the installer
#     writes nothing there; its audit log directory /var/log/kubernetes IS compared).
SNAPSHOT = r"""
echo '## files'
find / \( -path /proc -o -path /sys -o -path /dev -o -path /run -o -path /tmp -o -path /var/log/journal \) -prune \
  -o -printf '%p %y %m %u:%g\n' | sort
echo '## run'
ls -d /run/containerd /run/netns/cni-* /run/hiddenplane* 2>/dev/null
echo '## units'
systemctl list-unit-files --no-legend --no-pager | awk '{print $1, $2}' | sort
echo '## accounts'
cat /etc/passwd /etc/group /etc/shadow /etc/gshadow
echo '## routes'
ip route; ip -6 route
echo '## links'
ip -br link | awk '{print $1}' | sort
echo '## iptables'
iptables-save | grep -v '^#' | sed 's/\[[0-9]*:[0-9]*\]//'
ip6tables-save | grep -v '^#' | sed 's/\[[0-9]*:[0-9]*\]//'
echo '## nft'
if command -v nft >/dev/null; then nft list ruleset; fi
echo '## sysctl'
for k in net/ipv4/ip_forward net/ipv6/conf/all/forwarding net/bridge/bridge-nf-call-iptables \
         net/bridge/bridge-nf-call-ip6tables; do echo "$k=$(cat /proc/sys/$k)"; done
echo '## mounts'
awk '{print $5}' /proc/self/mountinfo | sort
echo '## processes'
ps -eo comm= | grep -E '^(etcd|kube|containerd|runc)' | sort
"""


def _without_empty_tables(lines: list[str]) -> list[str]:
    """iptables-save blocks of a table holding only built-in chains with policy ACCEPT and no
    rule are dropped. Why: the routes unit's `iptables -t nat` makes iptables-nft create the nat
    table; reset removes every rule and chain of ours from it, but iptables cannot delete a table
    (only nft can, and the lab hosts have no nft: the teardown drops such a table where nft is
    installed). A table like that filters and translates nothing: it is the fresh host's state."""
    out, block = [], None
    for line in lines:
        if line.startswith("*"):
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "COMMIT":
                body = block[1:-1]
                if not all(b.startswith(":") and b.split()[1] == "ACCEPT" for b in body):
                    out += block
                block = None
        else:
            out.append(line)
    return out


def snapshot(lab, host: str) -> dict[str, list[str]]:
    proc = subprocess.run(["ssh", "-F", str(lab.ssh_config), host, "sh"], input=SNAPSHOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sections: dict[str, list[str]] = {}
    current = None
    for line in proc.stdout.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:], [])
        elif current is not None:
            current.append(line.rstrip())
    sections["iptables"] = _without_empty_tables(sections["iptables"])
    spec = lab.spec.host(host)
    if spec.role == "worker" and spec.kind == "nspawn":
        # the lab bind-mounts a machine directory at /var/lib/containerd on nspawn workers (overlayfs
        # cannot hold containerd's snapshots): a mount point cannot be removed, so reset empties it,
        # and the mode containerd gave the directory (0700) stays. Not a file the installer put there.
        sections["files"] = [line if not line.startswith("/var/lib/containerd d ")
                             else "/var/lib/containerd d (mount point)"
                             for line in sections["files"]]
    return sections


def differences(before: dict[str, list[str]], after: dict[str, list[str]]) -> str:
    out = []
    for key in before.keys() | after.keys():
        a, b = before.get(key, []), after.get(key, [])
        if a != b:
            out.append(f"## {key}\n" + "\n".join(difflib.unified_diff(a, b, "fresh", "now", lineterm="", n=0)))
    return "\n".join(out)


@pytest.fixture(scope="module")
def rlab(tmp_path_factory):
    with standin_lab(NAME, SUBNET, tmp_path_factory.mktemp("resetlab"), controls=1, workers=1) as lab:
        w1 = lab.host("w1")
        w1.run_expect([0], f"mkdir -p /etc/containerd && printf '%s' '{FOREIGN_TEXT}' > {FOREIGN}")
        lab.fresh = {h.name: snapshot(lab, h.name) for h in lab.spec.hosts}
        yield lab


def state_listing(lab) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(lab.state)), p.read_bytes()) for p in lab.state.rglob("*") if p.is_file())


def test_reset_without_yes_changes_nothing(rlab):
    report = apply_json(rlab.inventory, rlab.state)
    assert report["changes"] > 0
    applied = {h.name: snapshot(rlab, h.name) for h in rlab.spec.hosts}
    for name, snap in applied.items():
        assert differences(rlab.fresh[name], snap), f"{name}: apply changed nothing?"
    assert rlab.host("w1").check_output(f"ls {FOREIGN}.hiddenplane-backup-* | wc -l") == "1"

    proc = run_installer("reset", str(rlab.inventory), "--state", str(rlab.state), check_rc=2)
    assert "--yes" in proc.stderr and "w1 (worker):" in proc.stderr and "cp1 (control):" in proc.stderr
    assert proc.stderr.index("w1 (worker):") < proc.stderr.index("cp1 (control):")
    for h in rlab.spec.hosts:
        assert not differences(applied[h.name], snapshot(rlab, h.name)), h.name


def test_reset_yes_leaves_every_host_as_it_was_fresh_and_keeps_the_state(rlab):
    before = state_listing(rlab)
    proc = run_installer("reset", str(rlab.inventory), "--state", str(rlab.state), "--yes", timeout=300)
    assert "w1: reset" in proc.stdout and "cp1: reset" in proc.stdout
    assert f"local state kept: {rlab.state}" in proc.stdout
    # workers first, then the control host
    assert proc.stderr.index("w1: stopped kubelet.service") < proc.stderr.index("cp1: stopped")
    assert f"w1: restored {FOREIGN} (the file that was there before hiddenplane)" in proc.stderr
    for h in rlab.spec.hosts:
        diff = differences(rlab.fresh[h.name], snapshot(rlab, h.name))
        assert not diff, f"{h.name} differs from its fresh snapshot:\n{diff}"
    assert rlab.host("w1").file(FOREIGN).content_string == FOREIGN_TEXT
    assert state_listing(rlab) == before


def test_reset_again_is_a_no_op(rlab):
    proc = run_installer("reset", str(rlab.inventory), "--state", str(rlab.state), "--yes")
    assert "w1: nothing to remove" in proc.stdout and "cp1: nothing to remove" in proc.stdout
    for h in rlab.spec.hosts:
        assert not differences(rlab.fresh[h.name], snapshot(rlab, h.name)), h.name


def test_purge_deletes_the_local_state(rlab):
    assert rlab.state.is_dir()
    proc = run_installer("reset", str(rlab.inventory), "--state", str(rlab.state), "--yes", "--purge")
    assert f"deleted the local state {rlab.state}" in proc.stdout
    assert not rlab.state.exists()
    for h in rlab.spec.hosts:
        assert not differences(rlab.fresh[h.name], snapshot(rlab, h.name)), h.name
