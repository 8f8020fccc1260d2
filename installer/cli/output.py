"""Progress for humans (rich) and a JSON report for machines."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

import click
from rich.console import Console

from ..phases.base import Event
from ..runner import Report

SYMBOL = {"changed": "[yellow]~[/]", "unchanged": "[green]=[/]", "checked": "[green]✓[/]",
          "waited": "[green]✓[/]", "skipped": "[dim]-[/]", "failed": "[red]✗[/]"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Progress:
    def __init__(self, fmt: str, verbose: bool = False):
        self.json = fmt == "json"
        self.verbose = verbose
        self.console = Console(stderr=self.json, highlight=False)
        self.phase = None
        self.lines: list[dict] = []       # every log line, for the JSON report
        self._lock = threading.Lock()

    def log(self, text: str) -> None:
        # phases log from their host threads
        with self._lock:
            self.lines.append({"time": _now(), "message": text})
        if not self.json:
            self.console.print(f"[dim]{text}[/]", markup=True)

    def event(self, ev: Event) -> None:
        if self.json:
            return
        if ev.phase != self.phase:
            self.phase = ev.phase
            self.console.print(f"[bold]{ev.phase}[/]")
        extra = []
        if ev.files:
            extra.append(f"{ev.files} file(s), {human_size(ev.bytes)}")
        if ev.restarts:
            extra.append("restarted " + ", ".join(u.removesuffix(".service") for u in ev.restarts))
        self.console.print(f"  {SYMBOL.get(ev.action, ' ')} {ev.host:<12} {ev.action:<9} "
                           f"{'; '.join(extra)} [dim]({ev.seconds:.2f} s)[/]")
        if self.verbose or ev.action == "failed":
            for line in ev.detail:
                self.console.print(f"      {line}", markup=False)

    def done(self, report: Report, title: str) -> None:
        if self.json:
            click.echo(json.dumps({**report.as_dict(), "log": self.lines}, indent=2))
            return
        trips = sum(report.round_trips.values())
        self.console.print(f"[bold]{title}[/]: {len(report.changed)} change(s), {len(report.restarts)} restart(s), "
                           f"{human_size(sum(report.bytes_up.values()))} uploaded, {trips} SSH round trip(s), "
                           f"{report.seconds:.1f} s")


def human_size(n: int) -> str:
    """``n`` bytes for a person: B below 1 KiB, else KiB/MiB/GiB/TiB with one decimal."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if round(value, 1) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` (the first is the header) in columns as wide as their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def nothing_without_yes(what: str, verb: str, steps: list[str]) -> None:
    """What ``what`` would do, on stderr; exit 2 (nothing was done)."""
    click.echo(f"{what} would:", err=True)
    for step in steps:
        click.echo(f"  - {step}", err=True)
    click.echo(f"error: nothing done; pass --yes to {verb}", err=True)
    raise SystemExit(2)
