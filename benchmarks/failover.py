"""Failover when a control host is lost: the workers' API balancer beside a single endpoint
(today's behaviour without one), measured in the same run on the same cut.

A real cluster on the lab (3 control hosts, 2 nspawn workers, no endpoint: the balancer is on),
then on every worker two probes side by side, each a GET of /readyz every 0.25 s on a new
connection with a 10 s timeout (tests/scripts/api_probe.py): one through the worker's balancer
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

import yaml

from installer.lab import lab as lab_mod
from installer.lab import net
from installer.lab.model import LabPaths, built_artifacts

ROOT = Path(__file__).resolve().parent.parent
NAME, SUBNET = "bfail", "10.213.212.0/24"
INSTALLER = str(Path(sys.executable).with_name("installer"))
PROBE = ROOT / "tests" / "scripts" / "api_probe.py"
ANCHOR = "25-30 s (k0s's and kubespray's balancer checks, by their configurations)"


def ssh(cfg: Path, host: str, command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(cfg), host, command], input=stdin, capture_output=True, text=True,
                          timeout=120)


def start_probe(cfg: Path, worker: str, name: str, url: str) -> None:
    ssh(cfg, worker, "cat > /root/api_probe.py", PROBE.read_text())
    ssh(cfg, worker, f"systemctl stop hp-bench-{name} 2>/dev/null; systemctl reset-failed hp-bench-{name} 2>/dev/null; "
                     f"systemd-run --unit=hp-bench-{name} /usr/bin/python3 /root/api_probe.py {url} "
                     "/etc/kubernetes/pki/ca.crt 0.25 10")


def probe_rows(cfg: Path, worker: str, name: str, since: float) -> list[tuple[float, bool, float]]:
    out = ssh(cfg, worker, f"systemctl stop hp-bench-{name}; journalctl -u hp-bench-{name} -o cat --no-pager").stdout
    rows = []
    for line in out.splitlines():
        f = line.split(" ", 3)
        if len(f) >= 3 and f[1] in ("ok", "fail") and float(f[0]) >= since:
            rows.append((float(f[0]), f[1] == "ok", float(f[2])))
    return rows


def longest_gap(rows: list[tuple[float, bool, float]], since: float) -> float:
    """The longest time without an answered request from ``since`` (when each answer came)."""
    answered = sorted(start + took for start, ok, took in rows if ok)
    marks = [since, *answered]
    return max((b - a for a, b in zip(marks, marks[1:])), default=float("nan"))


def marked(cfg: Path, worker: str, since: float, state: str) -> float | None:
    out = ssh(cfg, worker, "journalctl -u hiddenplane-api-balancer -o short-unix --no-pager "
                           f"--since=@{int(since) - 1}").stdout
    for line in out.splitlines():
        if f"apiservers/cp1 is {state}" in line and float(line.split()[0]) >= since:
            return float(line.split()[0]) - since
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outage", type=float, default=60.0, help="seconds cp1 stays cut (default 60)")
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = ap.parse_args()
    artifacts = built_artifacts()
    if artifacts is None or not (artifacts / "haproxy").is_file():
        raise SystemExit("no built real binaries with haproxy: run scripts/build-kubernetes first")
    quiet = lambda *_: None  # noqa: E731
    lab_mod.down(NAME, quiet)
    with tempfile.TemporaryDirectory() as tmp:
        inv = Path(tmp) / "bfail.inventory.yaml"
        try:
            lab_mod.up(NAME, 3, 2, 0, SUBNET, inv, quiet, artifacts=artifacts)
            doc = yaml.safe_load(inv.read_text())
            doc["spec"]["apiServer"].pop("endpoint")          # 3 control hosts, no endpoint: balanced
            inv.write_text(yaml.safe_dump(doc, sort_keys=False))
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
                start_probe(cfg, w, "lb", "https://127.0.0.1:6443")
                start_probe(cfg, w, "direct", f"https://{cp1.address}:6443")
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
                    rows = probe_rows(cfg, w, name, cut)
                    fails = sum(1 for r in rows if not r[1])
                    print(f"  {w} {what}: {len(rows)} requests, {fails} failed, longest without an answer "
                          f"{longest_gap(rows, cut):.1f} s")
                down, up = marked(cfg, w, cut, "DOWN"), marked(cfg, w, back, "UP")
                print(f"  {w} balancer: cp1 marked DOWN {down if down is None else f'{down:.1f}'} s after the cut, "
                      f"UP {up if up is None else f'{up:.1f}'} s after the restore")
            print(f"  anchors: {ANCHOR}; a single endpoint: the whole outage ({args.outage:.0f} s)")
        finally:
            if not args.keep:
                lab_mod.down(NAME, quiet)


if __name__ == "__main__":
    main()
