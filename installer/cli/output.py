"""Progress for humans and a JSON report for machines.

Styled with click (colour on a terminal only, as click.echo strips it elsewhere): rich cost a
no-op apply ~30 ms of its ~0.8 s just to import and set up."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, TextIO

import click

if TYPE_CHECKING:          # annotations only: the engine is not imported for the output module
    from installer.api.cluster import Event, Report


SYMBOL = {"changed": ("~", "yellow"), "unchanged": ("=", "green"), "checked": ("✓", "green"),
          "waited": ("✓", "green"), "skipped": ("-", None), "failed": ("✗", "red")}


def _symbol(action: str) -> str:
    sym, colour = SYMBOL.get(action, (" ", None))
    return click.style(sym, fg=colour, dim=colour is None)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Progress:
    def __init__(self, fmt: str, verbose: bool = False):
        self.json = fmt == "json"
        self.verbose = verbose
        self.phase = None
        self.lines: list[dict] = []       # every log line, for the JSON report
        self._lock = threading.Lock()
        self.uploads = UploadProgress()

    def upload(self, host: str, sent: int, total: int) -> None:
        """Bytes of ``host``'s upload sent so far (an SSH command's stdin)."""
        self.uploads.update(host, sent, total)

    def log(self, text: str) -> None:
        # phases log from their host threads
        with self._lock:
            self.lines.append({"time": _now(), "message": text})
        if not self.json:
            self.uploads.clear()
            click.echo(click.style(text, dim=True))

    def event(self, ev: Event) -> None:
        if self.json:
            return
        self.uploads.clear()
        if ev.phase != self.phase:
            self.phase = ev.phase
            click.echo(click.style(ev.phase, bold=True))
        click.echo(f"  {_symbol(ev.action)} {ev.host:<12} {ev.action:<9} {'; '.join(what_it_did(ev, self.verbose))} "
                   + click.style(f"({ev.seconds:.2f} s)", dim=True))
        if self.verbose or ev.action == "failed":
            for line in ev.detail:
                click.echo(f"      {line}")

    def done(self, report: Report, title: str) -> None:
        if self.json:
            click.echo(json.dumps({**report.as_dict(), "log": self.lines}, indent=2))
            return
        trips = sum(report.round_trips.values())
        click.echo(click.style(title, bold=True) + f": {len(report.changed)} change(s), {len(report.restarts)} "
                   f"restart(s), {human_size(sum(report.bytes_up.values()))} uploaded, {trips} SSH round trip(s), "
                   f"{report.seconds:.1f} s")


def what_it_did(ev: Event, verbose: bool = False, width: int = 90) -> list[str]:
    """The words on an event's line: files pushed and units restarted; otherwise, when not
    verbose (which prints every detail line below), its first detail line and how many more
    (an API step names the objects it created or changed)."""
    said = []
    if ev.files:
        said.append(f"{ev.files} file(s), {human_size(ev.bytes)}")
    if ev.restarts:
        said.append("restarted " + ", ".join(u.removesuffix(".service") for u in ev.restarts))
    if not said and ev.detail and not verbose and ev.action != "failed":
        first = ev.detail[0] if len(ev.detail[0]) <= width else ev.detail[0][:width - 3] + "..."
        said.append(first + (f" (+{len(ev.detail) - 1} more)" if len(ev.detail) > 1 else ""))
    return said


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


class UploadProgress:
    """Bytes sent per host while uploads run, on stderr, for uploads that last: nothing for the
    first ``delay`` seconds of a host's upload; then on a terminal one line redrawn in place at
    most every ``tty_interval`` seconds, elsewhere (a log, CI) one line per host at most every
    ``line_interval`` seconds, so a log never floods. ``update`` is called from the hosts'
    threads, after each chunk sent."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, delay: float = 1.5,
                 tty_interval: float = 0.25, line_interval: float = 10.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock, self.delay = clock, delay
        self.tty_interval, self.line_interval = tty_interval, line_interval
        self._lock = threading.Lock()
        self._uploads: dict[str, list] = {}      # host -> [started, sent, total, last line]
        self._drawn = -float("inf")
        self._width = 0                          # of the line on screen (a terminal), to erase it

    def update(self, host: str, sent: int, total: int) -> None:
        with self._lock:
            now = self.clock()
            up = self._uploads.setdefault(host, [now, 0, total, -float("inf")])
            up[1], up[2] = sent, total
            if sent >= total:
                del self._uploads[host]
                if self.tty and self._width and not self._uploads:
                    self._write("\r" + " " * self._width + "\r")
                    self._width = 0
                return
            if now - up[0] < self.delay:
                return
            if not self.tty:
                if now - up[3] >= self.line_interval:
                    up[3] = now
                    self._write(f"{host}: uploading, {self._of(sent, total)}\n")
                return
            if now - self._drawn >= self.tty_interval:
                self._drawn = now
                line = "uploading: " + ", ".join(f"{h} {self._of(u[1], u[2])}" for h, u in sorted(self._uploads.items())
                                                 if now - u[0] >= self.delay)
                self._write("\r" + line.ljust(self._width))
                self._width = len(line)

    def clear(self) -> None:
        """Erase the line drawn on the terminal (before other output is printed)."""
        with self._lock:
            if self.tty and self._width:
                self._write("\r" + " " * self._width + "\r")
                self._width = 0
                self._drawn = -float("inf")

    @staticmethod
    def _of(sent: int, total: int) -> str:
        return f"{human_size(sent)} of {human_size(total)} ({100 * sent // max(total, 1)}%)"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


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
