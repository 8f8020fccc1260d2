"""control-plane: kube-apiserver, kube-controller-manager and kube-scheduler as systemd units.

Waits until every apiserver answers /livez and /readyz over TLS (verified with the cluster CA,
authenticated with the admin certificate) and the controller-manager and scheduler listen on
their secure ports. A running apiserver whose inputs changed (a flag, a certificate, the etcd
member list) restarts one host at a time, each answering /readyz again before the next: with
several control hosts the API stays up through the change, and with the workers' balancers each
leaves them before its restart and comes back after (host/handover.py).
"""

from __future__ import annotations

import threading

from installer.core import components
from installer.engine.phases.base import Context, Event, Phase
from installer.engine.phases.select import CONTROL_UNITS, control_plane_part
from installer.host import handover
from installer.host.ssh import HostError

LOCAL_PORTS = components.ports("kube-controller-manager") + components.ports("kube-scheduler")
APISERVER_UNIT = components.unit("kube-apiserver")
# the apiserver restarts of one process's runs, one host at a time
_restart_lock = threading.Lock()


def listening_script(ports: tuple[int, ...], timeout: float,
                     units: tuple[str, ...] = ("kube-controller-manager", "kube-scheduler")) -> str:
    """Wait until something listens on every port; on timeout show ``units``' status. A subshell,
    so that scripts chain with ``&&`` (its ``exit`` ends only itself)."""
    want = " ".join(str(p) for p in ports)
    tries = max(1, int(timeout))
    return (f"(i=0; while [ $i -lt {tries} ]; do ok=1; for p in {want}; do "
            f"ss -Htln | awk '{{print $4}}' | grep -q \":$p$\" || ok=0; done; "
            f"[ $ok = 1 ] && exit 0; i=$((i+1)); sleep 1; done; "
            f"echo \"not listening on all of: {want}\" >&2; systemctl --no-pager status "
            f"{' '.join(units)} 2>&1 | tail -20 >&2; exit 1)")


class StartControlPlane(Phase):
    name = "control-plane"
    description = "apiserver, controller-manager, scheduler; wait for /livez and /readyz"

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts("control")]

    def run_host(self, ctx: Context, host: str) -> Event:
        changes = ctx.changes_for(host, control_plane_part(ctx.plans[host]))
        if APISERVER_UNIT not in changes.restart or ctx.options.dry_run:
            return ctx.execute(self.name, host, changes)
        with _restart_lock:
            with handover.restarting(ctx, host):
                ev = ctx.execute(self.name, host, changes)
            ev.detail.append("kube-apiserver restarted alone; /readyz ok again")
            return ev

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or ctx.settled(events, CONTROL_UNITS):
            return
        for h in ctx.hosts("control"):
            handover.wait_ready(ctx, h.name)
            ctx.events.append(Event(self.name, h.name, "waited", detail=["/livez ok", "/readyz ok"]))
        for h in ctx.hosts("control"):
            r = ctx.remotes[h.name].run(listening_script(LOCAL_PORTS, ctx.options.wait_timeout), check=False,
                                        what="wait for controller-manager and scheduler",
                                        timeout=ctx.options.wait_timeout + 30)
            if r.rc != 0:
                raise HostError(h.name, f"controller-manager/scheduler not serving: {r.stderr.strip()[-600:]}")
        ctx.mark_active([h.name for h in ctx.hosts("control")], CONTROL_UNITS)
