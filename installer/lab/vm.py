"""VM lab hosts: a qemu (TCG) virtual machine for the worker where real containers must run.

In an nspawn host runc cannot create containers (the machine's cgroup v1 hierarchies are
read-only there), so such a worker is a small VM with its own kernel, cgroup2 and ext4 disk.
``/dev/kvm`` does not work on the lab machines: qemu runs with pure emulation (``-accel tcg``),
about ten times slower than native, so a lab has as few VM hosts as possible.

- ``ensure_vm_image`` builds, once, a bootable root: a copy of the cached debootstrap base with
  Debian's kernel (``linux-image-amd64``) and initramfs, systemd-networkd, an fstab for
  ``/dev/vda`` and a serial getty. Built in a temporary directory renamed into place when
  complete; its stamp records the base and recipe it was built from.
- ``start_vm`` makes the VM's own sparse ext4 disk from that root plus the host's seed files
  (an overlayfs over the root with the files in the upper layer, fed to ``mkfs.ext4 -d``),
  plugs a tap device into the lab bridge and starts qemu detached (QMP socket, pidfile and
  serial console log in the host's directory).
- ``stop_vm`` powers it down over QMP (ACPI power button), kills it after a timeout, removes
  the tap. Idempotent.

Nothing is NATed or forwarded: the VM reaches the lab bridge and nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from installer.lab import images
from installer.lab.model import LabError, LabHost, LabSpec, cache_root
from installer.lab.net import ip, link_exists
from installer.lab.debian_artifacts import debs_dir, download
from installer.lab.seed import write_files

VM_RECIPE = 3                       # bump when the image recipe below changes
KERNEL_PACKAGES = ("linux-image-amd64",)
DISK_SIZE = "4G"
MEMORY_MB = 2048
CPUS = 2
STAMP = ".hiddenplane-vm"
# Debian package that provides each tool the VM host needs on the machine.
TOOLS = {"qemu-system-x86_64": "qemu-system-x86", "mkfs.ext4": "e2fsprogs", "ip": "iproute2"}
# initramfs: only what mounting /dev/vda needs; a smaller initrd boots much faster under TCG
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "ext4", "crc32c_generic")
KERNEL_CMDLINE = ("root=/dev/vda rw console=ttyS0 panic=-1 mitigations=off "
                  "systemd.show_status=auto loglevel=4")


@dataclass(frozen=True)
class VMImage:
    root: Path          # the VM's root file system (a directory)
    kernel: Path        # vmlinuz inside root/boot
    initrd: Path        # initrd.img inside root/boot


def vm_image_dir() -> Path:
    return cache_root() / "lab" / f"{images.DEBIAN_SUITE}-vm"


def missing_tools() -> list[str]:
    """Debian packages the machine still needs before it can run VM hosts."""
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    # qemu finds virtio-net's option ROM in ipxe-qemu; without it the device fails to start
    if "qemu-system-x86" not in missing and not Path("/usr/lib/ipxe/qemu/efi-virtio.rom").exists():
        missing.append("ipxe-qemu")
    return missing


def _stamp_text() -> str:
    base = (images.base_dir() / images.STAMP).read_text().strip()
    return (f"recipe={VM_RECIPE} kernel={','.join(KERNEL_PACKAGES)} "
            f"initramfs-modules={','.join(INITRAMFS_MODULES)} base=[{base}]\n")


def _image(root: Path) -> VMImage:
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if len(kernels) != 1 or len(initrds) != 1:
        raise LabError(f"{root}/boot: expected one kernel and one initrd, found "
                       f"{[k.name for k in kernels]} {[i.name for i in initrds]}")
    return VMImage(root, kernels[0], initrds[0])


def vm_image_ready() -> bool:
    stamp = vm_image_dir() / STAMP
    return images.base_ready() and stamp.is_file() and stamp.read_text() == _stamp_text()


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise LabError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) if path.exists() else str(path)
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                found.append(target)
    return found


def _umount_all_under(path: Path) -> None:
    """Unmount everything below ``path``, deepest first (lazily if busy)."""
    for target in sorted(_mounts_under(path), key=len, reverse=True):
        if subprocess.run(["umount", target], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", target], capture_output=True)


def _rmtree(path: Path) -> None:
    """rmtree, but never through a mount point (a bind of /dev must not lose its nodes)."""
    _umount_all_under(path)
    left = _mounts_under(path)
    if left:
        raise LabError(f"cannot remove {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _chroot_mounts(root: Path):
    """/proc, /sys, /dev and /dev/pts for a chroot, always unmounted afterwards."""
    try:
        _run(["mount", "-t", "proc", "proc", str(root / "proc")], "mount proc")
        _run(["mount", "-t", "sysfs", "sysfs", str(root / "sys")], "mount sysfs")
        _run(["mount", "--bind", "/dev", str(root / "dev")], "bind /dev")
        _run(["mount", "--bind", "/dev/pts", str(root / "dev/pts")], "bind /dev/pts")
        yield
    finally:
        _umount_all_under(root)


@contextlib.contextmanager
def _lock(name: str):
    path = cache_root() / "lab" / f".{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _enable(root: Path, target: str, unit: str, source: str | None = None) -> None:
    """What ``systemctl enable`` does, as a symlink (works on a root that is not running)."""
    wants = root / "etc/systemd/system" / f"{target}.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if not link.is_symlink():
        link.symlink_to(f"/lib/systemd/system/{source or unit}")


def _mask(root: Path, unit: str) -> None:
    link = root / "etc/systemd/system" / unit
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to("/dev/null")


def _configure(root: Path) -> None:
    (root / "etc/fstab").write_text("# hiddenplane lab VM: its own virtio disk\n"
                                    "/dev/vda / ext4 rw,errors=remount-ro 0 1\n")
    _enable(root, "multi-user.target", "systemd-networkd.service")
    _enable(root, "sockets.target", "systemd-networkd.socket")
    _enable(root, "network-online.target", "systemd-networkd-wait-online.service")
    (root / "etc/systemd/system/systemd-networkd.service").unlink(missing_ok=True)
    alias = root / "etc/systemd/system/dbus-org.freedesktop.network1.service"
    if not alias.is_symlink():
        alias.symlink_to("/lib/systemd/system/systemd-networkd.service")
    _enable(root, "getty.target", "serial-getty@ttyS0.service", "serial-getty@.service")
    # no tty to answer systemd-firstboot's prompts (an empty machine-id makes every boot a
    # "first boot" until it is committed); no package updates or periodic jobs in the lab
    for unit in ("systemd-firstboot.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                 "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer", "getty@tty1.service"):
        _mask(root, unit)
    # the lab has no DNS server: names are in /etc/hosts (seed files)
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text("# hiddenplane lab: no DNS; lab names are in /etc/hosts\n")
    (root / "etc/machine-id").write_text("")
    for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for p in (root / leftover).glob("*"):
            if p.is_file():
                p.unlink()


def ensure_vm_image(log=print) -> VMImage:
    """The cached bootable VM root (built on first use: about 15 s once the base is cached)."""
    target = vm_image_dir()
    base = images.ensure_base(log).resolve()      # copy the tree, never a symlink to it
    with _lock("vm-image"):
        if vm_image_ready():
            return _image(target)
        tmp = target.with_name(target.name + ".building")
        _rmtree(tmp)
        log(f"building the lab VM image (base + {' '.join(KERNEL_PACKAGES)}); cached in {target}")
        try:
            _run(["cp", "-a", "--reflink=auto", str(base), str(tmp)], "copying the base root")
            (tmp / images.STAMP).unlink(missing_ok=True)
            policy = tmp / "usr/sbin/policy-rc.d"      # start no service inside the chroot
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
            resolv = tmp / "etc/resolv.conf"
            resolv.unlink(missing_ok=True)
            shutil.copyfile("/etc/resolv.conf", resolv)
            conf = tmp / "etc/initramfs-tools"
            conf.mkdir(parents=True, exist_ok=True)
            (conf / "conf.d").mkdir(exist_ok=True)
            (conf / "conf.d/hiddenplane-lab.conf").write_text("MODULES=list\nCOMPRESS=gzip\n")
            (conf / "modules").write_text("".join(f"{m}\n" for m in INITRAMFS_MODULES))
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C.UTF-8"}
            apt = ["chroot", str(tmp), "apt-get", "-q", "-y", "-o", "Dpkg::Use-Pty=0"]
            with _chroot_mounts(tmp):
                _run([*apt, "update"], "apt-get update (VM image)", env=env)
                _run([*apt, "install", "--no-install-recommends", *KERNEL_PACKAGES],
                     "apt-get install (VM image)", env=env)
                _run(["chroot", str(tmp), "apt-get", "clean"], "apt-get clean", env=env)
            policy.unlink()
            _configure(tmp)
            _image(tmp)                                  # one kernel, one initrd
            (tmp / STAMP).write_text(_stamp_text())
        except BaseException:
            _rmtree(tmp)
            raise
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return _image(target)


# -- one VM ------------------------------------------------------------------------------------

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


def build_disk(image: VMImage, host_dir: Path, files: dict[str, tuple[bytes, int]],
               size: str = DISK_SIZE) -> Path:
    """host_dir/disk.img: a sparse ext4 of the VM root with ``files`` laid over it."""
    host_dir.mkdir(parents=True, exist_ok=True)
    disk = host_dir / "disk.img"
    scratch = host_dir / "disk-build"
    upper, work, merged = scratch / "upper", scratch / "work", scratch / "merged"
    _rmtree(scratch)
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    write_files(upper, files)
    # directories the files created take the lower root's owner and mode (/root stays 0700)
    for d in sorted(p for p in upper.rglob("*") if p.is_dir()):
        lower = image.root / d.relative_to(upper)
        if lower.is_dir() and not lower.is_symlink():
            st = lower.stat()
            os.chown(d, st.st_uid, st.st_gid)
            os.chmod(d, st.st_mode & 0o7777)
    disk.unlink(missing_ok=True)
    tmp_disk = host_dir / "disk.img.building"
    tmp_disk.unlink(missing_ok=True)
    try:
        _run(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={image.root},upperdir={upper},workdir={work}", str(merged)], "overlay mount")
        _run(["mkfs.ext4", "-q", "-F", "-L", "hiddenplane", "-E", "root_owner=0:0", "-d", str(merged),
              str(tmp_disk), size], "mkfs.ext4 (VM disk)")
    finally:
        _rmtree(scratch)
    tmp_disk.rename(disk)
    return disk


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

def _tar_bytes(entries: list[tuple[str, bytes | None, int, str | None]]) -> bytes:
    """A reproducible tar: (path, content or None for a directory, mode, symlink target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content, mode, link in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime, info.uid, info.gid = mode, 0, 0, 0
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def build_image_archive(out: Path, name: str, files: dict[str, tuple[bytes, int]],
                        cmd: list[str], env: list[str] | None = None,
                        links: dict[str, str] | None = None, entrypoint: list[str] | None = None) -> str:
    """Write an OCI image layout tar (one uncompressed layer holding ``files``, and ``links``:
    symlink path -> target) that ``ctr images import`` and ``podman load`` accept; returns the
    image's manifest digest.

    ``name`` is the full reference (e.g. ``localhost/hiddenplane/busybox:lab``).
    """
    links = links or {}
    dirs = set()
    for path in [*files, *links]:
        parts = path.strip("/").split("/")[:-1]
        dirs.update("/".join(parts[:i + 1]) for i in range(len(parts)))
    dirs.update({"tmp", "proc", "sys", "dev", "etc"})
    entries = [(d, None, 0o1777 if d == "tmp" else 0o755, None) for d in sorted(dirs)]
    entries += [(p.strip("/"), content, mode, None) for p, (content, mode) in sorted(files.items())]
    entries += [(p.strip("/"), None, 0o777, target) for p, target in sorted(links.items())]
    layer = _tar_bytes(entries)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": env or ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "Cmd": cmd,
                   **({"Entrypoint": entrypoint} if entrypoint else {})},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hiddenplane lab"}],
    }, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": len(manifest),
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}],
    }, sort_keys=True).encode()
    blobs = [(d.split(":")[1], b) for d, b in ((layer_digest, layer), (config_digest, config),
                                              (manifest_digest, manifest))]
    archive = _tar_bytes([("blobs", None, 0o755, None), ("blobs/sha256", None, 0o755, None)] +
                         [(f"blobs/sha256/{h}", b, 0o644, None) for h, b in blobs] +
                         [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644, None),
                          ("index.json", index, 0o644, None)])
    out.write_bytes(archive)
    return manifest_digest


def busybox_image_archive(out: Path, name: str, busybox: bytes) -> str:
    """An image whose only program is a static busybox (Debian ``busybox-static``)."""
    files = {"/bin/busybox": (busybox, 0o755)}
    return build_image_archive(out, name, files, ["/bin/busybox", "sh"])


def deb_tree(package: str, log=print) -> Path:
    """A Debian package's files, unpacked (``dpkg-deb -x``, nothing installed) into the cache
    once per package version; returns the tree's root (e.g. ``root/usr/bin/ctr``)."""
    deb = download([package], log)[package]
    if deb is None:
        raise LabError(f"apt-get download {package}: no .deb")
    tree = debs_dir() / "unpacked" / deb.name.removesuffix(".deb")
    if (tree / ".complete").is_file():
        return tree
    tmp = tree.with_name(tree.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"dpkg-deb -x {deb.name}")
    (tmp / ".complete").write_text(f"{deb.name}\n")
    shutil.rmtree(tree, ignore_errors=True)
    tmp.rename(tree)
    return tree
