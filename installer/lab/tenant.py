"""A hosted tenant on the lab (docs/hosted.md's walkthrough): `installer lab up --hosting
--tenant-workers N` keeps the first workers for the hosting cluster and gives the last N to a
tenant, whose inventory it writes beside the hosting cluster's; tests/test_real_hosted.py
writes its tenants with the same ``tenant_doc``.

Lab-only settings live here, never as product defaults: its images come from the artifacts (no
registry: ``alwaysPullImages`` off), its workers get the artifacts without the control plane's
image archives (hard links: ~690 MiB less per worker), and ``spread`` is ``preferred`` when the
hosting cluster has too few workers to give every etcd member and apiserver replica its own.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

from installer.core.artifacts import read_sums, write_sums
from installer.lab.debian_artifacts import WORKER_IMAGES
from installer.lab.model import LabError

TENANT = "tenant"
# the tenant's own ranges: apart from the hosting cluster's defaults (10.244/16, 10.96/12)
NETWORK = {"podCIDR": "10.245.0.0/16", "serviceCIDR": "10.97.0.0/16", "clusterDNS": "10.97.0.10"}
PORTS = (30443, 30132)              # the API's and konnectivity's NodePorts
HOSTING_KUBECONFIG = "hosting.kubeconfig"   # what the walkthrough writes with `installer kubeconfig`
# what a tenant's workers run: a worker's images and the konnectivity agent
IMAGES = WORKER_IMAGES | {"image-konnectivity-agent.tar"}
STORAGE = Path(__file__).resolve().parent / "manifests" / "local-path-storage.yaml"


def split(doc: dict, tenant_workers: int) -> tuple[dict, list[dict]]:
    """The lab's inventory without its last ``tenant_workers`` workers (the hosting cluster's),
    and those workers (the tenant's)."""
    workers = [h for h in doc["spec"]["hosts"] if h["role"] == "worker"]
    if not 0 < tenant_workers < len(workers):
        raise LabError(f"--tenant-workers {tenant_workers}: between 1 and {len(workers) - 1} of the lab's "
                       f"{len(workers)} workers (the hosting cluster keeps at least one)")
    theirs = workers[-tenant_workers:]
    hosting = copy.deepcopy(doc)
    hosting["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h not in theirs]
    return hosting, theirs


def tenant_doc(hosting: dict, hosts: list[dict], kubeconfig: str, artifacts: Path, name: str = TENANT,
               ports: tuple[int, int] = PORTS, etcd: int = 3, spread: str | None = None,
               upstream_dns: list[str] | None = None) -> dict:
    """A tenant of the lab's hosting cluster: ``hosts`` its workers, exposed on the hosting
    workers' addresses, its etcd on local-path volumes, the lab's SSH and its artifacts at
    ``artifacts``; ``upstream_dns`` as the hosting cluster's (the tests run one in the lab)."""
    spec = {k: v for k, v in hosting["spec"].items() if k not in ("hosts", "apiServer", "network", "artifacts")}
    spec["artifacts"] = {**hosting["spec"]["artifacts"], "path": str(artifacts)}
    spec["network"] = {**NETWORK, **({"upstreamDNS": upstream_dns} if upstream_dns else {})}
    spec["apiServer"] = {"alwaysPullImages": False}
    exposed = [h["address"] for h in hosting["spec"]["hosts"] if h["role"] == "worker"]
    enough = len(exposed) >= max(etcd, 2)     # a node per member and per apiserver replica
    spec["controlPlane"] = {"mode": "hosted", "hosted": {
        "kubeconfig": kubeconfig,
        "expose": {"type": "NodePort", "addresses": exposed, "port": ports[0], "konnectivityPort": ports[1]},
        # a replica behind each exposed address (each serves its own node's)
        "apiServerReplicas": min(max(len(exposed), 2), 5), "etcdReplicas": etcd, "storageClass": "local-path",
        "spread": spread or ("required" if enough else "preferred")}}
    spec["hosts"] = [{"name": h["name"], "address": h["address"], "role": "worker"} for h in hosts]
    return {"apiVersion": hosting["apiVersion"], "kind": "Cluster", "metadata": {"name": name}, "spec": spec}


def tenant_artifacts(src: Path, dest: Path, extra: dict[str, tuple[Path, str]] | None = None) -> Path:
    """``dest`` holding hard links to what a tenant's workers need of ``src`` (everything but
    the image archives of other components than ``IMAGES``), ``extra`` (name -> (file, sha256))
    besides, and its own SHA256SUMS; made again only when that differs."""
    sums = {n: d for n, d in read_sums(src).items() if not n.endswith(".tar") or n in IMAGES}
    files = {n: src / n for n in sums}
    for n, (path, digest) in (extra or {}).items():
        files[n], sums[n] = path, digest
    return linked_dir(dest, files, sums)


def linked_dir(dest: Path, files: dict[str, Path], sums: dict[str, str]) -> Path:
    """``dest`` holding hard links to ``files`` (name -> source) and its own SHA256SUMS of
    ``sums``; made again only when its sums differ, through a temporary directory."""
    if read_sums(dest) != sums:
        shutil.rmtree(dest, ignore_errors=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for n in sums:
            os.link(files[n], tmp / n)
        write_sums(tmp, sums)
        tmp.rename(dest)
    return dest
