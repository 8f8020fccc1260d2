"""etcd-membership: before any etcd member changes, the running cluster's membership is read
and checked against the inventory (core/etcd_rules.py): a control host without etcd data while
the others run a cluster would bootstrap a second, separate cluster; a live member whose host
left the inventory would stay a voting member nobody manages. Both stop the run before etcd is
touched, saying which `installer etcd member add|remove` to run. A host that `etcd member add`
already registered is rendered to join with ``--initial-cluster-state=existing``.
"""

from __future__ import annotations

from installer.core.components import ETCD_UNIT
from installer.core.etcd_rules import Guard, MembershipRefused, apply_guard, parse_members
from installer.engine.context import Context, EtcdMembership, Event
from installer.engine.parts import etcd_part
from installer.engine.phases.base import Phase
from installer.host.etcdctl import LOCAL, error_line, etcdctl
from installer.host.ssh import HostError


class ReadEtcdMembership(Phase):
    """The membership guard before the etcd members are touched (``--only etcd`` runs it too;
    ``--skip etcd-membership`` skips the members as well). Refuse what would split or orphan the
    running cluster; render the hosts joining it (registered by `etcd member add`) with
    --initial-cluster-state=existing. etcd is asked (in ``run_host``, by every running member at
    once; the first in inventory order that answers counts) only when the phase has work on a
    cluster that exists: a no-op apply spends no round trip."""
    name = "etcd-membership"
    description = "read the etcd membership when a member with data would change or one without joins"
    produces = (EtcdMembership,)

    def prepare(self, ctx: Context) -> list[str]:
        ctx.produce(EtcdMembership(Guard()))       # nothing to change, until read otherwise
        # the read: control host -> (member list JSON, why it failed)
        self.answers: dict[str, tuple[str, str]] = {}
        controls = ctx.inv.controls
        with_data = [h.name for h in controls if ctx.facts[h.name].etcd_data]
        fresh = [h.name for h in controls if h.name not in with_data]
        if not with_data or (not fresh and all(ctx.changes_for(h, etcd_part(ctx.plans[h])).empty
                                               for h in with_data)):
            return []                     # a new cluster (every member bootstraps it), or nothing to do
        active = [h for h in with_data if ctx.facts[h].units.get(ETCD_UNIT, ("", ""))[0] == "active"]
        if not active:
            # nobody to ask: every member with data is stopped (a reboot, a restore, a crash)
            self._unread(ctx, fresh, "etcd is not running on " + ", ".join(
                f"{h} ({ctx.facts[h].units.get(ETCD_UNIT, ('inactive', ''))[0] or 'inactive'})" for h in with_data))
        return active

    def run_host(self, ctx: Context, host: str) -> Event:
        try:
            r = ctx.remotes[host].run(f"{etcdctl(LOCAL)} member list -w json", check=False, what="etcd member list")
            self.answers[host] = (r.stdout, "") if r.rc == 0 else ("", f"{host}: {error_line(r)}")
        except HostError as e:
            self.answers[host] = ("", str(e))
        return Event(self.name, host, "checked")

    def finish(self, ctx: Context, events: list[Event]) -> None:
        controls = ctx.inv.controls
        with_data = {h.name for h in controls if ctx.facts[h.name].etcd_data}
        fresh = [h.name for h in controls if h.name not in with_data]
        asked = [h.name for h in controls if h.name in self.answers]
        answered = next((self.answers[h][0] for h in asked if not self.answers[h][1]), None)
        if answered is None:
            self._unread(ctx, fresh, "; ".join(self.answers[h][1] for h in asked))
            return
        guard = apply_guard(controls, with_data, parse_members(answered))
        if guard.problems:
            raise MembershipRefused("the etcd cluster does not match the inventory:\n"
                                    + "\n".join(f"  {p}" for p in guard.problems))
        ctx.produce(EtcdMembership(guard))
        if guard.joining:
            ctx.rerender()
        for name in sorted(guard.learners):
            ctx.log(f"{name}: an etcd learner, not promoted yet: run `installer etcd member add <inventory> {name}`")

    @staticmethod
    def _unread(ctx: Context, fresh: list[str], why: str) -> None:
        if fresh:
            with_data = [h.name for h in ctx.inv.controls if h.name not in fresh]
            raise MembershipRefused(
                f"{', '.join(fresh)}: no etcd data, while {', '.join(with_data)} hold an etcd cluster whose "
                f"members could not be read ({why}); not starting a member that could split it")
        ctx.log(f"etcd: member list unavailable ({why}); starting the members that have data")
