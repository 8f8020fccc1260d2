"""`lab up` of a name just torn down, and what `lab up` says when a host does not come up.

Real nspawn hosts throughout: the failures are made in the host's own root (a whiteout, a masked
unit, a halt that fails) before or while it runs, never by replacing lab code.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from installer.lab import lab as lab_mod
from installer.lab import net, nspawn, watch
from installer.lab.model import LabError, LabPaths, LabSpec

from .labfixtures import require_lab_tools
from .test_lab import leftovers


def run_on(name: str, host: str, command: str) -> subprocess.CompletedProcess:
    """``command`` on a lab host over SSH, as the lab's own key and known_hosts allow."""
    paths = LabPaths.of(name)
    spec = lab_mod.load_spec(paths)
    return subprocess.run(lab_mod.ssh_command(paths, spec.host(host), command), capture_output=True, text=True)


pytestmark = pytest.mark.lab

QUIET = dict(log=lambda *_: None)


def processes_using(root: Path) -> list[int]:
    """Live processes whose mount table mentions the lab's directory (an orphaned container's
    init does not name the lab on its command line, but its root overlay names the lab's dirs)."""
    needle = str(root) + "/"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if nspawn._state(int(entry.name)) in (None, "Z", "X"):
                continue
            if needle in (entry / "mountinfo").read_text():
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def nothing_left(spec: LabSpec, paths: LabPaths) -> dict[str, list]:
    left = leftovers(spec, paths)
    left["processes"] = sorted(set(left["processes"]) | set(processes_using(paths.root)))
    left["cgroups"] = [str(d) for h in spec.hosts for d in nspawn.cgroup_dirs(paths.host_dir(h.name)) if d.exists()]
    return left


EMPTY = {"processes": [], "mounts": [], "netns": [], "links": [], "files": [], "cgroups": []}


def container_init(host_dir: Path) -> int:
    """The PID (on the machine) of the host's systemd, nspawn's child."""
    pid = nspawn.pid_of(host_dir)
    assert pid, f"{host_dir.name} is not running"
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def systemd_cgroup(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if ":name=systemd:" in line:
            return line.split(":", 2)[2]
    return next(line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                if line.startswith("0::"))


@pytest.fixture
def lab_name():
    require_lab_tools()
    names = []

    def make(name: str) -> str:
        lab_mod.down(name, **QUIET)          # a previous run that died mid-way
        names.append(name)
        return name
    yield make
    for name in names:
        lab_mod.down(name, **QUIET)


def test_down_then_up_of_the_same_name_back_to_back(lab_name, tmp_path):
    """Each host boots in a cgroup of its own, every unit starts, and `down` leaves nothing,
    not even a container's init, before the next `up` of the same name starts at once."""
    name, subnet = lab_name("relab"), "10.213.226.0/24"
    spec, paths = LabSpec.create(name, 1, 2, 0, subnet), LabPaths.of(name)
    for i in range(3):
        lab_mod.up(name, 1, 2, 0, subnet, tmp_path / "relab.inventory.yaml", **QUIET)
        for h in spec.hosts:
            init = container_init(paths.host_dir(h.name))
            # a shared cgroup (nspawn's /payload) let the hosts' systemds break each other's units
            assert systemd_cgroup(init).startswith(f"/hiddenplane/{name}/{h.name}/"), (i, h.name)
            failed = run_on(name, h.name, "systemctl --failed --no-legend --plain")
            assert failed.returncode == 0 and failed.stdout.strip() == "", (i, h.name, failed.stdout)
        lab_mod.down(name, **QUIET)
        assert nothing_left(spec, paths) == EMPTY, i


def test_down_waits_for_a_host_whose_shutdown_hangs(lab_name, tmp_path):
    """A container whose systemd-halt fails stays in `stopping` forever: killing nspawn alone
    orphaned its init, which outlived `down` and the next `up` of the name."""
    name, subnet = lab_name("hang"), "10.213.227.0/24"
    spec, paths = LabSpec.create(name, 1, 1, 0, subnet), LabPaths.of(name)
    lab_mod.up(name, 1, 1, 0, subnet, tmp_path / "hang.inventory.yaml", **QUIET)
    hang = ("mkdir -p /etc/systemd/system/systemd-halt.service.d && printf '[Service]\\nExecStart=\\n"
            "ExecStart=/bin/false\\n' > /etc/systemd/system/systemd-halt.service.d/fail.conf && "
            "systemctl daemon-reload")
    assert run_on(name, "w1", hang).returncode == 0
    lab_mod.down(name, **QUIET)
    assert nothing_left(spec, paths) == EMPTY


def inner_pid(pid: int) -> int | None:
    """``pid``'s number in its innermost PID namespace (a host's own view), or None once it has
    exited: a host's cgroups hold short-lived processes too, gone between listing and reading."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


def test_down_after_chaos_a_peer_cut_a_stop_job_hung_on_it_and_a_frozen_process(lab_name, tmp_path):
    """What a fault test leaves behind: cp1 cut off the network, a unit on w1 whose stop waits on
    cp1 with no time limit (as a member waits for a lost peer), and a process frozen in a cgroup
    of w1 (state D: SIGKILL takes effect only once thawed). `down` leaves nothing, and `up` of the
    same name boots every host."""
    name, subnet = lab_name("chaos"), "10.213.238.0/24"
    spec, paths = LabSpec.create(name, 1, 1, 0, subnet), LabPaths.of(name)
    lab_mod.up(name, 1, 1, 0, subnet, tmp_path / "chaos.inventory.yaml", **QUIET)
    cp1 = spec.host("cp1")
    peer = ("printf '[Service]\\nExecStart=/bin/sleep infinity\\nExecStop=/bin/bash -c "
            f"\\x27exec 3<>/dev/tcp/{cp1.address}/2380\\x27\\nTimeoutStopSec=infinity\\n' "
            "> /etc/systemd/system/peer.service && systemctl daemon-reload && systemctl start peer && "
            "systemd-run --unit=frozen /bin/sleep infinity && sleep 1 && systemctl show -P MainPID frozen")
    out = run_on(name, "w1", peer)
    assert out.returncode == 0, out.stderr
    inner = int(out.stdout.split()[-1])
    host_dir = paths.host_dir("w1")
    # the frozen process, as seen on this machine: the one in w1's cgroups running that sleep
    sleeper = next(p for p in nspawn.cgroup_pids(host_dir) if inner_pid(p) == inner)
    freezer = next(d for d in nspawn.cgroup_dirs(host_dir) if "freezer" in d.parts[-4]) / "chaos-frozen"
    freezer.mkdir()
    (freezer / "cgroup.procs").write_text(str(sleeper))
    (freezer / "freezer.state").write_text("FROZEN")
    time.sleep(0.5)
    assert nspawn._state(sleeper) == "D"
    net.cut_link(cp1)
    started = time.monotonic()
    lab_mod.down(name, **QUIET)
    print(f"\ndown after the chaos: {time.monotonic() - started:.1f} s")
    assert nothing_left(spec, paths) == EMPTY
    lab_mod.up(name, 1, 1, 0, subnet, tmp_path / "chaos.inventory.yaml", **QUIET)
    for h in spec.hosts:
        assert run_on(name, h.name, "hostname").stdout.strip() == h.name


def test_up_stops_what_an_earlier_boot_left_running(lab_name, tmp_path):
    """nspawn killed (as by OOM or a crash) leaves its container running: `up` stops it before
    booting the host again instead of booting a second system on the same root."""
    name, subnet = lab_name("orphan"), "10.213.228.0/24"
    paths = LabPaths.of(name)
    lab_mod.up(name, 1, 1, 0, subnet, tmp_path / "orphan.inventory.yaml", **QUIET)
    host_dir = paths.host_dir("w1")
    old_init = container_init(host_dir)
    os.kill(nspawn.pid_of(host_dir), signal.SIGKILL)
    while nspawn.pid_of(host_dir) is not None:
        time.sleep(0.1)
    assert nspawn._state(old_init) not in (None, "Z"), "the container should outlive a killed nspawn"
    lab_mod.up(name, 1, 1, 0, subnet, tmp_path / "orphan.inventory.yaml", **QUIET)
    assert nspawn._state(old_init) in (None, "Z")
    assert container_init(host_dir) != old_init
    assert run_on(name, "w1", "hostname").stdout.strip() == "w1"


def _whiteout(upper: Path, path: str) -> None:
    """Hide ``path`` of the base in this host's overlay (overlayfs whiteout: char device 0/0)."""
    target = upper / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))


