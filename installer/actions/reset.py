"""``installer reset``: run the host teardown (installer/actions/teardown.py) on a whole cluster.

Holds the orchestration only, no script: every host's plan from the local state
(``cluster_plans``), the connection to every chosen host before anything is done, the apply
lock taken on the control hosts, ``teardown.wipe_host`` on the workers and then on the control
hosts (in parallel within a role), the optional purge of the local state, and the report of
what was done (``ResetReport``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from installer.actions.teardown import Log, TeardownError, host_plan, wipe_host
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import Material, ensure
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster
from installer.core.state import StateDir
from installer.core.tenancy import NoNamespace, NotOurNamespace
from installer.engine import steps
from installer.engine.run import Run, open_run
from installer.engine.session import Session
from installer.host.applylock import UNLOCK
from installer.host.parallel import each
from installer.host.ssh import HostError, Remote


class NotConfirmed(InstallerError):
    """Nothing was done: the operator did not pass --yes."""


@dataclass
class ResetReport:
    hosts: dict[str, list[str]] = field(default_factory=dict)    # host -> what was done
    unreachable: list[str] = field(default_factory=list)         # skipped (--ignore-unreachable)
    state: Path | None = None
    purged: bool = False

    def as_dict(self) -> dict:
        return {"dryRun": False, "hosts": self.hosts, "unreachable": self.unreachable,
                "state": str(self.state) if self.state else None, "purged": self.purged}


def cluster_plans(cluster: Cluster) -> dict[str, HostPlan]:
    """Every host's plan, for its paths, users and units only: rendered from the state's
    material when it is readable (nothing is written), else from throwaway material."""
    inv, state = cluster.inv, cluster.state
    try:
        old = state.load(inv) if state.root.is_dir() else Material()
        material, _ = ensure(inv, old)
    except InstallerError:
        material, _ = ensure(inv, Material())
    return render_cluster(inv, material)


def _chosen(inv: Inventory, hosts: Iterable[str], purge: bool) -> list[HostSpec]:
    """The hosts to reset, workers first; refused before anything else when a name is unknown
    or --purge comes with --host."""
    names = list(dict.fromkeys(hosts))
    unknown = [n for n in names if n not in {h.name for h in inv.spec.hosts}]
    if unknown:
        raise TeardownError(f"no host named {', '.join(unknown)} in the inventory")
    if purge and names:
        raise TeardownError("--purge deletes the whole cluster's state: it cannot go with --host")
    chosen = [h for h in inv.spec.hosts if not names or h.name in names]
    return [h for h in chosen if h.role == "worker"] + [h for h in chosen if h.role == "control"]


def plan(cluster: Cluster, *, keep_data: bool = False, purge: bool = False,
         hosts: Iterable[str] = ()) -> dict:
    """What ``reset`` would do, touching no host: its steps, each chosen host's teardown in the
    order they run (workers first), and what becomes of the local state."""
    inv, state = cluster.inv, cluster.state
    chosen = _chosen(inv, hosts, purge)
    with open_run(cluster) as run:             # its plane's words; nothing is reached
        words = steps.plan(_steps(_Reset(inv, chosen, {}, state, not keep_data, purge, run=run,
                                         limited=bool(list(hosts)))))
    return _plan(inv, chosen, cluster_plans(cluster), state, not keep_data, purge, words)


def _plan(inv: Inventory, chosen: list[HostSpec], plans: dict[str, HostPlan], state, data: bool,
          purge: bool, words: list[str]) -> dict:
    return {"steps": words, "hosts": {h.name: host_plan(inv, h, plans, data=data) for h in chosen},
            "state": str(state.root), "purge": purge}


@dataclass
class _Reset:
    """What the steps of one reset pass each other."""
    inv: Inventory
    chosen: list[HostSpec]
    plans: dict[str, HostPlan]
    state: StateDir
    data: bool
    purge: bool
    ignore_unreachable: bool = False
    log: Log = print
    report: ResetReport = field(default_factory=ResetReport)
    session: Session | None = None
    stack: ExitStack | None = None
    failed: dict[str, Exception] = field(default_factory=dict)
    limited: bool = False           # only some hosts (--host): a hosted control plane stays
    run: Run | None = None          # the command's (engine/run.py): its plane, its session

    @property
    def remotes(self) -> dict[str, Remote]:
        return self.session.remotes

    def of(self, role: str) -> list[HostSpec]:
        return [h for h in self.chosen if h.role == role and h.name not in self.failed]


def _connect(r: _Reset) -> None:
    """Every chosen host, before anything is done on any."""
    r.session = r.run.session
    r.session.connect(r.chosen)
    opened = each(lambda n: r.remotes[n].open(), [h.name for h in r.chosen])
    r.failed = {n: e for n, e in opened.items() if isinstance(e, Exception)}
    if r.failed and not r.ignore_unreachable:
        raise TeardownError("cannot reach " + "; ".join(str(e) for e in r.failed.values())
                            + ": nothing was done on any host (--ignore-unreachable resets the others)")
    r.report.unreachable = sorted(r.failed)
    for name in r.report.unreachable:
        r.log(f"{name}: unreachable, skipped")
    if r.purge and r.failed:
        raise TeardownError(f"--purge: {', '.join(r.failed)} could not be reset; the state is kept")


def _lock(r: _Reset) -> None:
    # as apply takes it: a lock its holder left dead on this machine is taken over once that
    # run's commands ended; any other held or stale lock refuses the reset. The session gives it
    # back at the end: after a wipe it went with /var/lib/hiddenplane, after a failed one it must
    # not refuse the next apply for an hour
    try:
        r.session.lock((h.name for h in r.of("control")), flag=UNLOCK, installed_only=True)
    except HostError as e:
        raise TeardownError(f"{e}: nothing was done") from None


def _wipe(role: str) -> Callable[[_Reset], None]:
    def wipe(r: _Reset) -> None:
        specs = {h.name: h for h in r.of(role)}
        results = each(lambda n: wipe_host(r.inv, specs[n], r.plans, r.remotes[n], data=r.data, log=r.log),
                       list(specs))
        errors = [e for e in results.values() if isinstance(e, Exception)]
        for name, done in results.items():
            if not isinstance(done, Exception):
                r.report.hosts[name] = done
                if not done:
                    r.log(f"{name}: nothing of hiddenplane there")
        if errors:
            later = " (control hosts not touched)" if role == "worker" and r.of("control") else ""
            raise TeardownError("; ".join(str(e) for e in errors) + later)
    return wipe


def _plane_lock(r: _Reset) -> None:
    try:
        r.run.plane.hold(r.run)
    except NoNamespace:
        return                      # nothing to lock: the namespace's step says it is gone already
    except NotOurNamespace:
        raise                       # it says that nothing was changed, and why
    except InstallerError as e:
        raise TeardownError(f"{e}: nothing was done") from None


def _plane_delete(r: _Reset) -> None:
    r.report.hosts.update(r.run.plane.delete(r.run))


def _purge(r: _Reset) -> None:
    if r.state.root.exists():
        shutil.rmtree(r.state.root)
        r.report.purged = True


def _steps(r: _Reset) -> list[steps.Step[_Reset]]:
    names = lambda role: ", ".join(h.name for h in r.chosen if h.role == role)    # noqa: E731
    out = [steps.Step(f"connect to {', '.join(h.name for h in r.chosen)} (one unreachable: nothing is done"
                      + (", unless --ignore-unreachable)" if not r.purge else ")"), _connect)]
    if names("control"):
        out.append(steps.Step(f"take the apply lock on {names('control')}", _lock))
    # what the control plane holds besides the hosts (a hosted tenant's namespace), when the
    # whole cluster goes with its data
    beyond = r.run.plane.beyond_hosts() if not r.limited and r.data else None
    if beyond:
        out.append(steps.Step(beyond[0], _plane_lock))
    for role, what in (("worker", "the workers"), ("control", "the control hosts")):
        if names(role):
            out.append(steps.Step(f"tear down {what} ({names(role)}), in parallel: the steps listed per host",
                                  _wipe(role)))
    if beyond:
        out.append(steps.Step(beyond[1], _plane_delete))
    if r.purge:
        out.append(steps.Step(f"delete the local state {r.state.root}", _purge))
    return out


def reset(cluster: Cluster, *, yes: bool = False, keep_data: bool = False, purge: bool = False,
          hosts: Iterable[str] = (), ignore_unreachable: bool = False, log: Log = print) -> ResetReport:
    """Take off every host (or only ``hosts``) what the installer put there: workers first,
    then control hosts, in parallel within a role. Without ``yes`` only the plan is logged and
    NotConfirmed raised (nothing done). ``keep_data``: etcd data, audit logs and containerd's
    images stay. ``purge`` also deletes the local state directory (never with ``hosts``).

    Every chosen host is connected to first: when one cannot be reached nothing is done on any
    (``ignore_unreachable`` resets the others and names the skipped ones). A live apply lock on
    a control host also stops the reset before anything is done."""
    inv, state = cluster.inv, cluster.state
    chosen = _chosen(inv, hosts, purge)
    r = _Reset(inv, chosen, cluster_plans(cluster), state, not keep_data, purge, ignore_unreachable, log,
               ResetReport(state=state.root), limited=bool(list(hosts)))
    # the module's Remote: tests fake it
    with ExitStack() as stack, open_run(cluster, log=log, remote=Remote) as r.run:
        todo = _steps(r)
        if not yes:
            would = _plan(inv, chosen, r.plans, state, r.data, purge, steps.plan(todo))
            for line in would["steps"]:
                log(f"- {line}")
            for name, lines in would["hosts"].items():
                log(f"{name} ({inv.host(name).role}):")
                for line in lines:
                    log(f"  - {line}")
            log(f"local state {state.root}: " + ("delete it (--purge)" if purge else "kept"))
            raise NotConfirmed("nothing done; pass --yes to reset these hosts")
        r.stack = stack
        steps.run_steps("reset", todo, r, log)
    return r.report
