"""Taking a node out for good: ``node remove`` (decommission) and ``node revoke`` (even against a
stolen certificate). Each is an ordered list of ``Step``s (engine/steps.py): a step's words are
both the plan printed without ``--yes`` and the progress line when it runs. The
steps share one ``_Run``: the target, its outcome, one API client.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

from installer.actions import etcd_members, teardown
from installer.actions.node_ops import (
    ApiFactory,
    NodeOpError,
    Target,
    cluster_api,
    converge,
    material_for,
    node_target,
    with_host,
    without,
)
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError
from installer.core.ledger import Entry, Ledger
from installer.core.pki.material import Material
from installer.core.render.revocation import POLICY, identity
from installer.engine.run import Run, open_run
from installer.engine.steps import Step, run_steps
from installer.host import apireach, kube, node_api
from installer.host.ssh import HostError


@dataclass
class Outcome:
    name: str
    done: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    entry: Entry | None = None
    steps: list[str] = field(default_factory=list)      # what was run, in order (Step.says)

    def as_dict(self) -> dict:
        return {"name": self.name, "steps": self.steps, "done": self.done, "warnings": self.warnings,
                "state": self.entry.state if self.entry else None, "since": self.entry.since if self.entry else None}


@dataclass
class _Run:
    """What the steps of one remove or revoke share: the target, its outcome, one API client
    (opened by the first step that needs it, closed after the last)."""
    t: Target
    ledger: Ledger
    out: Outcome
    log: Callable[[str], None]
    stack: contextlib.ExitStack
    api_factory: ApiFactory | None = None
    accept_new_host_keys: bool = False
    serials: list[str] = field(default_factory=list)
    _material: Material | None = None
    _api: kube.ApiClient | None = None

    @property
    def material(self) -> Material:
        if self._material is None:
            self._material = material_for(with_host(self.t.inv, self.t.host), self.t.state)
        return self._material

    @property
    def api(self) -> kube.ApiClient:
        if self._api is None:
            self._api = self.stack.enter_context(cluster_api(self.t.cluster, self.material, self.api_factory))
        return self._api


def _run_steps(run: _Run, steps: list[Step]) -> Outcome:
    run.out.steps = run_steps(run.t.host.name, steps, run, run.log)
    return run.out


def _wipe_words(t: Target) -> str:
    what = ("stop and wipe the control plane" if t.host.role == "control" else
            "stop and disable kubelet, kube-proxy, containerd; kill every container and shim; remove "
            "credentials, CNI state, routes, units, binaries, data")
    return f"on {t.host.name} ({t.host.address}): {what}"


def _wipe_step(t: Target) -> Step:
    return Step(_wipe_words(t), lambda r: r.out.done.extend(_wipe(r.t, r.log, r.accept_new_host_keys)))


def _mark_step(t: Target, state: str) -> Step:
    def mark(r: _Run) -> None:
        if state == "revoked":
            r.out.entry = r.ledger.mark_revoked(r.t.host, r.serials, "installer node revoke")
        else:
            r.out.entry = r.ledger.mark_removed(r.t.host, "installer node remove")
        r.ledger.save(r.t.state)
        r.log(f"{r.t.host.name}: recorded as {state} in {Ledger.path(r.t.state)}"
              + (f" (certificate serials {', '.join(r.serials)})" if r.serials else ""))
        if r.t.host.role == "worker" and r.t.state.drop_token(r.t.host.name):
            r.out.done.append("dropped its bootstrap token from the state (`node add` issues a new one)")
    return Step(f"mark {t.host.name} {state} in the node ledger", mark)


def _refresh_step(t: Target, skip: frozenset[str]) -> Step:
    return Step(f"drop the routes to {t.host.name}'s pods on the other hosts",
                lambda r: _refresh_others(r.t, skip, r.log, r.out, r.accept_new_host_keys))


def remove_steps(t: Target, *, skip_cluster: bool = False, host_unreachable: bool = False, timeout: float = 300.0,
                 allow_even: bool = False, refresh_others: bool = True) -> list[Step]:
    n = t.host.name
    if t.host.role == "control":
        def leave_etcd(r: _Run) -> None:
            etcd_members.remove(r.t.cluster, n, allow_even=allow_even,
                                host_unreachable=host_unreachable, log=r.log)
            r.out.done.append("removed from etcd")
        return [Step(f"remove {n} from etcd (one member at a time; refused when unsafe)", leave_etcd),
                *([] if host_unreachable else [_wipe_step(t)]), _mark_step(t, "removed")]

    def drain(r: _Run) -> None:
        if not node_api.cordon(r.api, n):
            r.log(f"{n}: no Node {n} in the cluster: nothing to drain")
            return
        r.log(f"{n}: cordoned")
        try:
            res = node_api.drain(r.api, n, timeout, log=r.log)
            left = f"; left to the node: {', '.join(res.skipped)}" if res.skipped else ""
            r.out.done.append(f"drained ({len(res.evicted)} pod(s) evicted{left})")
        except node_api.DrainError as e:
            if not host_unreachable:
                raise NodeOpError(f"{e}; the node stays cordoned and nothing else was done (retry with "
                                  "a longer --timeout, or fix the blocking PodDisruptionBudget)") from None
            # a dead kubelet never confirms: deleting the Node lets the pod GC clean up
            r.out.warnings.append(str(e))

    def delete(r: _Run) -> None:
        if node_api.delete_node(r.api, n):
            r.out.done.append(f"deleted Node {n}")
            r.log(f"{n}: deleted Node")
        r.serials = _cluster_cleanup(r.api, r.t, r.material, r.out, r.log)

    steps = []
    if not skip_cluster:
        steps += [Step(f"cordon and drain Node {n} (evictions respect PodDisruptionBudgets)", drain),
                  Step(f"delete Node {n}, its bootstrap token Secrets, its renewal and kube-proxy bindings and "
                       "pending CSRs", delete)]
    if not host_unreachable:
        steps.append(_wipe_step(t))
    steps.append(_mark_step(t, "removed"))
    if refresh_others:
        steps.append(_refresh_step(t, frozenset({"cluster-bootstrap"}) if skip_cluster else frozenset()))
    return steps


def revoke_steps(t: Target, *, host_unreachable: bool = False, refresh_others: bool = True,
                 refresh_skip: frozenset[str] = frozenset(), policy_timeout: float = 60.0) -> list[Step]:
    n = t.host.name

    def deny(r: _Run) -> None:
        known = set(r.ledger.revoked_names())
        res = node_api.apply_revocations(r.api, sorted(known | {n}), r.t.inv.spec.kubernetes.version)
        for kind, obj, action in res.actions:
            r.out.done.append(f"{action} {kind} {obj} (denies {', '.join(identity(x) for x in res.denied)})")
        _reconcile(r, known, res.cluster)
        if r.api_factory is None:
            # each apiserver loads the policy on its own: see every one refuse before going on
            run = r.t.cluster
            waited = _wait_enforced(run, r.material, n, policy_timeout)
            if probes := run.plane.api_probes():
                r.out.done.append(f"each of {len(waited)} connections ({probes} through each exposed address, each "
                                  f"to that node's apiservers) refuses system:node:{n} ({max(waited.values()):.2f} s "
                                  "after the policy)")
            else:
                r.out.done += [f"the apiserver on {host} refuses system:node:{n} ({seconds:.2f} s after the policy)"
                               for host, seconds in waited.items()]

    def cleanup(r: _Run) -> None:
        r.serials = _cluster_cleanup(r.api, r.t, r.material, r.out, r.log)

    def delete(r: _Run) -> None:
        if node_api.delete_node(r.api, n):
            r.out.done.append(f"deleted Node {n}")
        # its pods, at once: while one is bound to it the Node authorizer lets the identity read
        # what the pod uses (seen on the real lab: the pod garbage collector comes 40 s+ later)
        pods, seconds = node_api.delete_pods_and_their_reads(r.api, n, policy_timeout)
        if pods:
            r.out.done.append(f"deleted its {len(pods)} pod(s) ({', '.join(pods)}); system:node:{n} may read none "
                              f"of their Secrets and ConfigMaps ({seconds:.2f} s)")

    def wipe(r: _Run) -> None:
        try:
            r.out.done += _wipe(r.t, r.log, r.accept_new_host_keys)
        except HostError as e:
            r.out.warnings.append(f"the host was not wiped ({e}); the revocation stands. Wipe or re-image it before "
                                  "it is used again")

    steps = [Step(f"deny every write by system:node:{n} (ValidatingAdmissionPolicy {POLICY}; every name it "
                  "denies already stays), and wait until every control host's apiserver refuses it", deny),
             Step("delete its renewal and kube-proxy bindings, bootstrap token Secrets and pending CSRs", cleanup),
             Step(f"delete Node {n} and its pods (the Node authorizer then lets it read none of their Secrets)",
                  delete),
             _mark_step(t, "revoked")]
    if not host_unreachable:
        steps.append(Step(_wipe_words(t) + " (a failed wipe does not undo the revocation)", wipe))
    if refresh_others:
        steps.append(_refresh_step(t, refresh_skip))
    return steps


def _reconcile(r: _Run, known: set[str], cluster: list[str] | None) -> None:
    """Say where this state's ledger and the cluster's policy disagreed (``cluster``: the names
    the policy denied before this run, None without a policy), and mark revoked in the ledger,
    at once, every name the policy denies that the ledger did not: a later revoke from this
    state then keeps it (apply_revocations keeps it anyway, as long as the policy is there)."""
    denied = set(cluster or ())
    learned = sorted(denied - known)
    if learned:
        for name in learned:
            host = r.t.host if name == r.t.host.name else next((h for h in r.t.inv.spec.hosts if h.name == name), None)
            r.ledger.learn_revoked(name, "found in the cluster's revoked-nodes policy", host)
        r.ledger.save(r.t.state)
        r.out.warnings.append(
            f"the cluster's policy {POLICY} already denied {', '.join(identity(x) for x in learned)}, which this "
            f"state's node ledger did not mark revoked (revoked from another state directory, or this one is an older "
            f"copy): kept in the policy, and now marked revoked in {Ledger.path(r.t.state)}")
    missing = sorted(known - denied)
    if missing:
        there = (f"the cluster had no policy {POLICY} (deleted by hand?)" if cluster is None else
                 f"the cluster's policy {POLICY} did not deny {', '.join(identity(x) for x in missing)} (edited by "
                 "hand?)")
        r.out.warnings.append(f"this state's node ledger marks {', '.join(missing)} revoked but {there}: denied "
                              "again now")


def remove_plan(t: Target, *, skip_cluster: bool, host_unreachable: bool, revoke: bool = False) -> list[str]:
    """The plain-English plan of ``node remove`` / ``node revoke``: the steps' own words."""
    steps = revoke_steps(t, host_unreachable=host_unreachable) if revoke else \
        remove_steps(t, skip_cluster=skip_cluster, host_unreachable=host_unreachable)
    plan = [s.says for s in steps]
    if t.in_inventory:
        plan.append(f"then delete {t.host.name} from the inventory (apply refuses it from now on)")
    return plan


