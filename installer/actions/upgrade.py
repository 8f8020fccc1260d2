"""``installer upgrade``: a running cluster rolled to the inventory's versions, one host at a time.

The order (core/upgrade_rules.py): the checks (the version-skew rules, every Node Ready, etcd
healthy); an etcd snapshot, kept in ``<state>/backups/upgrade-<time>/``; etcd one member at a
time when its version changes; each control host alone; then the workers, ``max_unavailable``
at a time: cordon, drain (PodDisruptionBudgets respected, with a timeout), the new kubelet and
kube-proxy (containerd too when its pin changes), wait until each Node is Ready at the target
version, uncordon. Last, the whole cluster is converged at the new versions (add-ons) and they
are recorded in the state, which ends apply's refusal.

Each host's turn is an `installer apply` limited to that host (engine/runner.py, Options.hosts):
an upgrade changes on a host exactly what apply would, in apply's order and with its waits (on
a control host the apiserver restarts first and answers /readyz before the controller-manager
and scheduler are waited for).

Re-running continues: the hosts are asked which versions they run, and one already at the
target is not touched. A worker this command cordons is written to ``<state>/upgrade.yaml``
before the cordon and taken off after the uncordon, so an interrupted run never leaves one
cordoned unnoticed: the next run (and its ``--plan``) names it and uncordons it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import yaml

from installer.actions.node_ops import ApiFactory, cluster_api, material_for
from installer.core import upgrade_rules, versions
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError
from installer.core.inventory import Inventory
from installer.core.pki.material import Material
from installer.core.safefs import write_atomic
from installer.core.state import StateDir
from installer.core.upgrade_rules import (
    HostState,
    SkewError,
    check_etcd,
    check_kubernetes,
    current_version,
    leases_waiting,
    upgrade_order,
    with_versions,
)
from installer.engine import runner
from installer.engine.context import Event, Options
from installer.engine.run import Run, open_run
from installer.engine.steps import Step, plan, run_steps
from installer.host import node_api, probes
from installer.host.parallel import each

CONTROL_ONLY = frozenset({"cluster-bootstrap", "addons"})


class UpgradeError(InstallerError):
    exit_code = 3


class UpgradeRefused(InstallerError):
    """What the skew rules or the cluster's health forbid; nothing was changed."""
    exit_code = 4


@dataclass
class Survey:
    """What the hosts and the API say before an upgrade (read-only)."""
    hosts: list[HostState]
    nodes: dict[str, node_api.NodeState] = field(default_factory=dict)
    etcd: dict[str, bool] = field(default_factory=dict)         # endpoint -> healthy
    leaders: dict[str, str | None] = field(default_factory=dict)  # leader Lease -> holder, before any restart


def survey(run: Run, material, api_factory: ApiFactory | None = None, use_api: bool = True) -> Survey:
    inv = run.inv
    remotes = run.session.connect(inv.spec.hosts)
    def ask(name: str) -> HostState:
        h, r = inv.host(name), remotes[name]
        if h.role == "control":
            return HostState(name, h.role, probes.ask(r, probes.binary_version("kube-apiserver")),
                             probes.ask(r, probes.binary_version("etcd")))
        return HostState(name, h.role, probes.ask(r, probes.binary_version("kubelet")))
    found = each(ask, list(remotes))
    lost = [str(e) for e in found.values() if isinstance(e, Exception)]
    if lost:
        raise UpgradeRefused("cannot reach every host (an upgrade needs them all): " + "; ".join(lost)
                             + "; nothing was changed")
    more, etcd = run.plane.survey(run, remotes)         # a tenant's control plane: one more state
    found = {**{h.name: h for h in more}, **found}
    hosts, nodes, leaders = list(found.values()), {}, {}
    if use_api:
        with cluster_api(run, material, api_factory) as api:
            nodes, leaders = node_api.node_states(api), node_api.lease_holders(api)
        # a worker counts at the version its running kubelet reports: a run killed after the new
        # binary was written but before the restart leaves the file newer than the process
        hosts = [replace(h, kubernetes=nodes[h.name].kubelet) if h.role == "worker" and h.name in nodes else h
                 for h in hosts]
    return Survey(hosts, nodes, etcd, leaders)


# --- what an interrupted run left: the workers it cordoned ----------------------------------

def _marks_path(state: StateDir) -> Path:
    return state.root / "upgrade.yaml"


