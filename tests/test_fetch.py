"""Artifacts: `source: download` against a real HTTP mirror on 127.0.0.1 laid out like the
official release sites, `source: dir` against an artifacts directory, and the binaries each role
receives. No mocks: real sockets, real tarballs, real files."""

from __future__ import annotations

import copy
import hashlib
import http.server
import io
import re
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from installer.core import inventory
from installer.core.artifacts import CNI_PLUGINS, CONTROL_BINARIES, WORKER_BINARIES, ArtifactError, add_files, read_sums
from installer.host.download import MIRROR_ENV, mirrored
from installer.host.fetch import ALL_BINARIES, binary_files, cache_dir, component_versions, resolve

K8S = "v1.36.4"
VERSIONS = {"etcd": "v3.6.7", "containerd": "2.2.3", "runc": "v1.4.2", "cni": "v1.8.0"}
KUBE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
GH = "github.com"
# the paths of the official files, written out by hand (not taken from installer.host.fetch)
K8S_DIR = f"dl.k8s.io/release/{K8S}/bin/linux/amd64"
ETCD_TGZ = f"{GH}/etcd-io/etcd/releases/download/v3.6.7/etcd-v3.6.7-linux-amd64.tar.gz"
ETCD_SUMS = f"{GH}/etcd-io/etcd/releases/download/v3.6.7/SHA256SUMS"
CONTAINERD_TGZ = f"{GH}/containerd/containerd/releases/download/v2.2.3/containerd-2.2.3-linux-amd64.tar.gz"
RUNC = f"{GH}/opencontainers/runc/releases/download/v1.4.2/runc.amd64"
RUNC_SUMS = f"{GH}/opencontainers/runc/releases/download/v1.4.2/runc.sha256sum"
CNI_TGZ = f"{GH}/containernetworking/plugins/releases/download/v1.8.0/cni-plugins-linux-amd64-v1.8.0.tgz"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake(name: str) -> bytes:
    return f"#!/bin/sh\necho fake {name}\n".encode() + hashlib.sha256(name.encode()).digest() * 4


def tarball(members: dict[str, bytes], dirs: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def publish(root: Path) -> dict[str, bytes]:
    """Lay out a mirror of the official release files; return each binary's content."""
    def put(rel: str, data: bytes | str) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    bins = {n: fake(n) for n in ALL_BINARIES}
    for n in KUBE:                                   # dl.k8s.io: the .sha256 holds just the digest
        put(f"{K8S_DIR}/{n}", bins[n])
        put(f"{K8S_DIR}/{n}.sha256", sha(bins[n]))
    top = "etcd-v3.6.7-linux-amd64"
    # as the official tarball: the three binaries and documentation in one top directory
    etcd = tarball({f"{top}/etcd": bins["etcd"], f"{top}/etcdctl": bins["etcdctl"],
                    f"{top}/etcdutl": bins["etcdutl"], f"{top}/README.md": b"readme",
                    f"{top}/Documentation/README.md": b"docs"}, dirs=(top, f"{top}/Documentation"))
    put(ETCD_TGZ, etcd)
    put(ETCD_SUMS, f"{sha(b'other')}  etcd-v3.6.7-linux-arm64.tar.gz\n"
                   f"{sha(etcd)}  etcd-v3.6.7-linux-amd64.tar.gz\n"
                   f"{sha(b'src')}  v3.6.7.zip\n")
    containerd = tarball({"bin/containerd": bins["containerd"], "bin/ctr": bins["ctr"],
                          "bin/containerd-shim-runc-v2": bins["containerd-shim-runc-v2"],
                          "bin/containerd-stress": b"stress"}, dirs=("bin",))
    put(CONTAINERD_TGZ, containerd)
    put(CONTAINERD_TGZ + ".sha256sum", f"{sha(containerd)}  containerd-2.2.3-linux-amd64.tar.gz\n")
    put(RUNC, bins["runc"])
    put(RUNC_SUMS, f"{sha(b'arm')}  ./runc.arm64\n{sha(bins['runc'])}  ./runc.amd64\n"
                   f"{sha(b'tar')}  ./runc.tar.xz\n")
    cni = tarball({f"./{p}": bins[p] for p in CNI_PLUGINS} | {"./vlan": b"vlan", "./LICENSE": b"lic"},
                  dirs=(".",))
    put(CNI_TGZ, cni)
    put(CNI_TGZ + ".sha256", f"{sha(cni)}  cni-plugins-linux-amd64-v1.8.0.tgz\n")
    return bins


class Mirror:
    def __init__(self, root: Path):
        self.root, self.requests = root, []
        mirror = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=str(root), **kw)

            def do_GET(self):
                mirror.requests.append(self.path)
                super().do_GET()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    m = Mirror(tmp_path / "mirror")
    m.bins = publish(m.root)
    monkeypatch.setenv(MIRROR_ENV, m.url + "/")
    yield m
    m.close()


