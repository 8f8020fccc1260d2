"""Host teardown without hosts: what the scripts remove and in which order, derived from the
rendered plans; and the real worker and control scripts run under /bin/sh against a directory
standing in for a host's root (``root=``), with fake systemctl, ip, iptables, umount, userdel,
ctr and a fake /proc, and real processes (sleep) listed in a fake cgroup that must be killed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from installer.actions import reset, teardown, teardown_script, teardown_shell
from installer.core.cluster import resolve
from installer.core.facts import MANIFEST, STATE_DIR
from installer.core.inventory import HostSpec
from installer.core.render.network import SYSCTL_FILE
from installer.core.render.worker import SYSCTLS
from installer.host import hostops
from installer.host.fetch import binary_path, role_binaries
from installer.host.ssh import Result

WORKER, CONTROL = "node2", "cp1"
STAMP_OLD, STAMP_NEW = "20240101T000000", "20250101T000000"


@pytest.fixture(scope="module")
def inv(prepared):
    return prepared.inventory


@pytest.fixture(scope="module")
def plans(prepared):
    return prepared.plans


def binaries(role: str) -> list[str]:
    return [binary_path(b) for b in role_binaries(role)]


# --- pure: what is removed, and in which order -----------------------------------------------

def test_backup_naming_is_the_one_hostops_uses():
    # hostops writes backups named <file><infix><stamp>; the teardown's shell looks for that infix
    import shlex
    assert teardown_shell.BACKUP_INFIX == hostops.BACKUP_INFIX
    for prelude in (hostops._PRELUDE, teardown_shell.PRELUDE):
        assert f"BACKUP_INFIX={shlex.quote(hostops.BACKUP_INFIX)}\n" in prelude
    assert '"$2$BACKUP_INFIX$STAMP"' in hostops._PRELUDE


@pytest.mark.parametrize("name", [WORKER, CONTROL])
def test_only_the_installers_paths_are_removed(inv, plans, name):
    plan = plans[name]
    t = teardown.host_teardown(inv, name, plans, data=True)
    # files: exactly the planned ones, the absent ones and the role's binaries
    assert set(t.files) == set(plan.files) | set(plan.absent) | set(binaries(plan.role))
    # directories: planned ones, or parents of our files (never a system directory)
    parents = {p for f in t.files for p in teardown._ancestors(f)}
    extra = {teardown.CNI_DIR, teardown.CONTAINERD_OPT, f"{teardown.CONTAINERD_OPT}/bin",
             f"{teardown.CONTAINERD_OPT}/lib"} if plan.role == "worker" else set()
    assert set(t.dirs) <= set(plan.dirs) | parents | extra
    assert not set(t.dirs) & teardown.SYSTEM_DIRS
    assert {"/usr/local/bin", "/etc", "/opt", "/var/lib", "/etc/systemd/system"}.isdisjoint(t.dirs)
    # deepest first, so that a parent is empty when its turn comes
    depth = [d.count("/") for d in t.dirs]
    assert depth == sorted(depth, reverse=True)
    # whole trees: only the installer's and its components' own places
    if plan.role == "worker":
        assert t.trees == ("/etc/kubernetes", "/var/lib/kubelet", "/var/lib/kube-proxy", "/var/lib/cni",
                           "/etc/cni/net.d", "/run/containerd")
        assert t.data_trees == ("/var/lib/containerd",) and t.users == ()
    else:
        assert t.trees == ("/etc/kubernetes", "/etc/etcd")
        assert t.data_trees == ("/var/lib/etcd", "/var/log/kubernetes")
        assert t.users == (("etcd", "/var/lib/etcd"),)
    assert set(t.units) == set(plan.units)


def test_without_data_the_data_and_its_owner_stay(inv, plans):
    t = teardown.host_teardown(inv, CONTROL, plans, data=False)
    assert t.users == () and t.leftovers == ()
    script = teardown.render_script(t)
    assert "rmtree /var/lib/etcd" not in script and "userdel" not in script
    lines = teardown.host_plan(inv, CONTROL, plans, data=False)
    assert "keep /var/lib/etcd (data)" in lines and "keep the user etcd (it owns the kept data)" in lines


def test_without_binaries_they_stay(inv, plans):
    t = teardown.host_teardown(inv, WORKER, plans, data=True, binaries=False)
    assert not set(binaries("worker")) & set(t.files)
    assert "/usr/local/bin/* | /opt/cni/bin/*) continue" in teardown.render_script(t)   # manifest entries too


GATE = f'[ -d "$R"{STATE_DIR} ] || exit 0'


def order(script: str, *needles: str) -> list[int]:
    """Where each needle first appears in the script's body (after the functions and the gate)."""
    script = script[script.index(GATE):]
    at = []
    for n in needles:
        assert n in script, n
        at.append(script.index(n))
    return at


