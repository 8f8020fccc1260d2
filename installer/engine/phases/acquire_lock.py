"""lock: one command that changes hosts at a time, held on the control hosts.

`apply` takes it only when something will change (a no-op run spends no round trip on it,
but clears a stale lock its own machine left behind, or any stale one with --force-unlock);
every day-2 command that changes hosts holds it for its whole length (``cluster_lock``), and
an apply such a command runs inside joins it instead of fighting it. The lock file names its
holder; a lock whose holder is a dead process on this machine, or older than the lock TTL, is
stale. A holder that was a process on this machine and is gone (a killed run) is taken over
with a note; any other stale lock is reported and broken only with --force-unlock.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import socket
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

from installer.core.facts import LOCK, STATE_DIR
from installer.core.inventory import Inventory
from installer.host.runmark import set_process_scope, stop_scopes
from installer.host.ssh import HostError, Remote
from installer.engine.phases.base import Context, Event, Phase
from installer.engine.phases.select import pending_work

LOCK_TTL = 3600.0


class LockHeld(HostError):
    """Another command holds the apply lock (exit 3, like a failed apply)."""
    exit_code = 3

# cluster name -> run id of the lock this process holds through cluster_lock
_held: dict[str, str] = {}
_held_guard = threading.Lock()


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


def scope_of(run_id: str) -> str:
    """The mark prefix of a run's remote commands (see ssh.Remote.scope and stop_scopes)."""
    return f"hp-{run_id[:12]}"


def run_of(content: str | None) -> str | None:
    try:
        run = json.loads(content or "").get("run")
    except (ValueError, TypeError, AttributeError):
        return None
    return run if isinstance(run, str) and run.isalnum() else None


def end_dead_run(remotes: list[Remote], content: str | None, log: Callable[[str], None]) -> None:
    """A killed run's remote commands (a wait loop, an etcdctl) may still be running: end them
    before anyone takes its lock over."""
    run = run_of(content)
    if run is None:
        return
    for i, r in enumerate(remotes):
        try:
            ended = stop_scopes(r, scope_of(run))
        except HostError as e:
            if i == 0:          # the host whose lock is taken over: never take it blindly
                raise
            log(f"{e} (the dead run's commands there could not be ended)")
            continue
        if ended:
            log(f"{r.name}: ended {len(ended)} command(s) of the dead run {run[:12]} ({', '.join(ended)})")


def ours(content: str) -> bool:
    """The lock is held by this very process (a day-2 command around the apply asking)."""
    try:
        h = json.loads(content)
        return (h.get("machine") == socket.gethostname() and h.get("pid") == os.getpid()
                and h.get("run") in _held.values())
    except (ValueError, TypeError, AttributeError):
        return False


def acquire(remote: Remote, run_id: str, *, force_unlock: bool, log: Callable[[str], None],
            flag: str = "--force-unlock", others: Callable[[], list[Remote]] = list) -> bool:
    """Take the lock on ``remote``: True when taken, False when this process holds it already
    (nothing to release). A stale lock is taken over when its holder died on this machine, or
    with ``force_unlock``, once the dead run's commands on ``remote`` and ``others()`` ended;
    anything else held is a HostError naming the holder."""
    content = take(remote, run_id)
    if content is None:
        return True
    if ours(content):
        return False
    why = stale_reason(content, time.time())
    # our own machine's holder is certainly dead (a killed run): safe to take over
    dead_here = bool(why) and why.startswith("process ")
    if why and (force_unlock or dead_here):
        log(f"{remote.name}: breaking a stale apply lock ({why})")
        end_dead_run([remote, *others()], content, log)
        break_stale(remote)
        return acquire(remote, run_id, force_unlock=force_unlock, log=log, flag=flag)
    if why:
        raise LockHeld(remote.name, f"a stale apply lock is held ({why}): {content}; "
                       f"re-run with {flag} to break it")
    raise LockHeld(remote.name, f"another command holds the apply lock: {content}")


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
        if ctx.options.dry_run:
            return []
        ctx.changes_pending = pending_work(ctx)
        if not ctx.changes_pending:
            # nothing to change: only clear stale locks this run may break (the facts saw them)
            return [h.name for h in ctx.inv.controls if h.name in ctx.facts and self._breakable(ctx, h.name)]
        return [h.name for h in ctx.inv.controls]      # also in a run limited to some hosts

    @staticmethod
    def _breakable(ctx: Context, host: str) -> bool:
        content = ctx.facts[host].lock
        why = stale_reason(content, time.time()) if content is not None else None
        return bool(why) and (ctx.options.force_unlock or why.startswith("process "))

    def run_host(self, ctx: Context, host: str) -> Event:
        if not ctx.changes_pending:
            # a stale lock left by a killed run would block every other machine for an hour
            why = stale_reason(ctx.facts[host].lock or "", time.time())
            ctx.log(f"{host}: clearing a stale apply lock ({why}); nothing else to do")
            end_dead_run(self._hosts_first(ctx, host), ctx.facts[host].lock, ctx.log)
            break_stale(ctx.remotes[host])
            return Event(self.name, host, "checked")
        if acquire(ctx.remotes[host], ctx.run_id, force_unlock=ctx.options.force_unlock, log=ctx.log,
                   others=lambda: self._hosts_first(ctx, host)[1:]):
            ctx.locked.append(host)
        return Event(self.name, host, "checked")

    @staticmethod
    def _hosts_first(ctx: Context, host: str) -> list[Remote]:
        """``host``'s connection, then every other one: a dead run worked on workers too."""
        return [ctx.remotes[host], *(r for n, r in ctx.remotes.items() if n != host)]

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.locked:
            # from here on every command of this run carries its mark: a later run that finds
            # this one killed ends them (end_dead_run)
            for r in ctx.remotes.values():
                r.scope = scope_of(ctx.run_id)


def release(ctx: Context) -> None:
    for host in list(ctx.locked):
        drop(ctx.remotes[host], ctx.run_id)
        ctx.locked.remove(host)


@contextmanager
def cluster_lock(inv: Inventory, *, skip: frozenset[str] = frozenset(), log: Callable[[str], None] = print,
                 remote: Callable[..., Remote] = Remote) -> Iterator[str]:
    """Hold the apply lock on every control host but ``skip`` (hosts known to be gone) for a
    day-2 command's whole length; yields the run id. Re-entrant in one process: a nested
    holder (etcd member remove inside node remove) joins, and so does an apply run inside."""
    with _held_guard:
        joined = _held.get(inv.metadata.name)
    if joined is not None:
        yield joined
        return
    run_id = uuid.uuid4().hex
    hosts = [h for h in inv.controls if h.name not in skip]
    with ExitStack() as stack:
        remotes = {h.name: stack.enter_context(remote(h, inv)) for h in hosts}
        taken: list[str] = []

        def release_all() -> None:
            for name in taken:
                drop(remotes[name], run_id)
            with _held_guard:
                _held.pop(inv.metadata.name, None)
        stack.callback(release_all)
        with _held_guard:
            _held[inv.metadata.name] = run_id
        for name, r in remotes.items():
            if acquire(r, run_id, force_unlock=False, log=log,
                       flag="`installer apply --force-unlock` (it breaks it and changes nothing else)",
                       others=lambda name=name: [x for n, x in remotes.items() if n != name]):
                taken.append(name)
        # every command of this process from here on is in the run's scope (end_dead_run)
        set_process_scope(scope_of(run_id))
        stack.callback(set_process_scope, None)
        yield run_id
