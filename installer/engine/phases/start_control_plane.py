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
from installer.core.components import CONTROL_UNITS
from installer.engine.context import Context, Event
from installer.engine.parts import control_plane_part
from installer.engine.phases.base import Phase
from installer.host import handover

APISERVER_UNIT, CONTROLLER_MANAGER, SCHEDULER = components.units("kube-apiserver", "kube-controller-manager",
                                                                 "kube-scheduler")


class StartControlPlane(Phase):
    name = "control-plane"
    description = "apiserver, controller-manager, scheduler; wait for /livez and /readyz"

    def prepare(self, ctx: Context) -> list[str]:
        # the run's restarts, one host at a time (its hosts' run_host run in parallel threads)
        self._restart_lock = threading.Lock()
        return [h.name for h in ctx.hosts("control")]

    def run_host(self, ctx: Context, host: str) -> Event:
        changes = ctx.changes_for(host, control_plane_part(ctx.plans[host]))
        if APISERVER_UNIT not in changes.restart or ctx.options.dry_run:
            return ctx.plane.place(ctx, self.name, host, changes)
        with self._restart_lock:
            with handover.restarting(ctx, host):
                ev = ctx.plane.place(ctx, self.name, host, changes)
            ev.detail.append("kube-apiserver restarted alone; /readyz ok again")
            return ev

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or ctx.settled(events, CONTROL_UNITS):
            return
        for h in ctx.hosts("control"):
            ctx.plane.wait(ctx, h.name, APISERVER_UNIT)
            ctx.events.append(Event(self.name, h.name, "waited", detail=["/livez ok", "/readyz ok"]))
        for h in ctx.hosts("control"):
            ctx.plane.wait_all(ctx, h.name, (CONTROLLER_MANAGER, SCHEDULER))
        ctx.mark_active([h.name for h in ctx.hosts("control")], CONTROL_UNITS)