def test_worker_order_leaves_no_orphans(inv, plans):
    s = teardown.host_script(inv, WORKER, plans, data=True)
    at = order(s, "off kubelet.service", "off kube-proxy.service", "tasks kill -a -s SIGKILL", "tasks delete -f",
               "off containerd.service", "\nreap\n", "\nunmount_ours\n", '"$R"/run/netns/cni-',
               "off hiddenplane-routes-repair.timer", "off hiddenplane-routes.service",
               "ip link delete cni0", "route flush proto 199",
               "clean_rules iptables ip", "clean_rules ip6tables ip6", f'"$R"{SYSCTL_FILE}',
               'for f in $FILES; do rmf "$f"; done', "manifest | sort -u | while", "systemctl daemon-reload",
               "rmtree /etc/kubernetes", "rmtree /var/lib/kubelet", "rmtree /var/lib/containerd", "rmd /opt/cni",
               "could not remove", f'rm -rf "$R"{STATE_DIR}')
    assert at == sorted(at)
    # the gate comes before anything that changes the host: only functions are defined above it
    assert not [line for line in s[:s.index(GATE)].splitlines()
                if line.startswith(("off ", "rmf ", "rmtree ", "reap", "rm ")) and "() {" not in line]


def test_control_order_and_its_user(inv, plans):
    s = teardown.host_script(inv, CONTROL, plans, data=True)
    # the routes' repair timer stops before the routes unit, and both before the flush: nothing
    # puts a route back once the teardown took them away
    at = order(s, "off hiddenplane-routes-repair.timer", "off hiddenplane-routes.service",
               "off kube-scheduler.service", "off kube-controller-manager.service", "off kube-apiserver.service",
               "off etcd.service", "\nreap\n", "route flush proto 199", 'for f in $FILES; do rmf "$f"; done',
               "rmtree /etc/kubernetes", "rmtree /var/lib/etcd", "/var/lib/etcd.pre-restore-", "userdel etcd",
               f'rm -rf "$R"{STATE_DIR}')
    assert at == sorted(at)
    assert "tasks kill" not in s and "ip link delete" not in s      # no runtime, no bridge here


@pytest.mark.parametrize("name", [WORKER, CONTROL])
def test_no_secret_in_the_script(inv, plans, prepared, name):
    """The script travels in argv (sh -c): only paths, never content."""
    s = teardown.host_script(inv, name, plans, data=True)
    assert "PRIVATE KEY" not in s and "BEGIN CERTIFICATE" not in s
    for tok in prepared.material.tokens.values():
        assert tok.secret not in s
    assert prepared.material.encryption_key_b64 not in s


@pytest.mark.parametrize("name", [WORKER, CONTROL])
@pytest.mark.parametrize("data", [True, False])
def test_scripts_parse(inv, plans, name, data, tmp_path):
    p = tmp_path / "s.sh"
    p.write_text(teardown.host_script(inv, name, plans, data=data))
    for shell in ("/bin/sh", "dash", "bash"):
        if shutil.which(shell):
            r = subprocess.run([shell, "-n", str(p)], capture_output=True, text=True)
            assert r.returncode == 0, f"{shell}: {r.stderr}"


def test_a_node_no_longer_in_the_inventory_is_shaped_from_its_role(inv, plans):
    gone = HostSpec(name="node9", address="192.168.56.239", role="worker")
    t = teardown.host_teardown(inv, gone, plans, data=True)
    same = teardown.host_teardown(inv, WORKER, plans, data=True)
    assert t.host == "node9" and t.files == same.files and t.units == same.units and t.trees == same.trees
    with pytest.raises(teardown.TeardownError, match="no host named node9"):
        teardown.host_teardown(inv, "node9", plans, data=True)


def test_human_plan_says_what_and_in_which_order(inv, plans):
    lines = teardown.host_plan(inv, WORKER, plans, data=True)
    assert lines[0] == "stop and disable kubelet.service and kube-proxy.service"
    assert lines[1].startswith("kill and delete every container task")
    assert "remove /var/lib/containerd (data)" in lines and lines[-1] == f"remove {STATE_DIR}"
    assert any("forwarding back to the kernel default" in line for line in lines)
    assert "keep /var/lib/containerd (data)" in teardown.host_plan(inv, WORKER, plans, data=False)


def test_kernel_defaults_cover_every_sysctl_the_installer_sets():
    assert set(teardown_script.KERNEL_DEFAULTS) == set(SYSCTLS)


# --- wipe_host and reset without hosts ---------------------------------------------------------

class FakeRemote:
    def __init__(self, out="", rc=0, err=""):
        self.result, self.scripts = Result(out, err, rc), []

    def run(self, script, **kw):
        self.scripts.append(script)
        return self.result


def fake_hosts(monkeypatch, answer=lambda name, script: Result("", "", 0), unreachable=()):
    """Replace reset's Remote: every script run is recorded in the returned list as (host,
    script) and answered by ``answer``; hosts in ``unreachable`` fail to connect."""
    from installer.host.ssh import HostError
    ran = []

    class Fake:
        def __init__(self, host, inv):
            self.name = host.name

        def open(self):
            if self.name in unreachable:
                raise HostError(self.name, "cannot reach 192.168.56.232:22: timed out")

        def run(self, script, **kw):
            ran.append((self.name, script))
            return answer(self.name, script)

        def close(self):
            pass
    monkeypatch.setattr(reset, "Remote", Fake)
    return ran


