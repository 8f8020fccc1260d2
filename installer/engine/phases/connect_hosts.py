"""connect: open SSH to every host and gather its facts in one round trip each; then, before the
lock and any change (in a dry run too), the guards that need the facts: the CA guard
(core/trust.py, with what the run's plane holds besides the hosts), the revoked-nodes check
and the caller's own (``ctx.check``: `node add` refusing other pending edits)."""

from __future__ import annotations

from installer.core import trust
from installer.core.facts import PROBE, parse, probe_input
from installer.engine.bootstrap import refuse_revoked_before_changes
from installer.engine.context import Context, Event
from installer.engine.parts import managed_paths
from installer.engine.phases.base import Phase
from installer.host.ssh import HostError


class ConnectHosts(Phase):
    name = "connect"
    description = "open SSH to every host (verified host keys) and read its facts"

    def prepare(self, ctx: Context) -> list[str]:
        # the control hosts even in a run limited to other hosts: the lock lives there and
        # the API may be reached through them
        hosts = ctx.hosts() + [h for h in ctx.inv.controls if h not in ctx.hosts()]
        ctx.session.connect(hosts)
        return [h.name for h in hosts]

    def run_host(self, ctx: Context, host: str) -> Event:
        out = ctx.remotes[host].run(PROBE, stdin=probe_input(*managed_paths(ctx, host)), what="read facts")
        try:
            ctx.facts[host] = parse(out.stdout)
        except ValueError as e:
            raise HostError(host, f"read facts: {e}") from None
        return Event(self.name, host, "checked")

    def finish(self, ctx: Context, events: list[Event]) -> None:
        ctx.rerender()
        trust.check(ctx.plans, ctx.facts, str(ctx.state.root), "ca" in ctx.pki_changes.reasons,
                    more=ctx.plane.held_certificates(ctx))
        refuse_revoked_before_changes(ctx)
        if ctx.check is not None:
            ctx.check(ctx)
