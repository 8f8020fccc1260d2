"""The build tooling (tools/kubebuild) and how its output reaches a lab.

The wrapper modules are checked against the upstream go.mod they were generated from: every
staging module k8s.io/kubernetes replaces is pinned at v0.MINOR.PATCH, so nothing is pinned by
hand. The built binaries report the versions they were stamped with (real `--version`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from installer.core import versions
from installer.core.artifacts import read_sums, write_sums
from installer.lab import debian_artifacts
from installer.lab import lab as lab_mod
from installer.lab.model import LabError

ROOT = Path(__file__).resolve().parent.parent


def _build_module():
    spec = importlib.util.spec_from_file_location("kubebuild", ROOT / "tools/kubebuild/build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kubebuild"] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


kb = _build_module()


def gomod(pin_dir: Path) -> dict:
    """The wrapper's go.mod as the go command reads it (go mod edit -json)."""
    out = subprocess.run(["go", "mod", "edit", "-json"], cwd=pin_dir, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_component_of_the_default_versions_is_pinned():
    for c in [kb.kubernetes(versions.DEFAULT_KUBERNETES_VERSION), *kb.others()]:
        mod = gomod(c.pin_dir)
        direct = {r["Path"]: r["Version"] for r in mod["Require"] if not r.get("Indirect")}
        assert direct == {m: c.version for m in c.modules}, c.name
        assert (c.pin_dir / "go.sum").stat().st_size > 0, c.name
        assert (c.pin_dir / "tools.go").read_text() == kb.tools_go(c)


def test_kubernetes_staging_modules_are_all_pinned_from_the_upstream_go_mod():
    c = kb.kubernetes(versions.DEFAULT_KUBERNETES_VERSION)
    upstream, _ = kb.download_gomod("k8s.io/kubernetes", c.version, c.pin_dir)
    staging = kb.staging_modules(upstream)
    assert len(staging) >= 30 and "k8s.io/client-go" in staging and "k8s.io/cri-streaming" in staging
    _, minor, patch = c.version.lstrip("v").split(".")
    replaced = {r["Old"]["Path"]: r["New"] for r in gomod(c.pin_dir)["Replace"]}
    assert replaced == {m: {"Path": m, "Version": f"v0.{minor}.{patch}"} for m in staging}


def test_built_binaries_report_their_versions(built_artifacts):
    def out(*cmd):
        return subprocess.run([str(built_artifacts / cmd[0]), *cmd[1:]], capture_output=True, text=True,
                              timeout=60).stdout
    k8s = versions.DEFAULT_KUBERNETES_VERSION
    for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"):
        assert out(b, "--version").strip() == f"Kubernetes {k8s}", b
    assert f"Client Version: {k8s}" in out("kubectl", "version", "--client")
    etcd = versions.DEFAULT_COMPONENTS["etcd"].lstrip("v")
    assert f"etcd Version: {etcd}" in out("etcd", "--version")
    assert f"etcdctl version: {etcd}" in out("etcdctl", "version")
    assert f"etcdutl version: {etcd}" in out("etcdutl", "version")
    assert f" v{versions.DEFAULT_COMPONENTS['containerd']} " in out("containerd", "--version")
    assert f"runc version {versions.DEFAULT_COMPONENTS['runc'].lstrip('v')}" in out("runc", "--version")
    assert lab_mod.binaries_version(built_artifacts) == k8s
    assert lab_mod.containerd_version(built_artifacts) == versions.DEFAULT_COMPONENTS["containerd"]


def test_a_warm_build_only_copies(built_artifacts, tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/build-kubernetes"), "default", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "everything from the cache" in proc.stdout and "==> building" not in proc.stdout
    assert read_sums(tmp_path / "a") == read_sums(built_artifacts)


def test_import_dir_copies_verified_files_over_debian_ones(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    (src / "etcd").write_bytes(b"built etcd")
    (src / "image-x.tar").write_bytes(b"tar")
    write_sums(src, {"etcd": kb.sha256_file(src / "etcd"), "image-x.tar": kb.sha256_file(src / "image-x.tar")})
    (dest / "etcd").write_bytes(b"debian etcd")
    (dest / "runc").write_bytes(b"debian runc")
    write_sums(dest, {"etcd": kb.sha256_file(dest / "etcd"), "runc": kb.sha256_file(dest / "runc")})
    assert debian_artifacts.import_dir(src, dest) == ["etcd", "image-x.tar"]
    assert (dest / "etcd").read_bytes() == b"built etcd" and (dest / "runc").read_bytes() == b"debian runc"
    assert (dest / "image-x.tar").stat().st_mode & 0o777 == 0o644 and (dest / "etcd").stat().st_mode & 0o111
    assert set(read_sums(dest)) == {"etcd", "runc", "image-x.tar"}
    (src / "etcd").write_bytes(b"tampered")
    with pytest.raises(LabError, match="etcd: sha256 .* does not match"):
        debian_artifacts.import_dir(src, dest)
    with pytest.raises(LabError, match="no SHA256SUMS"):
        debian_artifacts.import_dir(tmp_path, dest)
