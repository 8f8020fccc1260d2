"""Apply figures on the local lab: cold apply and no-op re-apply for 1+2 and 1+10 workers, SSH
round trips per host and bytes uploaded on a no-op, against the targets:

  no-op re-apply of 1+2 in <= 3 s, <= 2 SSH round trips per host, 0 bytes uploaded;
  the 1+10 no-op within 2x of the 1+2 no-op.

The five Kubernetes binaries are the tests' contract stand-ins; cluster-bootstrap is skipped (the
stand-ins never answer API calls), as in tests/test_apply_lab.py. Needs root. Prints figures and
MET / NOT MET; it never fails on a time. Both labs are removed at the end, even on error.

Run from the repository root: sudo .venv/bin/python benchmarks/apply.py
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from installer.core.cluster import resolve
from installer.engine import runner
from installer.engine.context import Options
from installer.lab import lab as lab_mod
from installer.lab.model import LabPaths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import pss_kib_in_netns  # noqa: E402 - benchmarks/lab.py

ROOT = Path(__file__).resolve().parents[1]
LABS = (("bapply", "10.213.211.0/24", 2), ("bapply10", "10.213.212.0/24", 10))
NOOP_RUNS = 3
TARGET_NOOP_SECONDS, TARGET_ROUND_TRIPS, TARGET_BYTES, TARGET_RATIO = 3.0, 2, 0, 2.0
OPTIONS = Options(skip=frozenset({"cluster-bootstrap"}))


def quiet(*_) -> None:
    return None


@dataclass
class Figures:
    cluster: str
    hosts: int
    up_seconds: float = 0.0
    mem_used_mib: float = 0.0
    load: str = ""
    noop_cpu: list[float] = field(default_factory=list)
    cold: runner.Report | None = None
    noops: list[runner.Report] = field(default_factory=list)

    @property
    def noop_seconds(self) -> float:
        return statistics.median(r.seconds for r in self.noops)

    @property
    def trips(self) -> list[int]:
        """Round trips per host over every no-op run (each run counts on its own)."""
        return [n for r in self.noops for n in r.round_trips.values()]

    @property
    def noop_bytes(self) -> int:
        return max(sum(r.bytes_up.values()) for r in self.noops)


def lab_pss_mib(name: str) -> float:
    """Memory (PSS) of every process in the lab's hosts, with every unit running."""
    spec = lab_mod.load_spec(LabPaths.of(name))
    return sum(pss_kib_in_netns(h.netns) for h in spec.hosts) / 1024


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def install_standins(artifacts: Path) -> None:
    subprocess.run([sys.executable, "-m", "tests.standins", "install", str(artifacts)], cwd=ROOT, check=True,
                   capture_output=True)


def measure(name: str, subnet: str, workers: int, tmp: Path) -> Figures:
    fig = Figures(f"1+{workers}", 1 + workers)
    lab_mod.down(name, quiet)                     # a stale lab from a run that died mid-way
    t = time.perf_counter()
    inventory = lab_mod.up(name, 1, workers, 0, subnet, tmp / f"{name}.inventory.yaml", quiet)
    fig.up_seconds = time.perf_counter() - t
    install_standins(LabPaths.of(name).artifacts)
    state = tmp / f"{name}-state"

    fig.cold = runner.run(resolve(inventory, state), OPTIONS, log=quiet)
    fig.load = load_average()
    for _ in range(NOOP_RUNS):
        cpu = cpu_seconds()
        fig.noops.append(runner.run(resolve(inventory, state), OPTIONS, log=quiet))
        fig.noop_cpu.append(cpu_seconds() - cpu)
    fig.mem_used_mib = lab_pss_mib(name)
    return fig


