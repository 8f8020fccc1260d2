"""The node ledger: which hosts this cluster has had, and what became of them.

Kept in the state directory as ``nodes.yaml`` (0600: it names hosts and certificate serials).
``apply`` records every host it converges as *active* (name, role, address, so that a host later
deleted from the inventory can still be reached by ``node remove``); ``node remove`` marks a
node *removed* (``node add`` may bring it back), ``node revoke`` marks it *revoked* for good,
with the serials of the client certificates it was seen with. ``node revoke`` also marks revoked
every name the cluster's policy denies that this ledger did not know as revoked (a revoke run
from another state directory), so that no later run from this state forgets it; a name learned
that way and unknown here has no address (``""``).

A name marked removed or revoked that is still in the inventory stops ``apply`` with the reason:
re-joining it silently would undo the decommission (and, for a revoked name, could never work:
the admission policy denies every write by ``system:node:<name>``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Literal

import yaml

from installer.core.errors import InstallerError, StateError
from installer.core.inventory import HostSpec, Inventory
from installer.core.safefs import write_atomic
from installer.core.state import StateDir

NodeState = Literal["active", "removed", "revoked"]
HEADER = b"""\
# Hosts of this cluster and what became of them (hiddenplane node ledger). Written by
# `installer apply`, `node remove`, `node add` and `node revoke`; a revoked name never re-joins.
"""


class NodeRetiredError(InstallerError):
    """The inventory names a host that `node remove` or `node revoke` took out."""
    exit_code = 2


@dataclass
class Entry:
    name: str
    role: str
    address: str
    state: NodeState = "active"
    since: str = ""
    serials: list[str] = field(default_factory=list)     # revoked: client certificate serials seen
    history: list[dict] = field(default_factory=list)    # [{state, at, note}]

    def as_dict(self) -> dict:
        d = {"role": self.role, "address": self.address, "state": self.state, "since": self.since}
        if self.serials:
            d["certificateSerials"] = list(self.serials)
        if self.history:
            d["history"] = list(self.history)
        return d

    def host(self) -> HostSpec:
        return HostSpec(name=self.name, address=self.address, role=self.role)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Ledger:
    def __init__(self, entries: dict[str, Entry] | None = None):
        self.entries: dict[str, Entry] = dict(entries or {})

    @staticmethod
    def path(state: StateDir):
        return state.root / "nodes.yaml"

    @classmethod
    def load(cls, state: StateDir) -> "Ledger":
        p = cls.path(state)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return cls()
        except OSError as e:
            raise StateError(f"{p}: {e.strerror}") from None
        try:
            doc = yaml.safe_load(raw) or {}
            entries = {}
            for name, d in (doc.get("nodes") or {}).items():
                if d.get("state", "active") not in ("active", "removed", "revoked"):
                    raise ValueError(name)
                entries[str(name)] = Entry(str(name), str(d["role"]), str(d["address"]), d.get("state", "active"),
                                           str(d.get("since", "")), [str(s) for s in d.get("certificateSerials") or []],
                                           list(d.get("history") or []))
        except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
            # never guess: a revoked name forgotten here could be joined again
            raise StateError(f"{p} is corrupt: expected `nodes:` mapping names to role/address/state; "
                             "fix it by hand or restore it from a backup") from None
        return cls(entries)

    def save(self, state: StateDir) -> bool:
        state.ensure_root()
        doc = {"nodes": {n: e.as_dict() for n, e in sorted(self.entries.items())}}
        return write_atomic(self.path(state), HEADER + yaml.safe_dump(doc, sort_keys=False).encode(), 0o600)

    # -- transitions --
    def _set(self, host: HostSpec, state: NodeState, note: str) -> Entry:
        e = self.entries.get(host.name)
        if e is None:
            e = self.entries[host.name] = Entry(host.name, host.role, str(host.address))
        elif e.state == state and e.address == str(host.address) and e.role == host.role:
            return e
        e.role, e.address = host.role, str(host.address)
        if e.state != state or not e.since:
            e.state, e.since = state, now_iso()
            e.history.append({"state": state, "at": e.since, **({"note": note} if note else {})})
        return e

    def record_active(self, inv: Inventory) -> None:
        """Every host of ``inv`` that is not retired is active (address and role kept current)."""
        for h in inv.spec.hosts:
            e = self.entries.get(h.name)
            if e is None or e.state == "active":
                self._set(h, "active", "")

    def mark_removed(self, host: HostSpec, note: str = "") -> Entry:
        e = self.entries.get(host.name)
        if e is not None and e.state == "revoked":
            return e                       # revoked stays revoked
        return self._set(host, "removed", note)

    def mark_revoked(self, host: HostSpec, serials: list[str], note: str = "") -> Entry:
        e = self._set(host, "revoked", note)
        e.serials = sorted(set(e.serials) | set(serials))
        return e

    def learn_revoked(self, name: str, note: str, host: HostSpec | None = None) -> Entry:
        """``name`` is revoked according to the cluster (a revoke this state did not see): marked
        revoked, keeping the role and address known for it (``host``'s when it has no entry;
        else a worker, the only role with a node identity, at no known address)."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = (Entry(name, host.role, str(host.address)) if host is not None
                                      else Entry(name, "worker", ""))
        if e.state != "revoked":
            e.state, e.since = "revoked", now_iso()
            e.history.append({"state": "revoked", "at": e.since, "note": note})
        return e

    def reactivate(self, host: HostSpec) -> Entry:
        e = self.entries.get(host.name)
        if e is not None and e.state == "revoked":
            raise NodeRetiredError(revoked_message(e))
        return self._set(host, "active", "added back by `installer node add`")

    def revoked_names(self) -> list[str]:
        return sorted(n for n, e in self.entries.items() if e.state == "revoked")

    def host(self, name: str, inv: Inventory | None = None) -> HostSpec | None:
        """The host named ``name``: from the inventory if it is there, else as last recorded."""
        if inv is not None:
            for h in inv.spec.hosts:
                if h.name == name:
                    return h
        e = self.entries.get(name)
        if e is not None and not e.address:
            raise StateError(f"{name} is in the node ledger only as a name the cluster's revoked-nodes policy "
                             "denies (learned by `installer node revoke`; its address is not recorded): list it "
                             "in the inventory to act on it")
        return e.host() if e is not None else None


def revoked_message(e: Entry) -> str:
    return (f"host {e.name} was revoked on {e.since} (`installer node revoke`): system:node:{e.name} is denied "
            "by admission policy and can never join again; give the machine a new name")


def check_inventory(inv: Inventory, ledger: Ledger, returning: frozenset[str] = frozenset()) -> None:
    """Refuse an inventory that still lists a removed or revoked host (one message for all);
    ``returning``: removed hosts being added back (never a revoked one)."""
    problems = []
    for h in inv.spec.hosts:
        e = ledger.entries.get(h.name)
        if e is None or e.state == "active" or (e.state == "removed" and h.name in returning):
            continue
        if e.state == "revoked":
            problems.append(revoked_message(e) + "; delete it from the inventory")
        else:
            problems.append(f"host {h.name} was removed on {e.since} (`installer node remove`); delete it "
                            f"from the inventory, or run `installer node add INVENTORY {h.name}` to bring it back")
    if problems:
        raise NodeRetiredError("; ".join(problems))
