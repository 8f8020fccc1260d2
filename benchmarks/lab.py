"""Lab figures: time to boot 1 control + 2 workers with a warm cache, and memory per host.

Needs root. Prints figures; never fails on a time. Run: sudo .venv/bin/python benchmarks/lab.py
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from installer.lab import images
from installer.lab import lab as lab_mod
from installer.lab.model import LabPaths, built_artifacts

NAME, SUBNET = "bench", "10.213.210.0/24"


def pss_kib_in_netns(netns: str) -> int:
    """Proportional memory of every process whose network namespace is ``netns``."""
    target = os.stat(f"/run/netns/{netns}").st_ino
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino != target:
                continue
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


@contextmanager
def real_lab(name: str, subnet: str, controls: int, workers: int, tmp: str, *, needs: str = "kube-apiserver",
             keep: bool = False, hosting: bool = False, tenant_workers: int = 0) -> Iterator[tuple[Path, float]]:
    """A lab of nspawn hosts with the built real binaries (scripts/build-kubernetes; ``needs``
    one of them): (its inventory, seconds its `up` took). Any earlier lab of the name goes
    first; this one goes after, unless ``keep``, with how long `down` took printed.
    ``tenant_workers``: the last ones a hosted tenant's, its inventory ``tenant.yaml`` beside."""
    artifacts = built_artifacts()
    if artifacts is None or not (artifacts / needs).is_file():
        raise SystemExit(f"no built real binaries with {needs}: run scripts/build-kubernetes first")
    quiet = lambda *_: None  # noqa: E731
    lab_mod.down(name, quiet)
    inv = Path(tmp) / f"{name}.inventory.yaml"
    try:
        t = time.perf_counter()
        lab_mod.up(name, controls, workers, 0, subnet, inv, quiet, artifacts=artifacts, hosting=hosting,
                   tenant_workers=tenant_workers, tenant_out=Path(tmp) / "tenant.yaml" if tenant_workers else None)
        yield inv, time.perf_counter() - t
    finally:
        if not keep:
            t = time.perf_counter()
            lab_mod.down(name, quiet)
            print(f"lab down: {time.perf_counter() - t:.1f} s")


def main() -> None:
    quiet = lambda *_: None  # noqa: E731
    t = time.perf_counter()
    images.ensure_base(quiet)
    print(f"base image ready in {time.perf_counter() - t:.1f} s (cold build ~50 s, then cached)")
    lab_mod.down(NAME, quiet)
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in ("first up (artifacts cached)", "second up (no-op)"):
            t = time.perf_counter()
            lab_mod.up(NAME, 1, 2, 0, SUBNET, Path(tmp) / "inv.yaml", quiet)
            print(f"{attempt}: 1+2 hosts answering SSH in {time.perf_counter() - t:.2f} s")
        time.sleep(3)   # let boot-time services settle
        spec = lab_mod.load_spec(LabPaths.of(NAME))
        for h in spec.hosts:
            print(f"memory {h.name}: {pss_kib_in_netns(h.netns) / 1024:.1f} MiB PSS")
        t = time.perf_counter()
        lab_mod.down(NAME, quiet)
        print(f"down: {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