def test_wipe_host_returns_and_logs_what_was_done(inv, plans):
    remote, logged = FakeRemote("stopped kubelet.service\nremoved /usr/local/bin/kubelet\n"), []
    done = teardown.wipe_host(inv, inv.host(WORKER), plans, remote, data=True, log=logged.append)
    assert done == ["stopped kubelet.service", "removed /usr/local/bin/kubelet"]
    assert logged == [f"{WORKER}: stopped kubelet.service", f"{WORKER}: removed /usr/local/bin/kubelet"]
    assert len(remote.scripts) == 1 and "off kubelet.service" in remote.scripts[0]


def test_wipe_host_failure_names_the_host(inv, plans):
    remote = FakeRemote("removed /etc/kubernetes\n", 1, "could not remove: /usr/local/bin/kubelet")
    with pytest.raises(teardown.TeardownError, match=f"{WORKER}: teardown failed .*could not remove"):
        teardown.wipe_host(inv, inv.host(WORKER), plans, remote, data=True, log=lambda m: None)


def test_reset_without_yes_prints_the_plan_and_touches_nothing(inv, prepared, monkeypatch):
    def no_ssh(*a, **kw):
        raise AssertionError("reset without --yes connected to a host")
    monkeypatch.setattr(reset, "Remote", no_ssh)
    logged = []
    with pytest.raises(reset.NotConfirmed, match="--yes"):
        reset.reset(resolve(inv, prepared.state.root), log=logged.append)
    assert logged.index(f"{WORKER} (worker):") < logged.index(f"{CONTROL} (control):")   # workers first
    assert f"local state {prepared.state.root}: kept" in logged
    assert prepared.state.root.is_dir()


def test_reset_dry_run_lists_the_same_plan_and_exits_0_touching_no_host(inv, prepared, monkeypatch, tmp_path):
    def no_ssh(*a, **kw):
        raise AssertionError("reset --dry-run connected to a host")
    monkeypatch.setattr(reset, "Remote", no_ssh)
    from click.testing import CliRunner

    from installer.cli.main import cli
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv.model_dump(mode="json", exclude={"base_dir"}), sort_keys=False))
    base = ["reset", str(path), "--state", str(prepared.state.root), "--dry-run"]
    text = CliRunner().invoke(cli, base)
    doc = json.loads(CliRunner().invoke(cli, [*base, "--output", "json"]).output)
    assert text.exit_code == 0, text.output
    assert doc["dryRun"] is True and list(doc["hosts"]) == [WORKER, *[n for n in doc["hosts"] if n != WORKER]]
    assert list(doc["hosts"])[-1] == CONTROL                                        # workers first
    logged = []
    with pytest.raises(reset.NotConfirmed):
        reset.reset(resolve(inv, prepared.state.root), log=logged.append)
    # the plan without --yes and the dry run are one list
    assert [f"  - {step}" for step in doc["hosts"][WORKER]] == \
        logged[logged.index(f"{WORKER} (worker):") + 1:
               logged.index(f"{WORKER} (worker):") + 1 + len(doc["hosts"][WORKER])]
    assert f"  - {doc['hosts'][CONTROL][0]}" in text.output
    assert prepared.state.root.is_dir()


def test_reset_refuses_unknown_hosts_and_purge_of_a_subset(inv):
    with pytest.raises(teardown.TeardownError, match="no host named nope"):
        reset.reset(resolve(inv), hosts=["nope"], yes=True)
    with pytest.raises(teardown.TeardownError, match="--purge .* --host"):
        reset.reset(resolve(inv), hosts=[WORKER], purge=True, yes=True)


def test_reset_does_nothing_when_a_host_is_unreachable(inv, plans, prepared, monkeypatch, tmp_path):
    ran = fake_hosts(monkeypatch, unreachable=("node3",))
    with pytest.raises(teardown.TeardownError, match="node3: cannot reach.*nothing was done on any host"):
        reset.reset(resolve(inv, prepared.state.root), yes=True, log=lambda m: None)
    assert ran == []
    # with --ignore-unreachable the others are reset (workers, then the control host), node3 named
    report = reset.reset(resolve(inv, prepared.state.root), yes=True, ignore_unreachable=True,
                         log=lambda m: None)
    assert report.unreachable == ["node3"]
    wiped = [name for name, script in ran if "off " in script]
    assert wiped == [WORKER, CONTROL]
    assert prepared.state.root.is_dir() and not report.purged


# --- the real scripts under /bin/sh against a stand-in root ------------------------------------