def make_inv(example_doc, tmp_path, **artifacts) -> inventory.Inventory:
    doc = copy.deepcopy(example_doc)
    doc["spec"]["kubernetes"]["version"] = K8S
    doc["spec"]["artifacts"] = {"source": "download", "versions": dict(VERSIONS),
                                "cacheDir": "cache"} | artifacts
    return inventory.parse(doc, "test", base_dir=tmp_path)


def cached_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


# --- source: download ----------------------------------------------------------------------

def test_cold_download_verifies_everything_then_the_cache_makes_no_request(example_doc, tmp_path, mirror):
    inv = make_inv(example_doc, tmp_path)
    cache = tmp_path / "cache"
    assert cache_dir(inv) == cache
    lines: list[str] = []
    got = resolve(inv, log=lines.append)

    assert sorted(got) == sorted(ALL_BINARIES)
    for name, art in got.items():
        assert art.name == name
        assert art.path.read_bytes() == mirror.bins[name]
        assert art.sha256 == sha(mirror.bins[name])
    assert got["kube-apiserver"].path == cache / "kubernetes/v1.36.4/linux-amd64/kube-apiserver"
    assert got["etcdctl"].path == cache / "etcd/v3.6.7/linux-amd64/etcdctl"
    assert got["etcdutl"].path == cache / "etcd/v3.6.7/linux-amd64/etcdutl"
    assert read_sums(cache / "etcd/v3.6.7/linux-amd64") == {
        b: sha(mirror.bins[b]) for b in ("etcd", "etcdctl", "etcdutl")}
    assert got["containerd-shim-runc-v2"].path == cache / "containerd/2.2.3/linux-amd64/containerd-shim-runc-v2"
    assert got["runc"].path == cache / "runc/v1.4.2/linux-amd64/runc"
    assert got["portmap"].path == cache / "cni/v1.8.0/linux-amd64/portmap"
    # only the named binaries are taken out of the archives; every cache dir records its digests
    assert not any(f.endswith("README.md") or "vlan" in f for f in cached_files(cache))
    assert read_sums(cache / "cni/v1.8.0/linux-amd64") == {p: sha(mirror.bins[p]) for p in CNI_PLUGINS}
    assert not list(cache.glob(".fetch-*"))
    # 5 Kubernetes binaries + 4 archives/binaries, each with its published checksum file
    assert len(mirror.requests) == 18
    assert all(r.startswith(("/dl.k8s.io/", "/github.com/")) for r in mirror.requests)
    downloads = [line for line in lines if line.startswith("downloaded ")]
    assert len(downloads) == 9
    assert all(re.search(r" \(\d+(\.\d)? (B|kB|MB)\), sha256 verified$", line) for line in downloads)
    assert any(line.startswith("downloaded etcd-v3.6.7-linux-amd64.tar.gz (") for line in downloads)

    lines.clear()
    again = resolve(inv, log=lines.append)
    assert again == got
    assert len(mirror.requests) == 18, "a warm cache must not touch the network"
    assert lines == [f"artifacts: 16 verified binaries from the cache {cache}"]


def test_a_damaged_cached_binary_is_fetched_again_alone(example_doc, tmp_path, mirror):
    inv = make_inv(example_doc, tmp_path)
    got = resolve(inv, log=lambda _: None)
    got["kubelet"].path.write_bytes(b"tampered")
    mirror.requests.clear()
    lines = []
    again = resolve(inv, log=lines.append)
    assert again["kubelet"].path.read_bytes() == mirror.bins["kubelet"]
    assert mirror.requests == [f"/{K8S_DIR}/kubelet.sha256", f"/{K8S_DIR}/kubelet"]
    assert any("kubelet" in line and "downloading again" in line for line in lines)


