"""Density of hosted control planes (docs/hosted.md): how many tenants' control planes a hosting
cluster on this machine holds, and what each costs.

A hosting cluster on the lab (1 control host, 2 nspawn workers, local-path-provisioner built from
its Go module), then N tenants' control planes brought up one after another with `installer apply
--only hosted` (etcd x3, kube-apiserver + konnectivity x2, controller-manager x2, scheduler x2
each, as the inventory's defaults in tests/test_real_hosted.py): the seconds from the command to
its end (every workload of the tenant rolled out and ready: its API answers /readyz behind its
Service). The tenants' workers are not joined: all name one lab host (w3), which `--only hosted`
only connects to; what a worker costs is the worker's, not the hosting cluster's. After the
last one, at rest for ``--settle`` seconds: each tenant's memory (working set) and CPU from the
hosting kubelets' summaries, as metrics-server reads them, and the hosting workers' totals; the
machine's available memory before the first and after the last.

Printed beside the published anchors: Kamaji (a tenant reconciled every 4.5 s by its operator;
100 tenants per hosting cluster in its benchmark), k0smotron (210-560 MiB and 0.4-1.3 cores per
tenant at 100 tenants), HyperShift (an SLO of under 5 minutes to available). Needs root and the
built artifacts (scripts/build-kubernetes). Prints figures; never fails on a time.
Run: sudo .venv/bin/python benchmarks/hosted_density.py [--tenants 5] [--settle 60] [--keep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

NAME, SUBNET = "bdens", "10.213.214.0/24"
ROOT = Path(__file__).resolve().parent.parent
INSTALLER = str(Path(sys.executable).with_name("installer"))
STORAGE = ROOT / "installer" / "lab" / "manifests" / "local-path-storage.yaml"
ANCHORS = ("Kamaji: a tenant reconciled every 4.5 s by its operator (its pods ready later), 100 per hosting "
           "cluster; k0smotron: 210-560 MiB and 0.4-1.3 cores per tenant at 100; HyperShift: < 5 min to available")


def run(*cmd: str, timeout: float = 1800, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=stdin)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return proc


def mem_available() -> int:
    return int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemAvailable:"))) * 1024


def tenant_doc(hosting: dict, kubeconfig: Path, i: int, worker: dict, addresses: list[str]) -> dict:
    spec = {k: v for k, v in hosting["spec"].items() if k not in ("hosts", "apiServer")}
    spec["network"] = {"podCIDR": f"10.{100 + i}.0.0/16", "serviceCIDR": f"10.{150 + i}.0.0/16",
                       "clusterDNS": f"10.{150 + i}.0.10"}
    spec["apiServer"] = {"alwaysPullImages": False}
    spec["controlPlane"] = {"mode": "hosted", "hosted": {
        "kubeconfig": str(kubeconfig),
        "expose": {"type": "NodePort", "addresses": addresses, "port": 30500 + 2 * i,
                   "konnectivityPort": 30501 + 2 * i},
        # preferred: the hosting cluster here has two workers, too few for three members apart
        "apiServerReplicas": 2, "etcdReplicas": 3, "storageClass": "local-path", "spread": "preferred"}}
    spec["hosts"] = [worker]
    return {"apiVersion": hosting["apiVersion"], "kind": "Cluster", "metadata": {"name": f"t{i}"}, "spec": spec}


def usage(kubectl: list[str], nodes: list[str]) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """namespace -> (working-set bytes, nanocores) of its pods; node -> the same for the node."""
    per: dict[str, tuple[int, int]] = {}
    node_use = {}
    for node in nodes:
        s = json.loads(run(*kubectl, "get", "--raw", f"/api/v1/nodes/{node}/proxy/stats/summary").stdout)
        n = s.get("node") or {}
        node_use[node] = ((n.get("memory") or {}).get("workingSetBytes", 0),
                          (n.get("cpu") or {}).get("usageNanoCores", 0))
        for pod in s.get("pods", []):
            ns = pod["podRef"]["namespace"]
            m, c = per.get(ns, (0, 0))
            per[ns] = (m + (pod.get("memory") or {}).get("workingSetBytes", 0),
                       c + (pod.get("cpu") or {}).get("usageNanoCores", 0))
    return per, node_use


def apply_hosting(inv: Path, tmp_p: Path) -> tuple[dict, list[str], Path]:
    """The hosting cluster of inventory ``inv`` applied, its provisioner ready: (its inventory,
    kubectl for it, its kubeconfig ``tmp_p/hosting.kubeconfig``, where the lab's tenant
    inventories look for it)."""
    doc = yaml.safe_load(inv.read_text())
    state = tmp_p / "hosting-state"
    t = time.perf_counter()
    run(INSTALLER, "apply", str(inv), "--state", str(state), "--wait-timeout", "900")
    print(f"hosting cluster apply {time.perf_counter() - t:.0f} s")
    kubeconfig = tmp_p / "hosting.kubeconfig"
    run(INSTALLER, "kubeconfig", str(inv), "--state", str(state), "-o", str(kubeconfig))
    kubectl = [str(Path(doc["spec"]["artifacts"]["path"]) / "kubectl"), "--kubeconfig", str(kubeconfig)]
    run(*kubectl, "apply", "-f", str(STORAGE))
    run(*kubectl, "-n", "local-path-storage", "rollout", "status", "deployment/local-path-provisioner",
        "--timeout=300s")
    return doc, kubectl, kubeconfig


def hosting_cluster(lab_inv: Path, tmp_p: Path) -> tuple[dict, dict, list[str], list[str], Path]:
    """The lab's hosting cluster applied (w3 kept out: the tenants name it as their worker) with
    its provisioner ready: (its inventory, w3's host entry, kubectl for it, its workers, its
    kubeconfig)."""
    doc = yaml.safe_load(lab_inv.read_text())
    hosts = {h["name"]: h for h in doc["spec"]["hosts"]}
    worker = {**hosts["w3"], "role": "worker"}
    doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] != "w3"]
    hosting_inv = tmp_p / "hosting.yaml"
    hosting_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    doc, kubectl, kubeconfig = apply_hosting(hosting_inv, tmp_p)
    workers = [h["name"] for h in doc["spec"]["hosts"] if h["role"] == "worker"]
    return doc, worker, kubectl, workers, kubeconfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--settle", type=float, default=60.0, help="seconds at rest before reading usage")
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 3, tmp, keep=args.keep, hosting=True) \
            as (lab_inv, lab_seconds):
        tmp_p = Path(tmp)
        print(f"lab up {lab_seconds:.0f} s")
        doc, worker, kubectl, workers, kubeconfig = hosting_cluster(lab_inv, tmp_p)
        hosts = {h["name"]: h for h in doc["spec"]["hosts"]}
        addresses = [hosts[w]["address"] for w in workers]
        before = mem_available()
        seconds = []
        for i in range(1, args.tenants + 1):
            inv = tmp_p / f"t{i}.yaml"
            inv.write_text(yaml.safe_dump(tenant_doc(doc, kubeconfig, i, worker, addresses), sort_keys=False))
            t = time.perf_counter()
            run(INSTALLER, "apply", str(inv), "--state", str(tmp_p / f"t{i}-state"), "--only", "hosted",
                "--wait-timeout", "900")
            seconds.append(time.perf_counter() - t)
            print(f"tenant t{i}: control plane up (every workload ready) in {seconds[-1]:.0f} s; "
                  f"{mem_available() / 2**30:.1f} GiB available on this machine")
        time.sleep(args.settle)
        per, nodes = usage(kubectl, workers)
        after = mem_available()
        tenants = {f"hp-t{i}": per.get(f"hp-t{i}", (0, 0)) for i in range(1, args.tenants + 1)}
        print(f"\n{args.tenants} tenants, each 3 etcd + 2 apiserver/konnectivity + 2 controller-manager + "
              f"2 scheduler pods; at rest {args.settle:.0f} s after the last:")
        print(f"{'tenant':8} {'up (s)':>7} {'memory (MiB)':>13} {'CPU (mCPU)':>11}")
        for (ns, (m, c)), s in zip(tenants.items(), seconds):
            print(f"{ns:8} {s:7.0f} {m / 2**20:13.0f} {c / 1e6:11.0f}")
        mems = [m for m, _ in tenants.values()]
        print(f"mean: up {sum(seconds) / len(seconds):.0f} s, {sum(mems) / len(mems) / 2**20:.0f} MiB, "
              f"{sum(c for _, c in tenants.values()) / len(tenants) / 1e6:.0f} mCPU per tenant")
        for node, (m, c) in nodes.items():
            print(f"hosting {node}: {m / 2**30:.2f} GiB working set, {c / 1e6:.0f} mCPU in all")
        print(f"this machine: {before / 2**30:.1f} GiB available before the first tenant, {after / 2**30:.1f} GiB "
              f"after the last ({(before - after) / args.tenants / 2**20:.0f} MiB each, the hosts' own overhead "
              f"included); at 80 % of what is left: about {int(after * 0.8 // max(1, sum(mems) / len(mems)))} more")
        print(f"anchors: {ANCHORS}")


if __name__ == "__main__":
    main()