def _wipe(t: Target, log, accept_new_host_keys: bool) -> list[str]:
    inv = with_host(t.inv, t.host)
    # the command's connection to it (a host the ledger alone still names is connected here);
    # no plans given: teardown derives the host's paths, users and units from the inventory
    return teardown.wipe_host(inv, t.host, {}, t.cluster.session.remote(t.host), data=True, log=log)


def _cluster_cleanup(api, t: Target, material: Material, out: Outcome, log) -> list[str]:
    """Delete the Node's way back in: token Secrets, renewal and kube-proxy bindings, pending
    CSRs. Returns the serials of client certificates seen issued to it."""
    n = t.host.name
    token_ids = [material.tokens[n].id] if n in material.tokens else []
    done = []
    if node_api.delete_renewal_binding(api, n):
        done.append(f"deleted ClusterRoleBinding hiddenplane:node-renewal:{n}")
    if node_api.delete_kube_proxy_binding(api, n):
        done.append(f"deleted ClusterRoleBinding hiddenplane:kube-proxy:{n}")
    done += [f"deleted Secret kube-system/{s}" for s in node_api.delete_tokens(api, n, token_ids)]
    csrs = node_api.node_csrs(api, n, token_ids)
    done += [f"deleted pending CertificateSigningRequest {c}" for c in node_api.delete_csrs(api, csrs.pending)]
    for line in done:
        log(f"{n}: {line}")
    out.done += done
    return csrs.serials


