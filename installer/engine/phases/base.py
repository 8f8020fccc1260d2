"""The phase protocol of `installer apply` (engine/runner.py runs the phases).

A phase chooses its hosts in ``prepare`` (an empty list skips it), does its work per host in
``run_host`` (hosts of one phase run in parallel), then ``finish`` waits for what must be true
before the next phase starts. Phases compare the plan with the facts and act only on the
difference; in a dry run they compute the same differences and stop before executing. What a
phase uses that a day-2 command uses too lives outside this package (engine/context.py,
engine/parts.py, engine/api_objects.py, host/). What one phase makes for later ones is a typed
result it declares (``produces``), never a field of the Context any phase may write.
"""

from __future__ import annotations

from installer.engine.context import Context, Event


class Phase:
    name = ""
    description = ""
    # what it hands later phases (engine/context.py: ``ctx.produce``, checked against this) and
    # what it reads of earlier ones (``ctx.result``): test_phase_order checks that each read is an
    # earlier phase's output
    produces: tuple[type, ...] = ()
    reads: tuple[type, ...] = ()

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts()]

    def run_host(self, ctx: Context, host: str) -> Event | None:
        return None

    def finish(self, ctx: Context, events: list[Event]) -> None:
        return None
