"""VM lab hosts: a qemu (TCG) virtual machine for the worker where real containers must run.

In an nspawn host runc cannot create containers (the machine's cgroup v1 hierarchies are
read-only there), so such a worker is a small VM with its own kernel, cgroup2 and ext4 disk.
``/dev/kvm`` does not work on the lab machines: qemu runs with pure emulation (``-accel tcg``),
about ten times slower than native, so a lab has as few VM hosts as possible.

- ``vm_image.ensure_vm_image`` builds the bootable root once; ``vm_image.build_disk`` the VM's disk.
- ``start_vm`` makes the VM's disk, plugs a tap device into the lab bridge and starts qemu
  detached (QMP socket, pidfile and serial console log in the host's directory).
- ``stop_vm`` powers it down over QMP (ACPI power button), kills it after a timeout, removes
  the tap. Idempotent.

Nothing is NATed or forwarded: the VM reaches the lab bridge and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from installer.lab.model import LabError, LabHost, LabSpec
from installer.lab.net import ip, link_exists
from installer.lab.vm_image import CPUS, KERNEL_CMDLINE, MEMORY_MB, VMImage, build_disk, ensure_vm_image, missing_tools


def mac_address(host: LabHost) -> str:
    """Stable, locally administered unicast MAC from the lab name and the host's index."""
    h = hashlib.sha256(host.lab.encode()).digest()
    return f"52:54:{h[0]:02x}:{h[1]:02x}:{(host.index >> 8) & 0xff:02x}:{host.index & 0xff:02x}"


def _pidfile(host_dir: Path) -> Path:
    return host_dir / "pid"


def _qmp_path(host_dir: Path) -> Path:
    return host_dir / "qmp.sock"


def _pid(host_dir: Path) -> int | None:
    """The pid of this host's qemu if it is alive (a pid reused by another program is not)."""
    try:
        pid = int(_pidfile(host_dir).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X") or not cmdline or not cmdline[0].endswith(b"qemu-system-x86_64"):
        return None
    if str(_pidfile(host_dir)).encode() not in cmdline:
        return None
    return pid


def vm_running(host_dir: Path) -> bool:
    return _pid(Path(host_dir)) is not None


def _vm_name(host: LabHost) -> str:
    return f"hp-{host.lab}-{host.name}"


def qemu_pids(host: LabHost) -> list[int]:
    """Live qemu processes of this lab host, from whatever directory (a crashed run's too)."""
    want = _vm_name(host).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and cmdline[0].endswith(b"qemu-system-x86_64") and \
                any(a == b"-name" and b == want for a, b in zip(cmdline, cmdline[1:])):
            pids.append(int(entry.name))
    return pids


def _ensure_tap(spec: LabSpec, host: LabHost) -> None:
    if not link_exists(spec.bridge):
        raise LabError(f"bridge {spec.bridge} does not exist (create the lab network first)")
    if link_exists(host.tap):      # a leftover from a crash: start from a fresh tap
        ip("link", "del", host.tap)
    ip("tuntap", "add", "dev", host.tap, "mode", "tap")
    ip("link", "set", host.tap, "master", spec.bridge)
    ip("link", "set", host.tap, "up")


def qemu_command(image: VMImage, host: LabHost, host_dir: Path) -> list[str]:
    return ["qemu-system-x86_64", "-name", _vm_name(host),
            "-accel", "tcg", "-m", str(MEMORY_MB), "-smp", str(CPUS),
            "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", KERNEL_CMDLINE,
            "-drive", f"file={host_dir / 'disk.img'},if=virtio,format=raw",
            "-netdev", f"tap,id=n0,ifname={host.tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=n0,mac={mac_address(host)}",
            "-device", "virtio-rng-pci",
            "-display", "none", "-vga", "none", "-monitor", "none",
            "-serial", f"file:{host_dir / 'console.log'}",
            "-qmp", f"unix:{_qmp_path(host_dir)},server=on,wait=off",
            "-pidfile", str(_pidfile(host_dir)), "-daemonize"]


def start_vm(spec: LabSpec, host: LabHost, host_dir: Path, files: dict[str, tuple[bytes, int]],
             log=print) -> int:
    """Boot ``host`` as a VM on the lab bridge; returns qemu's pid (it runs on, detached)."""
    host_dir = Path(host_dir).resolve()
    if vm_running(host_dir):
        raise LabError(f"{host.name}: a VM is already running from {host_dir}")
    strays = qemu_pids(host)
    if strays:
        raise LabError(f"{host.name}: qemu {_vm_name(host)} already runs (pid {strays[0]}) from another "
                       "directory; stop it first")
    missing = missing_tools()
    if missing:
        raise LabError(f"VM hosts need: apt-get install --no-install-recommends {' '.join(missing)}")
    image = ensure_vm_image(log)
    log(f"{host.name}: building its VM disk")
    build_disk(image, host_dir, files)
    _ensure_tap(spec, host)
    for stale in (_pidfile(host_dir), _qmp_path(host_dir)):
        stale.unlink(missing_ok=True)
    (host_dir / "console.log").unlink(missing_ok=True)
    log(f"{host.name}: starting qemu (TCG) on {host.tap} ({mac_address(host)})")
    # -daemonize: qemu forks, and its parent exits only once the VM is set up (or failed), so
    # errors (tap, disk, kernel) surface here with qemu's own message
    with open(host_dir / "qemu.log", "wb") as qlog:
        proc = subprocess.run(qemu_command(image, host, host_dir), stdin=subprocess.DEVNULL,
                              stdout=qlog, stderr=subprocess.STDOUT, start_new_session=True)
    if proc.returncode != 0:
        ip("link", "del", host.tap, check=False)
        raise LabError(f"{host.name}: qemu failed (exit {proc.returncode}): "
                       f"{(host_dir / 'qemu.log').read_text(errors='replace').strip()[-600:]}")
    pid = _pid(host_dir)
    if pid is None:
        raise LabError(f"{host.name}: qemu started but is not running; see {host_dir / 'qemu.log'}")
    return pid


def _qmp(host_dir: Path, command: str, timeout: float = 5.0) -> bool:
    """Send one QMP command; True if qemu accepted it."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(_qmp_path(host_dir)))
            f = s.makefile("rwb")
            json.loads(f.readline())                      # greeting
            for cmd in ("qmp_capabilities", command):
                f.write(json.dumps({"execute": cmd}).encode() + b"\n")
                f.flush()
                while True:                                # skip asynchronous events
                    reply = json.loads(f.readline())
                    if "return" in reply or "error" in reply:
                        break
                if "error" in reply:
                    return False
            return True
    except (OSError, ValueError):
        return False


def _wait_gone(pid: int, host_dir: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _pid(host_dir) != pid:
            return True
        time.sleep(0.2)
    return _pid(host_dir) != pid


def stop_vm(host: LabHost, host_dir: Path, timeout: float = 60) -> None:
    """Power the VM down (ACPI, then SIGTERM, then SIGKILL) and remove its tap. Idempotent."""
    host_dir = Path(host_dir).resolve()
    pid = _pid(host_dir)
    if pid is not None:
        if not (_qmp(host_dir, "system_powerdown") and _wait_gone(pid, host_dir, timeout)):
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                if _wait_gone(pid, host_dir, wait):
                    break
            else:
                raise LabError(f"{host.name}: qemu (pid {pid}) did not exit")
    if link_exists(host.tap):
        ip("link", "del", host.tap, check=False)
    for p in (_pidfile(host_dir), _qmp_path(host_dir)):
        p.unlink(missing_ok=True)


# -- a container image without a registry --------------------------------------------------------
