"""Time the pure core: validate + PKI + render, cold (empty state) and warm (re-run).

Prints figures; it never fails on a time. Run: .venv/bin/python benchmarks/render.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import yaml

from installer import api


def inventory(controls: int, workers: int) -> dict:
    hosts = [{"name": f"cp{i}", "address": f"192.168.56.{10 + i}", "role": "control"} for i in range(1, controls + 1)]
    hosts += [{"name": f"w{i}", "address": f"192.168.57.{i}", "role": "worker"} for i in range(1, workers + 1)]
    return {"apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster", "metadata": {"name": "bench"},
            "spec": {"hosts": hosts}}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    print(f"{'cluster':>12} {'algorithm':>10} {'cold plan':>10} {'warm plan':>10} {'files':>6}")
    for controls, workers in ((1, 2), (3, 10), (3, 50)):
        for algo in ("ecdsa-p256", "rsa-2048"):
            with tempfile.TemporaryDirectory() as tmp:
                doc = inventory(controls, workers)
                doc["spec"]["pki"] = {"keyAlgorithm": algo}
                inv = Path(tmp) / "inv.yaml"
                inv.write_text(yaml.safe_dump(doc))
                state = Path(tmp) / "state"
                cold = timed(lambda: api.prepare(inv, state))
                result = {}
                warm = timed(lambda: result.setdefault("p", api.prepare(inv, state)))
                files = sum(len(p.files) for p in result["p"].plans.values())
                print(f"{controls:>5}+{workers:<6} {algo:>10} {cold:>9.2f}s {warm:>9.2f}s {files:>6}")


if __name__ == "__main__":
    main()
