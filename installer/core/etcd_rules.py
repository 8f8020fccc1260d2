"""etcd membership rules, pure: the member list as etcdctl prints it, what a membership change
may do without losing quorum (``check_add`` / ``check_remove``), and what `installer apply` must
refuse next to a running cluster (``apply_guard``). Nothing here talks to a host."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec
from installer.core.render.control import ETCD_DATA_DIR, peer_url

# A restored cluster's revision is the snapshot's, older than the resourceVersions the API's
# clients hold: a kubelet's pod watch resumed from a later one got no event until the revision
# passed it again (a tenant pod bound to a worker after a restore stayed Pending, no status, for
# 5 min on the lab, 2026-12-07). The revision is raised past any a client can hold and what lies
# below it marked compacted, so every watch from before the restore is told "too old" and lists
# again: the restore Kubernetes documents (both flags are etcdutl 3.6's).
RESTORE_REVISION_BUMP = 1_000_000_000
RESTORE_FLAGS = (f"--bump-revision={RESTORE_REVISION_BUMP}", "--mark-compacted")


class EtcdOpError(InstallerError):
    """An etcd operation could not be done (the message says which step)."""


@dataclass
class Member:
    name: str
    id: str
    peer_urls: list[str]
    client_urls: list[str]
    learner: bool


def parse_members(out: str, host: str = "etcd") -> list[Member]:
    """``etcdctl member list -w json`` -> members (IDs in hex, as etcdctl takes them). A member
    added but not started yet has no name and no client URL."""
    try:
        doc = json.loads(out)
    except ValueError:
        raise EtcdOpError(f"{host}: etcdctl member list printed no JSON: {out[:200]}") from None
    return [Member(m.get("name", ""), f"{int(m.get('ID', 0)):x}", list(m.get("peerURLs") or []),
                   list(m.get("clientURLs") or []), bool(m.get("isLearner", False)))
            for m in doc.get("members", [])]


class MembershipRefused(InstallerError):
    """An unsafe or out-of-order etcd membership change; nothing was changed."""

    exit_code = 4


@dataclass
class Change:
    """What a membership change does (``steps``) and the members after it."""

    name: str
    member_id: str
    steps: list[str]
    members: list[Member] = field(default_factory=list)
    next: str = ""                # what the operator does next


# --- the rules (pure) ------------------------------------------------------------------------

def quorum(n: int) -> int:
    return n // 2 + 1


def member_label(m: Member) -> str:
    return m.name or m.id


def names_list(names) -> str:
    return ", ".join(sorted(names)) or "none"


def _in_progress(members: list[Member], name: str) -> str | None:
    """One change at a time: no other change half done."""
    for m in members:
        if (m.learner or not m.client_urls) and m.name != name:
            state = "a learner" if m.learner else "added but never started"
            return (f"another membership change is in progress: member {member_label(m)} ({', '.join(m.peer_urls)}) is "
                    f"{state}; finish it (`installer etcd member add`) or undo it (`installer etcd member remove`) "
                    "first")
    return None


def _drift(members: list[Member], name: str, controls: list[str] | None) -> str | None:
    """One change at a time: the inventory differs from the members by at most ``name``."""
    if controls is None:
        return None
    have = {m.name for m in members}
    drift = (set(controls) ^ have) - {name}
    if drift:
        return (f"one change at a time: the inventory's control hosts ({names_list(controls)}) and the etcd members "
                f"({names_list(have)}) also differ by {names_list(drift)}; make the inventory match the members except "
                f"for {name}")
    return None


def _even(n_after: int, allow_even: bool) -> str | None:
    if n_after % 2 or allow_even:
        return None
    tolerated = n_after - quorum(n_after)
    return (f"the cluster would have {n_after} members, an even count: it would need {quorum(n_after)} healthy "
            f"members and tolerate {tolerated} failure{'' if tolerated == 1 else 's'}, no more than "
            f"{n_after - 1} member{'' if n_after == 2 else 's'} would; pass --allow-even only as one step of "
            "replacing a host (3 -> 2 while a dead member is replaced, then 2 -> 3)")


def _no_quorum(voting: list[Member], up: list[str]) -> str | None:
    n = len(voting)
    if len(up) >= quorum(n):
        return None
    down = [member_label(m) for m in voting if member_label(m) not in up]
    return (f"etcd has no quorum: only {len(up)} of {n} members are healthy (down: {names_list(down)}), "
            f"and a membership change needs {quorum(n)}; bring them back first")


def check_add(members: list[Member], health: dict[str, bool], name: str, allow_even: bool = False,
              controls: list[str] | None = None) -> str | None:
    """Why adding ``name`` is refused, or None. ``health``: member name -> healthy;
    ``controls``: the inventory's control host names (None: not checked). A learner named
    ``name`` is a half-done add of that very host: resuming it is allowed."""
    reason = _in_progress(members, name)
    if reason:
        return reason
    voting = [m for m in members if not m.learner]
    if any(m.name == name for m in voting):
        return (f"{name} is already a voting member (if an earlier `etcd member add` stopped after promoting it, "
                "run `installer apply` to finish)")
    up = [m.name for m in voting if health.get(m.name)]
    reason = _no_quorum(voting, up) or _drift(members, name, controls)
    if reason:
        return reason
    n_after = len(voting) + 1
    if len(up) + 1 < quorum(n_after):        # the new member counts once it caught up
        return (f"after the change only {len(up) + 1} of {n_after} members would be healthy, "
                f"{quorum(n_after)} are needed")
    return _even(n_after, allow_even)


def check_remove(members: list[Member], health: dict[str, bool], name: str, allow_even: bool = False,
                 controls: list[str] | None = None) -> str | None:
    """Why removing member ``name`` is refused, or None (see ``check_add``). The member is
    stopped before it is removed, so the *other* members must be a quorum of the current
    size to commit the removal (and so, a quorum of the smaller cluster after it)."""
    target = next((m for m in members if m.name == name), None)
    if target is None:
        return f"{name} is not an etcd member (members: {names_list(member_label(m) for m in members)})"
    voting = [m for m in members if not m.learner]
    up = [m.name for m in voting if health.get(m.name)]
    reason = _in_progress(members, name) or _no_quorum(voting, up)
    if reason:
        return reason
    n = len(voting)
    if n <= 2 and not target.learner:        # a learner never voted: its removal changes no quorum
        return (f"etcd has only {n} member{'s' if n != 1 else ''}: removing {name} would leave "
                + ("no cluster at all" if n == 1 else "a single member that tolerates no failure")
                + "; add a member first")
    reason = _drift(members, name, controls)
    if reason or target.learner:
        return reason
    others = [u for u in up if u != name]
    if len(others) < quorum(n):
        down = [m.name for m in voting if m.name != name and m.name not in up]
        return (f"{name} is stopped before it is removed, so the other members must commit the removal: only "
                f"{len(others)} of them are healthy (down: {names_list(down)}) and {quorum(n)} are needed; "
                "after it the cluster would not have a healthy quorum; bring the down member back first")
    return _even(n - 1, allow_even)


def named_members(members: list[Member], controls: list[HostSpec]) -> list[Member]:
    """Members added but not started carry no name yet: name them after the control host
    whose peer URL they were registered with."""
    by_peer = {peer_url(h.address): h.name for h in controls}
    return [m if m.name else dataclasses.replace(m, name=next((by_peer[u] for u in m.peer_urls if u in by_peer), ""))
            for m in members]


@dataclass
class Guard:
    problems: list[str] = field(default_factory=list)   # what apply must refuse, one line each
    joining: dict[str, str] = field(default_factory=dict)  # registered, no data yet -> --initial-cluster
    learners: set[str] = field(default_factory=set)      # not promoted yet: no health check answers


def apply_guard(controls: list[HostSpec], with_data: set[str], members: list[Member]) -> Guard:
    """What `installer apply` must refuse, and which control hosts join the running cluster
    (registered by `etcd member add`, no data yet: they start with the members as etcd knows
    them). ``with_data``: the control hosts holding /var/lib/etcd/member; ``members``: the
    live member list."""
    members = named_members(members, controls)
    names = {h.name for h in controls}
    listed = {m.name for m in members}
    guard = Guard(learners={m.name for m in members if m.learner and m.name in names})
    guard.problems = [f"{member_label(m)}: a live etcd member ({', '.join(m.peer_urls)}) whose host is not a control "
                      "host in the inventory; remove it with "
                      f"`installer etcd member remove <inventory> {member_label(m)}` "
                      "(or put the host back)" for m in members if m.name not in names]
    for h in controls:
        if h.name in with_data and h.name not in listed:
            guard.problems.append(
                f"{h.name}: holds etcd data in {ETCD_DATA_DIR} but is not a member of the running cluster (removed "
                f"earlier?): move that directory aside on {h.name}, then run `installer etcd member add <inventory> "
                f"{h.name}`")
        elif h.name not in with_data and h.name not in listed:
            guard.problems.append(
                f"{h.name}: has no etcd data while {names_list(with_data)} run an etcd cluster; "
                "apply would start it as a new, separate cluster: "
                f"run `installer etcd member add <inventory> {h.name}` to join it (as a "
                "learner, then promoted)")
        elif h.name not in with_data:
            guard.joining[h.name] = ",".join(f"{m.name}={u}" for m in members for u in m.peer_urls)
    return guard
