"""cluster-bootstrap: the API objects TLS bootstrapping needs (needs a real kube-apiserver):
RBAC and per-node bootstrap tokens, sent by ``engine/bootstrap.py`` (which says what and how;
`ca rotate` sends them too)."""

from __future__ import annotations

from installer.engine.bootstrap import send_bootstrap_objects
from installer.engine.context import Bootstrapped, Context, Event
from installer.engine.phases.base import Phase


class BootstrapCluster(Phase):
    name = "cluster-bootstrap"
    description = "RBAC and bootstrap tokens through the Kubernetes API"
    produces = (Bootstrapped,)

    def prepare(self, ctx: Context) -> list[str]:
        return ["(api)"]

    def run_host(self, ctx: Context, host: str) -> Event:
        ev = send_bootstrap_objects(ctx, self.name)
        if not ctx.options.dry_run:
            ctx.produce(Bootstrapped())
        return ev
