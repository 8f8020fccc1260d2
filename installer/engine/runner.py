"""Run the phases of `installer apply` (and `plan`, which is the same path stopped before any
change): hosts of a phase in parallel, a failing host stops the run after the phase with a
message naming host and phase, and the apply lock is always released."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from installer.core.cluster import Cluster
from installer.core.errors import InstallerError
from installer.core.ledger import Ledger, check_inventory
from installer.core.pki.material import ensure
from installer.core.render.plan import render_cluster
from installer.engine.context import Context, Event, Options
from installer.engine.phases import ALWAYS, PHASE_NAMES, RUN_WITH, SKIPPED_WITH, build
from installer.engine.run import Run, open_run
from installer.host.fetch import digest_record, resolve, resolve_images
from installer.host.ssh import HostError


class ApplyError(InstallerError):
    exit_code = 3


class VersionChange(InstallerError):
    """A version change on a running cluster: that is `installer upgrade`'s job."""


@dataclass
class Report:
    events: list[Event] = field(default_factory=list)
    seconds: float = 0.0
    round_trips: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def changed(self) -> list[Event]:
        return [e for e in self.events if e.action == "changed"]

    @property
    def restarts(self) -> list[str]:
        return [f"{e.host}:{u}" for e in self.events for u in e.restarts]

    def as_dict(self) -> dict:
        return {"dryRun": self.dry_run, "seconds": round(self.seconds, 3),
                "changes": len(self.changed), "restarts": self.restarts,
                "roundTrips": self.round_trips, "bytesUploaded": self.bytes_up,
                "events": [asdict(e) for e in self.events]}


def check_phase_names(names: frozenset[str], flag: str) -> None:
    unknown = sorted(names - set(PHASE_NAMES))
    if unknown:
        raise InstallerError(f"{flag}: unknown phase(s) {', '.join(unknown)}; phases: {', '.join(PHASE_NAMES)}")


def effective_options(options: Options) -> Options:
    """``options`` with the phases that depend on a skipped one skipped too (``--skip
    cluster-bootstrap``, no real API as with the stand-ins, also skips ``addons``), and those a
    chosen one needs chosen too (``--only etcd`` reads the membership first)."""
    skip = options.skip | frozenset().union(*(SKIPPED_WITH.get(p, frozenset()) for p in options.skip))
    only = options.only | frozenset().union(*(RUN_WITH.get(p, frozenset()) for p in options.only))
    return options if (skip, only) == (options.skip, options.only) else dataclasses.replace(
        options, skip=skip, only=only)


def context(run: Run | Cluster, options: Options, log: Callable[[str], None]) -> Context:
    """The context of apply's phases in ``run`` (day-2 commands pass one with a derived
    inventory, e.g. without a removed node: ``run.derived``; a Cluster, outside any command, gets
    a session and plane of its own)."""
    inv, state = run.inv, run.state
    unknown = sorted(options.hosts - {h.name for h in inv.spec.hosts})
    if unknown:
        raise InstallerError(f"no host named {', '.join(unknown)} in the inventory")
    state.ensure_root()
    check_inventory(inv, Ledger.load(state), options.returning)
    if not options.upgrade:
        check_versions(inv, state)
    material, changes = ensure(inv, state.load(inv))
    ctx = Context(inv, state, options, material, changes, log=log, plane=getattr(run, "plane", None),
                  session=getattr(run, "session", None))
    ctx.plans = render_cluster(inv, material)
    return ctx


def cluster_versions(inv) -> dict[str, str]:
    return {"kubernetes": inv.spec.kubernetes.version, "etcd": inv.spec.artifacts.versions.etcd}


def check_versions(inv, state) -> None:
    """Refuse an inventory whose versions differ from those the hosts run (as the last apply or
    upgrade recorded them): re-applying would restart every apiserver and kubelet at once."""
    recorded, wanted = state.recorded_versions(), cluster_versions(inv)
    moved = [f"{k} {recorded[k]} -> {v}" for k, v in wanted.items() if recorded.get(k) not in (None, v)]
    if moved:
        raise VersionChange(f"the inventory asks for {', '.join(moved)} on a running cluster: run `installer upgrade "
                            "INVENTORY` (it rolls one host at a time, draining each worker); apply would restart "
                            f"every apiserver and kubelet at once. The versions the hosts run: {state.versions_path}")


