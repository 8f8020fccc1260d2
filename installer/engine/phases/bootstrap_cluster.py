"""cluster-bootstrap: the API objects TLS bootstrapping needs (needs a real kube-apiserver).

Through the API from the operator machine with ``host/kube.py`` (directly, or tunnelled over SSH
via a control host when the API endpoint is not reachable): RBAC for bootstrapping (no group
auto-approval of bootstrap CSRs: the workers phase approves each node's own, and a binding of an
earlier release that allowed it is deleted), per-node bootstrap token Secrets with an expiry
(only for workers that have not joined, as the cluster says: ``joined_workers``; a joined
worker's Secret found again is deleted), the apiserver's kubelet-API binding, per-node renewal
and kube-proxy bindings, upstream's shared kube-proxy binding emptied. Every manifest is
schema-validated before anything is sent.
"""

from __future__ import annotations

from installer.engine.bootstrap import send_bootstrap_objects
from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase


class BootstrapCluster(Phase):
    name = "cluster-bootstrap"
    description = "RBAC and bootstrap tokens through the Kubernetes API"

    def prepare(self, ctx: Context) -> list[str]:
        return ["(api)"]

    def run_host(self, ctx: Context, host: str) -> Event:
        return send_bootstrap_objects(ctx, self.name)
