"""lock: the apply lock (host/applylock.py) taken for a run of `installer apply`.

It is taken only when something will change (a no-op run spends no round trip on it, but clears
a stale lock its own machine left behind, or any stale one with --force-unlock); a day-2 command
that holds it (``session.hold``) has an apply it runs join it instead of fighting it.
"""

from __future__ import annotations

import time

from installer.engine.context import Context, Event
from installer.engine.parts import pending_work
from installer.engine.phases.base import Phase
from installer.host.applylock import break_stale, dead_here, end_dead_run, held_run, stale_reason
from installer.host.ssh import HostError


class AcquireLock(Phase):
    name = "lock"
    description = "take the apply lock on the control hosts (only when something will change)"

    def prepare(self, ctx: Context) -> list[str]:
        if ctx.options.dry_run:
            return []
        if ctx.inv.hosted:
            # a hosted tenant's lock is a Lease in its namespace, taken every run: whether its
            # control plane needs a change is known only once the hosting cluster is read
            return [ctx.inv.hosted_namespace]
        ctx.changes_pending = pending_work(ctx)
        if not ctx.changes_pending:
            # nothing to change: only clear stale locks this run may break (the facts saw them)
            return [h.name for h in ctx.inv.controls if h.name in ctx.facts and self._breakable(ctx, h.name)]
        return [h.name for h in ctx.inv.controls]      # also in a run limited to some hosts

    @staticmethod
    def _breakable(ctx: Context, host: str) -> bool:
        content = ctx.facts[host].lock
        why = stale_reason(content, time.time()) if content is not None else None
        return bool(why) and (ctx.options.force_unlock or dead_here(why))

    def run_host(self, ctx: Context, host: str) -> Event:
        if ctx.inv.hosted:
            from installer.host.hosting import HostingError  # lazy: urllib3, for hosted tenants only
            # a run inside a day-2 command (upgrade's turns, node add) holds the Lease as that
            # command's run: it is ours already, and that command gives it back
            holder = held_run(ctx.inv.metadata.name) or ctx.run_id
            try:
                ctx.executor.take_lock(ctx.inv, holder, force=ctx.options.force_unlock)
            except HostingError as e:
                raise HostError(host, str(e)) from None
            return Event(self.name, host, "checked", detail=["the apply lock (a Lease) taken"])
        if not ctx.changes_pending:
            # a stale lock left by a killed run would block every other machine for an hour
            why = stale_reason(ctx.facts[host].lock or "", time.time())
            ctx.log(f"{host}: clearing a stale apply lock ({why}); nothing else to do")
            end_dead_run([ctx.remotes[host], *ctx.session.others(host)], ctx.facts[host].lock, ctx.log)
            break_stale(ctx.remotes[host])
            return Event(self.name, host, "checked")
        ctx.session.take(host, force_unlock=ctx.options.force_unlock)
        return Event(self.name, host, "checked")

    def finish(self, ctx: Context, events: list[Event]) -> None:
        ctx.session.mark_scope()