def _refresh_others(t: Target, skip: frozenset[str], log, out: Outcome, accept_new_host_keys: bool) -> None:
    others = without(t.inv, t.host.name)
    if not others.controls:
        return
    try:
        report = converge(t.cluster.with_inventory(others), None, skip, log, "refresh the other hosts' routes",
                           accept_new_host_keys)
    except (InstallerError, HostError) as e:
        out.warnings.append(f"the other hosts' routes were not refreshed: {e}; run `installer apply` once "
                            f"{t.host.name} is out of the inventory")
        return
    hosts = sorted({e.host for e in report.changed if not e.host.startswith("(")}) if report else []
    if hosts:
        out.done.append("dropped its routes on " + ", ".join(hosts))


def remove(cluster: Cluster | Run, name: str, *, timeout: float = 300.0, skip_cluster: bool = False,
           host_unreachable: bool = False, allow_even: bool = False, accept_new_host_keys: bool = False,
           api_factory: ApiFactory | None = None, refresh_others: bool = True, hold_lock: bool = True,
           log=print) -> Outcome:
    """``hold_lock=False``: for tests with no hosts at all (the apply lock lives on them)."""
    with open_run(cluster, log=log, accept_new_host_keys=accept_new_host_keys) as run:
        t, ledger = node_target(run, name)
        steps = remove_steps(t, skip_cluster=skip_cluster, host_unreachable=host_unreachable, timeout=timeout,
                             allow_even=allow_even, refresh_others=refresh_others)
        with _lock(run, hold_lock, _gone(t, host_unreachable)), contextlib.ExitStack() as stack:
            return _run_steps(_Run(t, ledger, Outcome(name), log, stack, api_factory, accept_new_host_keys), steps)


