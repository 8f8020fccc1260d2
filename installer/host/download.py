"""``source: download``: the official release files of the pinned versions, fetched into a local
cache laid out per component, version and platform::

    CACHE/kubernetes/v1.36.4/linux-amd64/kube-apiserver
    CACHE/etcd/v3.6.7/linux-amd64/{etcd,etcdctl,etcdutl}
    CACHE/containerd/2.2.3/linux-amd64/{containerd,ctr,containerd-shim-runc-v2}
    CACHE/runc/v1.4.2/linux-amd64/runc
    CACHE/cni/v1.8.0/linux-amd64/{bridge,host-local,loopback,portmap}

Each downloaded file is written to a temporary file, hashed and compared with the digest its
project publishes *before* anything is extracted or moved into the cache; a mismatch leaves
nothing behind. Each cache directory has a ``SHA256SUMS`` (the artifacts format) of the
binaries verified into it; a cached binary is re-hashed against it on every use and is never
downloaded again while it matches.

``HIDDENPLANE_DOWNLOAD_MIRROR`` (a base URL) rewrites every official URL
``https://HOST/PATH`` to ``MIRROR/HOST/PATH``: a mirror keeps the upstream layout under one
directory per host (the tests serve one from 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from installer.core.artifacts import (
    CNI_PLUGINS,
    CONTROL_BINARIES,
    SUMS_FILE,
    WORKER_BINARIES,
    ArtifactError,
    ResolvedArtifact,
    read_sums,
)
from installer.core.digests import Digests

MIRROR_ENV = "HIDDENPLANE_DOWNLOAD_MIRROR"
TIMEOUT = 60                       # seconds, per connect and per read
KUBERNETES_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
ALL_BINARIES = CONTROL_BINARIES + WORKER_BINARIES + CNI_PLUGINS

# why a binary an artifacts directory lacks is needed, and where to get it: said with the error
# because older sets (Debian's etcd packages, etcd 3.4 releases) have no etcdutl
WHERE_FROM = {
    "etcdutl": "etcdutl (etcd 3.5 and later) checks and restores etcd snapshots; it is in the official "
               "etcd release tarball, etcd-vX-linux-ARCH/etcdutl next to etcd and etcdctl (Debian's etcd "
               "packages have none)",
}

Log = Callable[[str], None]
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Release:
    """Where one component's official binaries come from.

    ``url`` and ``sums`` are templates over ``version``, ``arch`` and ``name`` (the binary;
    ``url`` may use it, then each binary is a download of its own); ``sums`` may also use
    ``{url}``. ``members`` maps each binary to its path inside the archive ``url`` names;
    without it the downloaded file is the binary itself.
    """
    binaries: tuple[str, ...]
    url: str
    sums: str
    members: dict[str, str] | None = None
    v_prefix: bool = True          # versions are spelled v1.2.3 in URLs (containerd: 1.2.3)


_GH = "https://github.com"
SOURCES: dict[str, Release] = {
    "kubernetes": Release(
        KUBERNETES_BINARIES,
        "https://dl.k8s.io/release/{version}/bin/linux/{arch}/{name}",
        "{url}.sha256"),
    "etcd": Release(
        ("etcd", "etcdctl", "etcdutl"),
        _GH + "/etcd-io/etcd/releases/download/{version}/etcd-{version}-linux-{arch}.tar.gz",
        _GH + "/etcd-io/etcd/releases/download/{version}/SHA256SUMS",
        {b: f"etcd-{{version}}-linux-{{arch}}/{b}" for b in ("etcd", "etcdctl", "etcdutl")}),
    "containerd": Release(
        ("containerd", "containerd-shim-runc-v2", "ctr"),
        _GH + "/containerd/containerd/releases/download/v{version}/containerd-{version}-linux-{arch}.tar.gz",
        "{url}.sha256sum",
        {"containerd": "bin/containerd", "containerd-shim-runc-v2": "bin/containerd-shim-runc-v2",
         "ctr": "bin/ctr"},
        v_prefix=False),
    "runc": Release(
        ("runc",),
        _GH + "/opencontainers/runc/releases/download/{version}/runc.{arch}",
        _GH + "/opencontainers/runc/releases/download/{version}/runc.sha256sum"),
    "cni": Release(
        CNI_PLUGINS,
        _GH + "/containernetworking/plugins/releases/download/{version}/cni-plugins-linux-{arch}-{version}.tgz",
        "{url}.sha256",
        {p: p for p in CNI_PLUGINS}),
}
assert sorted(b for r in SOURCES.values() for b in r.binaries) == sorted(ALL_BINARIES)


def component_versions(inv) -> dict[str, str]:
    """The version of each component as its release URLs spell it."""
    v = inv.spec.artifacts.versions
    raw = {"kubernetes": inv.spec.kubernetes.version, "etcd": v.etcd, "containerd": v.containerd,
           "runc": v.runc, "cni": v.cni}
    return {c: ("v" if SOURCES[c].v_prefix else "") + raw[c].removeprefix("v") for c in SOURCES}


def mirrored(url: str) -> str:
    """``https://HOST/PATH`` -> ``$HIDDENPLANE_DOWNLOAD_MIRROR/HOST/PATH`` when the mirror is set."""
    base = os.environ.get(MIRROR_ENV, "").strip()
    if not base:
        return url
    if "@" in urlsplit(base).netloc:
        raise ArtifactError(f"{MIRROR_ENV}: must not carry credentials (user:password@); "
                            "use a mirror that needs none, or source: dir")
    parts = urlsplit(url)
    return f"{base.rstrip('/')}/{parts.netloc}{parts.path}"


