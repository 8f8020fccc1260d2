"""Node day-2 operations: list, add, drain, remove (decommission) and revoke.

Each is a short ordered list of steps over three narrow parts: the Kubernetes API
(``node_api``), the host (``teardown.wipe_host`` over SSH) and the apply machinery (``runner``)
for the other hosts' routes. Control hosts are not Nodes: adding or removing one is an etcd
membership change (``etcd_members``), one member at a time.

What ``add`` and ``remove`` may change on the other hosts is checked once the facts are read,
before the lock and any change (``runner.run``'s ``check``): only the pod routes
(``hiddenplane-routes.service``). Anything else pending means the inventory holds other edits,
and the command refuses before touching anything: run ``installer apply`` for those.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

from kubernetes import client as k8s

from installer.host import kube, node_api
from installer.engine import runner
from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec, Inventory
from installer.core.ledger import Entry, Ledger, NodeRetiredError, check_inventory, revoked_message
from installer.core.network import ROUTES_UNIT
from installer.engine.phases.acquire_lock import cluster_lock
from installer.engine.phases.base import Options
from installer.engine.phases.select import planned_changes
from installer.core.pki.material import Material, ensure
from installer.core.render.revocation import POLICY
from installer.host.ssh import HostError, Remote
from installer.core.state import StateDir
from installer.core.inventory import as_inventory
from installer.core.state import state_for
from installer.actions import etcd_members
from installer.actions import teardown

ApiFactory = Callable[[], ContextManager[k8s.ApiClient]]
ROUTES_PATH = f"/etc/systemd/system/{ROUTES_UNIT}"


class NodeOpError(InstallerError):
    """A node operation was refused or failed (the message says which node and why)."""


@dataclass
class Target:
    inv: Inventory            # the inventory as given
    state: StateDir
    host: HostSpec
    in_inventory: bool


def node_target(inventory, state_dir, name: str) -> tuple[Target, Ledger]:
    inv = as_inventory(inventory)
    state = state_for(inv, state_dir)
    ledger = Ledger.load(state)
    host = ledger.host(name, inv)
    if host is None:
        raise NodeOpError(f"no host named {name} in the inventory or in the node ledger ({Ledger.path(state)})")
    return Target(inv, state, host, any(h.name == name for h in inv.spec.hosts)), ledger


def _with_hosts(inv: Inventory, hosts: list[HostSpec]) -> Inventory:
    # the models are frozen: copy with the one field replaced
    return inv.model_copy(update={"spec": inv.spec.model_copy(update={"hosts": hosts})})


def without(inv: Inventory, name: str) -> Inventory:
    return _with_hosts(inv, [h for h in inv.spec.hosts if h.name != name])


def with_host(inv: Inventory, host: HostSpec) -> Inventory:
    if any(h.name == host.name for h in inv.spec.hosts):
        return inv
    return _with_hosts(inv, [*inv.spec.hosts, host])


def _material(inv: Inventory, state: StateDir) -> Material:
    """The state's material for ``inv``, completed in memory (nothing written)."""
    return ensure(inv, state.load(inv))[0]


@contextlib.contextmanager
def cluster_api(inv: Inventory, material: Material, factory: ApiFactory | None = None) -> Iterator[k8s.ApiClient]:
    """The admin client, directly or through an SSH tunnel via a control host."""
    if factory is not None:
        with factory() as api:
            yield api
        return
    with kube.api_access(inv, lambda h: Remote(h, inv), material) as url, \
            kube.api_client(url, material, credential="admin") as api:
        yield api


# --- what a run may change elsewhere ----------------------------------------------------------

def foreign_changes(report: runner.Report, allowed_host: str | None) -> list[str]:
    """Planned changes beyond ``allowed_host`` and the other hosts' pod routes."""
    out = []
    for ev in report.changed:
        if ev.host == allowed_host or ev.host.startswith("("):     # (local) state, (api) objects
            continue
        for line in ev.detail:
            if line.startswith("~ " + ROUTES_PATH + " ") or line == f"* restart {ROUTES_UNIT}":
                continue
            out.append(f"{ev.host}: {line}")
    return out


def _converge(inv: Inventory, state_dir, name: str | None, skip: frozenset[str], log, what: str,
              accept_new_host_keys: bool = False, wait_timeout: float = 180.0) -> runner.Report | None:
    """Apply ``inv``, refusing (before the lock and any change) when the facts show it would
    change more than ``name`` and the routes. None when nothing changed."""
    def only_name_and_routes(ctx) -> None:
        extra = foreign_changes(runner.Report(events=planned_changes(ctx)), name)
        if extra:
            raise NodeOpError(f"{what}: the inventory has other pending changes; run `installer apply` for them "
                              "first (nothing was changed):\n" + "\n".join(f"  {x}" for x in extra))

    opts = Options(skip=skip, accept_new_host_keys=accept_new_host_keys, wait_timeout=wait_timeout)
    report = runner.run(inv, state_dir, opts, log=log, check=only_name_and_routes)
    return report if report.changed else None


