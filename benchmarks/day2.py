"""Day-2 node figures on the local lab (1 control + 2 nspawn workers, contract stand-ins, API
parts skipped: `--skip cluster-bootstrap`, `--skip-cluster`): how long `node add` takes for one worker, how many
SSH round trips it makes per host and what it uploads to the hosts that are not joining;
`node add` again (nothing to do); `node remove --skip-cluster` (wipe + routes on the others).

Target: adding one worker to a converged cluster uploads nothing but the routes unit to the
other hosts. Prints figures; never fails on a time. The lab is removed at the end.

Run from the repository root: sudo .venv/bin/python benchmarks/day2.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from installer.actions import node_ops, node_retire
from installer.core.cluster import resolve
from installer.engine import runner
from installer.engine.context import Options
from installer.lab import lab as lab_mod
from installer.lab.model import LabPaths

ROOT = Path(__file__).resolve().parents[1]
NAME, SUBNET = "bday2", "10.213.213.0/24"
SKIP = frozenset({"cluster-bootstrap"})


def quiet(*_) -> None:
    return None


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hiddenplane-bday2-"))
    lab_mod.down(NAME, log=quiet)
    try:
        t = time.monotonic()
        inv_path = lab_mod.up(NAME, 1, 2, 0, SUBNET, tmp / "inventory.yaml", log=quiet)
        print(f"lab 1+2 up in {time.monotonic() - t:.1f} s")
        # the contract stand-ins, installed as the lab tests do (binaries + SHA256SUMS)
        subprocess.run([sys.executable, "-m", "tests.standins", "install", str(LabPaths.of(NAME).artifacts)],
                       cwd=ROOT, check=True, capture_output=True)
        doc = yaml.safe_load(inv_path.read_text())
        doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] != "w2"]
        smaller = tmp / "without-w2.yaml"
        smaller.write_text(yaml.safe_dump(doc))
        state = tmp / "state"
        cold = runner.run(resolve(smaller, state), Options(skip=SKIP), log=quiet)
        print(f"apply 1+1 (cold): {cold.seconds:.1f} s")

        t = time.monotonic()
        rep = node_ops.add(resolve(inv_path, state), "w2", skip=SKIP, log=quiet)
        add_s = time.monotonic() - t
        others = {h: b for h, b in rep.bytes_up.items() if h != "w2"}
        print(f"node add w2: {add_s:.1f} s (one apply run, checked before any change); round trips {rep.round_trips}; "
              f"bytes uploaded to w2 {rep.bytes_up.get('w2', 0)}, to the others {others}")
        print(f"  changed elsewhere: {sorted({e.host for e in rep.changed if e.host != 'w2'})}")
        t = time.monotonic()
        again = node_ops.add(resolve(inv_path, state), "w2", skip=SKIP, log=quiet)
        print(f"node add w2 again: {time.monotonic() - t:.1f} s, {'nothing to do' if again is None else 'CHANGED'}")
        t = time.monotonic()
        node_retire.remove(resolve(inv_path, state), "w2", skip_cluster=True, log=quiet)
        print(f"node remove w2 --skip-cluster: {time.monotonic() - t:.1f} s (wipe + routes on the others)")
    finally:
        lab_mod.down(NAME, log=quiet)
        shutil.rmtree(tmp, ignore_errors=True)      # the cluster's PKI: no credential left in /tmp


if __name__ == "__main__":
    main()
