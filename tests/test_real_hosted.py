"""A hosted tenant on the real lab (docs/hosted.md): its etcd, kube-apiserver (with its
konnectivity server), controller-manager and scheduler run as pods of the real-cluster lab (the
hosting cluster, volumes from a real dynamic provisioner: local-path-provisioner built from its
Go module), its two workers (w3, w4: nspawn hosts of the same lab network) join over SSH as
any cluster's do.

Real: the hosting cluster and every tenant component (the images built from their Go modules by
scripts/build-kubernetes, imported on the hosting workers), etcd's membership-aware start, TLS,
kubectl. Nothing stands in for anything.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from installer.core.artifacts import read_sums
from installer.lab.debian_artifacts import WORKER_IMAGES

from .builtfixtures import _linked_dir
from .realcluster import TENANT_WORKERS, RealCluster, run_installer

pytestmark = [pytest.mark.lab, pytest.mark.real]

ROOT = Path(__file__).resolve().parent.parent
STORAGE = ROOT / "installer" / "lab" / "manifests" / "local-path-storage.yaml"
NS = "hp-tenant"
API_PORT, KONNECTIVITY_PORT = 30443, 30132


class Tenant:
    def __init__(self, rc: RealCluster, inventory: Path, state: Path, kubeconfig: Path, report: dict,
                 seconds: float):
        self.rc, self.inventory, self.state, self.kubeconfig = rc, inventory, state, kubeconfig
        self.report, self.seconds = report, seconds

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
                ) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.rc.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, timeout=timeout, input=stdin)
        if check:
            assert proc.returncode == 0, f"tenant kubectl {' '.join(args)}: rc={proc.returncode}\n{proc.stderr[-2000:]}"
        return proc

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


def tenant_inventory(rc: RealCluster, tmp: Path, name: str = "tenant", namespace: str | None = None) -> Path:
    """The tenant: w3 and w4 as workers, its control plane in the real cluster, exposed on the
    hosting workers' addresses (NodePort)."""
    lab_doc = yaml.safe_load(rc.lab.inventory.read_text())
    # (the lab's inventory is the hosting cluster's: its hosts are the lab's but the tenant's)
    hosts = [{"name": w, "address": rc.address(w), "role": "worker"} for w in TENANT_WORKERS]
    spec = {k: v for k, v in lab_doc["spec"].items() if k not in ("hosts", "apiServer")}
    spec["artifacts"] = {**spec["artifacts"], "path": str(worker_artifacts(Path(spec["artifacts"]["path"]), tmp))}
    spec["network"] = {"podCIDR": "10.245.0.0/16", "serviceCIDR": "10.97.0.0/16", "clusterDNS": "10.97.0.10",
                       "upstreamDNS": [rc.address("cp1")]}
    spec["apiServer"] = {"alwaysPullImages": False}
    spec["controlPlane"] = {"mode": "hosted", "hosted": {
        "kubeconfig": str(rc.kubeconfig), **({"namespace": namespace} if namespace else {}),
        "expose": {"type": "NodePort", "addresses": [rc.address(w) for w in rc.workers],
                   "port": API_PORT, "konnectivityPort": KONNECTIVITY_PORT},
        "apiServerReplicas": 2, "etcdReplicas": 3, "storageClass": "local-path"}}
    spec["hosts"] = hosts
    doc = {"apiVersion": lab_doc["apiVersion"], "kind": "Cluster", "metadata": {"name": name}, "spec": spec}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def worker_artifacts(src: Path, tmp: Path) -> Path:
    """The hosting lab's artifacts without the control-plane images (hard links): what the
    tenant's workers run, the konnectivity agent's image with it."""
    images = WORKER_IMAGES | {"image-konnectivity-agent.tar"}
    sums = {n: d for n, d in read_sums(src).items() if not n.endswith(".tar") or n in images}
    return _linked_dir(tmp / "tenant-artifacts", {n: src / n for n in sums}, sums)


def install_storage(rc: RealCluster) -> None:
    """The hosting cluster's provisioner (lab tooling): applied once, ready before any tenant."""
    rc.kubectl("apply", "-f", str(STORAGE))
    rc.kubectl("-n", "local-path-storage", "rollout", "status", "deployment/local-path-provisioner",
               "--timeout=300s", timeout=330)


@pytest.fixture(scope="module")
def tenant(real_cluster: RealCluster, tmp_path_factory) -> Tenant:
    rc = real_cluster
    tmp = tmp_path_factory.mktemp("tenant")
    install_storage(rc)
    inventory, state = tenant_inventory(rc, tmp), tmp / "state"
    started = time.monotonic()
    proc = run_installer("apply", str(inventory), "--state", str(state), "--output", "json", "--wait-timeout", "900")
    seconds = time.monotonic() - started
    kubeconfig = tmp / "tenant.kubeconfig"
    run_installer("kubeconfig", str(inventory), "--state", str(state), "-o", str(kubeconfig))
    print(f"\nhosted tenant: apply {seconds:.0f} s")
    yield Tenant(rc, inventory, state, kubeconfig, json.loads(proc.stdout), seconds)


def test_the_tenant_shows_its_own_workers_only(tenant: Tenant):
    nodes = tenant.get("nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(TENANT_WORKERS)
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
               for n in nodes)
    # and the hosting cluster runs its control plane, in its namespace only
    pods = tenant.rc.get("pods", "-n", NS)["items"]
    names = sorted(p["metadata"]["name"].rsplit("-", 2)[0] if not p["metadata"]["name"].startswith("etcd-")
                   else "etcd" for p in pods)
    assert names.count("etcd") == 3 and names.count("kube-apiserver") == 2, names
    hosting_nodes = {n["metadata"]["name"] for n in tenant.rc.get("nodes")["items"]}
    assert not hosting_nodes & {n["metadata"]["name"] for n in nodes}


def test_a_second_apply_changes_and_restarts_nothing(tenant: Tenant):
    proc = run_installer("apply", str(tenant.inventory), "--state", str(tenant.state), "--output", "json")
    report = json.loads(proc.stdout)
    assert report["changes"] == 0 and report["restarts"] == [], [e for e in report["events"]
                                                                 if e["action"] == "changed"]
