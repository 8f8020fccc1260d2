"""cluster-bootstrap: the API objects TLS bootstrapping needs (needs a real kube-apiserver).

Through the API from the operator machine with ``host/kube.py`` (directly, or tunnelled over SSH via a
control host when the API endpoint is not reachable): RBAC for bootstrapping (no group
auto-approval of bootstrap CSRs: the workers phase approves each node's own, and a binding of
an earlier release that allowed it is deleted), per-node
bootstrap token Secrets with an expiry (only for workers that have not joined yet: the workers
phase deletes a token's Secret once its node registered), the apiserver's kubelet-API binding and per-node
renewal bindings. Every manifest is schema-validated before anything is sent.
"""

from __future__ import annotations

from installer.core.render.manifests import RETIRED_BINDINGS, bootstrap_objects
from installer.engine.phases.base import Context, Event, Phase, apply_api_objects


class BootstrapCluster(Phase):
    name = "cluster-bootstrap"
    description = "RBAC and bootstrap tokens through the Kubernetes API"

    def prepare(self, ctx: Context) -> list[str]:
        return ["(api)"]

    def run_host(self, ctx: Context, host: str) -> Event:
        joined = frozenset(h.name for h in ctx.inv.workers if h.name in ctx.facts and ctx.facts[h.name].kubelet_joined)
        objects = bootstrap_objects(ctx.inv, ctx.material, joined)
        # the admin certificate gets its rights from a binding this phase creates: like kubeadm,
        # use the break-glass system:masters identity (kept in the state, never on a host)
        ev = apply_api_objects(ctx, self.name, objects, "super-admin", retired_bindings=RETIRED_BINDINGS)
        if not ctx.options.dry_run:
            ctx.bootstrap_ran = True
        return ev
