"""Whose apply lock is it: the holder's machine id, boot id and pid namespace decide, never its
host name. Two machines may share a host name (clones, containers, a re-used lab name); a pid
checked on the wrong one proves nothing, and taking over a live lock of another machine lets two
commands change the same hosts at once.

``stale_reason`` is told the local identity (pure); ``acquire`` runs against a scripted stand-in
of the host's shell (the one command ``take`` sends, and ``rm -f``), with this process's real
identity."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

from installer.host.applylock import (
    LOCK_TTL,
    REBOOTED,
    Identity,
    LockHeld,
    acquire,
    dead_here,
    holder,
    local_identity,
    stale_reason,
)

BOOT = "0d9c4f6a-1b2c-4d3e-8f40-5a6b7c8d9e0f"
OTHER_BOOT = "11111111-2222-4333-8444-555555555555"
BOOTED_AT = int(time.time()) - 600
ME = Identity("build1", "a" * 32, BOOT, 4026531836, BOOTED_AT)


def dead_pid() -> int:
    p = subprocess.Popen(["/bin/true"])
    p.wait()
    return p.pid


def lock(**fields) -> str:
    """A lock as this release writes it, by ``ME`` unless ``fields`` say otherwise."""
    return json.dumps({**ME.fields(), "pid": os.getpid(), "since": int(time.time()), "run": "r" * 32, **fields})


# --- stale_reason, pure ---------------------------------------------------------------------------

def test_another_machine_with_the_same_host_name_is_judged_by_age_only():
    now = time.time()
    theirs = lock(machineId="b" * 32, pid=dead_pid())     # same host name "build1", same boot id even
    assert stale_reason(theirs, now, ME) is None
    why = stale_reason(lock(machineId="b" * 32, since=int(now - LOCK_TTL - 5)), now, ME)
    assert why.startswith("it is older than 3600 s") and "on build1" in why and not dead_here(why)


def test_this_machine_and_boot_with_a_dead_pid_is_taken_over():
    why = stale_reason(lock(pid=dead_pid()), time.time(), ME)
    assert why and why.startswith("process ") and why.endswith("on this machine is gone") and dead_here(why)
    assert stale_reason(lock(), time.time(), ME) is None          # this very process: alive


def test_this_machine_after_a_reboot_is_taken_over_whatever_the_pid():
    # taken before this boot began; its pid may be alive again (another process): the boot decides
    why = stale_reason(lock(bootId=OTHER_BOOT, since=BOOTED_AT - 60), time.time(), ME)
    assert why.startswith(REBOOTED) and dead_here(why) and OTHER_BOOT in why


def test_a_clone_with_our_machine_id_is_judged_by_age_only():
    """A VM image copied with its /etc/machine-id: same machine id, another boot id, and a lock
    taken while this boot was already running, so not by an earlier boot of this machine."""
    now = time.time()
    assert stale_reason(lock(bootId=OTHER_BOOT, pid=dead_pid()), now, ME) is None
    # the same pid namespace inode means nothing across kernels (the initial one is a constant)
    assert stale_reason(lock(bootId=OTHER_BOOT, pid=dead_pid(), since=BOOTED_AT + 1), now, ME) is None
    # nor can a reboot be told without this boot's start time
    unknown_boot = Identity("build1", "a" * 32, BOOT, 4026531836, None)
    assert stale_reason(lock(bootId=OTHER_BOOT, since=BOOTED_AT - 60), now, unknown_boot) is None


def test_a_lock_of_an_earlier_release_goes_stale_only_with_age():
    now = time.time()
    old = {"machine": "build1", "pid": dead_pid(), "since": int(now)}
    assert stale_reason(json.dumps(old), now, ME) is None
    why = stale_reason(json.dumps({**old, "since": int(now - LOCK_TTL - 1)}), now, ME)
    assert "older than 3600 s" in why and "on build1" in why and not dead_here(why)


def test_another_pid_namespace_or_unreadable_ids_never_check_the_pid():
    now, gone = time.time(), dead_pid()
    # same machine and boot, another container's pid namespace: its pids are not ours to check
    assert stale_reason(lock(pid=gone, pidNs=4026532000), now, ME) is None
    # this machine's ids unreadable (a container without /etc/machine-id): nothing is ours
    blind = Identity("build1", None, None, None)
    assert stale_reason(lock(pid=gone, machineId=None, bootId=None, pidNs=None), now, blind) is None
    assert stale_reason(lock(pid=gone, bootId=None), now, ME) is None    # no boot id recorded


# --- acquire, against a scripted host --------------------------------------------------------------

class Host:
    """The control host's side of ``take`` (write the lock unless one is there: exit 3 and its
    content), ``break_stale`` (rm -f) and ``end_dead_run`` (no command of the dead run left)."""

    def __init__(self, content: str | None):
        self.name, self.lock, self.commands = "cp1", content, []

    def run(self, cmd: str, check: bool = True, what: str = "", **kw) -> SimpleNamespace:
        self.commands.append(cmd)
        if "set -C" in cmd:
            if self.lock is not None:
                return SimpleNamespace(rc=3, stdout=self.lock + "\n", stderr="")
            self.lock = re.search(r"printf '%s\\n' '([^']*)'", cmd).group(1)
            return SimpleNamespace(rc=0, stdout="", stderr="")
        if cmd.startswith("rm -f"):
            self.lock = None
        return SimpleNamespace(rc=0, stdout="", stderr="")


def test_acquire_keeps_the_live_lock_of_another_machine_with_our_host_name():
    """The bug: a lock naming this host name and a pid not running here was taken over, though
    it was another machine's (its command still running there)."""
    theirs = json.dumps({**holder(), "machineId": "f" * 32, "pid": dead_pid(), "run": "t" * 32})
    host, said = Host(theirs), []
    with pytest.raises(LockHeld) as e:
        acquire(host, "m" * 32, force_unlock=False, log=said.append)
    assert host.lock == theirs and not any(c.startswith("rm -f") for c in host.commands)
    assert f"on {socket.gethostname()}" in str(e.value) and said == []


