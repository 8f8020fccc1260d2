"""The local lab, for real: nspawn hosts with systemd and sshd, reached over verified SSH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core import inventory
from installer.core.artifacts import verify
from installer.lab import archives, nspawn
from installer.lab import lab as lab_mod
from installer.lab.debian_artifacts import PACKAGES
from installer.lab.model import LabError, LabPaths, LabSpec

from .labfixtures import start_lab

IMAGE = "localhost/hiddenplane/busybox:lab"

pytestmark = pytest.mark.lab


def live_pids_with(text: str) -> list[int]:
    """PIDs whose command line mentions ``text``; zombies do not count (they hold nothing)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        if "Z" not in state.split()[1] and text in cmdline:
            pids.append(int(entry.name))
    return pids


def leftovers(spec: LabSpec, paths: LabPaths) -> dict[str, list]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if str(paths.root) in line]
    return {
        "processes": live_pids_with(str(paths.root)),
        "mounts": mounts,
        "netns": [n for n in netns if n.startswith(f"hp-{spec.name}-")],
        "links": [ln for ln in links.splitlines()
                  if f" {spec.bridge}:" in ln or f" {spec.bridge}@" in ln or f" hv-{spec.name}-" in ln
                  or f" ht-{spec.name}-" in ln],
        "files": [str(paths.root)] if paths.root.exists() else [],
    }