STUB = r"""#!/bin/sh
echo "@NAME@ $*" >> "@LOG@"
case "@NAME@ $*" in
  "systemctl is-active "*) u=$2; [ -e "@STATE@/active.$u" ] && { cat "@STATE@/active.$u"; exit 0; }
    echo inactive; exit 3;;
  "systemctl is-enabled "*) u=$2; [ -e "@STATE@/enabled.$u" ] && { echo enabled; exit 0; }; echo disabled; exit 1;;
  "systemctl stop "*) rm -f "@STATE@/active.$2";;
  "systemctl disable "*) rm -f "@STATE@/enabled.$3";;
  "ip link show cni0") [ -e "@STATE@/cni0" ] || exit 1;;
  "ip link delete cni0") rm -f "@STATE@/cni0";;
  "ip -4 route show proto 199") [ -e "@STATE@/routes" ] && echo "10.244.1.0/24 via 192.168.56.232 proto 199";;
  "ip -4 route flush proto 199") rm -f "@STATE@/routes";;
  "ip -o link show") [ -e "@STATE@/cilium" ] && printf '%s\n' '7: cilium_host@cilium_net: <BROADCAST> mtu 1500' \
      '9: lxc_health@if8: <UP> mtu 1500' '10: lxc0123456789ab@if9: <UP> mtu 1500' '11: lxcbr0: <UP> mtu 1500';;
  "ip link show cilium_host"|"ip link show lxc_health"|"ip link show lxc0123456789ab")
      [ -e "@STATE@/cilium" ] || exit 1;;
  "ip -4 route show proto kernel") [ -e "@STATE@/cilium" ] && \
      echo '10.244.1.0/24 via 10.0.0.2 dev a$(touch@IFS@@STATE@/pwned) proto kernel';;
  "iptables-save -t nat") [ -e "@STATE@/masq" ] && printf '%s\n' '*nat' ':POSTROUTING ACCEPT [0:0]' \
      ':HIDDENPLANE-MASQ - [0:0]' '-A POSTROUTING -j HIDDENPLANE-MASQ' '-A HIDDENPLANE-MASQ -j MASQUERADE' 'COMMIT';;
  "iptables -w -t nat -S POSTROUTING") [ -e "@STATE@/masq" ] && printf '%s\n' '-P POSTROUTING ACCEPT' \
      '-A POSTROUTING -j HIDDENPLANE-MASQ';;
  "iptables -w -t nat -S POSTROUTING 1") [ -e "@STATE@/masq" ] && echo '-A POSTROUTING -j HIDDENPLANE-MASQ';;
  "iptables -w -t nat -X HIDDENPLANE-MASQ") rm -f "@STATE@/masq";;
esac
exit 0
"""

FAKE_CTR = r"""#!/bin/sh
echo "ctr $*" >> "@LOG@"
case "$*" in
  "namespaces ls -q") echo k8s.io;;
  "-n k8s.io tasks ls -q") [ -e "@STATE@/task" ] && echo t1;;
  "-n k8s.io tasks delete -f t1") rm -f "@STATE@/task";;
esac
exit 0
"""


