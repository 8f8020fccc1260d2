"""The apply lock: one command that changes hosts at a time, held on the control hosts.

`apply` takes it only when something will change (a no-op run spends no round trip on it,
but clears a stale lock its own machine left behind, or any stale one with --force-unlock);
every day-2 command that changes hosts holds it for its whole length (engine/run.py), and
an apply such a command runs inside, as the same run, finds it its own. The lock file names its
holder: the host name (for people), the machine id, boot id and pid namespace (``Identity``)
and the pid. A lock is stale when it is older than the lock TTL, or when its holder was this
very machine and is provably gone: same machine id and boot, and no such process (same pid
namespace), or same machine id, another boot and taken before this boot began (a reboot ended
it; taken later, it is a clone's that kept the machine id). Such a holder (a killed
run) is taken over with a note; any other stale lock is reported and broken only with
--force-unlock. A host name is not an identity: two machines can share one (clones, containers),
and a pid checked on the wrong machine proves nothing, so a lock of another machine, or one
written by a release that did not record these ids, goes stale only with age.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from installer.core.facts import LOCK, STATE_DIR
from installer.host.runmark import stop_scopes
from installer.host.ssh import HostError, Remote

LOCK_TTL = 3600.0


class LockHeld(HostError):
    """Another command holds the apply lock (exit 3, like a failed apply)."""
    exit_code = 3

MACHINE_ID = "/etc/machine-id"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE = "/proc/self/ns/pid"
PROC_STAT = "/proc/stat"            # btime: when this boot began
REBOOTED = "this machine rebooted since it was taken"


@dataclass(frozen=True)
class Identity:
    """Which machine, boot and pid namespace a process runs in, and when that boot began (epoch
    seconds). ``host`` is for people only; None for what could not be read (then no lock is
    judged to be this machine's by it)."""
    host: str
    machine_id: str | None
    boot_id: str | None
    pid_ns: int | None
    booted_at: int | None = None

    def fields(self) -> dict:
        return {"machine": self.host, "machineId": self.machine_id, "bootId": self.boot_id, "pidNs": self.pid_ns}


def _read_id(path: str, pattern: str) -> str | None:
    try:
        value = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    # systemd writes "uninitialized" before the first boot completes, containers may have none
    return value if re.fullmatch(pattern, value) else None


@functools.lru_cache(maxsize=None)
def local_identity() -> Identity:
    """This process's identity, read once (none of it changes while a process lives)."""
    try:
        ns = os.stat(PID_NAMESPACE).st_ino
    except OSError:
        ns = None
    try:
        btime = re.search(r"^btime (\d+)$", Path(PROC_STAT).read_text(), re.M)
    except (OSError, UnicodeDecodeError):
        btime = None
    return Identity(socket.gethostname(), _read_id(MACHINE_ID, r"[0-9a-f]{32}"),
                    _read_id(BOOT_ID, r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), ns,
                    int(btime.group(1)) if btime else None)


def holder() -> dict:
    return {**local_identity().fields(), "pid": os.getpid(), "since": int(time.time())}


def _who(h: dict) -> str:
    return f"process {h.get('pid')} on {h.get('machine') or 'an unnamed host'}"


def stale_reason(content: str, now: float, local: Identity | None = None) -> str | None:
    """Why a lock with ``content`` is stale, or None when it is live. Pure but for the pid
    check on this machine; ``local``: this process's identity (default: ``local_identity()``).
    Only a holder with this machine's id is judged by its boot and pid; any other (another
    machine with the same host name, a lock of an earlier release without the ids) by its age."""
    try:
        h = json.loads(content)
        since = float(h.get("since", 0))
    except (ValueError, TypeError, AttributeError):     # not JSON, not an object, no number
        return "its content is unreadable"
    if not math.isfinite(since) or since > now + 86400:
        return "its start time is not plausible"
    me = local or local_identity()
    if me.machine_id is not None and h.get("machineId") == me.machine_id and me.boot_id is not None \
            and isinstance(h.get("bootId"), str):
        # another boot, and the lock older than this one: it was taken before this machine
        # rebooted. A lock taken during this boot by another boot id is a clone's (a VM image
        # copied with its /etc/machine-id): judged by age only
        if h["bootId"] != me.boot_id:
            if me.booted_at is not None and since < me.booted_at:
                return f"{REBOOTED} ({_who(h)}, boot {h['bootId']})"
        elif me.pid_ns is not None and h.get("pidNs") == me.pid_ns:     # one kernel, one pid namespace
            try:
                os.kill(int(h.get("pid", 0)), 0)
            except ProcessLookupError:
                return f"process {h.get('pid')} on this machine is gone"
            except (PermissionError, ValueError, TypeError, OverflowError):
                pass
    if now - since > LOCK_TTL:
        return f"it is older than {int(LOCK_TTL)} s ({_who(h)})"
    return None


def dead_here(why: str | None) -> bool:
    """A stale reason that proves the holder was this machine's and is gone (a killed run, a
    reboot): its lock is taken over without --force-unlock."""
    return bool(why) and why.startswith(("process ", REBOOTED))


def held_by(content: str) -> str:
    """Who holds a live lock, for the message: a holder on another machine is stale only after
    the TTL, and the reader should know which machine to ask."""
    try:
        h = json.loads(content)
        who = _who(h)
    except (ValueError, TypeError, AttributeError):
        return content
    if "machineId" not in h:
        return f"{who}, written by an earlier release (no machine id): stale after {int(LOCK_TTL)} s: {content}"
    return f"{who}: {content}"


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


def ours(content: str, run_id: str) -> bool:
    """The lock is held by this very process for ``run_id`` (a command inside a day-2 command
    that holds it, asking again as the same run)."""
    try:
        h = json.loads(content)
        me = local_identity()
        return (h.get("machine") == me.host and h.get("machineId") == me.machine_id and h.get("pid") == os.getpid()
                and h.get("run") == run_id)
    except (ValueError, TypeError, AttributeError):
        return False


# what a command that cannot break a stale lock itself tells the operator to run
UNLOCK = "`installer apply --force-unlock` (it breaks it and changes nothing else)"


def acquire(remote: Remote, run_id: str, *, force_unlock: bool, log: Callable[[str], None],
            flag: str = "--force-unlock", others: Callable[[], list[Remote]] = list,
            installed_only: bool = False) -> bool:
    """Take the lock on ``remote``: True when taken, False when this process holds it already
    (nothing to release). A stale lock is taken over when its holder died on this machine, or
    with ``force_unlock``, once the dead run's commands on ``remote`` and ``others()`` ended;
    anything else held is a HostError naming the holder. ``installed_only``: see ``take``."""
    content = take(remote, run_id, installed_only=installed_only)
    if content is None:
        return True
    if ours(content, run_id):
        return False
    why = stale_reason(content, time.time())
    # our own machine's holder is certainly dead (a killed run, a reboot): safe to take over
    if why and (force_unlock or dead_here(why)):
        log(f"{remote.name}: breaking a stale apply lock ({why})")
        end_dead_run([remote, *others()], content, log)
        break_stale(remote)
        return acquire(remote, run_id, force_unlock=force_unlock, log=log, flag=flag, installed_only=installed_only)
    if why:
        raise LockHeld(remote.name, f"a stale apply lock is held ({why}): {content}; "
                       f"re-run with {flag} to break it")
    raise LockHeld(remote.name, f"another command holds the apply lock: {held_by(content)}")


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


def mark_scope(remotes, run_id: str) -> None:
    """From here on every command of this run carries its mark: a later run that finds this one
    killed ends them (end_dead_run)."""
    for r in remotes:
        r.scope = scope_of(run_id)


def release(remotes: dict[str, Remote], locked: list[str], run_id: str) -> None:
    """Drop the lock on each host of ``locked`` (emptied as it goes)."""
    for host in list(locked):
        drop(remotes[host], run_id)
        locked.remove(host)
