"""The VM lab host's bootable root and disk.

``ensure_vm_image`` builds, once, a bootable root: a copy of the cached debootstrap base with
Debian's kernel (``linux-image-amd64``) and initramfs, systemd-networkd, an fstab for
``/dev/vda`` and a serial getty. Built in a temporary directory renamed into place when
complete; its stamp records the base and recipe it was built from. ``build_disk`` makes a VM's
own sparse ext4 disk from that root plus the host's seed files (an overlayfs over the root with
the files in the upper layer, fed to ``mkfs.ext4 -d``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from installer.lab import images
from installer.lab.model import LabError, cache_root
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


def run_checked(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
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
        run_checked(["mount", "-t", "proc", "proc", str(root / "proc")], "mount proc")
        run_checked(["mount", "-t", "sysfs", "sysfs", str(root / "sys")], "mount sysfs")
        run_checked(["mount", "--bind", "/dev", str(root / "dev")], "bind /dev")
        run_checked(["mount", "--bind", "/dev/pts", str(root / "dev/pts")], "bind /dev/pts")
        yield
    finally:
        _umount_all_under(root)


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
    with images.cache_lock("vm-image"):
        if vm_image_ready():
            return _image(target)
        tmp = target.with_name(target.name + ".building")
        _rmtree(tmp)
        log(f"building the lab VM image (base + {' '.join(KERNEL_PACKAGES)}); cached in {target}")
        try:
            run_checked(["cp", "-a", "--reflink=auto", str(base), str(tmp)], "copying the base root")
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
                run_checked([*apt, "update"], "apt-get update (VM image)", env=env)
                run_checked([*apt, "install", "--no-install-recommends", *KERNEL_PACKAGES],
                     "apt-get install (VM image)", env=env)
                run_checked(["chroot", str(tmp), "apt-get", "clean"], "apt-get clean", env=env)
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
        run_checked(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={image.root},upperdir={upper},workdir={work}", str(merged)], "overlay mount")
        run_checked(["mkfs.ext4", "-q", "-F", "-L", "hiddenplane", "-E", "root_owner=0:0", "-d", str(merged),
              str(tmp_disk), size], "mkfs.ext4 (VM disk)")
    finally:
        _rmtree(scratch)
    tmp_disk.rename(disk)
    return disk