def test_acquire_keeps_a_lock_of_an_earlier_release_naming_our_host():
    old = json.dumps({"machine": socket.gethostname(), "pid": dead_pid(), "since": int(time.time())})
    host = Host(old)
    with pytest.raises(LockHeld, match="written by an earlier release .no machine id.: stale after 3600 s"):
        acquire(host, "m" * 32, force_unlock=False, log=lambda m: None)
    assert host.lock == old


@pytest.mark.skipif(local_identity().machine_id is None or local_identity().boot_id is None,
                    reason="this machine's ids are unreadable: no lock is ever judged to be its own")
def test_acquire_takes_over_the_lock_of_a_dead_run_of_this_machine():
    dead = json.dumps({**holder(), "pid": dead_pid(), "run": "d" * 32})
    host, said = Host(dead), []
    assert acquire(host, "m" * 32, force_unlock=False, log=said.append) is True
    assert json.loads(host.lock)["run"] == "m" * 32
    assert said and "breaking a stale apply lock (process " in said[0] and "on this machine is gone" in said[0]


def test_a_lock_of_this_process_is_its_own_only_for_the_same_run():
    """A command inside a day-2 command is handed that command's Run, and asks for the lock as
    the same run: it finds the lock its own (nothing to take, nothing to give back). Another run
    of this very process (there is no registry of what a process holds) is refused like anyone."""
    mine = json.dumps({**holder(), "run": "m" * 32})
    host = Host(mine)
    assert acquire(host, "m" * 32, force_unlock=False, log=print) is False
    assert host.lock == mine
    with pytest.raises(LockHeld, match="another command holds the apply lock"):
        acquire(host, "o" * 32, force_unlock=False, log=print)
    assert host.lock == mine


# --- the holder written ----------------------------------------------------------------------------

def test_the_holder_carries_the_ids_and_fits_what_the_facts_read():
    me = local_identity()
    assert me.machine_id is None or re.fullmatch(r"[0-9a-f]{32}", me.machine_id)
    assert me.boot_id is None or re.fullmatch(r"[0-9a-f-]{36}", me.boot_id)
    assert me.booted_at is None or me.booted_at <= time.time()
    h = holder()
    assert h["machine"] == socket.gethostname() and h["pid"] == os.getpid()
    assert (h["machineId"], h["bootId"], h["pidNs"]) == (me.machine_id, me.boot_id, me.pid_ns)
    # the facts read only the first 300 bytes of the lock: the longest host name still fits
    longest = {**h, "machine": "x" * 64, "machineId": "a" * 32, "bootId": BOOT, "pidNs": 2**32 - 1,
               "pid": 4194304, "run": "r" * 32}
    assert len(json.dumps(longest)) < 300
