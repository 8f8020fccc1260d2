"""``installer reset``: run the host teardown (installer/actions/teardown.py) on a whole cluster.

Holds the orchestration only, no script: every host's plan from the local state
(``cluster_plans``), the connection to every chosen host before anything is done, the apply
lock taken on the control hosts, ``teardown.wipe_host`` on the workers and then on the control
hosts (in parallel within a role), the optional purge of the local state, and the report of
what was done (``ResetReport``).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec, Inventory
from installer.engine.parallel import each
from installer.engine.phases.acquire_lock import break_stale, drop, stale_reason, take
from installer.core.pki.material import Material, ensure
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster
from installer.host.ssh import Remote
from installer.actions.teardown import Log, TeardownError, host_plan, wipe_host
from installer.core.inventory import as_inventory
from installer.core.state import state_for


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


def cluster_plans(inv: Inventory, state_dir=None) -> dict[str, HostPlan]:
    """Every host's plan, for its paths, users and units only: rendered from the state's
    material when it is readable (nothing is written), else from throwaway material."""
    state = state_for(inv, state_dir)
    try:
        old = state.load(inv) if state.root.is_dir() else Material()
        material, _ = ensure(inv, old)
    except InstallerError:
        material, _ = ensure(inv, Material())
    return render_cluster(inv, material)


def _take_lock(remote: Remote, run_id: str) -> str | None:
    """Take the apply lock on a control host that has one to take (a stale one is taken over);
    the content of a live lock otherwise. The teardown removes the lock with the state directory."""
    held = take(remote, run_id, installed_only=True)
    if held is not None and stale_reason(held, time.time()) is not None:
        break_stale(remote)
        held = take(remote, run_id, installed_only=True)
    return held


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


def plan(inventory, *, state_dir=None, keep_data: bool = False, purge: bool = False,
         hosts: Iterable[str] = ()) -> dict:
    """What ``reset`` would do, touching no host: each chosen host's steps in the order they
    run (workers first), and what becomes of the local state."""
    inv = as_inventory(inventory)
    return _plan(inv, _chosen(inv, hosts, purge), cluster_plans(inv, state_dir), state_for(inv, state_dir),
                 not keep_data, purge)


def _plan(inv: Inventory, chosen: list[HostSpec], plans: dict[str, HostPlan], state, data: bool,
          purge: bool) -> dict:
    return {"hosts": {h.name: host_plan(inv, h, plans, data=data) for h in chosen},
            "state": str(state.root), "purge": purge}


def reset(inventory, *, state_dir=None, yes: bool = False, keep_data: bool = False, purge: bool = False,
          hosts: Iterable[str] = (), ignore_unreachable: bool = False, log: Log = print) -> ResetReport:
    """Take off every host (or only ``hosts``) what the installer put there: workers first,
    then control hosts, in parallel within a role. Without ``yes`` only the plan is logged and
    NotConfirmed raised (nothing done). ``keep_data``: etcd data, audit logs and containerd's
    images stay. ``purge`` also deletes the local state directory (never with ``hosts``).

    Every chosen host is connected to first: when one cannot be reached nothing is done on any
    (``ignore_unreachable`` resets the others and names the skipped ones). A live apply lock on
    a control host also stops the reset before anything is done."""
    inv = as_inventory(inventory)
    chosen = _chosen(inv, hosts, purge)
    state = state_for(inv, state_dir)
    plans = cluster_plans(inv, state_dir)
    data = not keep_data
    if not yes:
        for name, steps in _plan(inv, chosen, plans, state, data, purge)["hosts"].items():
            log(f"{name} ({inv.host(name).role}):")
            for line in steps:
                log(f"  - {line}")
        log(f"local state {state.root}: " + ("delete it (--purge)" if purge else "kept"))
        raise NotConfirmed("nothing done; pass --yes to reset these hosts")

    report = ResetReport(state=state.root)
    remotes = {h.name: Remote(h, inv) for h in chosen}
    try:
        opened = each(lambda n: remotes[n].open(), [h.name for h in chosen])
        failed = {n: e for n, e in opened.items() if isinstance(e, Exception)}
        if failed and not ignore_unreachable:
            raise TeardownError("cannot reach " + "; ".join(str(e) for e in failed.values())
                                + ": nothing was done on any host (--ignore-unreachable resets the others)")
        report.unreachable = sorted(failed)
        for name in report.unreachable:
            log(f"{name}: unreachable, skipped")
        if purge and failed:
            raise TeardownError(f"--purge: {', '.join(failed)} could not be reset; the state is kept")
        reachable = [h for h in chosen if h.name not in failed]
        controls = [h for h in reachable if h.role == "control"]
        run_id = f"reset-{uuid.uuid4().hex}"
        locks = each(lambda n: _take_lock(remotes[n], run_id), [h.name for h in controls])
        held = {n: v for n, v in locks.items() if v is not None}
        if held:
            for h in controls:
                drop(remotes[h.name], run_id)
            raise TeardownError("; ".join(
                f"{n}: another command holds the apply lock: {v}" if isinstance(v, str) else str(v) for n, v in held.items())
                + ": nothing was done")
        try:
            for role in ("worker", "control"):
                group = [h for h in reachable if h.role == role]
                specs = {h.name: h for h in group}
                results = each(lambda n: wipe_host(inv, specs[n], plans, remotes[n], data=data, log=log),
                                    list(specs))
                errors = [e for e in results.values() if isinstance(e, Exception)]
                for name, done in results.items():
                    if not isinstance(done, Exception):
                        report.hosts[name] = done
                        if not done:
                            log(f"{name}: nothing of hiddenplane there")
                if errors:
                    later = " (control hosts not touched)" if role == "worker" and controls else ""
                    raise TeardownError("; ".join(str(e) for e in errors) + later)
        except BaseException:
            # a successful wipe takes the lock away with /var/lib/hiddenplane; a failed one must
            # not leave it behind to refuse the next apply for an hour
            for h in controls:
                drop(remotes[h.name], run_id)
            raise
    finally:
        for r in remotes.values():
            r.close()
    if purge:
        if state.root.exists():
            shutil.rmtree(state.root)
            report.purged = True
            log(f"deleted the local state {state.root}")
    return report