def _lock(run: Run, holding: bool, skip: frozenset[str]) -> ContextManager:
    return run.hold(skip=skip) if holding else contextlib.nullcontext()


def _gone(t: Target, host_unreachable: bool) -> frozenset[str]:
    """The hosts whose lock cannot be taken: the target itself when it is gone."""
    return frozenset({t.host.name}) if host_unreachable else frozenset()


# --- revoke -----------------------------------------------------------------------------------

def _wait_enforced(run: Run, material: Material, name: str, timeout: float) -> dict[str, float]:
    """Every control host's own apiserver refuses ``system:node:<name>`` (node_api); where the
    plane exposes its apiservers on addresses of their own (a hosted tenant: each address sends
    only to the replicas on its node, core/render/tenant_placement.py), each of its
    ``api_probes()`` connections through every one of them: a replica is missed by all of them
    only where two share a node, with a chance of 2^-probes."""
    inv = run.inv
    remotes = run.session.connect(inv.controls)         # the run's: a tunnel's stays open with it
    with contextlib.ExitStack() as stack:
        clients = {}
        if probes := run.plane.api_probes():
            clients = {f"{address} connection {i + 1}": stack.enter_context(
                           kube.api_client(apireach.base_url(address, port), material, credential="admin"))
                       for _, address, port in inv.api_backends for i in range(probes)}
        for h in inv.controls:
            url = stack.enter_context(apireach.api_access(inv, remotes, material, apiserver=h))
            clients[h.name] = stack.enter_context(kube.api_client(url, material, credential="admin"))
        return node_api.wait_refused_everywhere(clients, [name], timeout)


def revoke(cluster: Cluster | Run, name: str, *, host_unreachable: bool = False,
           accept_new_host_keys: bool = False, api_factory: ApiFactory | None = None,
           refresh_others: bool = True, refresh_skip: frozenset[str] = frozenset(),
           policy_timeout: float = 60.0, hold_lock: bool = True, log=print) -> Outcome:
    """Shut ``system:node:<name>`` out for good: deny its writes, delete its way to renew or
    re-bootstrap, delete its Node, record it, wipe the host (when reachable)."""
    with open_run(cluster, log=log, accept_new_host_keys=accept_new_host_keys) as run:
        t, ledger = node_target(run, name)
        if t.host.role == "control":
            raise NodeOpError(f"{name} is a control host: it has no node identity to revoke; use `installer node "
                              "remove` and, if its keys may be stolen, `installer ca rotate`")
        steps = revoke_steps(t, host_unreachable=host_unreachable, refresh_others=refresh_others,
                             refresh_skip=refresh_skip, policy_timeout=policy_timeout)
        with _lock(run, hold_lock, frozenset()), contextlib.ExitStack() as stack:
            return _run_steps(_Run(t, ledger, Outcome(name), log, stack, api_factory, accept_new_host_keys), steps)
