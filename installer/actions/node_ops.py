"""Node day-2 operations: list, add, drain; remove and revoke are in ``node_retire.py``.

They work over three narrow parts: the Kubernetes API (``node_api``), the host
(``teardown.wipe_host`` over SSH) and the apply machinery (``runner``) for the other hosts'
routes. Control hosts are not Nodes: adding or removing one is an etcd
membership change (``etcd_members``), one member at a time.

What ``add`` and ``remove`` may change on the other hosts is checked once the facts are read,
before the lock and any change (``runner.run``'s ``check``): only the pod routes
(``hiddenplane-routes.service``, and the list its repair puts back after a link flap,
``hiddenplane-routes-repair.service``). Anything else pending means the inventory holds other edits,
and the command refuses before touching anything: run ``installer apply`` for those.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

from installer.actions import etcd_members
from installer.core import components
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError
from installer.core.etcd_rules import Change
from installer.core.inventory import HostSpec, Inventory
from installer.core.ledger import Ledger, NodeRetiredError, check_inventory, revoked_message
from installer.core.network import REPAIR_SERVICE, ROUTES_UNIT
from installer.core.pki.material import Material, ensure
from installer.core.render.balancer import BALANCER_CONFIG
from installer.core.state import StateDir
from installer.engine import runner
from installer.engine.context import Options
from installer.engine.parts import planned_changes
from installer.engine.run import Run, open_run
from installer.host import apireach, kube, node_api

ApiFactory = Callable[[], ContextManager[kube.ApiClient]]
ROUTES_PATH = f"/etc/systemd/system/{ROUTES_UNIT}"
REPAIR_PATH = f"/etc/systemd/system/{REPAIR_SERVICE}"      # the same routes: restarts nothing
BALANCER_UNIT = components.unit("api-balancer")


class NodeOpError(InstallerError):
    """A node operation was refused or failed (the message says which node and why)."""


@dataclass
class Target:
    cluster: Cluster | Run    # the inventory as given and its state (a command's Run: remove, revoke)
    host: HostSpec
    in_inventory: bool

    @property
    def inv(self) -> Inventory:
        return self.cluster.inv

    @property
    def state(self) -> StateDir:
        return self.cluster.state


def node_target(cluster: Cluster | Run, name: str) -> tuple[Target, Ledger]:
    inv, state = cluster.inv, cluster.state
    ledger = Ledger.load(state)
    host = ledger.host(name, inv)
    if host is None:
        raise NodeOpError(f"no host named {name} in the inventory or in the node ledger ({Ledger.path(state)})")
    return Target(cluster, host, any(h.name == name for h in inv.spec.hosts)), ledger


def _with_hosts(inv: Inventory, hosts: list[HostSpec]) -> Inventory:
    # the models are frozen: copy with the one field replaced
    return inv.model_copy(update={"spec": inv.spec.model_copy(update={"hosts": hosts})})


def without(inv: Inventory, name: str) -> Inventory:
    return _with_hosts(inv, [h for h in inv.spec.hosts if h.name != name])


def with_host(inv: Inventory, host: HostSpec) -> Inventory:
    if any(h.name == host.name for h in inv.spec.hosts):
        return inv
    return _with_hosts(inv, [*inv.spec.hosts, host])


def material_for(inv: Inventory, state: StateDir) -> Material:
    """The state's material for ``inv``, completed in memory (nothing written)."""
    return ensure(inv, state.load(inv))[0]


@contextlib.contextmanager
def cluster_api(target: Cluster | Run, material: Material,
                factory: ApiFactory | None = None) -> Iterator[kube.ApiClient]:
    """The admin client, directly or through an SSH tunnel via a control host (a connection of
    the command's run)."""
    if factory is not None:
        with factory() as api:
            yield api
        return
    with open_run(target) as run:
        # the run's connections to the control hosts (a tunnel's, when one is needed, stays open)
        controls = run.session.connect(run.inv.controls)
        with apireach.api_access(run.inv, controls, material) as url, \
                kube.api_client(url, material, credential="admin") as api:
            yield api


# --- what a run may change elsewhere ----------------------------------------------------------

def foreign_changes(report: runner.Report, allowed_host: str | None) -> list[str]:
    """Planned changes beyond ``allowed_host``, the other hosts' pod routes and the workers' API
    balancers (a control host added or removed is a server more or less on every worker)."""
    out = []
    for ev in report.changed:
        if ev.host == allowed_host or ev.host.startswith("("):     # (local) state, (api) objects
            continue
        for line in ev.detail:
            if (line.startswith(("~ " + ROUTES_PATH + " ", "~ " + REPAIR_PATH + " ", "~ " + BALANCER_CONFIG + " "))
                    or line in (f"* restart {ROUTES_UNIT}", f"* reload {BALANCER_UNIT}")):
                continue
            out.append(f"{ev.host}: {line}")
    return out


