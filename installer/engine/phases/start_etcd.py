"""etcd: install and start a member on every control host; wait until all are healthy (mTLS).

The membership was checked just before (phases/read_etcd_membership.py). A member whose inputs
changed is restarted one at a time, each waited for until it answers healthy again, so a cluster
that has quorum keeps it (a membership change alone restarts nothing: see
``render.control.etcd_unit_files``); its host's apiserver steps aside meanwhile (host/handover.py).
"""

from __future__ import annotations

import threading

from installer.core.components import ETCD_UNIT
from installer.core.render.control import ETCD_DATA_DIR, client_url
from installer.engine.context import Context, EtcdMembership, Event
from installer.engine.parts import etcd_part
from installer.engine.phases.base import Phase
from installer.host import handover
from installer.host.etcdctl import LOCAL, endpoint_health_script, status_script
from installer.host.ssh import HostError


class StartEtcd(Phase):
    name = "etcd"
    description = "etcd members as systemd units (dedicated user, mTLS); wait for a healthy cluster"
    reads = (EtcdMembership,)

    def prepare(self, ctx: Context) -> list[str]:
        # the run's restarts, one host at a time (its hosts' run_host run in parallel threads)
        self._restart_lock = threading.Lock()
        return [h.name for h in ctx.hosts("control")]

    def run_host(self, ctx: Context, host: str) -> Event:
        changes = ctx.changes_for(host, etcd_part(ctx.plans[host]))
        if ETCD_UNIT not in changes.restart or ctx.options.dry_run:
            # a new member waits for its peers before it reports ready: never block on it
            return ctx.plane.place(ctx, self.name, host, changes, no_block=True)
        # a running member: one restart at a time, and back to healthy before the next, so
        # the cluster never loses more than one member to a restart. The restart blocks until
        # etcd reports ready (Type=notify: it has rejoined its cluster), then health confirms.
        # Its host's apiserver, which uses this member alone, steps aside meanwhile.
        with self._restart_lock, handover.aside(ctx, host) as aside:
            ev = ctx.plane.place(ctx, self.name, host, changes)
            wait = (status_script(ctx.options.wait_timeout) if host in _learners(ctx)
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
        learners = _learners(ctx)
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


def _learners(ctx: Context) -> set[str]:
    """The members etcd-membership found registered but not promoted yet."""
    membership = ctx.result(EtcdMembership)
    return set(membership.guard.learners) if membership else set()