# --- list -----------------------------------------------------------------------------------

@dataclass
class NodeRow:
    name: str
    role: str
    address: str
    state: str
    since: str
    in_inventory: bool
    registered: str = "-"        # with --api: Ready / NotReady / absent

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def list_nodes(inventory, state_dir=None, *, use_api: bool = False, api_factory: ApiFactory | None = None) -> list[NodeRow]:
    inv = as_inventory(inventory)
    state = state_for(inv, state_dir)
    ledger = Ledger.load(state)
    rows = {}
    for h in inv.spec.hosts:
        e = ledger.entries.get(h.name)
        rows[h.name] = NodeRow(h.name, h.role, str(h.address), e.state if e else "active",
                               e.since if e else "(not applied yet)", True)
    for n, e in ledger.entries.items():
        if n not in rows:
            rows[n] = NodeRow(n, e.role, e.address, e.state, e.since, False)
    if use_api:
        material = state.load(inv)
        with cluster_api(inv, material, api_factory) as api:
            ready = {n: "Ready" if ok else "NotReady" for n, ok in kube.node_readiness(api).items()}
        for r in rows.values():
            r.registered = ready.pop(r.name, "absent") if r.role == "worker" else "never (control)"
        for n, status in ready.items():            # registered, but unknown to us
            rows[n] = NodeRow(n, "?", "?", "unknown", "", False, status)
    return sorted(rows.values(), key=lambda r: (r.role != "control", r.name))


# --- add --------------------------------------------------------------------------------------

def add(inventory, name: str, state_dir=None, *, skip: frozenset[str] = frozenset(), allow_even: bool = False,
        accept_new_host_keys: bool = False, wait_timeout: float = 180.0, log=print) -> runner.Report | None:
    """Join the inventory's host ``name``: only its certificates and token are issued, only it
    is changed (plus the routes on the other hosts)."""
    inv = as_inventory(inventory)
    host = next((h for h in inv.spec.hosts if h.name == name), None)
    if host is None:
        raise NodeOpError(f"{name} is not in the inventory: add it under spec.hosts first")
    state = state_for(inv, state_dir)
    ledger = Ledger.load(state)
    e = ledger.entries.get(name)
    if e is not None and e.state == "revoked":
        raise NodeRetiredError(revoked_message(e))
    if host.role == "control":
        etcd_members.add(inv, name, state_dir=state_dir, allow_even=allow_even, wait_timeout=wait_timeout, log=log)
        ledger = Ledger.load(state)
        ledger.reactivate(host)
        ledger.save(state)
        return None
    others = without(inv, name)
    check_inventory(others, ledger)        # other retired hosts: say so before anything else
    if e is not None and e.state == "removed":
        log(f"{name}: was removed on {e.since}; adding it back")
        ledger.reactivate(host)
        ledger.save(state)
    return _converge(inv, state_dir, name, skip, log, f"node add {name}", accept_new_host_keys, wait_timeout)


# --- drain ------------------------------------------------------------------------------------

def drain(inventory, name: str, state_dir=None, *, timeout: float = 300.0, api_factory: ApiFactory | None = None,
          log=print) -> node_api.DrainResult:
    t, _ = node_target(inventory, state_dir, name)
    if t.host.role == "control":
        raise NodeOpError(f"{name} is a control host: it is not a Node and runs no pods")
    with cluster_api(t.inv, t.state.load(t.inv), api_factory) as api:
        if not node_api.cordon(api, name):
            raise NodeOpError(f"there is no Node {name} in the cluster")
        log(f"{name}: cordoned")
        return node_api.drain(api, name, timeout, log=log)


# --- remove -----------------------------------------------------------------------------------

@dataclass
class Outcome:
    name: str
    done: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    entry: Entry | None = None


def remove_plan(t: Target, *, skip_cluster: bool, host_unreachable: bool, revoke: bool = False) -> list[str]:
    n = t.host.name
    steps = []
    if t.host.role == "control":
        return [f"remove {n} from etcd (one member at a time; refused when unsafe)",
                f"stop and wipe the control plane on {n}", "mark it removed in the node ledger"]
    if revoke:
        steps += [f"deny every write by system:node:{n} (ValidatingAdmissionPolicy {POLICY})",
                  "delete its renewal binding, bootstrap token Secrets and pending CSRs", f"delete Node {n}"]
    elif not skip_cluster:
        steps += [f"cordon and drain Node {n} (evictions respect PodDisruptionBudgets)",
                  f"delete Node {n}, its bootstrap token Secrets, its renewal binding and pending CSRs"]
    if not host_unreachable:
        steps.append(f"on {n} ({t.host.address}): stop and disable kubelet, kube-proxy, containerd; kill every "
                     "container and shim; remove credentials, CNI state, routes, units, binaries, data")
    steps.append(f"mark {n} {'revoked' if revoke else 'removed'} in the node ledger")
    steps.append(f"drop the routes to {n}'s pods on the other hosts")
    if t.in_inventory:
        steps.append(f"then delete {n} from the inventory (apply refuses it from now on)")
    return steps