def _resolve_artifacts(ctx: Context) -> None:
    digests = digest_record(ctx.inv)
    ctx.artifacts = resolve(ctx.inv, log=ctx.log, arch=ctx.artifacts_arch, digests=digests)
    ctx.artifacts.update(resolve_images(ctx.inv, digests))       # image-*.tar: uploaded to workers, imported
    digests.save()


def run(target: Cluster | Run, options: Options | None = None,
        log: Callable[[str], None] = print, on_event: Callable[[Event], None] | None = None,
        check: Callable[[Context], None] | None = None,
        on_upload: Callable[[str, int, int], None] | None = None) -> Report:
    """Apply's phases on ``target``: a Cluster (a Run is opened for it) or the Run of a day-2
    command that converges hosts as part of its work. ``check``: called once the hosts' facts
    are known, before the lock and any change; it may refuse the run by raising (e.g. `node
    add` refusing other pending edits). The state directory is held for the whole run: a
    second run on it would make other keys."""
    options = options or Options()
    for names, flag in ((options.only, "--only"), (options.skip, "--skip")):
        check_phase_names(names, flag)            # before the state is created or read
    with open_run(target, log=log, accept_new_host_keys=options.accept_new_host_keys) as r, r.state.locked():
        return _run(r, effective_options(options), log, on_event, check, on_upload)


def _run(run: Run, options: Options, log: Callable[[str], None],
         on_event: Callable[[Event], None] | None, check: Callable[[Context], None] | None,
         on_upload: Callable[[str, int, int], None] | None) -> Report:
    started = time.monotonic()
    ctx = context(run, options, log)
    ctx.on_upload, ctx.check = on_upload, check
    _resolve_artifacts(ctx)
    report = Report(dry_run=options.dry_run)
    try:
        with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
            for phase in build():
                if phase.name not in ALWAYS and not ctx.will_run(phase.name):
                    continue
                ctx.made = set()
                hosts = phase.prepare(ctx)
                if not hosts:
                    _check_outputs(phase, ctx)
                    continue
                futures = {h: pool.submit(_timed, phase.run_host, ctx, h) for h in hosts}
                events, failures = [], []
                for h, fut in futures.items():
                    try:
                        ev = fut.result()
                    except HostError as e:
                        failures.append(e)
                        ev = Event(phase.name, h, "failed", detail=[str(e)])
                    if ev is not None:
                        events.append(ev)
                        if on_event:
                            on_event(ev)
                if failures:
                    raise ApplyError(f"phase {phase.name} failed on " + "; ".join(str(f) for f in failures))
                before = len(ctx.events)
                finish_started = time.monotonic()
                try:
                    phase.finish(ctx, events)
                except HostError as e:
                    raise ApplyError(f"phase {phase.name} failed on {e}") from None
                _check_outputs(phase, ctx)
                for ev in ctx.events[before:]:
                    # what the phase's finish waited for, when the event does not time itself
                    ev.seconds = ev.seconds or time.monotonic() - finish_started
                events += ctx.events[before:]
                if on_event:
                    for ev in ctx.events[before:]:
                        on_event(ev)
                report.events += [e for e in events if e not in report.events]
        if not options.dry_run and not options.upgrade and not options.hosts and ctx.will_run("artifacts"):
            ctx.state.record_versions(cluster_versions(ctx.inv))
    finally:
        if not run.session.holding:
            run.plane.release()         # first: the release's round trips are the run's too
        for name, remote in ctx.remotes.items():
            report.round_trips[name] = remote.counters.round_trips
            # file content sent to the host (the facts probe's path list is not counted)
            report.bytes_up[name] = sum(e.bytes for e in report.events if e.host == name and e.action == "changed"
                                        and not options.dry_run)
        report.seconds = time.monotonic() - started
    return report


def _check_outputs(phase, ctx: Context) -> None:
    """At a phase's end: it handed later phases only what it declares (``Phase.produces``)."""
    undeclared = sorted(t.__name__ for t in ctx.made - set(phase.produces))
    if undeclared:
        raise TypeError(f"phase {phase.name} produced {', '.join(undeclared)}, which it does not declare")


def _timed(run_host, ctx: Context, host: str) -> Event | None:
    """``run_host``'s event with the host's whole time in the phase (its push, restarts and
    waits), not only the push that ``Context.execute`` times."""
    started = time.monotonic()
    ev = run_host(ctx, host)
    if ev is not None:
        ev.seconds = max(ev.seconds, time.monotonic() - started)
    return ev


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
