"""Change etcd's membership one member at a time, never losing quorum.

``add`` registers a control host as a *learner* (it votes on nothing while it catches up),
installs and starts its member with ``--initial-cluster-state=existing``, promotes it once etcd
says it is in sync, checks every member healthy, then converges the hosts (the new host's
control plane, which uses its own member, and the workers' balancers, which list its
apiserver). ``remove`` stops the control plane and etcd
on the host, removes the member through another one, moves the host's data dir aside and checks
the others healthy.

Before anything changes, the request is checked against the live cluster (``check_add`` /
``check_remove``, pure): one change at a time (no learner or unstarted member left over, the
inventory's control hosts differ from the members by at most the host asked for), never from
2 members down to 1, never without quorum now or after the change, and never to an even member
count unless ``allow_even`` (one step of replacing a host: 3 -> 2 while a dead member is
replaced, then 2 -> 3). A refusal raises ``MembershipRefused`` naming the host and the reason.

``apply_guard`` is what `installer apply` checks (phases/start_etcd.py): it never starts a
member without data next to a running cluster unless ``add`` registered it, and refuses while
a live member's host is missing from the inventory.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from installer.core.cluster import Cluster
from installer.core.components import CONTROL_UNITS, ETCD_UNIT
from installer.core.errors import InstallerError
from installer.core.etcd_rules import (
    Change,
    EtcdOpError,
    Guard,
    Member,
    MembershipRefused,
    apply_guard,
    check_add,
    check_remove,
    member_label,
    named_members,
    names_list,
    parse_members,
    quorum,
)
from installer.core.inventory import HostSpec, Inventory
from installer.core.render.control import ETCD_DATA_DIR, ETCD_REMOVED_ASIDE, peer_url
from installer.engine import runner
from installer.engine.context import Event, Options
from installer.engine.planes.etcd_hosts import control_remotes, day2_etcdctl
from installer.engine.run import Run, open_run
from installer.engine.steps import Step, plan, run_steps
from installer.host import probes
from installer.host.etcdctl import LOCAL, endpoint_health_script, error_line, member_list
from installer.host.ssh import HostError, Remote

__all__ = ["MembershipRefused", "Change", "Guard", "add", "remove", "check_add", "check_remove", "apply_guard",
           "quorum", "parse_members"]

# what etcd answers while a membership change cannot be made *yet*: retried until the timeout
_NOT_YET = ("unhealthy cluster", "in sync with leader", "learner member is not ready", "too many requests")


# --- talking to the cluster ------------------------------------------------------------------

@dataclass
class _View:
    members: list[Member]
    health: dict[str, bool]
    via: Remote                   # a control host whose member answered


def _health(r: Remote, members: list[Member]) -> dict[str, bool]:
    """Voting member name -> answers `endpoint health` (a learner never does)."""
    voting = [m for m in members if not m.learner and m.client_urls]
    health = {m.name: False for m in members if not m.learner}
    if not voting:
        return health
    ok = probes.ask(r, probes.endpoint_health(day2_etcdctl(",".join(u for m in voting for u in m.client_urls))))
    for m in voting:
        health[m.name] = any(ok.get(u) for u in m.client_urls)
    return health


def _view(inv: Inventory, remotes: dict[str, Remote], skip: str) -> _View:
    """The members and their health, asked on the first control host (other than ``skip``)
    whose member answers."""
    r, out, why = member_list([remotes[h.name] for h in inv.controls if h.name != skip], timeout="10s")
    if r is None:
        raise EtcdOpError(f"no etcd member answered (nothing was changed): {why or 'no other control host'}")
    members = named_members(parse_members(out, r.name), inv.controls)
    return _View(members, _health(r, members), r)


def _checked(inv: Inventory, remotes: dict[str, Remote], name: str, rule, allow_even: bool, verb: str) -> _View:
    """The live cluster, once ``rule`` (check_add or check_remove) allows the change."""
    view = _view(inv, remotes, skip=name)
    reason = rule(view.members, view.health, name, allow_even, [h.name for h in inv.controls])
    if reason:
        raise MembershipRefused(f"{name}: not {verb}: {reason}; nothing was changed")
    return view


def _retrying(r: Remote, command: str, what: str, deadline: float) -> str:
    """Run an etcdctl membership command, again while etcd says "not yet" (e.g. a learner not
    in sync, members connected for less than etcd's 5 s health interval)."""
    while True:
        res = r.run(command, check=False, what=what)
        if res.rc == 0:
            return res.stdout
        err = error_line(res)
        if not any(s in err for s in _NOT_YET) or time.monotonic() > deadline:
            raise EtcdOpError(f"{r.name}: {what} failed: {err}")
        time.sleep(2)


def _wait_healthy(via: Remote, members: list[Member], timeout: float) -> None:
    endpoints = ",".join(u for m in members if not m.learner for u in m.client_urls)
    r = via.run(endpoint_health_script(endpoints, timeout), check=False,
                what="wait for etcd health", timeout=timeout + 30)
    if r.rc != 0:
        raise EtcdOpError(f"{via.name}: etcd is not healthy: {r.stderr.strip()[-500:]}")


def _members(via: Remote, inv: Inventory) -> list[Member]:
    return named_members(probes.ask(via, probes.member_list(day2_etcdctl(LOCAL))), inv.controls)


def _converge(run: Run, options: Options, log: Callable[[str], None]) -> None:
    def event(ev: Event) -> None:
        if ev.action not in ("checked", "unchanged"):
            log(f"  {ev.phase} {ev.host}: {ev.action}"
                + (f" (restarted {', '.join(ev.restarts)})" if ev.restarts else ""))
    runner.run(run, options, log=log, on_event=event)


# --- add ---------------------------------------------------------------------------------------

def add(cluster: Cluster | Run, name: str, *, allow_even: bool = False, wait_timeout: float = 180.0,
        log: Callable[[str], None] = print, dry_run: bool = False) -> Change:
    """Add control host ``name`` (in the inventory, not yet a member) to etcd: as a learner,
    then promoted; then converge the control hosts. Resumes an add that stopped after
    registering the learner. Holds the apply lock throughout, on the members (the new host may
    not answer yet: the checks name it). ``dry_run``: check, and return the steps undone."""
    with open_run(cluster, log=log) as run:
        if dry_run:
            return _add(run, name, allow_even=allow_even, wait_timeout=wait_timeout, log=log, dry_run=True)
        with run.hold(skip=frozenset({name})):
            return _add(run, name, allow_even=allow_even, wait_timeout=wait_timeout, log=log, dry_run=False)


@dataclass
class _Joining:
    """What the steps of one ``add`` pass each other."""
    via: Remote
    member_id: str = ""
    members: list[Member] = field(default_factory=list)


def _add_steps(inv: Inventory, host: HostSpec, member: Member | None, via: Remote, cluster: Run, deadline: float,
               wait_timeout: float, log: Callable[[str], None]) -> list[Step[_Joining]]:
    name, peer = host.name, peer_url(host.address)

    def register(j: _Joining) -> None:
        out = _retrying(j.via, f"{day2_etcdctl(LOCAL)} member add {shlex.quote(name)} --learner "
                        f"--peer-urls={shlex.quote(peer)} -w json", "etcdctl member add", deadline)
        try:
            j.member_id = f"{int(json.loads(out)['member']['ID']):x}"
        except (ValueError, KeyError, TypeError):
            raise EtcdOpError(f"{j.via.name}: etcdctl member add printed no member ID: {out[:200]}") from None

    def promote(j: _Joining) -> None:
        _retrying(j.via, f"{day2_etcdctl(LOCAL)} member promote {j.member_id}", "etcdctl member promote", deadline)
        j.members = _members(j.via, inv)
        _wait_healthy(j.via, j.members, max(10.0, deadline - time.monotonic()))

    if member is None:
        first = Step(f"etcdctl member add {name} --learner --peer-urls={peer} (on {via.name})", register)
    else:
        def resume(j: _Joining) -> None:
            j.member_id = member.id
        first = Step(f"resume: {name} is already registered as a learner ({member.id})", resume)
    return [
        first,
        Step(f"install and start etcd on {name} (--initial-cluster-state=existing); it joins as a learner",
             lambda j: _converge(cluster, Options(hosts=frozenset({name}), wait_timeout=wait_timeout,
                                                         only=frozenset({"preflight", "pki", "artifacts", "etcd"})),
                                 log)),
        Step(f"etcdctl member promote {member.id if member else '<its ID>'} once the learner is in sync; "
             "wait for every member healthy", promote),
        # the workers too: with spec.apiServer.balancer their balancers list the new apiserver
        Step("converge the hosts (the new host's control plane on its own member; the workers' API balancers "
             "list its apiserver)",
             lambda j: _converge(cluster, Options(hosts=frozenset(h.name for h in inv.spec.hosts),
                                                         skip=frozenset({"cluster-bootstrap"}),
                                                         wait_timeout=wait_timeout), log)),
    ]


def _add(cluster: Run, name: str, *, allow_even: bool, wait_timeout: float,
         log: Callable[[str], None], dry_run: bool) -> Change:
    inv = cluster.inv
    try:
        host = inv.host(name)
    except KeyError:
        raise InstallerError(f"{name}: not in the inventory; add it there as a control host first") from None
    if host.role != "control":
        raise InstallerError(f"{name}: is a {host.role}, not a control host: etcd members run on control hosts")
    deadline = time.monotonic() + wait_timeout
    remotes = control_remotes(cluster)
    view = _checked(inv, remotes, name, check_add, allow_even, "added")
    member = next((m for m in view.members if m.name == name), None)
    if member is None:
        # the host must be reachable and empty before it is registered: a learner that can
        # never start would block every later change
        if probes.ask(remotes[name], probes.holds_etcd_data()):
            raise MembershipRefused(f"{name}: not added: it already holds etcd data in {ETCD_DATA_DIR} (from an "
                                    "earlier cluster?); move that directory aside first; nothing was changed")
    # the member that answered stays open for the promotion (the run's connections close with it)
    via = view.via
    steps = _add_steps(inv, host, member, via, cluster, deadline, wait_timeout, log)
    if dry_run:
        via.close()
        return Change(name, member.id if member else "", plan(steps), view.members)
    joining = _Joining(via)
    try:
        done = run_steps(name, steps, joining, log)
    finally:
        via.close()
    return Change(name, joining.member_id, done, joining.members)


# --- remove ------------------------------------------------------------------------------------

def _stop_script() -> str:
    units = " ".join(CONTROL_UNITS + (ETCD_UNIT,))        # the apiserver first, etcd last
    return (f"set -e; for u in {units}; do if systemctl cat \"$u\" >/dev/null 2>&1; then "
            "systemctl disable --now --quiet \"$u\"; fi; done")


def remove(cluster: Cluster | Run, name: str, *, allow_even: bool = False, host_unreachable: bool = False,
           wait_timeout: float = 180.0, log: Callable[[str], None] = print, dry_run: bool = False) -> Change:
    """Remove member ``name`` (still in the inventory, or already deleted from it: then its
    address comes from its peer URL). ``host_unreachable``: the host is gone; only the
    membership changes. ``dry_run``: check, and return the steps without doing them. A removal
    converges nothing: edit the inventory and run `installer apply` afterwards."""
    with open_run(cluster, log=log) as run:
        if dry_run:
            return _remove(run, name, allow_even=allow_even, host_unreachable=host_unreachable,
                           wait_timeout=wait_timeout, log=log, dry_run=True)
        # a host already gone holds no lock to take
        with run.hold(skip=frozenset({name}) if host_unreachable else frozenset()):
            return _remove(run, name, allow_even=allow_even, host_unreachable=host_unreachable,
                           wait_timeout=wait_timeout, log=log, dry_run=False)


def _remove_steps(inv: Inventory, member: Member, target: Remote, via: Remote, host_unreachable: bool,
                  rest: list[Member], deadline: float) -> list[Step[dict]]:
    name = target.host.name
    units = ", ".join(u.removesuffix(".service") for u in CONTROL_UNITS + (ETCD_UNIT,))
    aside = f"{ETCD_REMOVED_ASIDE}{time.strftime('%Y%m%d%H%M%S', time.gmtime())}"

    def healthy(out: dict) -> None:
        out["members"] = _members(via, inv)
        _wait_healthy(via, out["members"], max(10.0, deadline - time.monotonic()))

    steps = [] if host_unreachable else [
        Step(f"stop and disable {units} on {name} ({target.host.address})",
             lambda _: target.run(_stop_script(), what="stop the control plane and etcd"))]
    steps.append(Step(f"etcdctl member remove {member.id} ({name}) on {via.name}",
                      lambda _: _retrying(via, f"{day2_etcdctl(LOCAL)} member remove {member.id}",
                                          "etcdctl member remove", deadline)))
    if not host_unreachable:
        steps.append(Step(f"move {ETCD_DATA_DIR} on {name} aside to {aside}",
                          lambda _: target.run(f"if [ -e {ETCD_DATA_DIR} ]; then mv -- {ETCD_DATA_DIR} {aside}; fi",
                                               what="move the etcd data aside")))
    steps.append(Step(f"check the remaining members healthy: {names_list(member_label(m) for m in rest)}", healthy))
    return steps


def _remove(run: Run, name: str, *, allow_even: bool, host_unreachable: bool, wait_timeout: float,
            log: Callable[[str], None], dry_run: bool) -> Change:
    inv = run.inv
    in_inventory = {h.name: h for h in inv.spec.hosts}
    if name in in_inventory and in_inventory[name].role != "control":
        raise InstallerError(f"{name}: is a {in_inventory[name].role}, not a control host: it is no etcd member")
    deadline = time.monotonic() + wait_timeout
    session = run.session
    remotes = session.connect(inv.controls)
    view = _checked(inv, remotes, name, check_remove, allow_even, "removed")
    member = next(m for m in view.members if m.name == name)
    if name in remotes:
        target = remotes[name]
    else:
        address = urlsplit(member.peer_urls[0]).hostname if member.peer_urls else None
        if not address:
            raise EtcdOpError(f"{name}: not in the inventory and its member has no peer URL to reach it by; "
                              "pass --host-unreachable; nothing was changed")
        # a host the inventory no longer lists: reached at its member's peer address
        target = session.remote(HostSpec(name=name, address=address, role="control"))
    rest = [m for m in view.members if m.id != member.id]
    steps = _remove_steps(inv, member, target, view.via, host_unreachable, rest, deadline)
    if not host_unreachable:
        try:
            target.open()
        except HostError as e:
            raise EtcdOpError(f"{e}; nothing was changed (if {name} is gone for good, pass --host-unreachable)") \
                from None
    if dry_run:
        return Change(name, member.id, plan(steps), view.members)
    out: dict = {}
    done = run_steps(name, steps, out, log)
    members = out["members"]
    log(f"{name}: removed; {len(members)} members healthy: {names_list(member_label(m) for m in members)}")
    voting = len([m for m in members if not m.learner])
    even = " (with spec.allowEvenControlHosts: true)" if voting % 2 == 0 else ""
    then = f"run `installer apply` with {voting} control host{'s' if voting != 1 else ''}{even}"
    nxt = f"delete {name} from the inventory, then {then}" if name in in_inventory else then
    return Change(name, member.id, done, members, next=nxt)
