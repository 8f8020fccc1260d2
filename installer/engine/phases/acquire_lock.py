"""lock: the apply lock taken for a run of `installer apply`, on the run's control plane
(engine/planes/): a file on every control host, or a hosted tenant's Lease.

On control hosts it is taken only when something will change (a no-op run spends no round trip
on it, but clears a stale lock its own machine left behind, or any stale one with
--force-unlock); a day-2 command that holds it (``Run.hold``) hands its apply the same Run, which
finds the lock its own instead of fighting it.
"""

from __future__ import annotations

from installer.engine.context import Context, Event
from installer.engine.parts import pending_work
from installer.engine.phases.base import Phase


class AcquireLock(Phase):
    name = "lock"
    description = "take the apply lock on the control hosts (only when something will change)"

    def prepare(self, ctx: Context) -> list[str]:
        if ctx.options.dry_run:
            return []
        self.pending = pending_work(ctx)       # whether any phase that runs changes a host
        return ctx.plane.lock_targets(ctx, self.pending)

    def run_host(self, ctx: Context, host: str) -> Event:
        return Event(self.name, host, "checked", detail=ctx.plane.take_lock(ctx, host, self.pending))

    def finish(self, ctx: Context, events: list[Event]) -> None:
        ctx.session.mark_scope()