def _wipe(t: Target, log, accept_new_host_keys: bool) -> list[str]:
    inv = with_host(t.inv, t.host)
    remote = Remote(t.host, inv, accept_new_host_keys)
    try:
        # no plans given: teardown derives the host's paths, users and units from the inventory
        return teardown.wipe_host(inv, t.host, {}, remote, data=True, log=log)
    finally:
        remote.close()


def _cluster_cleanup(api, t: Target, material: Material, out: Outcome, log) -> list[str]:
    """Delete the Node's way back in: token Secrets, renewal binding, pending CSRs. Returns the
    serials of client certificates seen issued to it."""
    n = t.host.name
    token_ids = [material.tokens[n].id] if n in material.tokens else []
    done = []
    if node_api.delete_renewal_binding(api, n):
        done.append(f"deleted ClusterRoleBinding hiddenplane:node-renewal:{n}")
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
        report = _converge(others, t.state.root, None, skip, log, "refresh the other hosts' routes",
                           accept_new_host_keys)
    except (InstallerError, HostError) as e:
        out.warnings.append(f"the other hosts' routes were not refreshed: {e}; run `installer apply` once "
                            f"{t.host.name} is out of the inventory")
        return
    hosts = sorted({e.host for e in report.changed if not e.host.startswith("(")}) if report else []
    if hosts:
        out.done.append("dropped its routes on " + ", ".join(hosts))


def remove(inventory, name: str, state_dir=None, *, timeout: float = 300.0, skip_cluster: bool = False,
           host_unreachable: bool = False, allow_even: bool = False, accept_new_host_keys: bool = False,
           api_factory: ApiFactory | None = None, refresh_others: bool = True, hold_lock: bool = True,
           log=print) -> Outcome:
    """``hold_lock=False``: for tests with no hosts at all (the apply lock lives on them)."""
    t, ledger = node_target(inventory, state_dir, name)
    with _lock(t, hold_lock, _gone(t, host_unreachable), log):
        return _remove(t, ledger, timeout=timeout, skip_cluster=skip_cluster, host_unreachable=host_unreachable,
                       allow_even=allow_even, accept_new_host_keys=accept_new_host_keys, api_factory=api_factory,
                       refresh_others=refresh_others, log=log)


def _lock(t: Target, hold: bool, skip: frozenset[str], log) -> ContextManager:
    return cluster_lock(t.inv, skip=skip, log=log) if hold else contextlib.nullcontext()


def _gone(t: Target, host_unreachable: bool) -> frozenset[str]:
    """The hosts whose lock cannot be taken: the target itself when it is gone."""
    return frozenset({t.host.name}) if host_unreachable else frozenset()


def _remove(t: Target, ledger: Ledger, *, timeout: float, skip_cluster: bool, host_unreachable: bool,
            allow_even: bool, accept_new_host_keys: bool, api_factory: ApiFactory | None, refresh_others: bool,
            log) -> Outcome:
    name = t.host.name
    out = Outcome(name)
    if t.host.role == "control":
        etcd_members.remove(t.inv, name, state_dir=t.state.root, allow_even=allow_even,
                            host_unreachable=host_unreachable, log=log)
        out.done.append("removed from etcd")
        if not host_unreachable:
            out.done += _wipe(t, log, accept_new_host_keys)
        out.entry = ledger.mark_removed(t.host, "installer node remove")
        ledger.save(t.state)
        return out
    skip = frozenset({"cluster-bootstrap"}) if skip_cluster else frozenset()
    if not skip_cluster:
        material = _material(with_host(t.inv, t.host), t.state)
        with cluster_api(t.inv, material, api_factory) as api:
            if node_api.cordon(api, name):
                log(f"{name}: cordoned")
                try:
                    res = node_api.drain(api, name, timeout, log=log)
                    left = f"; left to the node: {', '.join(res.skipped)}" if res.skipped else ""
                    out.done.append(f"drained ({len(res.evicted)} pod(s) evicted{left})")
                except node_api.DrainError as e:
                    if not host_unreachable:
                        raise NodeOpError(f"{e}; the node stays cordoned and nothing else was done (retry with "
                                          "a longer --timeout, or fix the blocking PodDisruptionBudget)") from None
                    # a dead kubelet never confirms: deleting the Node lets the pod GC clean up
                    out.warnings.append(str(e))
                if node_api.delete_node(api, name):
                    out.done.append(f"deleted Node {name}")
                    log(f"{name}: deleted Node")
            _cluster_cleanup(api, t, material, out, log)
    if not host_unreachable:
        out.done += _wipe(t, log, accept_new_host_keys)
    out.entry = ledger.mark_removed(t.host, "installer node remove")
    ledger.save(t.state)
    if refresh_others:
        _refresh_others(t, skip, log, out, accept_new_host_keys)
    return out


