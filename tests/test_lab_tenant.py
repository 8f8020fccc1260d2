"""The lab's hosting/tenant split (installer/lab/tenant.py): what `installer lab up --hosting
--tenant-workers N` writes is a hosting inventory and a tenant inventory the installer accepts,
the tenant's workers given what they run and nothing more."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core.artifacts import read_sums, write_sums
from installer.core.inventory import load
from installer.lab import lab as lab_mod
from installer.lab import tenant
from installer.lab.model import DEFAULT_SUBNET, LabError, LabPaths, LabSpec


def lab_doc(workers: int) -> dict:
    spec = LabSpec.create("ht", 1, workers, 0, DEFAULT_SUBNET)
    return lab_mod.inventory_doc(spec, LabPaths.of("ht"), hosting=True)


def test_the_last_workers_are_the_tenants_and_the_hosting_cluster_keeps_the_rest():
    hosting, theirs = tenant.split(lab_doc(3), 1)
    assert [h["name"] for h in hosting["spec"]["hosts"]] == ["cp1", "w1", "w2"]
    assert [h["name"] for h in theirs] == ["w3"]
    assert hosting["spec"]["network"] == {"policy": "kube-network-policies"}
    for n in (0, 3):
        with pytest.raises(LabError, match=f"--tenant-workers {n}: between 1 and 2 of the lab's 3 workers"):
            tenant.split(lab_doc(3), n)


@pytest.mark.parametrize("workers, spread", [(3, "preferred"), (4, "required")])
def test_the_tenant_inventory_is_valid_and_exposed_on_the_hosting_workers(tmp_path, workers, spread):
    hosting, theirs = tenant.split(lab_doc(workers), 1)
    (tmp_path / tenant.HOSTING_KUBECONFIG).write_text("apiVersion: v1\nkind: Config\n")
    (tmp_path / tenant.HOSTING_KUBECONFIG).chmod(0o600)
    (tmp_path / "arts").mkdir()
    doc = tenant.tenant_doc(hosting, theirs, tenant.HOSTING_KUBECONFIG, tmp_path / "arts")
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    inv = load(path)
    hosted = inv.hosted
    workers_there = [h["address"] for h in hosting["spec"]["hosts"] if h["role"] == "worker"]
    assert hosted.expose.addresses == workers_there and hosted.storageClass == "local-path"
    # required only where every member and replica (and a roll's) can have a node of its own
    assert hosted.spread == spread
    assert [h.name for h in inv.spec.hosts] == [theirs[0]["name"]] and inv.spec.hosts[0].role == "worker"
    assert str(inv.spec.network.podCIDR) == "10.245.0.0/16" and inv.spec.network.policy == "none"
    assert inv.spec.apiServer.alwaysPullImages is False
    assert "upstreamDNS" not in doc["spec"]["network"]          # the lab has none: the nodes' resolver


def test_the_tenants_workers_get_the_artifacts_without_the_control_planes_images(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    names = ["kubelet", "image-pause.tar", "image-konnectivity-agent.tar", "image-kube-apiserver.tar",
             "image-etcd.tar"]
    sums = {}
    for n in names:
        (src / n).write_bytes(n.encode())
        sums[n] = hashlib.sha256(n.encode()).hexdigest()
    write_sums(src, sums)
    dest = tenant.tenant_artifacts(src, tmp_path / "tenant-artifacts")
    assert set(read_sums(dest)) == {"kubelet", "image-pause.tar", "image-konnectivity-agent.tar"}
    assert (dest / "kubelet").stat().st_ino == (src / "kubelet").stat().st_ino          # a hard link
    inode = (dest / "kubelet").stat().st_ino
    assert tenant.tenant_artifacts(src, tmp_path / "tenant-artifacts") == dest          # kept as it is
    assert (dest / "kubelet").stat().st_ino == inode


def test_tenant_workers_without_hosting_are_refused_before_anything():
    with pytest.raises(LabError, match="--tenant-workers needs --hosting"):
        lab_mod.up("ht", 1, 3, tenant_workers=1)
    result = CliRunner().invoke(cli, ["lab", "up", "--name", "ht", "--workers", "3", "--tenant-workers", "1"])
    assert result.exit_code != 0 and "--tenant-workers needs --hosting" in result.output, result.output
