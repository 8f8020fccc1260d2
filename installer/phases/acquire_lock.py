"""lock: one apply at a time, held on the control hosts while anything changes.

A run with nothing to change takes no lock (and spends no round trip on it). The lock file
names its holder; a lock whose holder is a dead process on this machine, or older than the
lock TTL, is stale. A holder that was a process on this machine and is gone (a killed run) is
taken over with a note; any other stale lock is reported and broken only with --force-unlock.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import socket
import time

from ..facts import LOCK, STATE_DIR
from ..ssh import HostError, Remote
from .base import Context, Event, Phase

LOCK_TTL = 3600.0


def holder() -> dict:
    return {"machine": socket.gethostname(), "pid": os.getpid(), "since": int(time.time())}


def stale_reason(content: str, now: float) -> str | None:
    """Why a lock with ``content`` is stale, or None when it is live. Pure."""
    try:
        h = json.loads(content)
        since = float(h.get("since", 0))
    except (ValueError, TypeError, AttributeError):     # not JSON, not an object, no number
        return "its content is unreadable"
    if not math.isfinite(since) or since > now + 86400:
        return "its start time is not plausible"
    if h.get("machine") == socket.gethostname():
        try:
            os.kill(int(h.get("pid", 0)), 0)
        except ProcessLookupError:
            return f"process {h.get('pid')} on this machine is gone"
        except (PermissionError, ValueError, TypeError, OverflowError):
            pass
    if now - since > LOCK_TTL:
        return f"it is older than {int(LOCK_TTL)} s"
    return None


def take(remote: Remote, run_id: str, *, installed_only: bool = False) -> str | None:
    """Write ``run_id``'s lock on ``remote`` unless one is there (one round trip): None when
    taken, else the content of the lock that is held. ``installed_only``: a host without
    /var/lib/hiddenplane is left alone (nothing to lock there; None)."""
    me = json.dumps({**holder(), "run": run_id})
    guard = f"[ -d {STATE_DIR} ] || exit 0;" if installed_only else f"mkdir -p {os.path.dirname(LOCK)} &&"
    r = remote.run(f"{guard} (set -C; printf '%s\\n' {shlex.quote(me)} > {LOCK}) 2>/dev/null "
                   f"|| {{ cat {LOCK}; exit 3; }}", check=False, what="take the apply lock")
    if r.rc == 3:
        return r.stdout.strip()
    if r.rc != 0:
        raise HostError(remote.name, f"take the apply lock failed (exit {r.rc}): {r.stderr.strip()}")
    return None


def break_stale(remote: Remote) -> None:
    remote.run(f"rm -f {LOCK}", what="break a stale lock")


def drop(remote: Remote, run_id: str) -> None:
    """Remove ``run_id``'s lock from ``remote`` (anyone else's stays); an unreachable host's
    lock goes stale and is reported next time."""
    try:
        remote.run(f"grep -q {shlex.quote(run_id)} {LOCK} 2>/dev/null && rm -f {LOCK} || true",
                   what="release the apply lock")
    except HostError:
        pass


class AcquireLock(Phase):
    name = "lock"
    description = "take the apply lock on the control hosts (only when something will change)"

    def prepare(self, ctx: Context) -> list[str]:
        if ctx.options.dry_run or not ctx.pending_work():
            return []
        return [h.name for h in ctx.inv.controls]      # also in a run limited to some hosts

    def run_host(self, ctx: Context, host: str) -> Event:
        content = take(ctx.remotes[host], ctx.run_id)
        if content is not None:
            why = stale_reason(content, time.time())
            # our own machine's holder is certainly dead (a killed run): safe to take over
            dead_here = bool(why) and why.startswith("process ")
            if why and (ctx.options.force_unlock or dead_here):
                ctx.log(f"{host}: breaking a stale apply lock ({why})")
                break_stale(ctx.remotes[host])
                return self.run_host(ctx, host)
            if why:
                raise HostError(host, f"a stale apply lock is held ({why}): {content}; "
                                "re-run with --force-unlock to break it")
            raise HostError(host, f"another apply holds the lock: {content}")
        ctx.locked.append(host)
        return Event(self.name, host, "checked")


def release(ctx: Context) -> None:
    for host in list(ctx.locked):
        drop(ctx.remotes[host], ctx.run_id)
        ctx.locked.remove(host)