def test_hosts_answer_verified_ssh_with_their_names(lab):
    for h in lab.spec.hosts:
        proc = subprocess.run(["ssh", "-F", str(lab.ssh_config), h.name,
                               "hostname; systemctl is-system-running --wait"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{h.name}: {proc.stderr}"
        assert proc.stdout.split() == [h.name, "running"], f"{h.name}: {proc.stdout}"


def test_unknown_host_key_is_refused(lab, tmp_path):
    """Host keys are verified, never accepted on first use: an empty known_hosts fails."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    h = lab.spec.hosts[0]
    proc = subprocess.run(["ssh", "-i", str(lab.paths.ssh_key), "-o", f"UserKnownHostsFile={empty}",
                           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{h.address}", "true"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "Host key verification failed" in proc.stderr


def test_testinfra_hosts_by_role(lab):
    for name, host in lab.hosts("control").items():
        assert host.check_output("hostname") == name
        assert host.service("ssh").is_running
        assert host.file("/etc/ssh/ssh_host_ed25519_key").mode == 0o600
    workers = lab.hosts("worker")
    assert sorted(workers) == ["w1", "w2"]
    for name, host in workers.items():
        assert host.interface("eth0").addresses[0] == lab.spec.host(name).address
        # containerd's state dir is a plain directory, not the overlay root
        fstype = host.check_output("findmnt -n -o FSTYPE --target /var/lib/containerd")
        assert fstype != "overlay"


def test_hosts_reach_each_other_but_not_beyond(lab):
    cp1 = lab.host("cp1")
    for h in lab.spec.hosts[1:]:
        assert cp1.run(f"timeout 3 bash -c 'echo > /dev/tcp/{h.address}/22'").rc == 0
    # the bridge forwards nothing off the machine
    assert Path(f"/proc/sys/net/ipv4/conf/{lab.spec.bridge}/forwarding").read_text().strip() == "0"


def test_inventory_is_valid_and_artifacts_verified(lab, lab_inventory):
    inv = inventory.load(lab.inventory)
    assert [(h.name, h.address, h.role) for h in inv.spec.hosts] == \
        [(h.name, h.address, h.role) for h in lab.spec.hosts]
    assert inv.spec.artifacts.source == "dir"
    names = [n for members in PACKAGES.values() for _, n in members]
    digests = verify(inv.artifacts_dir(), names)
    assert set(digests) == set(names)
    assert (lab.paths.root.stat().st_mode & 0o777) == 0o700
    assert (lab.paths.ssh_key.stat().st_mode & 0o777) == 0o600


def test_etcd_from_artifacts_runs_under_systemd_in_a_host(lab):
    """The Debian etcd from the artifacts directory runs as a systemd unit inside a lab host."""
    cp1 = lab.host("cp1")
    subprocess.run(["scp", "-F", str(lab.ssh_config), str(lab.paths.artifacts / "etcd"), "cp1:/usr/local/bin/etcd"],
                   check=True, capture_output=True, timeout=60)
    cmd = ("systemd-run --unit=hp-lab-etcd --property=Type=notify /usr/local/bin/etcd "
           "--data-dir=/tmp/hp-lab-etcd --listen-client-urls=http://127.0.0.1:2399 "
           "--advertise-client-urls=http://127.0.0.1:2399 --listen-peer-urls=http://127.0.0.1:2398")
    try:
        assert cp1.run(cmd).rc == 0
        assert cp1.service("hp-lab-etcd").is_running
        assert '"health":"true"' in cp1.check_output("python3 -c \"import urllib.request;"
                                                     "print(urllib.request.urlopen('http://127.0.0.1:2399/health').read().decode())\"")
    finally:
        cp1.run("systemctl stop hp-lab-etcd; rm -rf /tmp/hp-lab-etcd /usr/local/bin/etcd")


def test_a_worker_runs_a_container_with_its_limits_in_its_own_cgroup(lab, tmp_path):
    """runc in an nspawn worker (nspawn.POD_HOST_ARGS): the built containerd runs a container from
    a locally built image, and the memory limit asked for lands in a cgroup of that worker's
    own tree on the machine (cgroup v1 here), not in another host's or the machine's root."""
    busybox = archives.deb_tree("busybox-static", log=lambda *_: None) / "bin" / "busybox"
    archive = tmp_path / "busybox.tar"
    archives.busybox_image_archive(archive, IMAGE, busybox.read_bytes())
    unit = tmp_path / "containerd.service"
    unit.write_text("[Service]\nExecStart=/usr/local/bin/containerd\nType=notify\nDelegate=yes\nKillMode=process\n")
    art = lab.paths.artifacts
    scp = ["scp", "-F", str(lab.ssh_config)]
    subprocess.run([*scp, *(str(art / b) for b in ("containerd", "ctr", "containerd-shim-runc-v2", "runc")),
                    "w1:/usr/local/bin/"], check=True, capture_output=True, timeout=120)
    subprocess.run([*scp, str(unit), "w1:/etc/systemd/system/hp-lab-containerd.service"], check=True,
                   capture_output=True, timeout=60)
    subprocess.run([*scp, str(archive), "w1:/root/busybox.tar"], check=True, capture_output=True, timeout=60)
    w1 = lab.host("w1")
    try:
        w1.run_expect([0], "systemctl daemon-reload && systemctl start hp-lab-containerd")
        w1.run_expect([0], "ctr -n k8s.io images import /root/busybox.tar")
        out = w1.run(f"ctr -n k8s.io run --rm {IMAGE} hp-lab-pod /bin/busybox echo hiddenplane-lab-ok")
        assert out.rc == 0 and out.stdout.strip() == "hiddenplane-lab-ok", out.stdout + out.stderr
        # a container kept running while its cgroup is read from the machine's side
        host_tree = Path("/sys/fs/cgroup/memory") / nspawn.CGROUP_DIR / lab.spec.name / "w1"
        held = w1.run(f"ctr -n k8s.io run -d --memory-limit 67108864 {IMAGE} hp-lab-held /bin/busybox sleep 60")
        assert held.rc == 0, held.stderr
        pid = w1.check_output("ctr -n k8s.io tasks ls | awk '$1==\"hp-lab-held\" {print $2}'").strip()
        inside = w1.check_output(f"cat /proc/{pid}/cgroup")
        path = next(line.split(":", 2)[2] for line in inside.splitlines() if ":memory:" in line)
        limit = host_tree / path.lstrip("/") / "memory.limit_in_bytes"
        assert limit.read_text().strip() == "67108864", limit
        assert not list(Path("/sys/fs/cgroup/memory").glob("hp-lab-*")), "a container cgroup at the machine's root"
    finally:
        w1.run("ctr -n k8s.io tasks kill -s KILL hp-lab-held; sleep 1; ctr -n k8s.io tasks rm hp-lab-held; "
               "ctr -n k8s.io containers rm hp-lab-held; systemctl stop hp-lab-containerd; "
               "rm -f /etc/systemd/system/hp-lab-containerd.service /root/busybox.tar; systemctl daemon-reload")


def test_up_again_keeps_running_hosts(lab):
    before = {h.name: nspawn.pid_of(lab.paths.host_dir(h.name)) for h in lab.spec.hosts}
    assert all(before.values())
    lab_mod.up(lab.spec.name, 1, 2, 0, lab.spec.subnet, lab.inventory, log=lambda *_: None)
    after = {h.name: nspawn.pid_of(lab.paths.host_dir(h.name)) for h in lab.spec.hosts}
    assert after == before


def test_status_command(lab):
    result = CliRunner().invoke(cli, ["lab", "status", "--name", lab.spec.name])
    assert result.exit_code == 0, result.output
    for h in lab.spec.hosts:
        assert f"{h.name}" in result.output
    assert result.output.count("running") == 3 and result.output.count("ssh ok") == 3


def test_preflight_refuses_clearly(lab):
    # a different shape for an existing lab
    with pytest.raises(LabError, match="already exists as 1 control \\+ 2 workers"):
        lab_mod.up(lab.spec.name, 1, 3, 0, lab.spec.subnet, log=lambda *_: None)
    # another lab on a subnet already in use
    with pytest.raises(LabError, match=r"--subnet 10\.213\.200\.0/24 is already in use"):
        lab_mod.up("other", 1, 1, 0, lab.spec.subnet, log=lambda *_: None)
    assert not LabPaths.of("other").root.exists()
    for args, message in ((["--name", "Bad_Name"], "must be 1-8 lower-case"),
                          (["--name", "x", "--control", "2"], "use 1, 3 or 5"),
                          (["--name", "x", "--subnet", "8.8.8.0/24"], "use a private IPv4 /24")):
        result = CliRunner().invoke(cli, ["lab", "up", *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_not_root_is_refused(tmp_path):
    """As an ordinary user, `lab up` says it needs root and changes nothing."""
    import sys
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-m", "installer.cli.main", "lab", "up", "--name", "nobody"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert "the lab needs root" in proc.stderr
    assert not LabPaths.of("nobody").root.exists()


def test_down_leaves_nothing(tmp_path):
    """A second, throw-away lab: up, then down, then nothing of it remains."""
    small = start_lab("gone", "10.213.201.0/24", tmp_path, controls=1, workers=1)
    assert leftovers(small.spec, small.paths)["processes"], "the lab should be running before down"
    inv_copy = small.inventory
    assert inv_copy.exists()
    result = CliRunner().invoke(cli, ["lab", "down", "--name", "gone"])
    assert result.exit_code == 0, result.output
    assert leftovers(small.spec, small.paths) == {"processes": [], "mounts": [], "netns": [], "links": [], "files": []}
    assert not inv_copy.exists()
    # and down again is a no-op
    assert CliRunner().invoke(cli, ["lab", "down", "--name", "gone"]).exit_code == 0


def test_exit_status_survives_other_subprocesses_reaping(tmp_path):
    """A host that exits at once is reported with its status even after other subprocesses
    were started meanwhile (each Popen reaps the children of dropped Popens it knows of)."""
    import gc
    import time
    nspawn._spawn(["sh", "-c", "echo refusing; exit 3"], tmp_path, dict(os.environ), [])
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while nspawn._state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    for _ in range(3):
        subprocess.run(["true"], check=True)
    assert nspawn.exit_status(tmp_path) == "exited with status 3"
    assert (tmp_path / "console.log").read_text() == "refusing\n"
    assert nspawn.pid_of(tmp_path) is None


def test_reading_a_cgroup_tree_that_changes_meanwhile_never_fails(tmp_path, monkeypatch):
    """`lab down` reads the host's cgroup tree (its processes, frozen cgroups) while the host's
    systemd removes the cgroups of units that ended: a directory gone between being listed and
    being read is skipped. (pathlib's rglob raised FileNotFoundError there: `lab down` after the
    chaos test failed so in CI.) Here a thread keeps making and removing a deep tree while the
    readers run."""
    import threading
    import time as _time

    top = tmp_path / "cg"
    top.mkdir()
    monkeypatch.setattr(nspawn, "cgroup_dirs", lambda host_dir: [top])
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            d = top / "system.slice" / "frozen.service" / "a" / "b"
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text("")
            (d / "freezer.state").write_text("THAWED")
            for p in (d / "cgroup.procs", d / "freezer.state"):
                p.unlink(missing_ok=True)
            for p in (d, d.parent, d.parent.parent):
                try:
                    p.rmdir()
                except OSError:
                    pass
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        deadline = _time.monotonic() + 3
        rounds = 0
        while _time.monotonic() < deadline:
            nspawn._thaw(tmp_path)
            nspawn.cgroup_pids(tmp_path)
            rounds += 1
    finally:
        stop.set()
        t.join()
    assert rounds > 50
