"""Quiet windows: a test that allows no failed request while it breaks something on purpose (a
host cut off, a roll, an upgrade) gets this machine's CPU first, and never shares it with
another such test.

Why: CI runs two pytest processes side by side (tools/testrun.py), each driving labs, on two
cores. Measured during the CI of 515ce1b's successor (2026-12-07, a fresh clone, nothing else
running): a load average of 60 to 113, the kernel's CPU pressure ("some") 88-93 % over minutes,
the real-cluster lab's hosts 127 % of a core and the upgrade lab's 64 % at one moment (their
cgroups' cpuacct). Starved like that, a SYN-ACK, a TLS handshake or an etcd write waits seconds:
the probes' timeouts, the balancers' 1 s connect timeout, leases. Two such tests ran at once,
one in each process (the official CI of 515ce1b, 5 failures: the upgrade lab's two in one half
minute of its etcd roll, beside the hosted module's three). The same tests pass when they do
not overlap (docs/testing.md, "Root-caused").

A window takes an exclusive lock shared by both processes (``HIDDENPLANE_QUIET_LOCK``, made by
tools/testrun.py; without it, a run of one process, no lock), then gives its lab's hosts ten
times the CPU weight of any other lab (installer/lab/nspawn.lab_cpu_shares) until it ends. The
other process goes on, slower while the window lasts. Each window prints how long it waited
for the lock and how long it held it (in ``<lock>.log`` too, which tools/testrun.py prints).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager

from installer.lab import nspawn

LOCK_ENV = "HIDDENPLANE_QUIET_LOCK"
SHARES = 10 * nspawn.DEFAULT_CPU_SHARES
# this process's windows so far, (lab, start, end) in wall-clock seconds; the open one's end is
# None: probes that outlive one test judge only what they saw inside windows (``within``)
HELD: list[list] = []


def within(lab: str, t: float) -> bool:
    """Whether wall-clock time ``t`` fell in one of this process's windows of ``lab``."""
    return any(w[0] == lab and w[1] <= t and (w[2] is None or t <= w[2]) for w in HELD)


@contextmanager
def window(lab: str, label: str):
    path = os.environ.get(LOCK_ENV)
    lock = open(path, "a") if path else None      # noqa: SIM115 - held for the window
    asked = time.monotonic()
    try:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        got = time.monotonic()
        old = nspawn.lab_cpu_shares(lab, SHARES)
        held = [lab, time.time(), None]
        HELD.append(held)
        try:
            yield
        finally:
            held[2] = time.time()
            if old is not None:
                nspawn.lab_cpu_shares(lab, old)
            said = (f"{time.strftime('%H:%M:%S')} {label} (lab {lab}): waited {got - asked:.0f} s for the lock, "
                    f"held it {time.monotonic() - got:.0f} s")
            print(f"\nquiet window: {said}", file=sys.stderr)
            if path:
                with open(f"{path}.log", "a") as log:
                    log.write(said + "\n")
    finally:
        if lock:
            lock.close()                            # closing it releases the lock
