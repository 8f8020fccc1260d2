"""Build figures: scripts/build-kubernetes cold (empty Go module cache, Go build cache and
binary cache, as on a fresh machine) and warm (everything cached), for the default version.

Prints wall time, CPU time and the peak resident memory of the largest single process of the
build; also the sampled peak of the whole machine's used memory during each build. Never fails
on a time. Run: sudo .venv/bin/python benchmarks/build.py
(``--warm-only`` skips the cold build, which takes about ten minutes on two cores).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def used_mib() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = lambda k: int(info[k].split()[0])          # noqa: E731
    return (kib("MemTotal") - kib("MemAvailable")) / 1024


def run(dest: Path, env: dict) -> dict:
    peak = {"used": used_mib()}
    base = peak["used"]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.5):
            peak["used"] = max(peak["used"], used_mib())
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "tools/kubebuild/build.py"), "default", str(dest)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    stop.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "maxrss_mib": after.ru_maxrss / 1024, "machine_peak_mib": peak["used"] - base,
            "log": proc.stdout}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--warm-only", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hp-build-bench-") as tmp:
        tmp = Path(tmp)
        rows = []
        if not args.warm_only:
            env = {**os.environ, "HIDDENPLANE_CACHE_DIR": str(tmp / "cache"), "GOCACHE": str(tmp / "gocache"),
                   "GOMODCACHE": str(tmp / "gomod")}
            cold = run(tmp / "cold", env)
            rows.append(("cold (empty module, build and binary caches)", cold))
            warm = run(tmp / "warm", env)
            rows.append(("warm (same caches)", warm))
            print(cold["log"])
            # the module cache is read-only by design: make it removable
            subprocess.run(["chmod", "-R", "u+w", str(tmp / "gomod")], check=False)
        else:
            rows.append(("warm (this machine's caches)", run(tmp / "warm", dict(os.environ))))
        print(f"{'build':<48} {'wall':>9} {'cpu':>9} {'largest process':>16} {'machine peak':>13}")
        for label, r in rows:
            print(f"{label:<48} {r['wall']:>8.1f}s {r['cpu']:>8.1f}s {r['maxrss_mib']:>12.0f} MiB "
                  f"{r['machine_peak_mib']:>9.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
