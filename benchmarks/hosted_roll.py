"""A hosted tenant's control plane rolled again and again under probes: what its users see while
`installer certs renew --only apiserver --only etcd/server-hosted` replaces etcd's members and
then the apiserver replicas (docs/hosted.md, "Rolls").

The lab is the real-cluster tests' shape: 1 control host and 2 nspawn workers as the hosting
cluster, a 3rd worker the tenant's (3 etcd members, 2 apiserver replicas, the API exposed on the
two hosting workers' addresses). For each of ``--rolls`` renewals, while it runs:

- through each exposed address from this machine, a read of the tenant's API every 0.2 s (a new
  connection each, 5 s timeout), as the tenant's admin;
- watches of the tenant's pods and of its API Service's EndpointSlices in the hosting cluster,
  each change a timestamped line.

Printed per roll: its seconds, failed/requests and the slowest answer per address; for each failure, the watched
changes from 10 s before it to 3 s after (which endpoint each node's proxy had to choose from).
Goal: 0 failed. Needs root and the built artifacts (scripts/build-kubernetes). Prints figures;
never fails on them.
Run: .venv/bin/python benchmarks/hosted_roll.py [--rolls 5] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosted_density import INSTALLER, apply_hosting, run  # noqa: E402 - benchmarks/hosted_density.py
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.probeloop import Loop, admin_context, api  # noqa: E402 - timed requests from here

NAME, SUBNET = "broll", "10.213.218.0/24"


def pod_line(pod: dict) -> str:
    meta, status = pod["metadata"], pod.get("status") or {}
    ready = next((c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), "?")
    states = []
    for c in status.get("containerStatuses") or []:
        state = next(iter(c.get("state") or {"?": {}}))
        states.append(f"{c['name']}={state}{'/ready' if c.get('ready') else ''}")
    gone = " DELETING" if meta.get("deletionTimestamp") else ""
    return (f"pod {meta['name']} on {pod['spec'].get('nodeName') or '-'} {status.get('phase')} "
            f"Ready={ready}{gone} {' '.join(states)}")


def slice_line(obj: dict) -> str:
    eps = []
    for e in obj.get("endpoints") or []:
        c = e.get("conditions") or {}
        flags = "".join(f for f, k in (("R", "ready"), ("S", "serving"), ("T", "terminating")) if c.get(k))
        eps.append(f"{(e.get('targetRef') or {}).get('name', '?')}@{e.get('nodeName', '?')}:{flags or '-'}")
    return f"slice {obj['metadata']['name']}: " + (" ".join(sorted(eps)) or "(none)")


class Watch:
    """A watch of ``path`` in the hosting cluster on a thread: (unix time, line) per change."""

    def __init__(self, ctx, server: str, path: str, line, keep=lambda _o: True):
        self.rows: list[tuple[float, str]] = []
        self.ctx, self.url, self.line, self.keep = ctx, f"{server}{path}?watch=1&timeoutSeconds=900", line, keep
        self.last: dict[str, str] = {}
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            resp = urllib.request.urlopen(urllib.request.Request(self.url), context=self.ctx, timeout=1000)
            for raw in resp:
                ev = json.loads(raw)
                obj = ev["object"]
                if not self.keep(obj):
                    continue
                text = ("DELETED " if ev["type"] == "DELETED" else "") + self.line(obj)
                if self.last.get(obj["metadata"]["name"]) != text:
                    self.last[obj["metadata"]["name"]] = text
                    self.rows.append((time.time(), text))
        except (OSError, ValueError):
            pass

    def close(self) -> list[tuple[float, str]]:
        """The rows so far. The thread is left to its watch's end (a daemon; closing the response
        under a blocked read would wait for the next event)."""
        return list(self.rows)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rolls", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    ap.add_argument("--lab", help="a kept lab's temporary directory (--keep printed it): no new lab")
    args = ap.parse_args()
    if args.lab:
        rolls(Path(args.lab), args.rolls)
        return
    # a kept lab keeps its directory too (the inventories, states and kubeconfigs): --lab reuses it
    place = contextlib.nullcontext(tempfile.mkdtemp(prefix="broll-")) if args.keep else tempfile.TemporaryDirectory()
    with place as tmp, real_lab(NAME, SUBNET, 1, 3, tmp, keep=args.keep, hosting=True, tenant_workers=1) as (
            lab_inv, up_s):
        tmp_p = Path(tmp)
        print(f"lab up {up_s:.0f} s" + (f"; kept, again with: --lab {tmp}" if args.keep else ""))
        apply_hosting(lab_inv, tmp_p)
        t = time.perf_counter()
        run(INSTALLER, "apply", str(tmp_p / "tenant.yaml"), "--state", str(tmp_p / "tenant-state"),
            "--wait-timeout", "900")
        print(f"tenant apply {time.perf_counter() - t:.0f} s")
        rolls(tmp_p, args.rolls)


def rolls(tmp_p: Path, count: int) -> None:  # noqa: PLR0914 - one scenario, told in order
    tenant_inv, tenant_state = tmp_p / "tenant.yaml", tmp_p / "tenant-state"
    doc = yaml.safe_load(tenant_inv.read_text())
    hosted, ns = doc["spec"]["controlPlane"]["hosted"], f"hp-{doc['metadata']['name']}"
    port, addresses = hosted["expose"]["port"], hosted["expose"]["addresses"]
    hosting_server = yaml.safe_load((tmp_p / "hosting.kubeconfig").read_text())["clusters"][0]["cluster"]["server"]
    hctx, ctx = admin_context(tmp_p / "hosting-state" / "pki"), admin_context(tenant_state / "pki")
    total = 0
    for n in range(1, count + 1):
        pods = Watch(hctx, hosting_server, f"/api/v1/namespaces/{ns}/pods", pod_line)
        slices = Watch(hctx, hosting_server, f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                       slice_line, lambda o: (o.get("ports") or [{}])[0].get("port") == 6443)
        slowest = dict.fromkeys(addresses, 0.0)

        def read(_i: int, a: str) -> None:
            t0 = time.monotonic()
            try:
                api(ctx, f"https://{a}:{port}/api/v1/namespaces/default")
            finally:
                slowest[a] = max(slowest[a], time.monotonic() - t0)
        reads = {a: Loop(lambda i, a=a: read(i, a), 0.2) for a in addresses}
        t = time.perf_counter()
        proc = subprocess.run([INSTALLER, "certs", "renew", str(tenant_inv), "--state", str(tenant_state),
                               "--only", "apiserver", "--only", "etcd/server-hosted"], capture_output=True, text=True,
                              timeout=1800)
        seconds = time.perf_counter() - t
        time.sleep(5)
        rows = {a: loop.end() for a, loop in reads.items()}
        events = sorted(pods.close() + slices.close())
        failed = sorted((r[0], a, r[2]) for a, rs in rows.items() for r in rs if not r[1])
        total += len(failed)
        print(f"\nroll {n}: certs renew {seconds:.0f} s (exit {proc.returncode}); "
              + "; ".join(f"{a}: {sum(not r[1] for r in rs)} failed of {len(rs)}, slowest {slowest[a]:.1f} s"
                        for a, rs in rows.items()))
        if proc.returncode:
            print(proc.stderr[-1500:])
        shown: set[float] = set()
        for at, address, what in failed:
            print(f"  {clock(at)} {address}: {what}")
            for et, line in events:
                if at - 10 <= et <= at + 3 and et not in shown:
                    shown.add(et)
                    print(f"      {clock(et)} {line}")
    print(f"\n{count} rolls: {total} failed requests (goal: 0)")


if __name__ == "__main__":
    main()
