"""pki: keep the cluster's keys and certificates in the local state directory.

Generation happened in memory when the run started (so that every host's files could be
planned); this phase writes what changed, atomically, 0600 for secrets, and records the hosts
in the node ledger. Nothing on a host.
"""

from __future__ import annotations

from installer.core.ledger import Ledger
from installer.core.state import write_admin_kubeconfig
from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase


class WritePKI(Phase):
    name = "pki"
    description = "write new or re-issued keys and certificates to the state directory"

    def prepare(self, ctx: Context) -> list[str]:
        return ["(local)"]

    def run_host(self, ctx: Context, host: str) -> Event:
        written = [] if ctx.options.dry_run else ctx.state.save(ctx.material)
        if not ctx.options.dry_run:
            write_admin_kubeconfig(ctx.inv, ctx.state, ctx.material)
            # the ledger keeps each host's address, for `node remove` after it left the inventory
            ledger = Ledger.load(ctx.state)
            ledger.record_active(ctx.inv)
            if ledger.save(ctx.state):
                written.append(Ledger.path(ctx.state))
        detail = [f"{name}: {why}" for name, why in sorted(ctx.pki_changes.reasons.items())]
        return Event(self.name, host, "changed" if (written or detail) else "unchanged",
                     files=len(written), detail=detail)
