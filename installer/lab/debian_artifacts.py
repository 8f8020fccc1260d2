"""Fill a lab's artifacts directory from Debian packages, for everything Debian has.

etcd, etcdctl, containerd, ctr, containerd-shim-runc-v2, runc and the CNI plugins come from
Debian 12 packages (``apt-get download`` + ``dpkg-deb -x``; nothing is installed on the
machine). The five Kubernetes binaries are not packaged anywhere we can reach: drop the official
ones (or, for tests, the contract stand-ins) into the directory and add them to SHA256SUMS.
Debian's etcd (3.4) has no etcdutl, which snapshot save and restore need: ``lab up --artifacts``
with a built set (etcd 3.6, etcdctl, etcdutl) replaces Debian's etcd; without one, resolving the
artifacts (the start of ``installer apply``) stops, naming etcdutl and where it comes from.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from installer.core.artifacts import (
    CNI_PLUGINS,
    SUMS_FILE,
    ArtifactError,
    add_files,
    read_sums,
    sha256_file,
    verify,
    write_sums,
)
from installer.lab.images import cache_lock
from installer.lab.model import LabError, cache_root

# Debian package -> (path inside the package, name in the artifacts directory)
PACKAGES = {
    "etcd-server": [("usr/bin/etcd", "etcd")],
    "etcd-client": [("usr/bin/etcdctl", "etcdctl")],
    "containerd": [("usr/bin/containerd", "containerd"), ("usr/bin/ctr", "ctr"),
                   ("usr/bin/containerd-shim-runc-v2", "containerd-shim-runc-v2")],
    "runc": [("usr/sbin/runc", "runc")],
    "containernetworking-plugins": [(f"usr/lib/cni/{p}", p) for p in CNI_PLUGINS],
}
KUBERNETES_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")


def debs_dir() -> Path:
    return cache_root() / "lab" / "debs"


def download(packages: list[str], log=print) -> dict[str, Path]:
    """The .deb of each package, downloaded once into the cache."""
    dest = debs_dir()
    dest.mkdir(parents=True, exist_ok=True)
    with cache_lock("debs"):
        return _download(packages, dest, log)


def _download(packages: list[str], dest: Path, log) -> dict[str, Path]:
    have = {p: next(iter(sorted(dest.glob(f"{p}_*.deb"))), None) for p in packages}
    missing = [p for p, deb in have.items() if deb is None]
    if missing:
        log(f"downloading Debian packages: {' '.join(missing)}")
        for attempt in (1, 2):
            proc = subprocess.run(["apt-get", "download", *missing], cwd=dest, capture_output=True, text=True)
            if proc.returncode == 0:
                break
            if attempt == 1:   # package lists may be missing on a fresh machine
                subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        else:
            raise LabError(f"apt-get download {' '.join(missing)}: {proc.stderr.strip()[-400:]}")
        have = {p: next(iter(sorted(dest.glob(f"{p}_*.deb"))), None) for p in packages}
    return have


def extract(deb: Path, members: list[tuple[str, str]], dest: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True, capture_output=True)
        names = []
        for inner, name in members:
            src = Path(tmp) / inner
            if not src.is_file():
                raise LabError(f"{deb.name} has no {inner}")
            shutil.copy2(src, dest / name)
            (dest / name).chmod(0o755)
            names.append(name)
    return names


def fill(dest: Path, log=print) -> list[str]:
    """Put Debian's binaries into ``dest`` and record them in its SHA256SUMS; returns their names."""
    dest.mkdir(parents=True, exist_ok=True)
    debs = download(list(PACKAGES), log)
    names = []
    for pkg, members in PACKAGES.items():
        if all((dest / name).is_file() for _, name in members):
            names += [name for _, name in members]
            continue
        names += extract(debs[pkg], members, dest)
    add_files(dest, names)
    return names


# the image archives a lab's workers run (the sandbox, CoreDNS, the test pods' busybox); a
# hosting lab's also get the hosted control planes' and konnectivity's (``up(hosting=True)``)
WORKER_IMAGES = frozenset({"image-pause.tar", "image-coredns.tar", "image-busybox.tar"})


def import_dir(src: Path, dest: Path, all_images: bool = False,
               extra_images: frozenset[str] = frozenset()) -> list[str]:
    """Copy every file ``src/SHA256SUMS`` lists into ``dest`` (of the image archives, only
    WORKER_IMAGES and ``extra_images`` unless ``all_images``: every worker is sent every archive),
    each verified against it, and record them in ``dest``'s SHA256SUMS (replacing Debian's of the
    same name)."""
    names = sorted(n for n in read_sums(src)
                   if all_images or not n.endswith(".tar") or n in WORKER_IMAGES | extra_images)
    if not names:
        raise LabError(f"--artifacts {src}: no {SUMS_FILE} listing any file")
    try:
        digests = verify(src, names)
    except ArtifactError as e:
        raise LabError(f"--artifacts {src}: {e}") from None
    have = read_sums(dest)
    for name in names:
        target = dest / name
        if have.get(name) == digests[name] and target.is_file() and sha256_file(target) == digests[name]:
            continue
        tmp = dest / f".{name}.importing"
        shutil.copyfile(src / name, tmp)
        tmp.chmod(0o644 if name.endswith(".tar") else 0o755)
        tmp.rename(target)
    write_sums(dest, {**have, **digests})
    return names


def missing_kubernetes(dest: Path) -> list[str]:
    return [b for b in KUBERNETES_BINARIES if not (dest / b).is_file()]
