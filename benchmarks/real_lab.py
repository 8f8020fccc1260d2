"""A real cluster on the lab, timed: `lab up` of 1 control + 2 workers (nspawn, the built real
binaries), the cold `installer apply` up to every Node Ready, then no-op re-applies; and the
memory each host holds once the cluster runs (CoreDNS on the workers).

Needs root and the built artifacts (scripts/build-kubernetes). Prints figures; never fails on a
time. Run: sudo .venv/bin/python benchmarks/real_lab.py [--noop-runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from installer.lab import lab as lab_mod
from installer.lab.model import LabPaths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import pss_kib_in_netns, real_lab  # noqa: E402

NAME, SUBNET = "breal", "10.213.211.0/24"
INSTALLER = str(Path(sys.executable).with_name("installer"))


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t, proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--noop-runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 2, tmp) as (inv, up_seconds):
        print(f"lab up, 1 control + 2 nspawn workers: {up_seconds:.1f} s")
        cold, proc = timed([INSTALLER, "apply", str(inv), "--output", "json", "--wait-timeout", "900"])
        report = json.loads(proc.stdout)
        print(f"cold apply up to every Node Ready: {cold:.1f} s (the run's own report: {report['seconds']:.1f} s, "
              f"{sum(report['bytesUploaded'].values()) / 2**20:.0f} MiB uploaded)")
        phases: dict[str, float] = {}
        for ev in report["events"]:
            phases[ev["phase"]] = max(phases.get(ev["phase"], 0.0), ev.get("seconds") or 0.0)
        print("  slowest host per phase: " + ", ".join(f"{p} {s:.1f} s" for p, s in phases.items()))
        noops = []
        for _ in range(args.noop_runs):
            s, proc = timed([INSTALLER, "apply", str(inv), "--output", "json"])
            assert json.loads(proc.stdout)["changes"] == 0, proc.stdout[-500:]
            noops.append(s)
        print(f"no-op apply (whole process), {len(noops)} runs: median {statistics.median(noops):.2f} s, "
              f"min {min(noops):.2f} s, max {max(noops):.2f} s")
        spec = lab_mod.load_spec(LabPaths.of(NAME))
        for h in spec.hosts:
            print(f"memory {h.name} ({h.role}): {pss_kib_in_netns(h.netns) / 1024:.0f} MiB PSS")


if __name__ == "__main__":
    main()
