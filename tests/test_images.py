"""Container images without a registry, without hosts: image archives (``image-*.tar``) in the
artifacts are verified against SHA256SUMS, travel to workers only (/var/lib/hiddenplane/images),
and the workers phase's import script imports each one into containerd's k8s.io namespace only
when missing, and pins it (run here under /bin/sh with a fake ``ctr`` that records its calls)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from installer.core import inventory
from installer.core.artifacts import ArtifactError, add_files
from installer.core.inventory_model import SANDBOX_IMAGE
from installer.core.render.worker import HostFacts, render_worker
from installer.engine.parts import binaries_part, phase_parts
from installer.engine.phases.join_workers import archive_images, import_script, normalize_ref
from installer.host.fetch import ALL_BINARIES, IMAGE_DIR, ResolvedArtifact, binary_files, resolve_images
from installer.lab.archives import build_image_archive

REF = "localhost/hiddenplane/pause:lab"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dir_inv(example_doc, tmp_path, **extra) -> inventory.Inventory:
    doc = copy.deepcopy(example_doc)
    doc["spec"]["artifacts"] = {"source": "dir", "path": "artifacts"} | extra
    return inventory.parse(doc, "test", base_dir=tmp_path)


def artifacts_with_image(tmp_path: Path) -> Path:
    d = tmp_path / "artifacts"
    d.mkdir()
    for n in ALL_BINARIES:
        (d / n).write_bytes(f"fake {n}\n".encode())
    build_image_archive(d / "image-pause.tar", REF, {"/pause": (b"#!/bin/sh\n", 0o755)}, ["/pause"])
    (d / "image-unlisted.tar").write_bytes(b"not in SHA256SUMS: ignored")
    (d / "notanimage.tar").write_bytes(b"x")
    add_files(d, [*ALL_BINARIES, "image-pause.tar", "notanimage.tar"])
    return d


def test_resolve_images_verifies_the_listed_archives(example_doc, tmp_path):
    d = artifacts_with_image(tmp_path)
    inv = dir_inv(example_doc, tmp_path)
    got = resolve_images(inv)
    assert list(got) == ["image-pause.tar"]
    assert got["image-pause.tar"].path == d / "image-pause.tar"
    assert got["image-pause.tar"].sha256 == sha((d / "image-pause.tar").read_bytes())

    with open(d / "image-pause.tar", "ab") as f:     # tampered after it was recorded
        f.write(b"\0")
    with pytest.raises(ArtifactError) as e:
        resolve_images(inv)
    assert "image-pause.tar: sha256" in str(e.value) and "does not match" in str(e.value)
    (d / "image-pause.tar").unlink()
    with pytest.raises(ArtifactError, match="image-pause.tar: missing"):
        resolve_images(inv)


def test_no_images_and_download_source_without_a_cache_index(example_doc, tmp_path):
    d = tmp_path / "artifacts"
    d.mkdir()
    add_files(d, [])
    assert resolve_images(dir_inv(example_doc, tmp_path)) == {}
    doc = copy.deepcopy(example_doc)
    doc["spec"]["artifacts"] = {"source": "download", "cacheDir": "cache"}
    assert resolve_images(inventory.parse(doc, "test", base_dir=tmp_path)) == {}


def test_archive_names_oci_and_docker(tmp_path):
    d = artifacts_with_image(tmp_path)
    assert archive_images(d / "image-pause.tar") == (REF,)
    import io
    import tarfile
    docker = tmp_path / "docker.tar"
    with tarfile.open(docker, "w") as tar:
        data = json.dumps([{"Config": "c.json", "RepoTags": ["busybox:1.36", "quay.io/x/y:2"], "Layers": []}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert archive_images(docker) == ("docker.io/library/busybox:1.36", "quay.io/x/y:2")
    (tmp_path / "junk.tar").write_bytes(b"junk")
    assert archive_images(tmp_path / "junk.tar") == ()
    assert normalize_ref("cilium/cilium:v1") == "docker.io/cilium/cilium:v1"
    assert normalize_ref("registry.k8s.io/pause:3.10.1") == "registry.k8s.io/pause:3.10.1"
    assert normalize_ref("localhost/a:b") == "localhost/a:b"


def test_images_go_to_workers_only(example_doc, tmp_path, prepared):
    artifacts_with_image(tmp_path)
    inv = dir_inv(example_doc, tmp_path)
    images = resolve_images(inv)
    resolved = {n: ResolvedArtifact(n, tmp_path / "artifacts" / n, "0" * 64) for n in ALL_BINARIES} | images
    worker = {f.path: f for f in binary_files(resolved, "worker")}
    f = worker[f"{IMAGE_DIR}/image-pause.tar"]
    assert (f.mode, f.source, f.digest, f.restarts) == (0o644, images["image-pause.tar"].path,
                                                         images["image-pause.tar"].sha256, ())
    assert not any(p.startswith(IMAGE_DIR) for p in (g.path for g in binary_files(resolved, "control")))

    # the artifacts phase owns them (uploaded through the normal diff; the probe looks at them)
    ctx = SimpleNamespace(artifacts=resolved, inv=prepared.inventory, plans=prepared.plans)
    for h in prepared.inventory.spec.hosts:
        paths = [g.path for g in binaries_part(ctx, h.name).files]
        assert (f"{IMAGE_DIR}/image-pause.tar" in paths) == (h.role == "worker"), h.name
        if h.role == "worker":
            assert f"{IMAGE_DIR}/image-pause.tar" in [g.path for g in phase_parts(ctx, h.name)["artifacts"].files]


def test_sandbox_image_is_configurable(prepared, example_doc, tmp_path):
    inv = prepared.inventory
    host = next(h for h in inv.spec.hosts if h.role == "worker")
    assert inv.spec.artifacts.sandboxImage == SANDBOX_IMAGE
    conf = render_worker(inv, host, prepared.material, HostFacts())
    assert f"sandbox = '{SANDBOX_IMAGE}'" in conf.files["/etc/containerd/config.toml"].content.decode()
    other = inv.model_copy(update={"spec": inv.spec.model_copy(update={
        "artifacts": inv.spec.artifacts.model_copy(update={"sandboxImage": REF})})})
    conf = render_worker(other, host, prepared.material, HostFacts())
    assert f"sandbox = '{REF}'" in conf.files["/etc/containerd/config.toml"].content.decode()
    doc = copy.deepcopy(example_doc)
    doc["spec"]["artifacts"] = {"sandboxImage": "localhost/pause:1"}
    assert inventory.parse(doc, "t", base_dir=tmp_path).spec.artifacts.sandboxImage == "localhost/pause:1"
    doc["spec"]["artifacts"] = {"sandboxImage": 'pause" x = "1'}      # would break the TOML
    with pytest.raises(Exception, match="sandboxImage"):
        inventory.parse(doc, "t", base_dir=tmp_path)


FAKE_CTR = """#!/bin/sh
# a containerd client that keeps its image list in a file; it answers `version` only once
# containerd is "up" (@UP@ exists: a test may make it appear later)
if [ "$1" = version ]; then [ -e "@UP@" ]; exit; fi
echo "$*" >> "@LOG@"
case "$*" in
  "-n k8s.io images ls -q") cat "@DB@" 2>/dev/null || true ;;
  '-n k8s.io images ls -q labels."io.cri-containerd.pinned"==pinned') cat "@DB@.pinned" 2>/dev/null || true ;;
  "-n k8s.io images import "*) for ref in $(cat "$5.refs"); do echo "$ref" >> "@DB@"; done ;;
  "-n k8s.io images label "*" io.cri-containerd.pinned=pinned") echo "$5" >> "@DB@.pinned" ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""