def test_a_download_that_differs_from_its_published_digest_is_refused_and_not_cached(
        example_doc, tmp_path, mirror):
    (mirror.root / ETCD_TGZ).write_bytes(tarball({"etcd-v3.6.7-linux-amd64/etcd": b"evil"}))
    inv = make_inv(example_doc, tmp_path)
    with pytest.raises(ArtifactError) as e:
        resolve(inv, log=lambda _: None)
    msg = str(e.value)
    assert f"{mirror.url}/{ETCD_TGZ}" in msg
    assert sha((mirror.root / ETCD_TGZ).read_bytes()) in msg                      # what came
    assert ETCD_SUMS.split("/")[-1] in msg and sha(b"evil") not in msg
    published = next(line.split()[0] for line in (mirror.root / ETCD_SUMS).read_text().splitlines()
                     if "amd64" in line)
    assert published in msg                                                       # what was promised
    cache = tmp_path / "cache"
    assert not any(f.startswith("etcd/") for f in cached_files(cache)), "nothing of etcd may be cached"
    assert not list(cache.glob(".fetch-*"))


def test_an_etcd_release_without_etcdutl_is_refused_saying_why(example_doc, tmp_path, mirror):
    """etcd 3.4's tarball has etcd and etcdctl only; snapshots need etcdutl."""
    top = "etcd-v3.6.7-linux-amd64"
    old = tarball({f"{top}/etcd": mirror.bins["etcd"], f"{top}/etcdctl": mirror.bins["etcdctl"]}, dirs=(top,))
    (mirror.root / ETCD_TGZ).write_bytes(old)
    (mirror.root / ETCD_SUMS).write_text(f"{sha(old)}  etcd-v3.6.7-linux-amd64.tar.gz\n")
    with pytest.raises(ArtifactError) as e:
        resolve(make_inv(example_doc, tmp_path), log=lambda _: None)
    msg = str(e.value)
    assert f"the archive has no file {top}/etcdutl (for etcdutl)" in msg
    assert "checks and restores etcd snapshots" in msg
    assert not any(f.startswith("etcd/") for f in cached_files(tmp_path / "cache"))


def test_a_tampered_kubernetes_binary_leaves_an_empty_cache(example_doc, tmp_path, mirror):
    (mirror.root / K8S_DIR / "kube-apiserver").write_bytes(b"evil")
    with pytest.raises(ArtifactError, match=r"kube-apiserver: downloaded sha256 [0-9a-f]{64} does not match"):
        resolve(make_inv(example_doc, tmp_path), log=lambda _: None)
    assert cached_files(tmp_path / "cache") == []


def test_pinned_checksums_apply_to_downloads(example_doc, tmp_path, mirror):
    good = sha(mirror.bins["kubelet"])
    assert resolve(make_inv(example_doc, tmp_path, checksums={"kubelet": good}), log=lambda _: None)
    bad = "0" * 64
    n = len(mirror.requests)
    with pytest.raises(ArtifactError) as e:
        resolve(make_inv(example_doc, tmp_path, checksums={"kubelet": bad, "runc": sha(mirror.bins["runc"])}),
                log=lambda _: None)
    assert "kubelet" in str(e.value) and good in str(e.value) and bad in str(e.value)
    assert "runc" not in str(e.value)
    assert len(mirror.requests) == n
    with pytest.raises(ArtifactError, match="kube-apiservr: not a binary the cluster uses"):
        resolve(make_inv(example_doc, tmp_path, checksums={"kube-apiservr": good}), log=lambda _: None)


def test_unreachable_mirror_names_the_url_and_the_way_out(example_doc, tmp_path, monkeypatch):
    with socket.socket() as s:                 # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(MIRROR_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(ArtifactError) as e:
        resolve(make_inv(example_doc, tmp_path), log=lambda _: None)
    msg = str(e.value)
    assert msg.startswith(f"cannot download http://127.0.0.1:{port}/{K8S_DIR}/kube-apiserver.sha256: ")
    assert msg.endswith("use source: dir for air-gapped installs")
    assert cached_files(tmp_path / "cache") == []


def test_missing_release_file_is_an_http_error(example_doc, tmp_path, mirror):
    (mirror.root / RUNC_SUMS).unlink()
    with pytest.raises(ArtifactError, match=r"cannot download .*runc\.sha256sum: HTTP 404"):
        resolve(make_inv(example_doc, tmp_path), log=lambda _: None)


