"""One command's hold on its cluster's hosts: the connections, the apply lock, and the clean-up.

Apply (engine/runner.py, through its Context) and every day-2 command reach hosts through a
``Session``:

- ``connect(hosts)``: one ``Remote`` per host (host keys verified; an unknown key accepted only
  with ``accept_new_host_keys``), opened on first use, all closed with the session;
- ``take(host)`` and ``lock(hosts)``: the apply lock (host/applylock.py) on control hosts. A lock
  a killed run of this machine left is taken over once that run's commands ended; any other
  stale lock is broken only with --force-unlock (``flag`` names how to ask for it). ``lock``
  takes every host at once and, when one refuses, gives back those it took;
- ``mark_scope()``: from then on every command of the run carries its mark, so a later run
  that finds this one dead can end them;
- ``close()``: the locks it took dropped, then its connections closed, also after a failure.

A command's session is its Run's (engine/run.py): the Run holds the lock for a day-2 command's
whole length (``Run.hold``), and a command inside another one is handed the same Run.
"""

from __future__ import annotations

import uuid
from typing import Callable, Iterable

from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec, Inventory
from installer.host import applylock
from installer.host.parallel import each
from installer.host.ssh import HostError, Remote

Log = Callable[[str], None]


class Session:
    def __init__(self, inv: Inventory, *, log: Log = print, accept_new_host_keys: bool = False,
                 remote: Callable[..., Remote] = Remote, run_id: str | None = None):
        self.inv = inv
        self.log = log
        self.accept_new_host_keys = accept_new_host_keys
        self._remote = remote
        self.remotes: dict[str, Remote] = {}
        self.locked: list[str] = []
        self.run_id = run_id or uuid.uuid4().hex
        # the mark every command carries once the run holds a lock (mark_scope); a connection
        # made later gets it too
        self.scope: str | None = None
        # the lock is held for the command's whole length (Run.hold)
        self.holding = False

    # --- connections ---------------------------------------------------------------------

    def connect(self, hosts: Iterable[HostSpec]) -> dict[str, Remote]:
        """The Remotes of ``hosts`` (made when first asked for; the connection opens on first use)."""
        out = {}
        for h in hosts:
            if h.name not in self.remotes:
                # the flag only when set: a factory may take (host, inventory) alone (the tests' hosts)
                self.remotes[h.name] = (self._remote(h, self.inv, self.accept_new_host_keys)
                                        if self.accept_new_host_keys else self._remote(h, self.inv))
                if self.scope:
                    self.remotes[h.name].scope = self.scope
            out[h.name] = self.remotes[h.name]
        return out

    def remote(self, host: HostSpec) -> Remote:
        """``host``'s Remote (made when first asked for)."""
        return self.connect([host])[host.name]

    def others(self, host: str) -> list[Remote]:
        """Every connection but ``host``'s: a dead run worked on them too."""
        return [r for n, r in self.remotes.items() if n != host]

    # --- the apply lock --------------------------------------------------------------------

    def take(self, host: str, *, force_unlock: bool = False, flag: str = "--force-unlock",
             installed_only: bool = False) -> bool:
        """The apply lock on ``host`` (connected): True when this session took it, False when
        this process holds it already or (``installed_only``) the host has nothing to lock."""
        if applylock.acquire(self.remotes[host], self.run_id, force_unlock=force_unlock, log=self.log, flag=flag,
                             installed_only=installed_only, others=lambda: self.others(host)):
            self.locked.append(host)
            return True
        return False

    def lock(self, hosts: Iterable[str], *, force_unlock: bool = False, flag: str = "--force-unlock",
             installed_only: bool = False) -> None:
        """The apply lock on every one of ``hosts`` at once. When any refuses (held, stale, or
        unreachable), the locks taken are given back and the refusals raised as one HostError."""
        hosts = list(hosts)
        results = each(lambda h: self.take(h, force_unlock=force_unlock, flag=flag, installed_only=installed_only),
                       hosts)
        refused = [e for e in results.values() if isinstance(e, Exception)]
        if refused:
            self.release()
            if len(refused) == 1 and isinstance(refused[0], HostError):
                raise refused[0]
            raise LockRefused(refused)

    def mark_scope(self, always: bool = False) -> None:
        """This run's commands in its scope from here on (when it took any lock, or ``always``:
        a command holding a hosted tenant's Lease)."""
        if self.locked or always:
            self.scope = applylock.scope_of(self.run_id)
            applylock.mark_scope(self.remotes.values(), self.run_id)

    def release(self) -> None:
        applylock.release(self.remotes, self.locked, self.run_id)

    # --- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self.release()
        finally:
            for r in self.remotes.values():
                r.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LockRefused(HostError):
    """More than one host refused the lock: each one's message, each naming its host (exit 3)."""

    def __init__(self, errors: list[Exception]):
        self.host = ", ".join(getattr(e, "host", "?") for e in errors)
        InstallerError.__init__(self, "; ".join(str(e) for e in errors))