class Root:
    """A directory standing in for a host's / with what apply left there, fake tools on PATH."""

    def __init__(self, tmp_path: Path, inv, plans, name: str):
        self.inv, self.plans, self.name = inv, plans, name
        self.r, self.state, self.bin = tmp_path / "root", tmp_path / "fake-state", tmp_path / "bin"
        self.log = tmp_path / "calls"
        for d in (self.r, self.state, self.bin):
            d.mkdir()
        tools = ["systemctl", "ip", "iptables", "iptables-save", "ip6tables", "ip6tables-save", "nft", "umount",
                 "userdel", "groupdel"]
        for tool in tools:
            self.exe(self.bin / tool, STUB.replace("@NAME@", tool))
        self.env = {"PATH": f"{self.bin}:/usr/bin:/bin", "LC_ALL": "C"}
        self.procs: list[subprocess.Popen] = []

    def exe(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = text.replace("@LOG@", str(self.log)).replace("@STATE@", str(self.state))
        path.write_text(text.replace("@IFS@", "${IFS}"))
        path.chmod(0o755)

    def put(self, path: str, content: bytes = b"x\n") -> Path:
        p = self.r / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        return p

    def exists(self, path: str) -> bool:
        p = self.r / path.lstrip("/")
        return p.exists() or p.is_symlink()

    def installed(self, t) -> None:
        """What apply leaves: every planned file and binary, recorded in the manifest."""
        rows = []
        for f in t.files:
            data = f"ours {f}\n".encode()
            self.put(f, data)
            rows.append(f"{f}\t{hashlib.sha256(data).hexdigest()}\t{len(data)}\t0")
        (self.r / STATE_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self.put(MANIFEST, ("\n".join(rows) + "\n").encode())
        for u in t.units:
            (self.state / f"active.{u}").write_text("active\n")
            (self.state / f"enabled.{u}").write_text("enabled\n")
            self.put(f"/etc/systemd/system/multi-user.target.wants/{u}")
            wants = self.r / f"etc/systemd/system/multi-user.target.wants/{u}"
            wants.unlink()
            wants.symlink_to(f"/etc/systemd/system/{u}")

    def sleeper(self) -> int:
        """A real process to be killed; reaped by a thread as soon as it dies."""
        p = subprocess.Popen(["sleep", "300"], start_new_session=True)
        self.procs.append(p)
        threading.Thread(target=p.wait, daemon=True).start()
        return p.pid

    def run(self, data: bool = True) -> subprocess.CompletedProcess:
        s = teardown.host_script(self.inv, self.name, self.plans, data=data, root=str(self.r))
        # its own session: were it to kill its process group, pytest would survive it
        return subprocess.run(["/bin/sh", "-c", s], capture_output=True, text=True, env=self.env, timeout=120,
                              start_new_session=True)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture
def worker_root(tmp_path, inv, plans):
    root = Root(tmp_path, inv, plans, WORKER)
    yield root
    root.cleanup()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_script_for_real(worker_root, inv, plans):
    h = worker_root
    t = teardown.host_teardown(inv, WORKER, plans, data=True)
    h.installed(t)
    # a foreign file apply replaced: its original is in the oldest backup, a newer one is foreign too
    conf = "/etc/containerd/config.toml"
    h.put(conf + teardown_shell.BACKUP_INFIX + STAMP_OLD, b"the admin's original\n")
    h.put(conf + teardown_shell.BACKUP_INFIX + STAMP_NEW, b"an edit made after apply\n")
    # things that are not ours and must survive
    foreign = ["/usr/local/bin/helm", "/opt/cni/bin/macvlan", "/etc/sysctl.d/99-admin.conf",
               "/etc/systemd/system/admin.service", "/etc/modules-load.d/admin.conf", "/var/lib/other/data",
               "/etc/cni/README"]
    for f in foreign:
        h.put(f, b"not ours\n")
    # what the components made: kubelet credentials and pods, CNI leases, containerd's data
    made = ["/etc/kubernetes/kubelet.conf", "/var/lib/kubelet/pki/kubelet-client-current.pem",
            "/var/lib/kubelet/pods/p1/volumes/v", "/var/lib/cni/networks/hiddenplane/10.244.1.2",
            "/etc/cni/net.d/05-other.conflist", "/run/containerd/io.containerd.runtime.v2.task/k8s.io/t1/config.json",
            "/var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db", "/run/netns/cni-1234",
            "/opt/containerd/bin/.keep"]
    for f in made:
        h.put(f)
    (h.r / "opt/containerd/bin/.keep").unlink()
    (h.r / "opt/containerd/lib").mkdir(parents=True)
    # a manifest entry of an earlier configuration: a unit no longer planned
    h.put("/etc/systemd/system/old-extra.service")
    with open(h.r / MANIFEST.lstrip("/"), "a") as m:
        m.write("/etc/systemd/system/old-extra.service\tabc\t1\t0\n")
    (h.state / "active.old-extra.service").write_text("active\n")
    # the routes' repair: its service (not a planned unit, the timer runs it) in the middle of a run
    (h.state / "active.hiddenplane-routes-repair.service").write_text("activating\n")
    # a timer of an earlier configuration, found in the manifest as the service above is
    h.put("/etc/systemd/system/old-extra.timer")
    with open(h.r / MANIFEST.lstrip("/"), "a") as m:
        m.write("/etc/systemd/system/old-extra.timer\tabc\t1\t0\n")
    (h.state / "active.old-extra.timer").write_text("active\n")
    # containerd running with a task, its socket; the bridge, a route and the masquerade chain
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(h.r / "run/containerd/containerd.sock"))
    h.exe(h.r / "usr/local/bin/ctr", FAKE_CTR)
    for flag in ("task", "cni0", "routes", "masq"):
        (h.state / flag).write_text("")
    # mounts: below the runtime and kubelet dirs (deepest first), the bind-mounted data dir itself
    # (a mount point: emptied, not unmounted), and one that is not ours
    mounts = ["/", "/var/lib/containerd", "/run/containerd/io.containerd.runtime.v2.task/k8s.io/t1/rootfs",
              "/var/lib/kubelet/pods/p1/volumes/v", "/run/netns/cni-1234", "/data"]
    h.put("/proc/self/mountinfo", "".join(f"{i} 1 0:1 / {m} rw - ext4 x rw\n" for i, m in enumerate(mounts)).encode())
    # cgroups: containerd's unit still holds a shim (KillMode=process), a container in its namespace's
    # cgroup; 0 is a process of another PID namespace and must never be signalled
    shim, container = h.sleeper(), h.sleeper()
    h.put("/proc/self/mounts", b"cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
    h.put("/sys/fs/cgroup/system.slice/containerd.service/cgroup.procs", f"0\n{shim}\n".encode())
    h.put("/sys/fs/cgroup/k8s.io/t1/cgroup.procs", f"{container}\n".encode())
    h.put("/sys/fs/cgroup/system.slice/ssh.service/cgroup.procs", f"{os.getpid()}\n".encode())
    # forwarding on (what apply set); a bridge sysctl already at the kernel default
    h.put("/proc/sys/net/ipv4/ip_forward", b"1\n")
    h.put("/proc/sys/net/ipv6/conf/all/forwarding", b"1\n")
    h.put("/proc/sys/net/bridge/bridge-nf-call-iptables", b"1\n")

    r = h.run()
    assert r.returncode == 0, r.stderr
    out, calls = r.stdout.splitlines(), h.calls()

    # processes: the shim and the container are dead; pytest (another unit's cgroup) is not
    assert not alive(shim) and not alive(container)
    assert any(line.startswith("killed 2 leftover process(es)") for line in out), out
    # units: kubelet and kube-proxy, then the task, then containerd; the manifest's extra unit too
    i = {c: n for n, c in enumerate(calls)}
    assert (i["systemctl stop kubelet.service"] < i["systemctl stop kube-proxy.service"]
            < i["ctr -n k8s.io tasks kill -a -s SIGKILL t1"] < i["ctr -n k8s.io tasks delete -f t1"]
            < i["systemctl stop containerd.service"] < i["systemctl stop hiddenplane-routes-repair.timer"]
            < i["systemctl stop hiddenplane-routes.service"] < i["ip -4 route flush proto 199"])
    assert "systemctl stop old-extra.service" in calls and "systemctl stop admin.service" not in calls
    # the repair: its timer disabled, the run stopped, its files gone (no orphan); an old timer too
    assert "systemctl disable --quiet hiddenplane-routes-repair.timer" in calls
    assert "systemctl stop hiddenplane-routes-repair.service" in calls and "systemctl stop old-extra.timer" in calls
    for f in ("/etc/systemd/system/hiddenplane-routes-repair.timer",
              "/etc/systemd/system/hiddenplane-routes-repair.service", "/usr/local/bin/hiddenplane-routes-repair"):
        assert f in t.files and not h.exists(f), f
    assert not h.exists("/etc/systemd/system/old-extra.timer")
    # mounts: ours, deepest first; never the data mount point itself nor a foreign one
    umounts = [c.split(" ", 1)[1].removeprefix(str(h.r)) for c in calls if c.startswith("umount ")]
    assert umounts == ["/var/lib/kubelet/pods/p1/volumes/v", "/run/netns/cni-1234",
                       "/run/containerd/io.containerd.runtime.v2.task/k8s.io/t1/rootfs"]
    # network: bridge, route, masquerade jump and chain, forwarding back to the kernel default
    for c in ("ip link delete cni0", "ip -4 route flush proto 199",
              "iptables -w -t nat -D POSTROUTING 1",
              "iptables -w -t nat -F HIDDENPLANE-MASQ", "iptables -w -t nat -X HIDDENPLANE-MASQ"):
        assert c in calls, c
    assert (h.r / "proc/sys/net/ipv4/ip_forward").read_text() == "0\n"
    assert (h.r / "proc/sys/net/ipv6/conf/all/forwarding").read_text() == "0\n"
    assert (h.r / "proc/sys/net/bridge/bridge-nf-call-iptables").read_text() == "1\n"
    assert "set net.bridge.bridge-nf-call-iptables = 1" not in out
    # files: ours gone, the replaced one back with its original content, the newer backup kept
    for f in t.files:
        if f != conf:
            assert not h.exists(f), f
    assert (h.r / conf.lstrip("/")).read_bytes() == b"the admin's original\n"
    assert h.exists(conf + teardown_shell.BACKUP_INFIX + STAMP_NEW)
    assert f"kept 1 newer backup(s) of {conf} (not written by hiddenplane)" in out
    assert not h.exists("/etc/systemd/system/old-extra.service")
    assert not list((h.r / "etc/systemd/system").glob("*.wants/*"))
    # what the components made is gone; /etc/containerd stays (it holds the restored file)
    for f in made:
        assert not h.exists(f), f
    for d in ("/etc/kubernetes", "/var/lib/kubelet", "/var/lib/kube-proxy", "/var/lib/cni", "/etc/cni/net.d",
              "/run/containerd", "/opt/containerd", STATE_DIR):
        assert not h.exists(d), d
    assert h.exists("/var/lib/containerd") and not any((h.r / "var/lib/containerd").iterdir())
    assert "emptied /var/lib/containerd (a mount point: kept)" in out
    assert h.exists("/etc/containerd")
    # never anything foreign; system directories stay even when empty
    for f in foreign:
        assert (h.r / f.lstrip("/")).read_bytes() == b"not ours\n", f
    assert h.exists("/opt/cni/bin") and h.exists("/etc/cni") and h.exists("/usr/local/bin")
    assert not any(c.startswith(("userdel", "groupdel")) for c in calls)

    # idempotent: a second run does nothing at all, and says nothing
    h.log.unlink()
    again = h.run()
    assert again.returncode == 0 and again.stdout == "" and h.calls() == []


def test_cilium_leftovers_go_and_a_device_name_is_never_run(worker_root, inv, plans):
    """What Cilium's agent left goes; a route through a device whose name holds $(...) (anyone
    with CAP_NET_ADMIN in the host's network namespace names devices) is deleted by its words,
    never evaluated: the reset runs as root."""
    h = worker_root
    h.installed(teardown.host_teardown(inv, WORKER, plans, data=True))
    (h.state / "cilium").write_text("")
    left = ["/etc/cni/net.d/05-cilium.conflist", "/opt/cni/bin/cilium-cni", "/etc/sysctl.d/99-zzz-override_cilium.conf",
            "/run/cilium/cilium.sock", "/sys/fs/bpf/cilium/devices/eth0/links/x",
            "/sys/fs/bpf/tc/globals/cilium_ct4_global"]
    for f in left:
        h.put(f)
    h.put("/sys/fs/bpf/other-tool/map", b"not ours\n")
    h.put("/etc/cni/net.d/10-admin.conflist.cilium_bak", b"the admin's\n")
    r = h.run()
    assert r.returncode == 0, r.stderr
    calls = h.calls()
    assert not (h.state / "pwned").exists(), calls
    assert [c for c in calls if c.startswith("ip link delete")] == \
        ["ip link delete cilium_host", "ip link delete lxc_health", "ip link delete lxc0123456789ab"]
    dels = [c for c in calls if c.startswith("ip -4 route del")]
    assert dels == ["ip -4 route del 10.244.1.0/24 via 10.0.0.2 dev a$(touch${IFS}" + str(h.state) + "/pwned) "
                    "proto kernel"], dels
    assert not any(h.exists(f) for f in left), [f for f in left if h.exists(f)]
    assert not h.exists("/sys/fs/bpf/tc") and h.exists("/sys/fs/bpf/other-tool/map")
    assert (h.r / "etc/cni/net.d/10-admin.conflist").read_bytes() == b"the admin's\n"


def test_control_script_for_real_with_and_without_data(tmp_path, inv, plans):
    h = Root(tmp_path, inv, plans, CONTROL)
    t = teardown.host_teardown(inv, CONTROL, plans, data=True)
    h.installed(t)
    for f in ("/var/lib/etcd/member/wal/0.wal", "/var/lib/etcd.pre-restore-20250101T000000/member/snap/db",
              "/var/lib/etcd.removed-20250101T000000/member/snap/db",
              "/var/log/kubernetes/audit/audit.log", "/etc/kubernetes/pki/etcd/extra-made-later"):
        h.put(f)
    h.put("/etc/passwd", b"root:x:0:0:root:/root:/bin/bash\netcd:x:999:997::/var/lib/etcd:/usr/sbin/nologin\n")
    h.put("/etc/group", b"root:x:0:\netcd:x:997:\n")
    # an older configuration's binary, recorded in the manifest
    h.put("/usr/local/bin/konnectivity-server")
    with open(h.r / MANIFEST.lstrip("/"), "a") as m:
        m.write("/usr/local/bin/konnectivity-server\tabc\t1\t0\n")

    r = h.run(data=False)
    assert r.returncode == 0, r.stderr
    for f in t.files:
        assert not h.exists(f), f
    assert not h.exists("/usr/local/bin/konnectivity-server") and not h.exists("/etc/kubernetes")
    for kept in ("/var/lib/etcd/member/wal/0.wal", "/var/lib/etcd.pre-restore-20250101T000000/member/snap/db",
                 "/var/lib/etcd.removed-20250101T000000/member/snap/db", "/var/log/kubernetes/audit/audit.log"):
        assert h.exists(kept), kept
    assert (h.r / teardown_script.KEPT_DATA.lstrip("/")).read_text() == "/var/lib/etcd\n/var/log/kubernetes\n"
    assert sorted(p.name for p in (h.r / STATE_DIR.lstrip("/")).iterdir()) == ["kept-data"]
    assert not any(c.startswith("userdel") for c in h.calls())
    calls = h.calls()
    stops = [c for c in calls if c.startswith("systemctl stop ")]
    assert stops == [f"systemctl stop {u}" for u in t.units]

    # later, with data: the rest goes, and the user and group made by useradd --system
    r = h.run(data=True)
    assert r.returncode == 0, r.stderr
    for gone in ("/var/lib/etcd", "/var/lib/etcd.pre-restore-20250101T000000", "/var/lib/etcd.removed-20250101T000000",
                 "/var/log/kubernetes", STATE_DIR):
        assert not h.exists(gone), gone
    assert "userdel etcd" in h.calls() and "groupdel etcd" in h.calls()
    assert h.run(data=True).stdout == ""


def test_a_user_that_is_not_the_installers_shape_stays(tmp_path, inv, plans):
    h = Root(tmp_path, inv, plans, CONTROL)
    h.installed(teardown.host_teardown(inv, CONTROL, plans, data=True))
    # Debian's etcd-server package makes its own etcd user, with a comment
    h.put("/etc/passwd", b"etcd:x:120:130:etcd user,,,:/var/lib/etcd:/usr/sbin/nologin\n")
    r = h.run(data=True)
    assert r.returncode == 0, r.stderr
    assert not any(c.startswith(("userdel", "groupdel")) for c in h.calls())


def test_nothing_happens_on_a_host_the_installer_never_touched(tmp_path, inv, plans):
    h = Root(tmp_path, inv, plans, WORKER)
    for f in ("/etc/kubernetes/admin.conf", "/usr/local/bin/kubelet", "/var/lib/kubelet/config.yaml"):
        h.put(f, b"kubeadm's\n")
    (h.state / "active.kubelet.service").write_text("active\n")
    r = h.run()
    assert r.returncode == 0 and r.stdout == "" and h.calls() == []
    assert (h.r / "usr/local/bin/kubelet").read_bytes() == b"kubeadm's\n"


def test_an_unremovable_file_fails_and_keeps_the_state_for_a_rerun(tmp_path, inv, plans):
    h = Root(tmp_path, inv, plans, WORKER)
    t = teardown.host_teardown(inv, WORKER, plans, data=True)
    h.installed(t)
    h.exe(h.bin / "rm", "#!/bin/sh\ncase \"$*\" in *usr/local/bin/kubelet*) exit 1;; esac\nexec /bin/rm \"$@\"\n")
    r = h.run()
    assert r.returncode == 1 and "could not remove: /usr/local/bin/kubelet" in r.stderr
    assert h.exists(STATE_DIR) and h.exists("/usr/local/bin/kubelet")
    (h.bin / "rm").unlink()
    r = h.run()
    assert r.returncode == 0, r.stderr
    assert "removed /usr/local/bin/kubelet" in r.stdout and not h.exists(STATE_DIR)


def test_reset_respects_a_live_apply_lock(inv, prepared, monkeypatch):
    import json
    import time
    live = json.dumps({"machine": "elsewhere", "pid": 1, "since": int(time.time()), "run": "abc"})
    ran = fake_hosts(monkeypatch, lambda name, script: Result(live + "\n", "", 3) if "set -C" in script
                     else Result("", "", 0))
    with pytest.raises(teardown.TeardownError,
                       match=f"{CONTROL}: another command holds the apply lock: .*elsewhere.*nothing was done"):
        reset.reset(resolve(inv, prepared.state.root), yes=True, log=lambda m: None)
    assert not [name for name, script in ran if "off " in script]      # no host was wiped
    # a worker alone: no control host to lock, it is reset
    report = reset.reset(resolve(inv, prepared.state.root), yes=True, hosts=[WORKER], log=lambda m: None)
    assert list(report.hosts) == [WORKER]


def test_reset_takes_a_stale_lock_only_as_apply_does(inv, prepared, monkeypatch):
    """A lock aged past its TTL whose holder may live elsewhere is not broken by reset (as
    before) but refused with the command that breaks it; one whose holder died on this machine
    is taken over after that run's commands were ended on the control hosts."""
    import json
    import time

    from installer.host.applylock import LOCK_TTL, local_identity
    aged = json.dumps({"machine": "elsewhere", "pid": 1, "since": int(time.time() - LOCK_TTL - 60), "run": "old"})
    ran = fake_hosts(monkeypatch, lambda name, script: Result(aged + "\n", "", 3) if "set -C" in script
                     else Result("", "", 0))
    with pytest.raises(teardown.TeardownError, match=f"{CONTROL}: a stale apply lock is held .*"
                       r"re-run with `installer apply --force-unlock`.*nothing was done"):
        reset.reset(resolve(inv, prepared.state.root), yes=True, log=lambda m: None)
    from installer.core.facts import LOCK
    assert not [s for _, s in ran if "off " in s or s == f"rm -f {LOCK}"]     # nothing wiped, nothing broken
    assert [s for _, s in ran if "set -C" in s]

    # a run of this machine that was killed: its pid is gone (the highest a kernel hands out)
    dead = json.dumps({**local_identity().fields(), "pid": 2 ** 22 + 1, "since": int(time.time()),
                       "run": "0123456789abcdef"})
    answered = []

    def answer(name, script):
        if "set -C" in script and name not in answered:
            answered.append(name)
            return Result(dead + "\n", "", 3)
        return Result("", "", 0)
    ran = fake_hosts(monkeypatch, answer)
    logged: list[str] = []
    reset.reset(resolve(inv, prepared.state.root), yes=True, log=logged.append)
    scripts = [s for name, s in ran if name == CONTROL]
    takes = [i for i, s in enumerate(scripts) if "set -C" in s]
    ends = [i for i, s in enumerate(scripts) if "hp-0123456789ab" in s]
    # the dead run's commands ended on the control host, then the lock taken, then the wipe
    assert len(takes) == 2 and ends and takes[0] < ends[0] < takes[1], scripts[:5]
    assert any("breaking a stale apply lock (process" in m for m in logged), logged
    assert [s for s in scripts[takes[1]:] if "off " in s]


def test_a_failed_reset_releases_its_lock(inv, prepared, monkeypatch):
    def answer(name, script):                                  # the worker's wipe fails
        if "off " in script and name == WORKER:
            return Result("", "could not remove: /usr/local/bin/kubelet", 1)
        return Result("", "", 0)
    ran = fake_hosts(monkeypatch, answer)
    with pytest.raises(teardown.TeardownError, match="control hosts not touched"):
        reset.reset(resolve(inv, prepared.state.root), yes=True, log=lambda m: None)
    on_control = [script for name, script in ran if name == CONTROL]
    run = re.search(r'"run": "([0-9a-f]+)"', on_control[0]).group(1)     # the lock the reset took
    assert "set -C" in on_control[0] and "rm -f" in on_control[-1] and f"grep -q {run} " in on_control[-1]
    assert not [s for s in on_control if "off " in s]                   # the control host was not wiped


def test_a_put_back_original_survives_a_later_teardown_with_data(tmp_path, inv, plans):
    h = Root(tmp_path, inv, plans, WORKER)
    h.installed(teardown.host_teardown(inv, WORKER, plans, data=True))
    conf = "/etc/containerd/config.toml"
    h.put(conf + teardown_shell.BACKUP_INFIX + STAMP_OLD, b"the admin's original\n")
    h.put("/var/lib/containerd/io.containerd.content.v1.content/blobs/x")
    assert h.run(data=False).returncode == 0
    assert (h.r / conf.lstrip("/")).read_bytes() == b"the admin's original\n"
    assert h.exists("/var/lib/containerd/io.containerd.content.v1.content/blobs/x")
    assert sorted(p.name for p in (h.r / STATE_DIR.lstrip("/")).iterdir()) == ["kept-data", "restored"]
    r = h.run(data=True)
    assert r.returncode == 0, r.stderr
    assert (h.r / conf.lstrip("/")).read_bytes() == b"the admin's original\n"
    assert not h.exists("/var/lib/containerd") and not h.exists(STATE_DIR)