def display(url: str) -> str:
    """A URL safe to show: no user information, query or fragment."""
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc.rpartition("@")[2], p.path, "", ""))


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def resolve(root: Path, versions: dict[str, str], log: Log, arch: str, digests: Digests | None = None
            ) -> dict[str, ResolvedArtifact]:
    """Every binary of ALL_BINARIES for ``versions`` (component_versions) under the cache ``root``:
    verified from the cache, or downloaded, verified and cached."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"cannot create the artifacts cache {root}: {e.strerror}") from None
    out: dict[str, ResolvedArtifact] = {}
    cached = 0
    digests = digests or Digests()
    for component, release in SOURCES.items():
        version = versions[component]
        directory = root / component / version / f"linux-{arch}"
        have = _cached(directory, release.binaries, log, digests)
        out.update(have)
        cached += len(have)
        # the downloads still needed, each with the binaries it yields
        todo: dict[str, list[str]] = {}
        for name in release.binaries:
            if name not in have:
                todo.setdefault(release.url.format(version=version, arch=arch, name=name), []).append(name)
        for upstream, names in todo.items():
            url = mirrored(upstream)
            sums_url = mirrored(release.sums.format(version=version, arch=arch, name=names[0], url=upstream))
            members = None if release.members is None else {
                n: release.members[n].format(version=version, arch=arch) for n in names}
            out.update(_fetch(root, directory, url, sums_url, names, members, log))
    if cached:
        log(f"artifacts: {cached} verified binaries from the cache {root}")
    return {n: out[n] for n in ALL_BINARIES}


def _cached(directory: Path, names: tuple[str, ...], log: Log, digests: Digests) -> dict[str, ResolvedArtifact]:
    """The binaries of ``names`` already in ``directory`` that still match its SHA256SUMS."""
    if not directory.is_dir():
        return {}
    try:
        sums = read_sums(directory)
    except ArtifactError as e:
        log(f"artifacts: ignoring a damaged cache index ({e}); downloading again")
        return {}
    out = {}
    for name in names:
        path = directory / name
        if name not in sums or not path.is_file():
            continue
        digest = digests.sha256(path)
        if digest == sums[name]:
            out[name] = ResolvedArtifact(name, path, digest)
        else:
            log(f"artifacts: cached {path} has sha256 {digest}, not the verified {sums[name]}; "
                "downloading again")
    return out


def _fetch(root: Path, directory: Path, url: str, sums_url: str, names: list[str],
           members: dict[str, str] | None, log: Log) -> dict[str, ResolvedArtifact]:
    filename = urlsplit(url).path.rpartition("/")[2]
    published = _published_digest(sums_url, filename)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        part = Path(tmp) / "download"
        digest, size = _download(url, part)
        if digest != published:
            raise ArtifactError(f"{display(url)}: downloaded sha256 {digest} does not match the "
                                f"published {published} ({display(sums_url)}); nothing was cached")
        log(f"downloaded {filename} ({_size(size)}), sha256 verified")
        if members is None:
            (name,) = names
            files = {name: (part, digest)}
        else:
            files = _extract(part, members, Path(tmp), url)
        directory.mkdir(parents=True, exist_ok=True)
        out = {}
        for name, (path, file_digest) in files.items():
            path.chmod(0o755)
            os.replace(path, directory / name)
            out[name] = ResolvedArtifact(name, directory / name, file_digest)
        _record(directory, {n: a.sha256 for n, a in out.items()}, Path(tmp))
    return out


def _record(directory: Path, digests: dict[str, str], tmp: Path) -> None:
    """Merge ``digests`` into the directory's SHA256SUMS, replacing it atomically."""
    try:
        sums = read_sums(directory)
    except ArtifactError:
        sums = {}
    sums.update(digests)
    new = tmp / SUMS_FILE
    new.write_text("".join(f"{d}  {n}\n" for n, d in sorted(sums.items())))
    os.replace(new, directory / SUMS_FILE)


