"""The cached Debian base root file system every lab host starts from.

Built once with debootstrap (about a minute), into a temporary directory that is renamed into
place only when complete, so an interrupted build never leaves a half base behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
from pathlib import Path

from installer.lab.model import DEBIAN_SUITE, LabError, cache_root

DEBIAN_MIRROR = "http://deb.debian.org/debian"
# systemd + sshd for real hosts; python3-yaml and openssl serve the tests' contract stand-ins,
# procps and iproute2 the host checks; zstd as on an installed Debian 12 (initramfs-tools
# recommends it), so uploads travel zstd-compressed as they would there.
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "iproute2", "ca-certificates",
                 "openssl", "python3", "python3-yaml", "procps", "iptables", "kmod", "zstd")
STAMP = ".hiddenplane-base"


def base_dir() -> Path:
    return cache_root() / "lab" / f"{DEBIAN_SUITE}-base"


def _stamp_text() -> str:
    return f"suite={DEBIAN_SUITE} packages={','.join(BASE_PACKAGES)}\n"


def base_ready(path: Path | None = None) -> bool:
    path = path or base_dir()
    stamp = path / STAMP
    return stamp.is_file() and stamp.read_text() == _stamp_text()


@contextlib.contextmanager
def cache_lock(name: str):
    """Hold the lab cache's lock ``name`` (an flock, released when the process dies): two test
    processes or two `lab up` on a fresh machine build a cache entry once, and neither replaces
    a base the other's running hosts sit on."""
    path = cache_root() / "lab" / f".{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_base(log=print) -> Path:
    """Return the cached base root, building it first if missing or built with other packages."""
    target = base_dir()
    if base_ready(target):
        return target
    with cache_lock("base"):
        if base_ready(target):          # built by another process while this one waited
            return target
        return _build_base(target, log)


def _build_base(target: Path, log) -> Path:
    tmp = target.with_name(target.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the lab base image with debootstrap ({DEBIAN_SUITE}); cached in {target}")
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE,
           str(tmp), DEBIAN_MIRROR]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        shutil.rmtree(tmp, ignore_errors=True)
        raise LabError(f"debootstrap failed (exit {proc.returncode}):\n{tail}")
    # every host gets its own machine-id from systemd on first boot
    (tmp / "etc" / "machine-id").write_text("")
    (tmp / STAMP).write_text(_stamp_text())
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
