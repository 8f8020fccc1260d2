"""`installer apply`, `plan` and `verify`: the phases of the engine, run on the inventory's hosts."""

from installer.actions.verify import verify
from installer.engine.context import Event, Options
from installer.engine.phases import PHASE_NAMES
from installer.engine.runner import Report, run

__all__ = ["Event", "Options", "PHASE_NAMES", "Report", "run", "verify"]
