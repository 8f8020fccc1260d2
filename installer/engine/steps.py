"""Day-2 commands as ordered steps, run by one small runner.

A ``Step``'s words (``says``) are both the line of its plan (``--dry-run``, or a command run
without ``--yes``) and its progress line when it runs, so the plan cannot drift from what is
done. Every day-2 command prints its progress the same way: ``<subject>: [i/n] <words>`` on
stderr, with ``<subject>`` the host or the thing the command acts on. Apply's phases are the
other runner (engine/runner.py): hosts in parallel per phase, with facts and a diff.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

S = TypeVar("S")


@dataclass(frozen=True)
class Step(Generic[S]):
    says: str
    run: Callable[[S], None]


def progress_line(subject: str, i: int, n: int, says: str) -> str:
    return f"{subject}: [{i}/{n}] {says}"


def plan(steps: list[Step]) -> list[str]:
    return [s.says for s in steps]


def run_steps(subject: str, steps: list[Step[S]], shared: S, log: Callable[[str], None],
              timings: list[tuple[str, float]] | None = None) -> list[str]:
    """Run ``steps`` in order on ``shared`` (what they pass each other); the words of those
    run (and each one's seconds appended to ``timings``). A step that raises stops the run
    there: the steps after it never start."""
    done = []
    for i, step in enumerate(steps, 1):
        log(progress_line(subject, i, len(steps), step.says))
        started = time.monotonic()
        step.run(shared)
        done.append(step.says)
        if timings is not None:
            timings.append((step.says, round(time.monotonic() - started, 1)))
    return done