def _extract(archive: Path, members: dict[str, str], dest: Path, url: str) -> dict[str, tuple[Path, str]]:
    """Copy the named regular files out of a verified tarball (nothing else is extracted)."""
    out = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            index = {m.name.lstrip("/").removeprefix("./"): m for m in tar.getmembers()}
            for name, inner in members.items():
                member = index.get(inner)
                if member is None or not member.isreg():
                    hint = f"; {WHERE_FROM[name]}" if name in WHERE_FROM else ""
                    raise ArtifactError(f"{display(url)}: the archive has no file {inner} (for {name}){hint}")
                target = dest / f"bin-{name}"
                h = hashlib.sha256()
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                        dst.write(chunk)
                out[name] = (target, h.hexdigest())
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{display(url)}: cannot read the archive: {e}") from None
    return out


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(req.full_url).scheme == "https" and urlsplit(newurl).scheme != "https":
            raise urllib.error.URLError(f"refusing a redirect from https to {display(newurl)}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _open(url: str):
    req = urllib.request.Request(url, headers={"User-Agent": "hiddenplane-installer"})
    try:
        # built per call: proxies come from the environment (https_proxy, no_proxy) as it is now
        return urllib.request.build_opener(_NoDowngrade).open(req, timeout=TIMEOUT)
    except urllib.error.HTTPError as e:
        e.close()
        reason = f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except (OSError, ValueError) as e:
        reason = str(e) or type(e).__name__
    raise ArtifactError(f"cannot download {display(url)}: {reason}; "
                        "use source: dir for air-gapped installs")


def _download(url: str, dest: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    try:
        with _open(url) as resp, open(dest, "wb") as f:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
                size += len(chunk)
    except ArtifactError:
        raise
    except (OSError, http.client.HTTPException) as e:   # timeouts, connections cut mid-transfer
        raise ArtifactError(f"cannot download {display(url)}: {e or type(e).__name__}; "
                            "use source: dir for air-gapped installs") from None
    return h.hexdigest(), size


def _published_digest(sums_url: str, filename: str) -> str:
    """The sha256 of ``filename`` from a published checksum file: either just the digest
    (dl.k8s.io) or ``sha256sum`` lines naming files (GitHub releases)."""
    try:
        with _open(sums_url) as resp:
            text = resp.read(1 << 20).decode("utf-8", "replace")
    except ArtifactError:
        raise
    except (OSError, http.client.HTTPException) as e:
        raise ArtifactError(f"cannot download {display(sums_url)}: {e or type(e).__name__}; "
                            "use source: dir for air-gapped installs") from None
    named, bare = set(), set()
    for line in text.splitlines():
        fields = line.split()
        if not fields or not _HEX64.fullmatch(fields[0].lower()):
            continue
        digest = fields[0].lower()
        if len(fields) == 1:
            bare.add(digest)
        elif fields[1].lstrip("*").rpartition("/")[2] == filename:
            named.add(digest)
    found = named or bare
    if len(found) != 1:
        why = "no" if not found else "conflicting"
        raise ArtifactError(f"{display(sums_url)}: {why} sha256 for {filename}")
    return found.pop()
