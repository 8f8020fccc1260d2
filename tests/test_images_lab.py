"""Images without a registry, for real: a lab with one VM worker (qemu; Debian's containerd and
runc, really running containers) gets an image archive from the artifacts directory, and
`installer apply` imports it into containerd's k8s.io namespace, from which a container runs.
A second apply uploads and imports nothing. The Kubernetes binaries are the contract stand-ins,
so cluster-bootstrap is skipped."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from installer.artifacts import add_files
from installer.fetch import IMAGE_DIR
from installer.lab import lab as lab_mod
from installer.lab import vm

from .labfixtures import install_standins, start_lab
from .test_apply_lab import run_installer

pytestmark = [pytest.mark.lab, pytest.mark.vm]

NAME = "img"
SUBNET = "10.213.230.0/24"
IMAGE = "localhost/hiddenplane/busybox:lab"
ARCHIVE = "image-busybox.tar"


def apply(lab, inventory) -> dict:
    proc = run_installer("apply", str(inventory), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         "--output", "json", "--wait-timeout", "120")
    return json.loads(proc.stdout)


def with_image_archive(lab, tmp, vm_host: str) -> None:
    """Stand-ins and a busybox image archive in the lab's artifacts, the VM worker's kernel
    modules loaded, and ``lab.inv_images``: the lab inventory with that image as sandbox image."""
    install_standins(lab.paths.artifacts)
    busybox = vm.deb_tree("busybox-static", log=lambda *_: None) / "bin" / "busybox"
    vm.busybox_image_archive(lab.paths.artifacts / ARCHIVE, IMAGE, busybox.read_bytes())
    add_files(lab.paths.artifacts, [ARCHIVE])
    # the VM's own kernel has neither overlay nor br_netfilter loaded: apply's preflight loads them
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["spec"]["artifacts"]["sandboxImage"] = IMAGE
    lab.inv_images = tmp / f"{lab.spec.name}-images.inventory.yaml"
    lab.inv_images.write_text(yaml.safe_dump(doc))
    lab.state = tmp / "state"


@pytest.fixture(scope="module")
def imglab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imglab")
    t = time.monotonic()
    lab = start_lab(NAME, SUBNET, tmp, controls=1, workers=1, vm_workers=1)
    try:
        assert lab.spec.host("w1").kind == "vm"
        print(f"\nlab {NAME} up in {time.monotonic() - t:.1f} s")
        with_image_archive(lab, tmp, "w1")
        yield lab
    finally:
        lab_mod.down(NAME, log=lambda *_: None)


def test_apply_imports_the_archive_and_a_container_runs_from_it(imglab):
    t = time.monotonic()
    report = apply(imglab, imglab.inv_images)
    print(f"\ncold apply {time.monotonic() - t:.1f} s")
    assert report["changes"] > 0
    uploads = [d for e in report["events"] if (e["phase"], e["host"]) == ("artifacts", "w1") for d in e["detail"]]
    assert any(f"{IMAGE_DIR}/{ARCHIVE}" in d for d in uploads), uploads
    cp_files = [d for e in report["events"] if e["host"] == "cp1" for d in e["detail"]]
    assert not any(IMAGE_DIR in d for d in cp_files), "no images on the hidden control host"
    workers = [e for e in report["events"] if (e["phase"], e["host"]) == ("workers", "w1")]
    assert [d for e in workers for d in e["detail"] if d.startswith("imported ")] == [f"imported {ARCHIVE}"]

    w1 = imglab.host("w1")
    assert IMAGE in w1.check_output("ctr -n k8s.io images ls -q").split()
    out = w1.check_output(f"ctr -n k8s.io run --rm {IMAGE} t1 /bin/busybox echo hiddenplane-image-ok")
    assert out.strip() == "hiddenplane-image-ok"
    assert w1.check_output("ctr -n k8s.io containers ls -q").strip() == ""
    assert f"sandbox = '{IMAGE}'" in w1.file("/etc/containerd/config.toml").content_string
    assert not imglab.host("cp1").file(IMAGE_DIR).exists


def test_second_apply_imports_nothing(imglab):
    t = time.monotonic()
    report = apply(imglab, imglab.inv_images)
    print(f"\nsecond apply {time.monotonic() - t:.1f} s")
    assert report["changes"] == 0, [e for e in report["events"] if e["action"] == "changed"]
    assert set(report["bytesUploaded"].values()) == {0}
    assert not [d for e in report["events"] for d in e["detail"] if d.startswith("imported")]
    assert IMAGE in imglab.host("w1").check_output("ctr -n k8s.io images ls -q").split()


def test_an_image_removed_from_containerd_is_imported_again(imglab):
    w1 = imglab.host("w1")
    w1.run_expect([0], f"ctr -n k8s.io images rm {IMAGE}")
    report = apply(imglab, imglab.inv_images)
    assert [d for e in report["events"] for d in e["detail"] if d.startswith("imported")] == [f"imported {ARCHIVE}"]
    assert report["restarts"] == [] and set(report["bytesUploaded"].values()) == {0}
    assert IMAGE in w1.check_output("ctr -n k8s.io images ls -q").split()
