"""What each component of a hosted tenant's control plane uses, at rest and under load, beside
the requests and limits it gets by default (installer/core/inventory_hosted.py SIZING;
docs/hosted.md, "Neighbours"): the figures those defaults are chosen from.

A hosting cluster on the lab (1 control host, 2 nspawn workers, local-path-provisioner), one
tenant's control plane (`apply --only hosted`: 3 etcd, 2 apiserver + konnectivity, 2
controller-manager, 2 scheduler; its worker not joined). At rest for ``--settle`` seconds, then
``--load`` seconds of load through the tenant's API from this machine: ``--writers`` threads
creating ConfigMaps of 4 KiB (``--objects`` in all, then deleted) and ``--readers`` threads
listing them all, over and over. The hosting kubelets' summaries (as metrics-server reads them)
are sampled every 5 s: each container's working set and CPU, the peak of its replicas, at rest
and under load. Needs root and the built artifacts (scripts/build-kubernetes). Prints figures;
never fails on them.
Run: sudo .venv/bin/python benchmarks/hosted_sizing.py [--load 120] [--objects 3000] [--keep]
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosted_density import INSTALLER, hosting_cluster, run, tenant_doc  # noqa: E402 - benchmarks/hosted_density.py
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from installer.core.inventory_hosted import SIZING  # noqa: E402
from tests.probeloop import admin_context  # noqa: E402 - the admin's TLS context

NAME, SUBNET = "bsize", "10.213.215.0/24"
NS = "hp-t1"


def containers(kubectl: list[str], nodes: list[str]) -> dict[str, tuple[int, int]]:
    """container -> (the largest working set of its replicas, their largest CPU in nanocores)."""
    out: dict[str, tuple[int, int]] = {}
    for node in nodes:
        s = json.loads(run(*kubectl, "get", "--raw", f"/api/v1/nodes/{node}/proxy/stats/summary").stdout)
        for pod in s.get("pods", []):
            if pod["podRef"]["namespace"] != NS:
                continue
            for c in pod.get("containers", []):
                m = (c.get("memory") or {}).get("workingSetBytes", 0)
                u = (c.get("cpu") or {}).get("usageNanoCores", 0)
                old = out.get(c["name"], (0, 0))
                out[c["name"]] = (max(old[0], m), max(old[1], u))
    return out


def peak(samples: list[dict[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for s in samples:
        for name, (m, c) in s.items():
            old = out.get(name, (0, 0))
            out[name] = (max(old[0], m), max(old[1], c))
    return out


class Load:
    """Writers and readers through the tenant's API until stopped; counts what failed."""

    def __init__(self, url: str, ctx: ssl.SSLContext, writers: int, readers: int, objects: int):
        self.url, self.objects, self.ctx = f"{url}/api/v1/namespaces/default/configmaps", objects, ctx
        self.stop, self.done, self.failed, self.next = threading.Event(), 0, 0, 0
        self.first_error = ""
        self.lock = threading.Lock()
        self.threads = ([threading.Thread(target=self._write, daemon=True) for _ in range(writers)]
                        + [threading.Thread(target=self._read, daemon=True) for _ in range(readers)])

    def _call(self, method: str, url: str, body: dict | None = None) -> None:
        req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=60) as r:
                r.read()
            with self.lock:
                self.done += 1
        except (urllib.error.URLError, OSError) as e:
            with self.lock:
                self.failed += 1
                self.first_error = self.first_error or f"{method}: {e}"[:200]

    def _write(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                i, self.next = self.next % self.objects, self.next + 1
                again = self.next > self.objects
            if again:       # all made once: replace them in turn (delete, create)
                self._call("DELETE", f"{self.url}/load-{i}")
            self._call("POST", self.url, {"metadata": {"name": f"load-{i}"}, "data": {"x": "y" * 4096}})

    def _read(self) -> None:
        while not self.stop.is_set():
            self._call("GET", self.url)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settle", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=120.0)
    ap.add_argument("--objects", type=int, default=3000)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 3, tmp, keep=args.keep, hosting=True) \
            as (lab_inv, _):
        tmp_p = Path(tmp)
        doc, worker, kubectl, workers, kubeconfig = hosting_cluster(lab_inv, tmp_p)
        hosts = {h["name"]: h for h in doc["spec"]["hosts"]}
        addresses = [hosts[w]["address"] for w in workers]
        inv, state = tmp_p / "t1.yaml", tmp_p / "t1-state"
        inv.write_text(yaml.safe_dump(tenant_doc(doc, kubeconfig, 1, worker, addresses), sort_keys=False))
        # its control plane and the admin's RBAC binding (cluster-bootstrap): the load runs as the admin
        run(INSTALLER, "apply", str(inv), "--state", str(state), "--only", "hosted", "--only", "cluster-bootstrap",
            "--wait-timeout", "900")
        time.sleep(args.settle)
        at_rest = []
        for _ in range(3):
            at_rest.append(containers(kubectl, workers))
            time.sleep(5)
        rest = peak(at_rest)
        port = yaml.safe_load(inv.read_text())["spec"]["controlPlane"]["hosted"]["expose"]["port"]
        samples = []
        with Load(f"https://{addresses[0]}:{port}", admin_context(state / "pki"), args.writers, args.readers,
                  args.objects) as load:
            end = time.monotonic() + args.load
            while time.monotonic() < end:
                samples.append(containers(kubectl, workers))
                time.sleep(5)
        loaded = peak(samples)
        print(f"\none tenant's control plane: at rest ({args.settle:.0f} s after its apply) and under "
              f"{args.load:.0f} s of load ({args.writers} writers of 4 KiB ConfigMaps, {args.objects} kept, "
              f"{args.readers} readers listing them all): {load.done} requests answered, {load.failed} failed"
              + (f" (the first: {load.first_error})" if load.first_error else ""))
        print(f"{'container':24} {'rest MiB':>8} {'load MiB':>8} {'request':>8} {'limit':>7} "
              f"{'rest mCPU':>9} {'load mCPU':>9} {'request':>8}")
        for name in SIZING:
            (rm, rc), (lm, lc) = rest.get(name, (0, 0)), loaded.get(name, (0, 0))
            s = SIZING[name]
            print(f"{name:24} {rm / 2**20:8.0f} {lm / 2**20:8.0f} {s['requests']['memory']:>8} "
                  f"{s['limits']['memory']:>7} {rc / 1e6:9.0f} {lc / 1e6:9.0f} {s['requests']['cpu']:>8}")
        print("(the largest replica of each; memory is the working set, as the kubelet's eviction reads it)")


if __name__ == "__main__":
    main()
