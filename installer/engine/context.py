"""What one run shares, for apply's phases and day-2 commands alike: its options, the events it
reports, and the Context (inventory, state, material, connections, facts, plans, the control
plane) with the push of a change (``execute``) that keeps the facts current."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from installer.core.artifacts import ARTIFACTS_ARCH
from installer.core.diff import HostChanges, Selection, diff
from installer.core.etcd_rules import Guard
from installer.core.facts import DirFact, FileFact, HostFacts
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import Changes, Material
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster
from installer.core.render.worker import HostFacts as RenderFacts
from installer.core.state import StateDir
from installer.engine.events import Event
from installer.engine.planes import ControlPlane, plane_for
from installer.engine.session import Session
from installer.host.hostops import Payloads, codec_for, script
from installer.host.ssh import Remote

R = TypeVar("R")


@dataclass
class Options:
    dry_run: bool = False
    parallel: int = 10
    accept_new_host_keys: bool = False
    only: frozenset[str] = frozenset()
    skip: frozenset[str] = frozenset()
    force_unlock: bool = False
    wait_timeout: float = 180.0
    # limit the run to these hosts (empty: every host). The control hosts are still connected
    # (the lock lives there and the API is reached through them) but not changed.
    hosts: frozenset[str] = frozenset()
    # removed hosts `node add` brings back: the ledger still says removed in its dry run
    returning: frozenset[str] = frozenset()
    # a run of `installer upgrade`: the inventory's versions may differ from the recorded ones
    upgrade: bool = False


@dataclass
class Context:
    inv: Inventory
    state: StateDir
    options: Options
    material: Material
    pki_changes: Changes
    log: Callable[[str], None] = print
    # (host, bytes sent, total) while a change's tar is uploaded; for progress lines
    on_upload: Callable[[str, int, int], None] | None = None
    facts: dict[str, HostFacts] = field(default_factory=dict)
    plans: dict[str, HostPlan] = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)          # name -> fetch.ResolvedArtifact
    # the release architecture the artifacts are for (one per run: a directory holds one arch);
    # preflight refuses a host of another architecture
    artifacts_arch: str = ARTIFACTS_ARCH
    events: list[Event] = field(default_factory=list)
    # workers this command made forget their client certificate (ca rotate): they bootstrap
    # again with a new token although their Node is registered
    rejoin: set[str] = field(default_factory=set)
    # the caller's refusal once the hosts' facts are known, before the lock and any change
    # (the connect phase asks it; `node add` refuses other pending edits)
    check: Callable[["Context"], None] | None = None
    # each distinct upload built (and compressed) once, shared by the hosts that get it
    payloads: Payloads = field(default_factory=Payloads)
    # the control plane: where its components run, how the run is locked (engine/planes/): the
    # run's (engine/run.py); made for the Context when not given
    plane: ControlPlane | None = None
    # the hosts' connections and the apply lock (engine/session.py); made for the run when not given
    session: Session | None = None
    # what phases made for later ones, by type (``produce``, ``result``); ``made``: the types the
    # running phase produced, checked against its declaration at the phase's end (the runner)
    results: dict[type, object] = field(default_factory=dict)
    made: set[type] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.session is None:
            self.session = Session(self.inv, log=self.log, accept_new_host_keys=self.options.accept_new_host_keys)
        if self.plane is None:          # a Context made outside a Run (tests, the Python API)
            self.plane = plane_for(self.inv, self.session, self.state)

    @property
    def remotes(self) -> dict[str, Remote]:
        """The run's connections, by host name (the session's)."""
        return self.session.remotes

    @remotes.setter
    def remotes(self, value: dict[str, Remote]) -> None:
        self.session.remotes = value

    @property
    def run_id(self) -> str:
        return self.session.run_id

    def produce(self, result: object) -> None:
        """Hand ``result`` to later phases: one of the outputs the running phase declares
        (``Phase.produces``, checked when it ends), never a field any phase may write."""
        self.results[type(result)] = result
        self.made.add(type(result))

    def result(self, kind: type[R]) -> R | None:
        """What an earlier phase produced of ``kind`` (None: it did not run, or made none)."""
        found = self.results.get(kind)
        return found if isinstance(found, kind) else None

    def settled(self, events: list[Event], units: tuple[str, ...]) -> bool:
        """Nothing changed and every unit was already active: no health wait needed. A unit
        still starting (e.g. restarted by a run that was killed) is waited for."""
        return all(e.action == "unchanged" for e in events) and all(
            self.facts[e.host].units.get(u, ("", ""))[0] == "active" for e in events for u in units)

    def mark_active(self, hosts: list[str], units: tuple[str, ...]) -> None:
        """A health wait succeeded: the units are running now."""
        for h in hosts:
            for u in units:
                self.facts[h].units[u] = ("active", self.facts[h].units.get(u, ("", "enabled"))[1] or "enabled")

    def hosts(self, role: str | None = None) -> list[HostSpec]:
        limit = self.options.hosts
        return [h for h in self.inv.spec.hosts if role in (None, h.role) and (not limit or h.name in limit)]

    def rerender(self) -> None:
        """Render every host's plan again with what the hosts told us (their facts, e.g. whether
        systemd-resolved runs, and the etcd membership read)."""
        self.plans = render_cluster(self.inv, self.material, render_facts(self))

    def will_run(self, phase: str) -> bool:
        o = self.options
        return (not o.only or phase in o.only) and phase not in o.skip

    def changes_for(self, host: str, sel: Selection) -> HostChanges:
        return diff(host, sel, self.facts[host])

    def execute(self, phase: str, host: str, changes: HostChanges, no_block: bool = False) -> Event:
        """Apply ``changes`` on ``host`` in one round trip (or only describe them in a dry run)."""
        start = time.monotonic()
        ev = Event(phase, host, "unchanged" if changes.empty else "changed", files=len(changes.write),
                   bytes=changes.upload_bytes, restarts=list(changes.restart), detail=changes.summary())
        if not changes.empty and not self.options.dry_run:
            upload = functools.partial(self.on_upload, host) if self.on_upload else None
            codec = codec_for(changes, self.facts[host].tools)
            self.remotes[host].run(script(changes, no_block=no_block, codec=codec),
                                   stdin=self.payloads.get(changes, codec),
                                   what=f"{phase}: apply changes", progress=upload)
            self._remember(host, changes)
        ev.seconds = time.monotonic() - start
        return ev

    def _remember(self, host: str, changes: HostChanges) -> None:
        """Keep the facts current without another probe: what we wrote is now there."""
        facts = self.facts[host]
        for f in changes.write + changes.fix:
            facts.files[f.path] = FileFact(f.sha256, f.mode, f.owner, f.group, True)
        for d in changes.dirs:
            facts.dirs[d.path] = DirFact(d.mode, d.owner, d.group)
        facts.users.update(u.name for u in changes.users)
        for u in changes.enable + changes.start + changes.restart:
            active, enabled = facts.units.get(u, ("inactive", ""))
            facts.units[u] = ("active", "enabled")
        facts.pending_restarts -= set(changes.restart) | set(changes.start)
        facts.pending_restarts |= set(changes.defer)


# --- what phases hand later ones (Context.produce / result; Phase.produces / reads) ----------------

@dataclass(frozen=True)
class EtcdMembership:
    """etcd-membership's read: the membership changes the etcd phase may make (learners to add
    and promote) and the hosts joining a running cluster (rendered with
    --initial-cluster-state=existing)."""
    guard: Guard


@dataclass(frozen=True)
class Bootstrapped:
    """cluster-bootstrap sent the RBAC and the per-node bootstrap tokens (not in a dry run): the
    workers may join, and verify-hidden may ask the API."""


def render_facts(ctx: Context) -> dict[str, RenderFacts]:
    """What rendering needs to know of each host, from its facts and the etcd membership read."""
    membership = ctx.result(EtcdMembership)
    joining = membership.guard.joining if membership else {}
    return {name: RenderFacts(systemd_resolved=f.systemd_resolved, kubelet_joined=f.kubelet_joined,
                              etcd_join=joining.get(name))
            for name, f in ctx.facts.items()}
