"""Requests from this machine in a loop, each one timed: what a user of an API sees while a fault
runs. Shared by the real-lab tests (test_real_hosted.py's cut) and the benchmarks that tell the
same scenarios at length (benchmarks/hosted_node_cut.py, hosted_hosting_upgrade.py).

Every request is a row (its start as unix time, ok, what failed), so a test can split them at
the fault's edges (before, at the fault, during it, after it).
"""

from __future__ import annotations

import ipaddress
import json
import os
import ssl
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

Row = tuple[float, bool, str]


class Loop:
    """``call(i)`` every ``every`` seconds on a thread until ``end``: one row per call."""

    def __init__(self, call, every: float):
        self.call, self.every, self.rows = call, every, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            t = time.time()
            try:
                self.call(i)
                self.rows.append((t, True, ""))
            except Exception as e:  # noqa: BLE001 - counted and shown
                self.rows.append((t, False, f"{type(e).__name__}: {e}"[:120]))
            self.stop.wait(self.every)

    def end(self) -> list[Row]:
        self.stop.set()
        self.thread.join(timeout=30)
        return self.rows


def admin_context(pki: Path) -> ssl.SSLContext:
    """A TLS context for a cluster's API as its admin: ``pki``'s ca.crt, admin.crt and admin.key
    (a state directory's). The pair is joined in a 0600 file that is gone before this returns
    (Python's ssl loads a client key from a file only)."""
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    fd, name = tempfile.mkstemp(prefix="admin-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write((pki / "admin.crt").read_bytes() + (pki / "admin.key").read_bytes())
        ctx.load_cert_chain(name)
    finally:
        os.unlink(name)
    return ctx


def api(ctx: ssl.SSLContext, url: str, method: str = "GET", body: dict | None = None, timeout: float = 5) -> dict:
    """One request; an HTTP error status or no answer within ``timeout`` raises."""
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def by_node(pods: list[dict]) -> dict[str, list[str]]:
    """The names of ``pods`` (as the API lists them) by the node each runs on ("-": none yet):
    how a fault's victim is chosen (a node with an apiserver replica and one etcd member)."""
    out: dict[str, list[str]] = {}
    for p in pods:
        out.setdefault(p["spec"].get("nodeName") or "-", []).append(p["metadata"]["name"])
    return out


def within(rows: list[Row], start: float, end: float) -> list[Row]:
    """The rows of requests started in [start, end)."""
    return [r for r in rows if start <= r[0] < end]


def columns(rows: list[Row], *edges: float) -> str:
    """failed/requests of ``rows`` in each span between ``edges``."""
    out = []
    for start, end in zip(edges, edges[1:]):
        inside = [ok for _, ok, _ in within(rows, start, end)]
        out.append(f"{inside.count(False):>6}/{len(inside):<6}")
    return " ".join(out)


def when(rows: list[Row], cut_at: float, back_at: float) -> str:
    """The failures of ``rows`` as seconds after the fault (``c+``) or after its end (``r+``)."""
    out = [f"r+{t - back_at:.1f}" if t >= back_at else f"c+{t - cut_at:.1f}" if t >= cut_at else f"b{t - cut_at:.1f}"
           for t, ok, _ in rows if not ok]
    return " ".join(out[:8]) + (" ..." if len(out) > 8 else "")



def tcp_clients(proc_net_tcp: str, port: int) -> set[str]:
    """The addresses with an established connection to local ``port``, read from a dump of
    /proc/net/tcp and /proc/net/tcp6 (each 32-bit word little-endian hex; etcd listens on both
    families at once, so IPv4 clients show in tcp6 as IPv4-mapped): which pods a member serves,
    read in its own network namespace, where the Service's address is already translated."""
    out = set()
    for line in proc_net_tcp.splitlines():
        f = line.split()
        if len(f) < 4 or f[3] != "01" or ":" not in f[1]:      # 01: ESTABLISHED (and no header)
            continue
        (_, local_port), (remote, _) = f[1].split(":"), f[2].split(":")
        if int(local_port, 16) != port:
            continue
        raw = b"".join(bytes.fromhex(remote[i:i + 8])[::-1] for i in range(0, len(remote), 8))
        address = ipaddress.ip_address(raw)
        out.add(str(getattr(address, "ipv4_mapped", None) or address))
    return out
