"""The build tooling (tools/kubebuild) and how its output reaches a lab.

The wrapper modules are checked against the upstream go.mod they were generated from: every
staging module k8s.io/kubernetes replaces is pinned at v0.MINOR.PATCH, so nothing is pinned by
hand. The built binaries report the versions they were stamped with (real `--version`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from installer.core import versions
from installer.core.artifacts import read_sums, write_sums
from installer.core.inventory_hosted import hosted_images
from installer.core.render.addons.konnectivity import AGENT_IMAGE, SERVER_BINARY
from installer.core.render.addons.netpol import NETPOL, NETPOL_IMAGE
from installer.engine.phases.join_workers import archive_images
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
    for c in [kb.kubernetes(versions.DEFAULT_KUBERNETES_VERSION), *kb.others(), *kb.hosted_components()]:
        mod = gomod(c.pin_dir)
        required = {r["Path"]: r["Version"] for r in mod["Require"]}
        direct = {r["Path"] for r in mod["Require"] if not r.get("Indirect")}
        # (konnectivity-client is required for its version only: go mod tidy marks it indirect)
        assert {m: required.get(m) for m in c.modules} == {m: c.version for m in c.modules}, c.name
        assert direct <= set(c.modules) and direct, c.name
        assert (c.pin_dir / "go.sum").stat().st_size > 0, c.name
        assert (c.pin_dir / "tools.go").read_text() == kb.tools_go(c)


def test_the_cilium_components_are_pinned_with_their_replacements_said_why():
    import cilium
    for c in cilium.components():
        mod = gomod(c.pin_dir)
        assert {r["Path"]: r["Version"] for r in mod["Require"] if not r.get("Indirect")} == \
            {m: c.version for m in c.modules}
        assert (c.pin_dir / "tools.go").read_text() == kb.tools_go(c)
        replaced = {r["Old"]["Path"]: r["New"] for r in mod.get("Replace") or []}
        want = {m: ({"Path": to} if to.startswith("./") else {"Path": to.split()[0], "Version": to.split()[1]})
                for m, to in c.replaces.items()}
        assert replaced == want, c.name
    agent = cilium.components()[0]
    # the stand-in module holds one constant and says why
    local = agent.pin_dir / "mcs-api-controllers"
    assert sorted(p.name for p in local.iterdir()) == ["controllers.go", "go.mod"]
    assert "module sigs.k8s.io/mcs-api/controllers" in (local / "go.mod").read_text()
    # its files are part of the build key: a change to them is a new build
    key = kb.build_key(agent, "go1.26.8")
    original = (local / "controllers.go").read_text()
    try:
        (local / "controllers.go").write_text(original + "// changed\n")
        assert kb.build_key(agent, "go1.26.8") != key
    finally:
        (local / "controllers.go").write_text(original)


def test_the_cilium_chart_is_packed_like_helm_package_and_reproducibly(tmp_path):
    import tarfile

    import cilium
    src = tmp_path / "src"
    chart = src / "install/kubernetes/cilium"
    (chart / "templates").mkdir(parents=True)
    (chart / ".helmignore").write_text("# comment\n.git/\n*.tmpl\n*~\n")
    for name, text in {"Chart.yaml": "name: cilium\n", "values.yaml": "a: 1\n", "values.yaml.tmpl": "x",
                       "templates/ds.yaml": "kind: DaemonSet\n", "templates/ds.yaml~": "old",
                       ".git/config": "x"}.items():
        (chart / name).parent.mkdir(parents=True, exist_ok=True)
        (chart / name).write_text(text)
    one, two = cilium.chart_tgz(src), cilium.chart_tgz(src)
    assert one == two
    (tmp_path / "c.tgz").write_bytes(one)
    with tarfile.open(tmp_path / "c.tgz") as tar:
        assert sorted(tar.getnames()) == ["cilium/Chart.yaml", "cilium/templates/ds.yaml", "cilium/values.yaml"]
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_kubernetes_staging_modules_are_all_pinned_from_the_upstream_go_mod():
    c = kb.kubernetes(versions.DEFAULT_KUBERNETES_VERSION)
    upstream, _ = kb.download_gomod("k8s.io/kubernetes", c.version, c.pin_dir)
    staging = kb.staging_modules(upstream)
    assert len(staging) >= 30 and "k8s.io/client-go" in staging and "k8s.io/cri-streaming" in staging
    _, minor, patch = c.version.lstrip("v").split(".")
    replaced = {r["Old"]["Path"]: r["New"] for r in gomod(c.pin_dir)["Replace"]}
    assert replaced == {m: {"Path": m, "Version": f"v0.{minor}.{patch}"} for m in staging}


def test_the_hosted_images_are_named_as_the_installer_names_them():
    k8s, etcd = versions.DEFAULT_KUBERNETES_VERSION, versions.DEFAULT_COMPONENTS["etcd"]
    plan = {i.archive: i for i in kb.hosted_image_plan(k8s, etcd)}
    names = hosted_images("registry.k8s.io", k8s, etcd)
    # one image-<component>.tar per component, under the name the hosted plane runs
    own = ("local-path-provisioner", NETPOL)           # the hosting cluster's, not a tenant's
    assert {a: i.ref for a, i in plan.items() if a not in own} == names
    assert plan[NETPOL].ref == NETPOL_IMAGE and plan[NETPOL].entrypoint == "/bin/netpol"
    assert names["konnectivity-agent"] == AGENT_IMAGE and plan["konnectivity-agent"].entrypoint == "/proxy-agent"
    assert plan["local-path-provisioner"].ref == "docker.io/rancher/local-path-provisioner:v0.0.37"
    built = {c.name: c for c in [kb.kubernetes(k8s), *kb.others(), *kb.hosted_components()]}
    for img in plan.values():
        assert img.entrypoint in img.files, img.archive
        for comp, name in img.files.values():
            assert comp == kb.BUSYBOX or name in built[comp].binaries, img.archive
    # etcd's pods run installer/sh/etcd-member-start.sh, and etcd's day 2 of a tenant and
    # apply's NetworkPolicy probe exec commands in them: busybox's sh and what those call, no more
    script = "".join((ROOT / f).read_text() for f in ("installer/sh/etcd-member-start.sh",
                                                      "installer/engine/planes/etcd_pods.py",
                                                      "installer/core/render/tenant_network.py"))
    assert plan["etcd"].files["/bin/busybox"] == (kb.BUSYBOX, "busybox") and "sh" in kb.ETCD_APPLETS
    assert all(re.search(rf"(^|[\s($/]){re.escape(a)}[\s\"]", script, re.M) for a in kb.ETCD_APPLETS if a != "sh")
    # local-path-provisioner's helper pods run its setup and teardown scripts in the lab's busybox
    assert {"sh", "mkdir", "chmod", "rm"} <= set(kb.BUSYBOX_APPLETS)
    # and the konnectivity-server binary control hosts get is the one the server image runs
    assert plan["konnectivity-server"].files["/proxy-server"] == ("konnectivity", SERVER_BINARY)


def test_the_agnhost_archive_holds_the_e2e_archives_agnhost(tmp_path):
    e2e = kb.e2e                            # tools/kubebuild/e2e.py, as build.py imports it
    from installer.lab import archives
    c = e2e.e2e(kb.kubernetes(versions.DEFAULT_KUBERNETES_VERSION))
    _, src = kb.download_gomod("k8s.io/kubernetes", c.version, c.pin_dir)
    # the agnhost tags the pinned suite lists (Agnhost, AgnhostPrev) and the one its tests use
    manifest = (src / "test/utils/image/manifest.go").read_text()
    tags = re.findall(r'configs\[Agnhost\w*\] = Config\{list\.PromoterE2eRegistry, "agnhost", "([^"]+)"\}', manifest)
    current = re.search(r'configs\[Agnhost\] = Config\{[^}]*"agnhost", "([^"]+)"\}', manifest)[1]
    names = [f"registry.k8s.io/e2e-test-images/agnhost:{t}" for t in tags]
    assert len(names) == 2 and current in tags
    names += ["gcr.io/k8s-authenticated-test/agnhost:2.6", "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"]
    ref = e2e.agnhost_ref(names)
    assert ref == f"registry.k8s.io/e2e-test-images/agnhost:{current}"
    # image-agnhost.tar's image is image-e2e.tar's: the same manifest under the same name
    layers = {"debian": b"debian tree", "agnhost": b"agnhost files", "busybox": b"busybox"}
    made, _ = e2e.images(names, layers, src)
    everything = archives.oci_archive(tmp_path / "image-e2e.tar", made)
    alone = archives.oci_archive(tmp_path / e2e.AGNHOST_ARCHIVE,
                                 [e2e.agnhost_image(ref, layers["debian"], layers["agnhost"])])
    assert alone == {ref: everything[ref]}
    assert archive_images(tmp_path / e2e.AGNHOST_ARCHIVE) == (ref,)


def test_the_hosted_images_are_built(built_artifacts):
    k8s, etcd = versions.DEFAULT_KUBERNETES_VERSION, versions.DEFAULT_COMPONENTS["etcd"]
    for img in kb.hosted_image_plan(k8s, etcd):
        assert archive_images(built_artifacts / f"image-{img.archive}.tar") == (img.ref,)
    assert "--uds-name" in subprocess.run([str(built_artifacts / SERVER_BINARY), "--help"], capture_output=True,
                                          text=True, timeout=60).stdout


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
    # of the image archives only the ones every worker runs, unless all_images (a lab hosting tenants)
    assert debian_artifacts.import_dir(src, dest) == ["etcd"] and not (dest / "image-x.tar").exists()
    assert debian_artifacts.import_dir(src, dest, all_images=True) == ["etcd", "image-x.tar"]
    assert (dest / "etcd").read_bytes() == b"built etcd" and (dest / "runc").read_bytes() == b"debian runc"
    assert (dest / "image-x.tar").stat().st_mode & 0o777 == 0o644 and (dest / "etcd").stat().st_mode & 0o111
    assert set(read_sums(dest)) == {"etcd", "runc", "image-x.tar"}
    (src / "etcd").write_bytes(b"tampered")
    with pytest.raises(LabError, match="etcd: sha256 .* does not match"):
        debian_artifacts.import_dir(src, dest)
    with pytest.raises(LabError, match="no SHA256SUMS"):
        debian_artifacts.import_dir(tmp_path, dest)
