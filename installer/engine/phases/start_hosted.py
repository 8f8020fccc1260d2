"""hosted: a hosted tenant's control plane in its hosting cluster (docs/hosted.md), converged by
its plane (engine/planes/hosted.py).

The tenant's objects (render/tenant.py: its files as Secrets and ConfigMaps, etcd's
StatefulSet, the apiserver's Deployment, PodDisruptionBudget and Service, the controller-manager
and scheduler) are brought to what is rendered, then every workload is waited for until it runs
its current template on every replica, all ready, and the tenant's API answers /readyz where it
is exposed. An object already as rendered is not written: a run that changes nothing rolls
nothing. A plane with nothing to converge (control hosts: the etcd and control-plane phases')
has no target, and the phase does not run.
"""

from __future__ import annotations

from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase


class StartHosted(Phase):
    name = "hosted"
    description = "a hosted tenant's control plane: its objects in the hosting cluster; wait for its API"

    def prepare(self, ctx: Context) -> list[str]:
        return ctx.plane.targets()

    def run_host(self, ctx: Context, host: str) -> Event:
        return ctx.plane.converge(ctx, host)

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run:
            return
        lines = ctx.plane.wait_converged(ctx)
        ctx.events.append(Event(self.name, ctx.plane.targets()[0], "waited", detail=lines))
