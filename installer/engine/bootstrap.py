"""The API objects TLS bootstrapping needs, sent by apply's cluster-bootstrap phase and by `ca
rotate` (workers that bootstrap again get new tokens).

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

from installer.core.ledger import NodeRetiredError
from installer.core.render.manifests import RETIRED_BINDINGS, bootstrap_objects
from installer.core.render.revocation import POLICY
from installer.engine.api_objects import api_live, apply_api_objects
from installer.engine.context import Context, Event
from installer.host import apireach, csr_approval


def joined_workers(ctx: Context, api) -> frozenset[str]:
    """The workers whose token has done its job, from the cluster: their Node is registered, or
    a certificate was issued to a request made with their token; and, from the facts, those
    whose kubelet holds a client certificate. Never from the run's hosts alone (a run limited
    to some hosts must not bring back the token of a worker that joined long ago). Workers this
    command makes bootstrap again (``ctx.rejoin``) are not joined."""
    joined = {h.name for h in ctx.inv.workers if h.name in ctx.facts and ctx.facts[h.name].kubelet_joined}
    if api is not None:
        from installer.host import kube
        registered = kube.list_nodes(api)
        issued = csr_approval.issued_tokens(api)
        joined |= {h.name for h in ctx.inv.workers
                   if h.name in registered
                   or (h.name in ctx.material.tokens and ctx.material.tokens[h.name].id in issued)}
    return frozenset(joined - ctx.rejoin)


def refuse_revoked(ctx: Context, api, done: str = "nothing was sent") -> None:
    """Stop when the inventory lists a worker the cluster's revoked-nodes policy denies: a state
    directory copied before that revoke does not know it, and would make its renewal binding and
    token Secret again, and its routes on every host (the policy itself stays)."""
    from installer.host import node_api
    listed = sorted(set(node_api.revoked_in_cluster(api) or ()) & {h.name for h in ctx.inv.workers})
    if listed:
        raise NodeRetiredError(
            f"{', '.join(listed)}: revoked in this cluster (ValidatingAdmissionPolicy {POLICY}), though this "
            f"state's node ledger ({ctx.state.root}) does not say so: it is older than that `installer node revoke`. "
            f"Delete them from the inventory (a revoked name never joins again); {done}")


def refuse_revoked_before_changes(ctx: Context) -> None:
    """The same refusal once the hosts' facts are known, before the lock and any change to a host
    (the connect phase asks it; cluster-bootstrap asks again under the lock). Only when
    an apiserver runs already (a first run has no policy) and this run talks to the API."""
    if not ctx.inv.workers or not ctx.will_run("cluster-bootstrap") or not api_live(ctx):
        return
    from installer.host import kube
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material, credential="super-admin") as api:
        refuse_revoked(ctx, api, done="no host was changed")


def send_bootstrap_objects(ctx: Context, phase: str) -> Event:
    """RBAC and the bootstrap token Secrets of workers that have not joined (the phase's whole
    work); a joined worker's token Secret is deleted."""
    deleted: list[str] = []

    def objects(api) -> list[dict]:
        if api is not None:
            refuse_revoked(ctx, api)
        joined = joined_workers(ctx, api)
        if api is not None and not ctx.options.dry_run:
            # a joined worker's token Secret must not exist, whoever made it again
            deleted.extend(csr_approval.delete_token_secrets(
                api, {ctx.material.tokens[n].id: n for n in joined if n in ctx.material.tokens}))
        return bootstrap_objects(ctx.inv, ctx.material, joined)
    # the admin certificate gets its rights from a binding this phase creates: like kubeadm,
    # use the break-glass system:masters identity (kept in the state, never on a host)
    ev = apply_api_objects(ctx, phase, objects, "super-admin", retired_bindings=RETIRED_BINDINGS)
    if deleted:
        ev.detail += [f"deleted the bootstrap token Secret of {n} (it joined)" for n in deleted]
        ev.action = "changed"
    return ev
