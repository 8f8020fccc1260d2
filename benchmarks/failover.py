"""Failover when a control host is lost: the workers' API balancer beside a single endpoint
(today's behaviour without one), measured in the same run on the same cut.

A real cluster on the lab (3 control hosts, 2 nspawn workers, no endpoint: the balancer is on),
then on every worker two probes side by side, each a GET of the worker's own Node as its kubelet
(its client certificate) every 0.25 s on a new connection with a 10 s timeout
(tests/hostprobes.py): one through the worker's balancer
(https://127.0.0.1:6443), one to cp1's apiserver directly (what kubelet and kube-proxy used with
`endpoint: <cp1>`). cp1 is cut off the network (its bridge port down: packets dropped) for
``--outage`` seconds, then put back. Printed per worker and probe: requests, failed requests,
the longest gap between two answered requests (the failover time a client sees), and for the
balancer when it marked cp1 down and up again; beside the anchors: the 25-30 s that k0s's and
kubespray's balancer checks take by their configurations, and the whole outage for the single
endpoint.

Needs root and the built artifacts (scripts/build-kubernetes). Prints figures; never fails on a
time. Run: sudo .venv/bin/python benchmarks/failover.py [--outage 60] [--keep]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from installer.lab import lab as lab_mod
from installer.lab import net
from installer.lab.model import LabPaths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

from tests import hostprobes  # noqa: E402 - probes shared with tests/test_real_ha.py

NAME, SUBNET = "bfail", "10.213.212.0/24"
INSTALLER = str(Path(sys.executable).with_name("installer"))
ANCHOR = "25-30 s (k0s's and kubespray's balancer checks, by their configurations)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outage", type=float, default=60.0, help="seconds cp1 stays cut (default 60)")
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 3, 2, tmp, needs="haproxy",
                                                        keep=args.keep) as (inv, _):
        # `lab up` writes no endpoint: 3 control hosts, balanced
        proc = subprocess.run([INSTALLER, "apply", str(inv), "--wait-timeout", "900"], capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"apply: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        paths = LabPaths.of(NAME)
        spec = lab_mod.load_spec(paths)
        cfg = Path(tmp) / "ssh_config"
        cfg.write_text(subprocess.run([INSTALLER, "lab", "ssh-config", "--name", NAME], capture_output=True,
                                      text=True, check=True).stdout)
        cp1 = spec.host("cp1")
        workers = [h.name for h in spec.hosts if h.role == "worker"]
        for w in workers:
            hostprobes.start(cfg, w, "hp-bench-lb", dict(hostprobes.api(w))["lb"])
            hostprobes.start(cfg, w, "hp-bench-direct", f"https://{cp1.address}:6443/api/v1/nodes/{w}")
        time.sleep(5)
        cut = time.time()
        net.cut_link(cp1)
        time.sleep(args.outage)
        net.restore_link(cp1)
        back = time.time()
        time.sleep(15)
        print(f"cp1 cut for {args.outage:.0f} s; probes every 0.25 s, 10 s timeout, new connection each")
        for w in workers:
            for name, what in (("lb", "through its balancer"), ("direct", "single endpoint cp1")):
                rows = hostprobes.rows(cfg, w, f"hp-bench-{name}", cut)
                n, fails, _ = hostprobes.summary(rows)
                print(f"  {w} {what}: {n} requests, {fails} failed, longest without an answer "
                      f"{hostprobes.longest_gap(rows, cut):.1f} s")
            down, up = hostprobes.marked(cfg, w, "cp1", cut, "DOWN"), hostprobes.marked(cfg, w, "cp1", back, "UP")
            print(f"  {w} balancer: cp1 marked DOWN {down if down is None else f'{down:.1f}'} s after the cut, "
                  f"UP {up if up is None else f'{up:.1f}'} s after the restore")
        print(f"  anchors: {ANCHOR}; a single endpoint: the whole outage ({args.outage:.0f} s)")


if __name__ == "__main__":
    main()
