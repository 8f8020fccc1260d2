"""VM lab host figures: VM image build (cold, warm), disk build + qemu start, boot to SSH,
boot to ``systemctl is-system-running``, graceful stop.

Needs root and qemu-system-x86. The cold build uses a temporary cache that borrows the cached
debootstrap base (so it times the VM step alone, not debootstrap). Prints figures; never fails on
a time. Run: sudo .venv/bin/python benchmarks/lab_vm.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from installer.lab import images, seed, vm, vm_image
from installer.lab.model import LabSpec

NAME, SUBNET = "vmb", "10.213.251.0/24"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def wait_ssh(address: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, 22), timeout=2) as s:
                if s.recv(8).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{address}:22 did not answer within {timeout} s")


def main() -> None:
    quiet = lambda *_: None  # noqa: E731
    base = images.ensure_base(quiet)
    real_cache = os.environ.get("HIDDENPLANE_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="hp-vm-bench-") as tmp:
        cache = Path(tmp) / "cache"
        (cache / "lab").mkdir(parents=True)
        (cache / "lab" / base.name).symlink_to(base)
        os.environ["HIDDENPLANE_CACHE_DIR"] = str(cache)
        cold, _ = timed(lambda: vm_image.ensure_vm_image(quiet))
        warm, _ = timed(lambda: vm_image.ensure_vm_image(quiet))
        if real_cache is None:
            del os.environ["HIDDENPLANE_CACHE_DIR"]
        else:
            os.environ["HIDDENPLANE_CACHE_DIR"] = real_cache
    print(f"VM image build: cold {cold:.1f} s (base cached), warm {warm * 1000:.0f} ms")

    vm_image.ensure_vm_image(quiet)
    spec = LabSpec.create(NAME, 1, 1, 1, subnet=SUBNET)
    host = spec.host("w1")
    with tempfile.TemporaryDirectory(prefix="hp-vm-bench-") as tmp:
        tmp = Path(tmp)
        login = seed.load_or_create(tmp / "ssh" / "id_ed25519", "bench")
        host_key = seed.new_ed25519()
        known = tmp / "ssh" / "known_hosts"
        known.write_text(seed.known_hosts_line(host, host_key))
        host_dir = tmp / "w1"
        ip("link", "add", spec.bridge, "type", "bridge")
        try:
            ip("addr", "add", f"{spec.gateway}/24", "dev", spec.bridge)
            Path(f"/proc/sys/net/ipv4/conf/{spec.bridge}/forwarding").write_text("0\n")
            ip("link", "set", spec.bridge, "up")
            files = seed.host_files(spec, host, login, host_key)
            t0 = time.perf_counter()
            start, _ = timed(lambda: vm.start_vm(spec, host, host_dir, files, quiet))
            to_ssh, _ = timed(lambda: wait_ssh(host.address))
            ssh = ["ssh", "-i", str(tmp / "ssh" / "id_ed25519"), "-o", f"UserKnownHostsFile={known}",
                   "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{host.address}"]
            state = subprocess.run([*ssh, "systemctl is-system-running --wait"], capture_output=True,
                                   text=True).stdout.strip()
            to_running = time.perf_counter() - t0
            stop, _ = timed(lambda: vm.stop_vm(host, host_dir))
        finally:
            vm.stop_vm(host, host_dir)
            subprocess.run(["ip", "link", "del", spec.bridge], capture_output=True)
    print(f"VM w1: disk + qemu start {start:.1f} s, then SSH after {to_ssh:.1f} s; "
          f"system {state} {to_running:.1f} s after start; graceful stop {stop:.1f} s")


if __name__ == "__main__":
    main()