def cordoned_by_upgrade(state: StateDir) -> list[str]:
    try:
        doc = yaml.safe_load(_marks_path(state).read_text()) or {}
    except FileNotFoundError:
        return []
    return sorted(doc.get("cordoned", []))


def _mark(state: StateDir, names: list[str]) -> None:
    path = _marks_path(state)
    if names:
        write_atomic(path, yaml.safe_dump({"cordoned": sorted(names)}).encode(), 0o600)
    else:
        path.unlink(missing_ok=True)


# --- the run -------------------------------------------------------------------------------

@dataclass
class Upgrade:
    """What the steps of one upgrade pass each other."""
    inv: Inventory                                   # the target
    state: StateDir
    current: str
    target: str
    kind: str
    max_unavailable: int = 1
    drain_timeout: float = 300.0
    wait_timeout: float = 600.0
    use_api: bool = True
    api_factory: ApiFactory | None = None
    log: Callable[[str], None] = print
    run: Run | None = None                           # the command's (engine/run.py)
    snapshot: str | None = None
    timings: list[tuple[str, float]] = field(default_factory=list)
    # where a worker's turn spends its time: (host(s) and part, seconds)
    parts: list[tuple[str, float]] = field(default_factory=list)
    # the phases a control host's turn leaves out (the plane's turn reads it)
    control_only: frozenset[str] = CONTROL_ONLY
    _material: Material | None = None

    @property
    def material(self) -> Material:
        """The state's material for the target, derived once for the whole upgrade."""
        if self._material is None:
            self._material = material_for(self.inv, self.state)
        return self._material

    @contextlib.contextmanager
    def timed(self, what: str):
        started = time.monotonic()
        yield
        self.parts.append((what, round(time.monotonic() - started, 1)))

    def converge(self, inv: Inventory, hosts: frozenset[str], only: frozenset[str] = frozenset(),
                 skip: frozenset[str] = frozenset()) -> None:
        def event(ev: Event) -> None:
            if ev.action not in ("checked", "unchanged"):
                self.log(f"  {ev.phase} {ev.host}: {ev.action}"
                         + (f" (restarted {', '.join(ev.restarts)})" if ev.restarts else ""))
        skip = skip | (frozenset() if self.use_api else CONTROL_ONLY)
        runner.run(self.run.derived(inv), Options(hosts=hosts, only=only, skip=skip, upgrade=True,
                                                  wait_timeout=self.wait_timeout), log=self.log, on_event=event)

    @contextlib.contextmanager
    def api(self):
        with cluster_api(self.run, self.material, self.api_factory) as api:
            yield api


def _snapshot(up: Upgrade) -> None:
    dest = up.state.root / "backups" / f"upgrade-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}" / "etcd.db"
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = up.run.plane.snapshot_save(up.run, dest)
    up.snapshot = info.path
    up.log(f"  etcd snapshot: {info.path} ({info.size} bytes, revision {info.revision})")


def _wait_ready_at(up: Upgrade, api, names: list[str]) -> None:
    deadline = time.monotonic() + up.wait_timeout
    while True:
        states = node_api.node_states(api)
        waiting = {n: states.get(n) for n in names
                   if n not in states or not states[n].ready or states[n].kubelet != up.target}
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise UpgradeError("; ".join(
                f"{n}: {'not registered' if s is None else ('Ready' if s.ready else 'NotReady') + ' at ' + s.kubelet}"
                for n, s in waiting.items()) + f" after {up.wait_timeout:g} s (still cordoned: see "
                f"{_marks_path(up.state)}; `installer upgrade` again finishes)")
        time.sleep(2)


def _controllers_lead(before: dict[str, str | None]) -> Callable[[Upgrade], None]:
    """Until a restarted controller-manager and scheduler hold their leader Leases. A restarted
    one waits for its predecessor's Lease to run out (15 s by default): a worker drained meanwhile
    would leave its evicted pods' addresses in the Services' endpoints (no endpoint controller to
    take them out) and its pending pods unscheduled."""
    def run(up: Upgrade) -> None:
        deadline = time.monotonic() + up.wait_timeout
        with up.api() as api:
            while True:
                now = node_api.lease_holders(api)
                pods = up.run.plane.leader_pods(up.run)
                waiting = leases_waiting(now, before, pods)
                if not waiting:
                    up.log("  " + "; ".join(f"{n}: led by {h}" for n, h in now.items()))
                    return
                if time.monotonic() > deadline:
                    raise UpgradeError(f"{', '.join(waiting)}: no restarted instance holds the leader Lease after "
                                       f"{up.wait_timeout:g} s (kube-system Leases); no worker was touched")
                time.sleep(1)
    return run