def test_mirror_rewrites_every_official_url(monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    official = f"https://{K8S_DIR}/kubelet"
    assert mirrored(official) == official
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:8080/base/")
    assert mirrored(official) == f"http://127.0.0.1:8080/base/{K8S_DIR}/kubelet"
    monkeypatch.setenv(MIRROR_ENV, "http://user:hunter2@127.0.0.1:8080")
    with pytest.raises(ArtifactError) as e:
        mirrored(official)
    assert "hunter2" not in str(e.value)


def test_versions_and_cache_location(example_doc, tmp_path, monkeypatch):
    inv = make_inv(example_doc, tmp_path, versions={"etcd": "3.6.7", "containerd": "v2.2.3",
                                                     "runc": "1.4.2", "cni": "v1.8.0"})
    assert component_versions(inv) == {"kubernetes": K8S, **VERSIONS}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    doc = copy.deepcopy(example_doc)
    assert cache_dir(inventory.parse(doc, "t", base_dir=tmp_path)) == tmp_path / "xdg/hiddenplane/artifacts"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir(inventory.parse(doc, "t", base_dir=tmp_path)) == Path.home() / ".cache/hiddenplane/artifacts"


def test_arm64_fetches_arm64_files(example_doc, tmp_path, mirror):
    with pytest.raises(ArtifactError,
                       match=f"/dl.k8s.io/release/{K8S}/bin/linux/arm64/kube-apiserver.sha256: HTTP 404"):
        resolve(make_inv(example_doc, tmp_path), log=lambda _: None, arch="arm64")


# --- source: dir ---------------------------------------------------------------------------

def dir_inv(example_doc, tmp_path, **extra):
    doc = copy.deepcopy(example_doc)
    doc["spec"]["artifacts"] = {"source": "dir", "path": "artifacts"} | extra
    return inventory.parse(doc, "test", base_dir=tmp_path)


def test_source_dir_verifies_against_sha256sums(example_doc, tmp_path, monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:9")         # must never be used
    d = tmp_path / "artifacts"
    d.mkdir()
    for n in ALL_BINARIES:
        (d / n).write_bytes(fake(n))
    add_files(d, list(ALL_BINARIES))
    got = resolve(dir_inv(example_doc, tmp_path), log=lambda _: None)
    assert {n: (a.path, a.sha256) for n, a in got.items()} == {n: (d / n, sha(fake(n))) for n in ALL_BINARIES}

    with pytest.raises(ArtifactError) as e:
        resolve(dir_inv(example_doc, tmp_path, checksums={"etcd": "1" * 64}), log=lambda _: None)
    assert "etcd" in str(e.value) and "1" * 64 in str(e.value) and sha(fake("etcd")) in str(e.value)

    (d / "runc").unlink()
    (d / "kube-scheduler").write_bytes(b"swapped")
    with pytest.raises(ArtifactError) as e:
        resolve(dir_inv(example_doc, tmp_path), log=lambda _: None)
    assert "runc: missing" in str(e.value)
    assert f"kube-scheduler: sha256 {sha(b'swapped')} does not match" in str(e.value)


def test_source_dir_without_etcdutl_says_where_it_comes_from(example_doc, tmp_path):
    """An artifacts directory from Debian's etcd packages (the lab without --artifacts) has no
    etcdutl: the error names it, why it is needed and where it is."""
    d = tmp_path / "artifacts"
    d.mkdir()
    names = [n for n in ALL_BINARIES if n != "etcdutl"]
    for n in names:
        (d / n).write_bytes(fake(n))
    add_files(d, names)
    with pytest.raises(ArtifactError) as e:
        resolve(dir_inv(example_doc, tmp_path), log=lambda _: None)
    msg = str(e.value)
    assert msg.startswith(f"artifacts: etcdutl: no entry in {d / 'SHA256SUMS'}; ")
    assert "etcd-vX-linux-ARCH/etcdutl" in msg and "Debian's etcd packages have none" in msg

    (d / "etcdutl").write_bytes(fake("etcdutl"))
    add_files(d, ["etcdutl"])
    (d / "etcdutl").unlink()                          # listed, but gone
    with pytest.raises(ArtifactError, match=r"etcdutl: missing from .*; etcdutl \(etcd 3.5 and later\)"):
        resolve(dir_inv(example_doc, tmp_path), log=lambda _: None)

    (d / "etcdutl").write_bytes(b"swapped")           # a mismatch is only a mismatch: no hint
    with pytest.raises(ArtifactError) as e:
        resolve(dir_inv(example_doc, tmp_path), log=lambda _: None)
    assert "etcdutl: sha256" in str(e.value) and "release tarball" not in str(e.value)


# --- what each role gets -------------------------------------------------------------------

def test_binary_files_per_role_and_no_worker_binary_on_control(tmp_path):
    from installer.host.fetch import ResolvedArtifact
    resolved = {}
    for n in ALL_BINARIES:
        (tmp_path / n).write_bytes(fake(n))
        resolved[n] = ResolvedArtifact(n, tmp_path / n, sha(fake(n)))

    control = {f.path: f for f in binary_files(resolved, "control")}
    assert sorted(control) == sorted(f"/usr/local/bin/{n}" for n in CONTROL_BINARIES)
    worker_names = set(WORKER_BINARIES) | set(CNI_PLUGINS)
    assert not {p.rsplit("/", 1)[1] for p in control} & worker_names, "hidden control plane: no runtime"
    assert not any(p.startswith("/opt/cni") for p in control)
    assert control["/usr/local/bin/etcd"].restarts == ("etcd.service",)
    assert control["/usr/local/bin/etcdctl"].restarts == control["/usr/local/bin/etcdutl"].restarts == ()
    for unit in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        assert control[f"/usr/local/bin/{unit}"].restarts == (f"{unit}.service",)

    worker = {f.path: f for f in binary_files(resolved, "worker")}
    assert sorted(worker) == sorted([f"/usr/local/bin/{n}" for n in WORKER_BINARIES]
                                    + [f"/opt/cni/bin/{p}" for p in CNI_PLUGINS])
    assert not {p.rsplit("/", 1)[1] for p in worker} & set(CONTROL_BINARIES)
    assert worker["/usr/local/bin/containerd"].restarts == ("containerd.service",)
    assert worker["/usr/local/bin/kubelet"].restarts == ("kubelet.service",)
    assert worker["/usr/local/bin/kube-proxy"].restarts == ("kube-proxy.service",)
    assert worker["/usr/local/bin/runc"].restarts == () and worker["/opt/cni/bin/bridge"].restarts == ()

    for f in [*control.values(), *worker.values()]:
        name = f.path.rsplit("/", 1)[1]
        assert (f.mode, f.owner, f.group, f.secret) == (0o755, "root", "root", False)
        assert f.source == tmp_path / name and f.sha256 == sha(fake(name)) and f.data() == fake(name)

    del resolved["kubelet"]
    with pytest.raises(ArtifactError, match="kubelet"):
        binary_files(resolved, "worker")


def test_remembered_digests_skip_hashing_until_a_file_changes(example_doc, tmp_path, monkeypatch):
    """A re-run reads the digests of unchanged artifacts from the record instead of hashing
    them; a binary replaced in place (same size, its old mtime put back) is hashed again and
    refused, so the record never vouches for a changed file."""
    import os

    from installer.core.digests import Digests

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    d = tmp_path / "artifacts"
    d.mkdir()
    for n in ALL_BINARIES:
        (d / n).write_bytes(fake(n))
    add_files(d, list(ALL_BINARIES))
    inv = dir_inv(example_doc, tmp_path)
    record = cache_dir(inv) / "sha256-by-identity.json"

    first = Digests(record)
    resolve(inv, log=lambda _: None, digests=first)
    first.save()
    assert first.hashed == len(ALL_BINARIES)
    assert oct(record.stat().st_mode & 0o777) == "0o600" and oct(record.parent.stat().st_mode & 0o777) == "0o700"

    second = Digests(record)
    got = resolve(inv, log=lambda _: None, digests=second)
    assert second.hashed == 0
    assert {n: a.sha256 for n, a in got.items()} == {n: sha(fake(n)) for n in ALL_BINARIES}

    st = (d / "kubelet").stat()
    swapped = bytes(reversed(fake("kubelet")))                  # same size
    (d / "kubelet").write_bytes(swapped)
    os.utime(d / "kubelet", ns=(st.st_atime_ns, st.st_mtime_ns))   # mtime put back; ctime moves
    third = Digests(record)
    with pytest.raises(ArtifactError, match=f"kubelet: sha256 {sha(swapped)} does not match"):
        resolve(inv, log=lambda _: None, digests=third)
    assert third.hashed == 1

    record.write_text("{not json")                              # a damaged record costs the hashing only
    (d / "kubelet").write_bytes(fake("kubelet"))
    fourth = Digests(record)
    assert resolve(inv, log=lambda _: None, digests=fourth)["kubelet"].sha256 == sha(fake("kubelet"))
    assert fourth.hashed == len(ALL_BINARIES)