class Worker:
    def __init__(self, tmp: Path):
        self.root = tmp / "images"
        self.root.mkdir()
        self.log, self.db = tmp / "ctr.log", tmp / "images.db"
        self.ctr = tmp / "ctr"
        self.up = tmp / "containerd-up"
        self.up.touch()
        self.ctr.write_text(FAKE_CTR.replace("@LOG@", str(self.log)).replace("@DB@", str(self.db))
                            .replace("@UP@", str(self.up)))
        self.ctr.chmod(0o755)

    def run(self, images) -> subprocess.CompletedProcess:
        script = import_script(images, ctr=str(self.ctr), directory=str(self.root))
        return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=dict(os.environ))

    def calls(self) -> list[str]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return lines


def test_import_script_imports_only_what_is_missing(tmp_path):
    w = Worker(tmp_path)
    (w.root / "image-pause.tar").write_bytes(b"p")
    (w.root / "image-pause.tar.refs").write_text(REF + "\n")
    (w.root / "image-dns.tar").write_bytes(b"d")
    (w.root / "image-dns.tar.refs").write_text("registry.k8s.io/coredns/coredns:v1.12.0\n")
    images = [("image-dns.tar", "d" * 64, ("registry.k8s.io/coredns/coredns:v1.12.0",)),
              ("image-pause.tar", "a" * 64, (REF,))]

    dns = "registry.k8s.io/coredns/coredns:v1.12.0"
    listing = ["-n k8s.io images ls -q", '-n k8s.io images ls -q labels."io.cri-containerd.pinned"==pinned']
    r = w.run(images)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["imported image-dns.tar", "imported image-pause.tar"]
    # each image pinned once imported: the kubelet's image garbage collection leaves it
    assert w.calls() == [*listing, f"-n k8s.io images import {w.root}/image-dns.tar",
                         f"-n k8s.io images label {dns} io.cri-containerd.pinned=pinned",
                         f"-n k8s.io images import {w.root}/image-pause.tar",
                         f"-n k8s.io images label {REF} io.cri-containerd.pinned=pinned"]
    assert (w.root / "image-pause.tar.imported").read_text() == "a" * 64 + "\n"

    r = w.run(images)                     # second run: everything is there
    assert (r.returncode, r.stdout) == (0, "")
    assert w.calls() == listing

    # an image there but not pinned (imported by an earlier release): pinned, not imported
    (w.db.parent / "images.db.pinned").write_text(REF + "\n")
    r = w.run(images)
    assert r.stdout.splitlines() == [f"pinned {dns}"]
    assert w.calls()[2:] == [f"-n k8s.io images label {dns} io.cri-containerd.pinned=pinned"]

    # an image removed from containerd (e.g. garbage-collected) is imported again
    w.db.write_text("registry.k8s.io/coredns/coredns:v1.12.0\n")
    r = w.run(images)
    assert r.stdout.splitlines() == ["imported image-pause.tar"]
    assert w.calls()[2:] == [f"-n k8s.io images import {w.root}/image-pause.tar",
                             f"-n k8s.io images label {REF} io.cri-containerd.pinned=pinned"]

    # a new archive (another digest) under the same name is imported even though its names exist
    r = w.run([("image-pause.tar", "b" * 64, (REF,))])
    assert r.stdout.splitlines() == ["imported image-pause.tar"]
    assert (w.root / "image-pause.tar.imported").read_text() == "b" * 64 + "\n"

    # an archive that names no image: the stamp alone decides
    (w.root / "image-anon.tar").write_bytes(b"x")
    (w.root / "image-anon.tar.refs").write_text("")
    assert w.run([("image-anon.tar", "c" * 64, ())]).stdout == "imported image-anon.tar\n"
    assert w.run([("image-anon.tar", "c" * 64, ())]).stdout == ""