def _worker_batch(names: list[str]) -> Callable[[Upgrade], None]:
    label = ", ".join(names)

    def run(up: Upgrade) -> None:
        if up.use_api:
            _mark(up.state, sorted(set(cordoned_by_upgrade(up.state)) | set(names)))    # before the cordon
            with up.timed(f"{label}: cordon and drain"), up.api() as api:
                for n in names:
                    node_api.cordon(api, n)
                    result = node_api.drain(api, n, up.drain_timeout, log=up.log)
                    up.log(f"  {n}: drained, {len(result.evicted)} pod(s) evicted")
        with up.timed(f"{label}: new binaries and restarts (apply)"):
            up.converge(up.inv, frozenset(names))
        if up.use_api:
            with up.timed(f"{label}: Ready at the new version, uncordon"), up.api() as api:
                _wait_ready_at(up, api, names)
                for n in names:
                    node_api.uncordon(api, n)
            _mark(up.state, [n for n in cordoned_by_upgrade(up.state) if n not in names])
    return run


def _uncordon_left(names: list[str]) -> Callable[[Upgrade], None]:
    def run(up: Upgrade) -> None:
        with up.api() as api:
            for n in names:
                node_api.uncordon(api, n)
        _mark(up.state, [n for n in cordoned_by_upgrade(up.state) if n not in names])
    return run


def _finish(up: Upgrade) -> None:
    up.converge(up.inv, frozenset())
    up.state.record_versions(runner.cluster_versions(up.inv))


def upgrade_steps(up: Upgrade, found: Survey, current_etcd: str | None) -> list[Step[Upgrade]]:
    target_etcd = up.inv.spec.artifacts.versions.etcd
    order = upgrade_order(found.hosts, up.target, target_etcd, up.max_unavailable)
    role = {h.name: h.role for h in found.hosts}
    # the first turns are etcd's, one per member whose version differs (upgrade_order); a
    # control host whose Kubernetes differs too comes again after them for its own turn
    etcd_n = sum(1 for h in found.hosts if h.role == "control" and h.etcd is not None and h.etcd != target_etcd)
    steps: list[Step[Upgrade]] = []
    left = [n for n in cordoned_by_upgrade(up.state) if not any(n in b for b in order)]
    if left:
        steps.append(Step(f"uncordon {', '.join(left)} (left cordoned by an interrupted upgrade, already at "
                          f"{up.target})", _uncordon_left(left)))
    last = Step(f"converge every host at {up.target} (add-ons; nothing else should change); record the versions",
                _finish)
    if not order:
        return steps + [last]
    steps.append(Step("save an etcd snapshot into <state>/backups/upgrade-<time>/etcd.db (kept: `installer etcd "
                      "snapshot restore` takes the cluster back to it)", _snapshot))
    etcd_inv = with_versions(up.inv, kubernetes=up.current)
    running = {h.name: h.kubernetes for h in found.hosts}
    restarts_controllers = any(role[b[0]] == "control" for b in order[etcd_n:])
    first_worker = next((i for i, b in enumerate(order) if role[b[0]] == "worker"), None)
    for i, batch in enumerate(order):
        names = ", ".join(batch)
        was = ", ".join(sorted({running[n] or "none" for n in batch}))
        if i == first_worker and restarts_controllers and up.use_api:
            steps.append(Step("wait until a restarted kube-controller-manager and kube-scheduler lead (their "
                              "kube-system Leases) before any worker is drained", _controllers_lead(found.leaders)))
        if role[batch[0]] == "control":
            steps.append(up.run.plane.upgrade_turn(up, batch, i < etcd_n, etcd_inv, current_etcd, was))
        else:
            what = (f"cordon, drain (PodDisruptionBudgets respected, {up.drain_timeout:g} s at most), "
                    if up.use_api else "")
            after = ", wait until Ready at the new version, uncordon" if up.use_api else ""
            steps.append(Step(f"{names}: {what}kubelet and kube-proxy {was} -> {up.target} (containerd too "
                              f"when its pin changes; apply on {names}){after}", _worker_batch(batch)))
    return steps + [last]