# --- revoke -----------------------------------------------------------------------------------

def _wait_enforced(inv: Inventory, material: Material, name: str, timeout: float) -> dict[str, float]:
    """Every control host's own apiserver refuses ``system:node:<name>`` (node_api)."""
    with contextlib.ExitStack() as stack:
        clients = {}
        for h in inv.controls:
            url = stack.enter_context(kube.api_access(inv, lambda x: Remote(x, inv), material, apiserver=h))
            clients[h.name] = stack.enter_context(kube.api_client(url, material, credential="admin"))
        return node_api.wait_refused_everywhere(clients, [name], timeout)


def revoke(inventory, name: str, state_dir=None, *, host_unreachable: bool = False,
           accept_new_host_keys: bool = False, api_factory: ApiFactory | None = None,
           refresh_others: bool = True, refresh_skip: frozenset[str] = frozenset(),
           policy_timeout: float = 60.0, hold_lock: bool = True, log=print) -> Outcome:
    """Shut ``system:node:<name>`` out for good: deny its writes, delete its way to renew or
    re-bootstrap, delete its Node, record it, wipe the host (when reachable)."""
    t, ledger = node_target(inventory, state_dir, name)
    if t.host.role == "control":
        raise NodeOpError(f"{name} is a control host: it has no node identity to revoke; use `installer node "
                          "remove` and, if its keys may be stolen, `installer ca rotate`")
    with _lock(t, hold_lock, frozenset(), log):
        return _revoke(t, ledger, host_unreachable=host_unreachable, accept_new_host_keys=accept_new_host_keys,
                       api_factory=api_factory, refresh_others=refresh_others, refresh_skip=refresh_skip,
                       policy_timeout=policy_timeout, log=log)


def _revoke(t: Target, ledger: Ledger, *, host_unreachable: bool, accept_new_host_keys: bool,
            api_factory: ApiFactory | None, refresh_others: bool, refresh_skip: frozenset[str],
            policy_timeout: float, log) -> Outcome:
    name = t.host.name
    out = Outcome(name)
    material = _material(with_host(t.inv, t.host), t.state)
    revoked = sorted(set(ledger.revoked_names()) | {name})
    with cluster_api(t.inv, material, api_factory) as api:
        # first the policy: from here on the identity cannot re-create its Node or anything else
        for kind, obj, action in node_api.apply_revocations(api, revoked, t.inv.spec.kubernetes.version):
            out.done.append(f"{action} {kind} {obj} (denies {', '.join('system:node:' + r for r in revoked)})")
        if api_factory is None:
            # each apiserver loads the policy on its own: see every one refuse before going on
            for host, seconds in _wait_enforced(t.inv, material, name, policy_timeout).items():
                out.done.append(f"the apiserver on {host} refuses system:node:{name} ({seconds:.2f} s after the policy)")
        serials = _cluster_cleanup(api, t, material, out, log)
        if node_api.delete_node(api, name):
            out.done.append(f"deleted Node {name}")
        # its pods, at once: while one is bound to it the Node authorizer lets the identity read
        # what the pod uses (seen on the real lab: the pod garbage collector comes 40 s+ later)
        pods, seconds = node_api.delete_pods_and_their_reads(api, name, policy_timeout)
        if pods:
            out.done.append(f"deleted its {len(pods)} pod(s) ({', '.join(pods)}); system:node:{name} may read none "
                            f"of their Secrets and ConfigMaps ({seconds:.2f} s)")
    out.entry = ledger.mark_revoked(t.host, serials, "installer node revoke")
    ledger.save(t.state)
    log(f"{name}: recorded as revoked in {Ledger.path(t.state)}"
        + (f" (certificate serials {', '.join(serials)})" if serials else ""))
    if not host_unreachable:
        try:
            out.done += _wipe(t, log, accept_new_host_keys)
        except HostError as e:
            out.warnings.append(f"the host was not wiped ({e}); the revocation stands. Wipe or re-image it before "
                                "it is used again")
    if refresh_others:
        _refresh_others(t, refresh_skip, log, out, accept_new_host_keys)
    return out
