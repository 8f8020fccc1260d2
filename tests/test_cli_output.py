"""The operator-facing report pieces: human sizes and the upload progress lines (a clock the
test advances, a text stream the test reads)."""

from __future__ import annotations

import io
import re

import pytest

from installer.cli.output import UploadProgress, human_size

MiB = 1 << 20


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                     (MiB - 1, "1.0 MiB"), (242667420, "231.4 MiB"), (5 << 30, "5.0 GiB")])
def test_human_size(n, text):
    assert human_size(n) == text


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed(progress: UploadProgress, clock: Clock, host: str, total: int, chunk: int, step: float) -> None:
    """An upload of ``total`` bytes in ``chunk``-byte pieces, ``step`` seconds apart."""
    sent = 0
    while sent < total:
        sent = min(total, sent + chunk)
        clock.now += step
        progress.update(host, sent, total)


def test_no_line_for_a_short_upload():
    out, clock = io.StringIO(), Clock()
    p = UploadProgress(out, tty=False, clock=clock)
    feed(p, clock, "cp1", 64 * MiB, MiB, 0.01)          # 0.64 s in all
    assert out.getvalue() == ""


def test_a_long_upload_logs_a_line_every_ten_seconds_without_a_terminal():
    out, clock = io.StringIO(), Clock()
    p = UploadProgress(out, tty=False, clock=clock)
    feed(p, clock, "w1", 100 * MiB, 256 * 1024, 0.1)    # 400 chunks, 40 s
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 4, lines
    assert all(re.fullmatch(r"w1: uploading, \d+\.\d MiB of 100\.0 MiB \(\d+%\)", line) for line in lines), lines
    # nothing during the first 1.5 s (15 chunks of 256 KiB)
    assert float(lines[0].split()[2]) >= 15 / 4


def test_on_a_terminal_one_line_is_redrawn_a_few_times_a_second_then_erased():
    out, clock = io.StringIO(), Clock()
    p = UploadProgress(out, tty=True, clock=clock)
    p.update("cp1", 0, 60 * MiB)
    p.update("w1", 0, 100 * MiB)
    clock.now += 2
    for i in range(1, 101):                             # 100 chunks per host in 1 s
        clock.now += 0.01
        p.update("cp1", i * 600 * 1024 - 1, 60 * MiB)
        p.update("w1", i * MiB - 1, 100 * MiB)
    text = out.getvalue()
    draws = text.split("\r")[1:]
    assert 4 <= len(draws) <= 6, draws                  # at most 4 a second (+ the first)
    assert "\n" not in text
    line = re.compile(r"uploading: cp1 ([\d.]+) MiB of 60\.0 MiB \(\d+%\), w1 ([\d.]+) MiB of 100\.0 MiB \(\d+%\) *")
    assert draws[0].startswith("uploading: cp1 600.0 KiB of 60.0 MiB (0%), w1 0 B of 100.0 MiB (0%)")
    draws = draws[1:]
    assert all(line.fullmatch(d) for d in draws), draws
    sent = [float(line.fullmatch(d).group(1)) for d in draws]
    assert sent == sorted(sent) and sent[-1] > 40
    p.update("cp1", 60 * MiB, 60 * MiB)
    p.update("w1", 100 * MiB, 100 * MiB)                # the last upload done: the line is erased
    assert out.getvalue().endswith("\r" + " " * len(draws[-1].rstrip()) + "\r")


def test_an_event_line_says_what_was_done():
    from installer.cli.output import what_it_did
    from installer.engine.context import Event
    api = Event("cluster-bootstrap", "(api)", "changed", detail=["created Secret kube-system/bootstrap-token-w1",
                                                                 "created Secret kube-system/bootstrap-token-w2"])
    assert what_it_did(api) == ["created Secret kube-system/bootstrap-token-w1 (+1 more)"]
    assert what_it_did(api, verbose=True) == []          # verbose prints every line below instead
    pushed = Event("workers", "w1", "changed", files=2, bytes=2048, restarts=["kubelet.service"], detail=["~ a"])
    assert what_it_did(pushed) == ["2 file(s), 2.0 KiB", "restarted kubelet"]
    assert what_it_did(Event("etcd", "cp1", "unchanged")) == []
    long = Event("addons", "(api)", "changed", detail=["x" * 200])
    assert what_it_did(long)[0].endswith("...") and len(what_it_did(long)[0]) == 90