@dataclass
class UpgradeReport:
    current: str
    target: str
    kind: str
    dry_run: bool
    checks: list[str]
    steps: list[str]
    snapshot: str | None = None
    timings: list[tuple[str, float]] = field(default_factory=list)
    parts: list[tuple[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"dryRun": self.dry_run, "from": self.current, "to": self.target, "kind": self.kind,
                "checks": self.checks, "steps": self.steps, "snapshot": self.snapshot,
                "timings": [{"step": s, "seconds": t} for s, t in self.timings],
                "parts": [{"part": p, "seconds": t} for p, t in self.parts], "seconds": round(self.seconds, 1)}


def _checks(inv: Inventory, found: Survey, force: bool, use_api: bool) -> list[str]:
    """The health checks, as words; UpgradeRefused (unless ``force``) when one fails."""
    problems, said = [], []
    unhealthy = [e for e, ok in found.etcd.items() if not ok]
    if not found.etcd or unhealthy:
        problems.append("etcd is not healthy: " + (", ".join(unhealthy) or "no endpoint answered"))
    said.append(f"etcd: {len(found.etcd) - len(unhealthy)}/{len(inv.controls) or len(found.etcd)} members healthy")
    if use_api:
        not_ready = [f"{w.name}: {'NotReady' if w.name in found.nodes else 'not registered'}"
                     for w in inv.workers if not (found.nodes.get(w.name) and found.nodes[w.name].ready)]
        problems += not_ready
        said.append(f"Nodes: {len(inv.workers) - len(not_ready)}/{len(inv.workers)} Ready")
    if problems and not force:
        raise UpgradeRefused("not upgrading: " + "; ".join(problems)
                             + " (--force upgrades anyway); nothing was changed")
    return said + [f"ignored (--force): {p}" for p in problems]


def upgrade(cluster: Cluster, *, to: str | None = None, plan_only: bool = False,
            max_unavailable: int = 1, drain_timeout: float = 300.0, wait_timeout: float = 600.0,
            force: bool = False, use_api: bool = True, api_factory: ApiFactory | None = None,
            log: Callable[[str], None] = print) -> UpgradeReport:
    """Roll the cluster to ``to`` (default: the inventory's spec.kubernetes.version) and the
    inventory's etcd version. ``plan_only``: the checks and the steps, nothing changed."""
    started = time.monotonic()
    inv, state = cluster.inv, cluster.state
    if to:
        parsed = versions.parse(to)
        if parsed is None or not versions.is_supported(parsed):
            raise InstallerError(f"--to: {to!r} is not a supported version (vMAJOR.MINOR.PATCH, "
                                 f"{versions.supported_range_text()})")
        inv = with_versions(inv, kubernetes=to)
    target = inv.spec.kubernetes.version
    if not state.root.is_dir():
        raise UpgradeRefused(f"no state at {state.root}: nothing to upgrade (run `installer apply` first)")
    with open_run(cluster, log=log) as run:
        run = run.derived(inv)          # the target versions
        material = material_for(inv, state)
        found = survey(run, material, api_factory, use_api)
        current = current_version(found.hosts)
        if current is None:
            raise UpgradeRefused("no control host runs Kubernetes binaries yet: run `installer apply` first")
        current_etcd = upgrade_rules.current_etcd(found.hosts)
        try:
            kind = check_kubernetes(current, target)
            if current_etcd:
                check_etcd(current_etcd, inv.spec.artifacts.versions.etcd)
        except SkewError as e:
            raise UpgradeRefused(f"{e}; nothing was changed") from None
        checks = [f"versions: Kubernetes {current} -> {target} ({kind}); etcd {current_etcd} -> "
                  f"{inv.spec.artifacts.versions.etcd}"] + _checks(inv, found, force, use_api)
        up = Upgrade(inv, state, current, target, kind, max_unavailable, drain_timeout, wait_timeout, use_api,
                     api_factory, log, run, _material=material)
        steps = upgrade_steps(up, found, current_etcd)
        report = UpgradeReport(current, target, kind, plan_only, checks, plan(steps))
        if plan_only:
            return report
        with run.hold():
            report.steps = run_steps("upgrade", steps, up, log, up.timings)
        report.snapshot, report.timings, report.parts = up.snapshot, up.timings, up.parts
        report.seconds = time.monotonic() - started
        return report