def met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def report(figs: list[Figures]) -> None:
    print()
    print(f"{'cluster':>8} {'lab up':>8} {'lab PSS':>9} {'cold apply':>11} {'cold up':>10} {'restarts':>9} "
          f"{'no-op (median of 3)':>20} {'no-op runs':>20} {'RT max/mean':>12} {'no-op bytes':>12} "
          f"{'no-op changes':>14}")
    for f in figs:
        cold_bytes = sum(f.cold.bytes_up.values())
        runs = " ".join(f"{r.seconds:.2f}" for r in f.noops)
        trips = f.trips
        changes = max(len(r.changed) for r in f.noops)
        print(f"{f.cluster:>8} {f.up_seconds:>7.1f}s {f.mem_used_mib:>6.0f}MiB {f.cold.seconds:>10.2f}s "
              f"{cold_bytes / 2**20:>7.1f}MiB {len(f.cold.restarts):>9} {f.noop_seconds:>19.2f}s {runs:>20} "
              f"{max(trips):>5}/{statistics.mean(trips):<6.2f} {f.noop_bytes:>12} {changes:>14}")
    for f in figs:
        print(f"{f.cluster}: cold apply uploaded {sum(f.cold.bytes_up.values())} bytes "
              f"({', '.join(f'{h}={b}' for h, b in sorted(f.cold.bytes_up.items()))}); "
              f"{len(f.cold.restarts)} restart(s); {len(f.cold.changed)} change event(s)")
        print(f"{f.cluster}: no-op round trips per host {dict(sorted(f.noops[-1].round_trips.items()))}")
        print(f"{f.cluster}: installer CPU per no-op {statistics.median(f.noop_cpu):.2f} s (median; the lab's hosts "
              f"share this machine's CPUs); load average before the no-ops {f.load}")
        restarts = [u for r in f.noops for u in r.restarts]
        if restarts:
            print(f"{f.cluster}: no-op runs restarted {restarts}")

    print()
    small = next((f for f in figs if f.cluster == "1+2"), None)
    large = next((f for f in figs if f.cluster == "1+10"), None)
    if small:
        print(f"target: 1+2 no-op <= {TARGET_NOOP_SECONDS:.0f} s: {small.noop_seconds:.2f} s "
              f"{met(small.noop_seconds <= TARGET_NOOP_SECONDS)}")
    for f in figs:
        print(f"target: {f.cluster} no-op <= {TARGET_ROUND_TRIPS} SSH round trips per host: max {max(f.trips)} "
              f"{met(max(f.trips) <= TARGET_ROUND_TRIPS)}")
        print(f"target: {f.cluster} no-op uploads {TARGET_BYTES} bytes: {f.noop_bytes} "
              f"{met(f.noop_bytes == TARGET_BYTES)}")
    if small and large:
        ratio = large.noop_seconds / small.noop_seconds
        print(f"target: 1+10 no-op within {TARGET_RATIO:.0f}x of 1+2: {large.noop_seconds:.2f} s / "
              f"{small.noop_seconds:.2f} s = {ratio:.2f}x {met(ratio <= TARGET_RATIO)}")


def main() -> int:
    if os.geteuid() != 0:
        print("benchmarks/apply.py needs root (the lab uses network namespaces, mounts, systemd-nspawn): "
              "sudo .venv/bin/python benchmarks/apply.py", file=sys.stderr)
        return 1
    print(f"machine: {os.cpu_count()} CPUs, {mem_available_mib():.0f} MiB available, load average {load_average()}")
    figs: list[Figures] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, subnet, workers in LABS:
                t = time.perf_counter()
                try:
                    figs.append(measure(name, subnet, workers, Path(tmp)))
                except Exception as e:  # noqa: BLE001 - report and go on; the figures so far still print
                    print(f"1+{workers} ({name}): failed: {type(e).__name__}: {e}")
                finally:
                    # measure one lab at a time: the other lab's units would share the CPUs
                    lab_mod.down(name, quiet)
                print(f"1+{workers} ({name}): measured in {time.perf_counter() - t:.0f} s (boot, apply, down)")
    finally:
        for name, _, _ in LABS:
            lab_mod.down(name, quiet)
    if figs:
        report(figs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