def test_a_failed_import_fails_the_script_and_leaves_no_stamp(tmp_path):
    w = Worker(tmp_path)
    w.ctr.write_text("#!/bin/sh\ncase \"$*\" in *import*) echo 'ctr: broken archive' >&2; exit 1;; esac\n")
    (w.root / "image-bad.tar").write_bytes(b"x")
    r = w.run([("image-bad.tar", "e" * 64, ("localhost/bad:1",))])
    assert r.returncode != 0 and "broken archive" in r.stderr
    assert not (w.root / "image-bad.tar.imported").exists()


def _containerd_dump(containerd: Path, config: bytes, tmp_path: Path) -> dict:
    """The configuration the real containerd binary makes of ``config`` (`config dump`: the
    file merged over its defaults, plugin sections resolved)."""
    import tomllib
    path = tmp_path / "config.toml"
    path.write_bytes(config)
    proc = subprocess.run([str(containerd), "--config", str(path), "config", "dump"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads(proc.stdout)


def test_real_containerd_2_reads_the_rendered_config(prepared, built_artifacts, tmp_path):
    """containerd 2.x (built from its module) puts every rendered value at its own place:
    unknown keys would pass silently, so the check is where each value lands."""
    host = prepared.inventory.workers[0]
    conf = render_worker(prepared.inventory, host, prepared.material, HostFacts()).files["/etc/containerd/config.toml"]
    got = _containerd_dump(built_artifacts / "containerd", conf.content, tmp_path)
    default = _containerd_dump(built_artifacts / "containerd", b"version = 3\n", tmp_path)
    runc = got["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]
    assert runc["options"]["SystemdCgroup"] is True
    assert default["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]["options"][
        "SystemdCgroup"] is False            # so the rendered value is what sets it
    assert runc["options"]["BinaryName"] == "/usr/local/bin/runc"
    assert got["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == SANDBOX_IMAGE
    cni = got["plugins"]["io.containerd.cri.v1.runtime"]["cni"]
    assert (cni["bin_dirs"], cni["conf_dir"]) == (["/opt/cni/bin"], "/etc/cni/net.d")


def test_containerd_1x_gets_the_version_2_format(prepared, example_doc, tmp_path):
    """spec.artifacts.versions.containerd 1.x (e.g. Debian's 1.6, which the lab uses without
    Go): the version 2 format, which Debian's real containerd 1.6 reads into its CRI plugin."""
    from installer.lab.archives import deb_tree
    doc = copy.deepcopy(example_doc)
    doc["spec"]["artifacts"] = {"versions": {"containerd": "1.6.20"}}
    inv = inventory.parse(doc, "t", base_dir=tmp_path)
    conf = render_worker(inv, inv.workers[0], prepared.material, HostFacts()).files["/etc/containerd/config.toml"]
    assert conf.content.decode().count("version = 2") == 1
    got = _containerd_dump(deb_tree("containerd", log=lambda *_: None) / "usr/bin/containerd", conf.content, tmp_path)
    cri = got["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == SANDBOX_IMAGE
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True


def test_real_containerd_reads_restrict_oom_score_adj_of_a_container_worker(prepared, built_artifacts, example_doc,
                                                                          tmp_path):
    """spec.workerHosts.inContainer: true puts restrict_oom_score_adj where each real containerd
    reads it: 2.x (built) in the CRI runtime plugin, Debian's 1.6 in the one CRI plugin (both
    default it to false, so the rendered line is what sets it)."""
    from installer.lab.archives import deb_tree
    debian = deb_tree("containerd", log=lambda *_: None) / "usr/bin/containerd"
    for binary, versions, plugin in (
            (built_artifacts / "containerd", None, "io.containerd.cri.v1.runtime"),
            (debian, {"containerd": "1.6.20"}, "io.containerd.grpc.v1.cri")):
        doc = copy.deepcopy(example_doc)
        doc["spec"]["workerHosts"] = {"inContainer": True}
        if versions:
            doc["spec"]["artifacts"] = {"versions": versions}
        inv = inventory.parse(doc, "t", base_dir=tmp_path)
        conf = render_worker(inv, inv.workers[0], prepared.material, HostFacts()).files["/etc/containerd/config.toml"]
        got = _containerd_dump(binary, conf.content, tmp_path)["plugins"][plugin]
        default = _containerd_dump(binary, conf.content.replace(b"restrict_oom_score_adj = true", b""),
                                   tmp_path)["plugins"][plugin]
        assert (got["restrict_oom_score_adj"], default["restrict_oom_score_adj"]) == (True, False), binary
        assert got["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True, binary


def test_import_waits_for_containerd_to_answer(tmp_path):
    """The workers' units start without blocking: the import waits until containerd answers."""
    w = Worker(tmp_path)
    w.up.unlink()
    (w.root / "a.tar").write_bytes(b"a")
    (w.root / "a.tar.refs").write_text("docker.io/library/a:1\n")
    threading.Timer(1.5, w.up.touch).start()
    r = w.run([("a.tar", "d" * 64, ("docker.io/library/a:1",))])
    assert r.returncode == 0, r.stderr
    assert "imported a.tar" in r.stdout
