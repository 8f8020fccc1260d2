"""What a phase or a day-2 step reports: one ``Event`` per host and phase (the apply report's
rows, ``--output json``). Apart from engine/context.py so that the control planes
(engine/planes/), which the Context holds, report the same way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Event:
    phase: str
    host: str
    action: str                   # changed | unchanged | skipped | failed | waited | checked
    seconds: float = 0.0
    files: int = 0
    bytes: int = 0
    restarts: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)