def test_a_host_that_cannot_boot_is_named_with_its_console(lab_name, tmp_path):
    """A root nspawn refuses to boot: `up` boots it once more, then fails, naming the host, how
    its nspawn ended and its console lines (nspawn's own refusal among them)."""
    name, subnet = lab_name("noboot"), "10.213.229.0/24"
    paths = LabPaths.of(name)
    upper = paths.host_dir("w2") / "upper"
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        _whiteout(upper, path)
    with pytest.raises(LabError) as err:
        lab_mod.up(name, 1, 2, 0, subnet, tmp_path / "noboot.inventory.yaml", **QUIET)
    text = str(err.value)
    assert "w2: exited before sshd answered (twice)" in text, text
    assert "cp1 (" not in text and "w1 (" not in text, text
    assert "nspawn: not running (exited with status 1)" in text, text
    assert f"last lines of {paths.host_dir('w2') / 'console.log'}:" in text, text
    assert "os-release" in text, text        # nspawn's own refusal, from the console log


def test_a_host_whose_sshd_never_starts_is_named_with_what_was_seen(lab_name, tmp_path, monkeypatch):
    """ssh.service masked in the host's root before boot: after the deadline the error names the
    host and shows nspawn alive, its link up, ping answering, port 22 refused and its console."""
    name, subnet = lab_name("nossh"), "10.213.237.0/24"
    paths = LabPaths.of(name)
    unit = paths.host_dir("w1") / "upper" / "etc/systemd/system/ssh.service"
    unit.parent.mkdir(parents=True)
    unit.symlink_to("/dev/null")
    monkeypatch.setitem(watch.SSH_TIMEOUT, "nspawn", 30)
    with pytest.raises(LabError) as err:
        lab_mod.up(name, 1, 2, 0, subnet, tmp_path / "nossh.inventory.yaml", **QUIET)
    text = str(err.value)
    assert "w1: no SSH answer after" in text, text
    assert "cp1 (" not in text and "w2 (" not in text, text
    h = LabSpec.create(name, 1, 2, 0, subnet).host("w1")
    assert f"nspawn: running (pid {nspawn.pid_of(paths.host_dir('w1'))})" in text, text
    assert f"link: {h.veth} up, on hp-{name}; eth0 in {h.netns}: up" in text, text
    assert f"ping {h.address}: answers" in text, text
    assert f"tcp {h.address}:22: refused" in text, text
    console = text.split("last lines of")[1].splitlines()[1:]
    assert console and all(line.startswith("    ") for line in console), text
    assert "\x1b[" not in text
    # the host really is up, only without sshd: the console shows its boot
    assert any("Reached target" in line or "login:" in line for line in console), text