def converge(cluster: Cluster | Run, name: str | None, skip: frozenset[str], log, what: str,
              accept_new_host_keys: bool = False, wait_timeout: float = 180.0,
              dry_run: bool = False, returning: frozenset[str] = frozenset()) -> runner.Report | None:
    """Apply ``cluster`` (``dry_run``: plan it), refusing (before the lock and any change) when the
    facts show it would change more than ``name`` and the routes. None when nothing changed."""
    def only_name_and_routes(ctx) -> None:
        extra = foreign_changes(runner.Report(events=planned_changes(ctx)), name)
        if extra:
            raise NodeOpError(f"{what}: the inventory has other pending changes; run `installer apply` for them "
                              "first (nothing was changed):\n" + "\n".join(f"  {x}" for x in extra))

    opts = Options(skip=skip, accept_new_host_keys=accept_new_host_keys, wait_timeout=wait_timeout, dry_run=dry_run,
                   returning=returning)
    report = runner.run(cluster, opts, log=log, check=only_name_and_routes)
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


def list_nodes(cluster: Cluster, *, use_api: bool = False, api_factory: ApiFactory | None = None) -> list[NodeRow]:
    inv, state = cluster.inv, cluster.state
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
        with cluster_api(cluster, cluster.material, api_factory) as api:
            ready = {n: "Ready" if ok else "NotReady" for n, ok in kube.node_readiness(api).items()}
        for r in rows.values():
            r.registered = ready.pop(r.name, "absent") if r.role == "worker" else "never (control)"
        for n, status in ready.items():            # registered, but unknown to us
            rows[n] = NodeRow(n, "?", "?", "unknown", "", False, status)
    return sorted(rows.values(), key=lambda r: (r.role != "control", r.name))


# --- add --------------------------------------------------------------------------------------

def add(cluster: Cluster, name: str, *, skip: frozenset[str] = frozenset(), allow_even: bool = False,
        accept_new_host_keys: bool = False, wait_timeout: float = 180.0, log=print,
        dry_run: bool = False) -> runner.Report | Change | None:
    """Join the inventory's host ``name``: only its certificates and token are issued, only it
    is changed (plus the routes on the other hosts). A worker: the apply's report (None when
    nothing changed); a control host: its etcd membership change. ``dry_run``: the same
    checks and plan, nothing changed."""
    inv, state = cluster.inv, cluster.state
    host = next((h for h in inv.spec.hosts if h.name == name), None)
    if host is None:
        raise NodeOpError(f"{name} is not in the inventory: add it under spec.hosts first")
    ledger = Ledger.load(state)
    e = ledger.entries.get(name)
    if e is not None and e.state == "revoked":
        raise NodeRetiredError(revoked_message(e))
    if host.role == "control":
        change = etcd_members.add(cluster, name, allow_even=allow_even, wait_timeout=wait_timeout,
                                  log=log, dry_run=dry_run)
        if dry_run:
            return change
        ledger = Ledger.load(state)
        ledger.reactivate(host)
        ledger.save(state)
        return change
    others = without(inv, name)
    check_inventory(others, ledger)        # other retired hosts: say so before anything else
    if e is not None and e.state == "removed" and not dry_run:
        log(f"{name}: was removed on {e.since}; adding it back")
        ledger.reactivate(host)
        ledger.save(state)
    return converge(cluster, name, skip, log, f"node add {name}", accept_new_host_keys, wait_timeout, dry_run,
                    returning=frozenset({name}) if dry_run else frozenset())


# --- drain ------------------------------------------------------------------------------------

def drain(cluster: Cluster, name: str, *, timeout: float = 300.0, api_factory: ApiFactory | None = None,
          log=print, dry_run: bool = False) -> node_api.DrainResult:
    """Cordon and drain ``name``; ``dry_run``: what it would evict and leave, nothing changed."""
    t, _ = node_target(cluster, name)
    if t.host.role == "control":
        raise NodeOpError(f"{name} is a control host: it is not a Node and runs no pods")
    with cluster_api(t.cluster, cluster.material, api_factory) as api:
        if dry_run:
            if not kube.node_exists(api, name):
                raise NodeOpError(f"there is no Node {name} in the cluster")
            return node_api.drain_plan(api, name)
        if not node_api.cordon(api, name):
            raise NodeOpError(f"there is no Node {name} in the cluster")
        log(f"{name}: cordoned")
        return node_api.drain(api, name, timeout, log=log)
