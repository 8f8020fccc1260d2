"""Request probes that run on lab hosts (tests/scripts/api_probe.py as a transient systemd unit),
and what the workers' API balancer logged: shared by the real-lab tests and benchmarks/failover.py.

A probe runs on the host itself, so what it sees is what that host's kubelet, kube-proxy or pods
see (its balancer on 127.0.0.1, the kubernetes Service, a workload's Service), not the view from
the operator's machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

from installer.core.render.worker import KUBELET_CLIENT_PEM

SCRIPT = Path(__file__).with_name("scripts") / "api_probe.py"
BALANCER = "hiddenplane-api-balancer.service"
CA = "/etc/kubernetes/pki/ca.crt"


def api(worker: str) -> tuple[tuple[str, str], ...]:
    """(probe name, URL) of a worker's API probes: what its kubelet and kube-proxy use (its
    balancer) and what its pods use (the kubernetes Service, DNAT-ed to the balancer address).
    Each GETs the worker's own Node as its kubelet does (with ``KUBELET_CLIENT_PEM``): a read
    that reaches etcd, not /readyz (which an apiserver fails on purpose while it shuts down
    and still serves)."""
    return (("lb", f"https://127.0.0.1:6443/api/v1/nodes/{worker}"),
            ("svc", f"https://10.96.0.1:443/api/v1/nodes/{worker}"))


class Row(NamedTuple):
    start: float        # unix time the request started
    ok: bool
    took: float         # seconds
    detail: str


def ssh(cfg: Path, host: str, command: str, stdin: str | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(cfg), host, command], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def start(cfg: Path, host: str, unit: str, url: str, ca: str = CA, interval: float = 0.25,
          timeout: float = 10, cert: str | None = KUBELET_CLIENT_PEM) -> None:
    """``url`` requested from ``host`` every ``interval`` s as the transient unit ``unit``, as
    the client ``cert`` (default: the host's kubelet; None: anonymous)."""
    # one round trip: the script (renamed into place: a probe already running keeps its copy)
    # and the unit
    r = ssh(cfg, host, "cat > /root/api_probe.py.new && mv /root/api_probe.py.new /root/api_probe.py && "
                       f"{{ systemctl stop {unit}; systemctl reset-failed {unit}; }} 2>/dev/null; "
                       f"systemd-run --unit={unit} /usr/bin/python3 /root/api_probe.py {url} {ca} {interval} {timeout}"
                       + (f" {cert}" if cert else ""), SCRIPT.read_text())
    assert r.returncode == 0, r.stderr


def rows(cfg: Path, host: str, unit: str, since: float = 0.0) -> list[Row]:
    """The probe ``unit`` stopped; its requests started at or after ``since``."""
    out = ssh(cfg, host, f"systemctl stop {unit}; journalctl -u {unit} -o cat --no-pager").stdout
    found = []
    for line in out.splitlines():
        f = line.split(" ", 3)
        if len(f) >= 3 and f[1] in ("ok", "fail") and float(f[0]) >= since:
            found.append(Row(float(f[0]), f[1] == "ok", float(f[2]), f[3] if len(f) > 3 else ""))
    return found


def failed(found: list[Row]) -> list[Row]:
    """The requests that failed. In a rolling restart none may: every apiserver leaves the
    balancers before it stops (host/handover.py), so neither an HTTP error nor a connection cut
    by a balancer's mark-down (shutdown-sessions) reaches a client."""
    return [r for r in found if not r.ok]


def summary(found: list[Row]) -> tuple[int, int, float]:
    """(requests, failed, the longest request in seconds)."""
    return len(found), sum(1 for r in found if not r.ok), max((r.took for r in found), default=0.0)


def longest_gap(found: list[Row], since: float) -> float:
    """The longest time without an answered request from ``since`` (when each answer came)."""
    answered = sorted(r.start + r.took for r in found if r.ok)
    marks = [since, *answered]
    return max((b - a for a, b in zip(marks, marks[1:])), default=float("nan"))


def marked(cfg: Path, worker: str, server: str, since: float, state: str) -> float | None:
    """Seconds from ``since`` (unix time) to ``worker``'s balancer marking ``server`` ``state``
    (UP or DOWN) in its journal."""
    return next((t - since for t, message in _balancer_lines(cfg, worker, since)
                 if f"apiservers/{server} is {state}" in message), None)


def _balancer_lines(cfg: Path, worker: str, since: float) -> list[tuple[float, str]]:
    """(unix time, message) of ``worker``'s balancer journal lines at or after ``since``."""
    out = ssh(cfg, worker, f"journalctl -u {BALANCER} -o short-unix --no-pager --since=@{int(since) - 1}").stdout
    found = []
    for line in out.splitlines():
        f = line.split(maxsplit=3)
        if len(f) == 4 and f[0].replace(".", "", 1).isdigit() and float(f[0]) >= since:
            found.append((float(f[0]), f[3]))
    return found


def marks(cfg: Path, worker: str, since: float) -> list[str]:
    """``worker``'s balancer's lines since ``since`` (unix time) that mark a server up or down
    or say it runs on the unchecked backups, as "+<seconds after since> <the line's message>"."""
    return [f"+{t - since:.1f} {message}" for t, message in _balancer_lines(cfg, worker, since)
            if any(k in message for k in (" is DOWN", " is UP", "Running on backup")) and "[WARNING]" not in message]


class Stop(NamedTuple):
    seconds: float          # from systemd's "Stopping" to its "Stopped"
    deadline: bool          # the apiserver said its HTTP server's shutdown ran out of time


def apiserver_stops(cfg: Path, host: str, since: float) -> list[Stop]:
    """Each stop of ``host``'s kube-apiserver unit since ``since`` (unix time), from its journal.
    ``deadline``: "Failed to shutdown server: context deadline exceeded", what a stop held open
    by watches until --request-timeout says (render/control.py's watch drain is the cure)."""
    out = ssh(cfg, host, "journalctl -u kube-apiserver.service -o short-unix --no-pager "
                         f"--since=@{int(since) - 1}").stdout
    stops, began, deadline = [], None, False
    for line in out.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if not first.replace(".", "", 1).isdigit() or float(first) < since:
            continue                    # "-- No entries --", or before since
        at = float(first)
        if "Stopping kube-apiserver.service" in line:
            began, deadline = at, False
        elif "Failed to shutdown server" in line:
            deadline = True
        elif "Stopped kube-apiserver.service" in line and began is not None:
            stops.append(Stop(round(at - began, 1), deadline))
            began = None
    return stops
