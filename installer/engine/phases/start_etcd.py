"""etcd: install and start a member on every control host; wait until all are healthy (mTLS).

Two guards keep a running cluster whole:

* membership: a control host without etcd data while the others run a cluster would
  bootstrap a second, separate cluster; a live member whose host left the inventory would
  stay a voting member nobody manages. Both stop the run before etcd is touched, saying
  which `installer etcd member add|remove` to run. A host that `etcd member add` already
  registered joins with ``--initial-cluster-state=existing``.
* restarts: a member whose inputs changed is restarted one at a time, each waited for
  until it answers healthy again, so a cluster that has quorum keeps it (a membership change
  alone restarts nothing: see ``render.control.etcd_unit_files``).
"""

from __future__ import annotations

import threading

from installer.core.etcd_rules import Guard, MembershipRefused, apply_guard, parse_members
from installer.core.render.control import ETCD_DATA_DIR, client_url
from installer.core.render.plan import render_cluster
from installer.engine.phases.base import Context, Event, Phase, render_facts
from installer.engine.phases.select import ETCD_UNIT, etcd_part
from installer.host import handover
from installer.host.etcdctl import LOCAL, endpoint_health_script, error_line, etcdctl, status_script
from installer.host.ssh import HostError

# the restarts of one process's runs, one member at a time
_restart_lock = threading.Lock()


class ReadEtcdMembership(Phase):
    """The first half of the etcd phase (same name: --only/--skip etcd take both): the
    membership guard. Refuse what would split or orphan the running cluster; render the hosts
    joining it (registered by `etcd member add`) with --initial-cluster-state=existing. etcd is
    asked (in ``run_host``, by every running member at once; the first in inventory order that
    answers counts) only when the phase has work on a cluster that exists: a no-op apply spends
    no round trip."""
    name = "etcd"
    description = "read the etcd membership when a member with data would change or one without joins"

    def prepare(self, ctx: Context) -> list[str]:
        ctx.etcd_guard, ctx.etcd_answers = Guard(), {}
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
            ctx.etcd_answers[host] = (r.stdout, "") if r.rc == 0 else ("", f"{host}: {error_line(r)}")
        except HostError as e:
            ctx.etcd_answers[host] = ("", str(e))
        return Event(self.name, host, "checked")

    def finish(self, ctx: Context, events: list[Event]) -> None:
        controls = ctx.inv.controls
        with_data = {h.name for h in controls if ctx.facts[h.name].etcd_data}
        fresh = [h.name for h in controls if h.name not in with_data]
        asked = [h.name for h in controls if h.name in ctx.etcd_answers]
        answered = next((ctx.etcd_answers[h][0] for h in asked if not ctx.etcd_answers[h][1]), None)
        if answered is None:
            self._unread(ctx, fresh, "; ".join(ctx.etcd_answers[h][1] for h in asked))
            return
        guard = apply_guard(controls, with_data, parse_members(answered))
        if guard.problems:
            raise MembershipRefused("the etcd cluster does not match the inventory:\n"
                                    + "\n".join(f"  {p}" for p in guard.problems))
        ctx.etcd_guard = guard
        if guard.joining:
            ctx.plans = render_cluster(ctx.inv, ctx.material, render_facts(ctx))
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


class StartEtcd(Phase):
    name = "etcd"
    description = "etcd members as systemd units (dedicated user, mTLS); wait for a healthy cluster"

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts("control")]

    def run_host(self, ctx: Context, host: str) -> Event:
        changes = ctx.changes_for(host, etcd_part(ctx.plans[host]))
        if ETCD_UNIT not in changes.restart or ctx.options.dry_run:
            # a new member waits for its peers before it reports ready: never block on it
            return ctx.execute(self.name, host, changes, no_block=True)
        # a running member: one restart at a time, and back to healthy before the next, so
        # the cluster never loses more than one member to a restart. The restart blocks until
        # etcd reports ready (Type=notify: it has rejoined its cluster), then health confirms.
        # Its host's apiserver, which uses this member alone, steps aside meanwhile.
        with _restart_lock, handover.aside(ctx, host) as aside:
            ev = ctx.execute(self.name, host, changes)
            wait = (status_script(ctx.options.wait_timeout) if host in ctx.etcd_guard.learners
                    else endpoint_health_script(LOCAL, ctx.options.wait_timeout))
            r = ctx.remotes[host].run(wait, check=False, what="wait for etcd health after its restart",
                                      timeout=ctx.options.wait_timeout + 30)
            if r.rc != 0:
                raise HostError(host, f"etcd is not healthy after its restart: {r.stderr.strip()[-500:]}")
            ev.detail.append("restarted alone; healthy again" + ("; its apiserver stepped aside meanwhile"
                                                                  if aside else ""))
        return ev

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or ctx.settled(events, (ETCD_UNIT,)):
            return
        learners = ctx.etcd_guard.learners
        voting = [h for h in ctx.inv.controls if h.name not in learners]
        # a learner answers no health check: the voting members are checked from one of them,
        # each learner only until its member answers
        first = voting[0].name
        endpoints = ",".join(client_url(h.address) for h in voting)
        r = ctx.remotes[first].run(endpoint_health_script(endpoints, ctx.options.wait_timeout), check=False,
                                   what="wait for etcd health", timeout=ctx.options.wait_timeout + 30)
        if r.rc != 0:
            raise HostError(first, f"etcd did not become healthy: {r.stderr.strip()[-500:]}")
        ctx.events.append(Event(self.name, first, "waited", detail=r.stdout.strip().splitlines()))
        for name in sorted(learners):
            r = ctx.remotes[name].run(status_script(ctx.options.wait_timeout), check=False,
                                      what="wait for the joining etcd member", timeout=ctx.options.wait_timeout + 30)
            if r.rc != 0:
                raise HostError(name, f"etcd did not join as a learner (data dir {ETCD_DATA_DIR}): "
                                f"{r.stderr.strip()[-500:]}")
            ctx.events.append(Event(self.name, name, "waited", detail=["joined as a learner"]))
        ctx.mark_active([h.name for h in ctx.hosts("control")], (ETCD_UNIT,))
