"""A VM lab worker, for real: qemu (TCG) on a private bridge, verified SSH, systemd running, and
Debian's containerd + runc running a container from a locally built image (no registry).

One VM boots for the whole module (about 20 s to SSH on the 2-core CI machine); teardown stops it
and checks that no qemu process, tap device or bridge is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from installer.lab import archives, seed, vm, vm_image
from installer.lab.model import LabSpec

pytestmark = pytest.mark.vm

SUBNET = "10.213.250.0/24"
IMAGE = "localhost/hiddenplane/busybox:lab"
BOOT_TIMEOUT = 180
CONTAINERD_UNIT = """[Unit]
Description=containerd (hiddenplane lab test)
After=network.target local-fs.target

[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
LimitNOFILE=infinity
TasksMax=infinity

[Install]
WantedBy=multi-user.target
"""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def link_exists(name: str) -> bool:
    return ip("link", "show", "dev", name, check=False).returncode == 0


def live_qemu_pids(host_dir: Path) -> list[int]:
    """qemu processes started for ``host_dir`` that are still alive (zombies hold nothing)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and b"qemu-system" in cmdline and str(host_dir).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


class VMHost:
    def __init__(self, spec: LabSpec, host_dir: Path, key: Path, known_hosts: Path):
        self.spec, self.host, self.host_dir = spec, spec.host("w1"), host_dir
        self.opts = ["-i", str(key), "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known_hosts}",
                     "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                     "-o", "LogLevel=ERROR"]

    def ssh(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", *self.opts, f"root@{self.host.address}", command],
                              capture_output=True, text=True, timeout=timeout)

    def scp(self, sources: list[Path], dest: str, timeout: float = 120) -> None:
        subprocess.run(["scp", "-q", *self.opts, *map(str, sources), f"root@{self.host.address}:{dest}"],
                       check=True, capture_output=True, timeout=timeout)


def wait_for_port(address: str, port: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            with socket.create_connection((address, port), timeout=2) as s:
                if s.recv(8).startswith(b"SSH-"):
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{address}:{port} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def vm_host(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the VM lab tests need root (CI runs as root)")
    missing = vm_image.missing_tools()
    if missing:
        pytest.fail(f"VM hosts need: apt-get install --no-install-recommends {' '.join(missing)}")
    spec = LabSpec.create("vmt", 1, 1, 1, subnet=SUBNET)
    host = spec.host("w1")
    assert host.kind == "vm"
    tmp = tmp_path_factory.mktemp("vm")
    host_dir = tmp / "hosts" / "w1"
    login = seed.load_or_create(tmp / "ssh" / "id_ed25519", "hiddenplane-vm-test")
    host_key = seed.new_ed25519()
    known_hosts = tmp / "ssh" / "known_hosts"
    known_hosts.write_text(seed.known_hosts_line(host, host_key))

    # a run of this test that died mid-way may have left its VM, tap or bridge
    for pid in vm.qemu_pids(host):
        os.kill(pid, signal.SIGKILL)
    if link_exists(host.tap):
        ip("link", "del", host.tap)
    if link_exists(spec.bridge):
        ip("link", "del", spec.bridge)
    ip("link", "add", spec.bridge, "type", "bridge")
    try:
        ip("addr", "add", f"{spec.gateway}/{spec.prefixlen}", "dev", spec.bridge)
        Path(f"/proc/sys/net/ipv4/conf/{spec.bridge}/forwarding").write_text("0\n")   # nothing leaves
        ip("link", "set", spec.bridge, "up")
        vm_image.ensure_vm_image(log=lambda *_: None)
        t = time.monotonic()
        pid = vm.start_vm(spec, host, host_dir, seed.host_files(spec, host, login, host_key), log=lambda *_: None)
        started = time.monotonic() - t
        assert pid in live_qemu_pids(host_dir)
        assert vm.vm_running(host_dir)
        try:
            boot = wait_for_port(host.address, 22, BOOT_TIMEOUT)
        except TimeoutError as e:
            console = (host_dir / "console.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"{e}; console:\n{console}")
        print(f"\nVM w1: disk + qemu start {started:.1f} s, then SSH after {boot:.1f} s")
        yield VMHost(spec, host_dir, tmp / "ssh" / "id_ed25519", known_hosts)
    finally:
        vm.stop_vm(host, host_dir)
        if link_exists(spec.bridge):
            ip("link", "del", spec.bridge)
    assert not vm.vm_running(host_dir)
    assert live_qemu_pids(host_dir) == []
    assert not link_exists(host.tap)
    assert not link_exists(spec.bridge)


def test_ssh_with_verified_host_key(vm_host):
    r = vm_host.ssh("hostname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "w1"


def test_wrong_host_key_is_refused(vm_host, tmp_path):
    """StrictHostKeyChecking really checks: another key for the same address is rejected."""
    other = tmp_path / "known_hosts"
    other.write_text(seed.known_hosts_line(vm_host.host, seed.new_ed25519()))
    opts = [o if not o.startswith("UserKnownHostsFile=") else f"UserKnownHostsFile={other}" for o in vm_host.opts]
    r = subprocess.run(["ssh", *opts, f"root@{vm_host.host.address}", "true"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 255
    assert "host key" in r.stderr.lower() or "HOST IDENTIFICATION" in r.stderr


def test_systemd_is_running(vm_host):
    r = vm_host.ssh("systemctl is-system-running --wait", timeout=150)
    failed = vm_host.ssh("systemctl --failed --no-legend --plain").stdout
    assert r.stdout.strip() == "running", f"{r.stdout.strip()}; failed units:\n{failed}"


def test_vm_host_is_a_real_machine(vm_host):
    """Own kernel, own ext4 disk, cgroup2 with controllers, the seed's static address."""
    r = vm_host.ssh("uname -r; findmnt -no FSTYPE,SOURCE /; cat /sys/fs/cgroup/cgroup.controllers; "
                    "ip -o -4 addr show scope global")
    assert r.returncode == 0, r.stderr
    kernel, root, controllers, addr = r.stdout.splitlines()[:4]
    assert kernel.endswith("-amd64")
    assert root.split() == ["ext4", "/dev/vda"]
    assert {"cpu", "memory", "pids"} <= set(controllers.split())
    assert f"{vm_host.host.address}/24" in addr


def test_containerd_runs_a_locally_built_image(vm_host, tmp_path):
    containerd = archives.deb_tree("containerd", log=lambda *_: None)
    runc = archives.deb_tree("runc", log=lambda *_: None)
    busybox = archives.deb_tree("busybox-static", log=lambda *_: None) / "bin" / "busybox"
    binaries = [containerd / "usr/bin/containerd", containerd / "usr/bin/ctr",
                containerd / "usr/bin/containerd-shim-runc-v2", runc / "usr/sbin/runc"]
    archive = tmp_path / "busybox.tar"
    archives.busybox_image_archive(archive, IMAGE, busybox.read_bytes())
    unit = tmp_path / "containerd.service"
    unit.write_text(CONTAINERD_UNIT)

    vm_host.scp(binaries, "/usr/local/bin/")
    vm_host.scp([unit], "/etc/systemd/system/")
    vm_host.scp([archive], "/root/")
    r = vm_host.ssh("systemctl daemon-reload && systemctl start containerd && systemctl is-active containerd")
    assert r.stdout.strip() == "active", r.stdout + r.stderr + vm_host.ssh("journalctl -u containerd -n 30").stdout
    r = vm_host.ssh("ctr -n k8s.io images import /root/busybox.tar && ctr -n k8s.io images ls -q")
    assert r.returncode == 0, r.stderr
    assert IMAGE in r.stdout.split()
    r = vm_host.ssh(f"ctr -n k8s.io run --rm {IMAGE} hp-vm-test /bin/busybox echo hiddenplane-vm-ok")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hiddenplane-vm-ok"
    # the container ran under runc in its own cgroup and is gone again
    assert vm_host.ssh("ctr -n k8s.io containers ls -q").stdout.strip() == ""


def test_stop_is_graceful_and_idempotent(vm_host):
    t = time.monotonic()
    vm.stop_vm(vm_host.host, vm_host.host_dir)
    took = time.monotonic() - t
    assert not vm.vm_running(vm_host.host_dir)
    assert "Power down" in (vm_host.host_dir / "console.log").read_text(errors="replace")
    assert took < 60
    vm.stop_vm(vm_host.host, vm_host.host_dir)        # again: nothing to do, no error
    assert not link_exists(vm_host.host.tap)
