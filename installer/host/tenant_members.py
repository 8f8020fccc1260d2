"""Changing a running hosted tenant's etcd member count (``etcdReplicas``, 1 <-> 3) by `apply`,
one member at a time, quorum kept at every step (docs/hosted.md).

Growing: each new member is first registered as a **learner** through a running member
(``etcdctl member add --learner``: it copies the data but has no vote, so the cluster's quorum
does not depend on its start), then the StatefulSet runs one replica more; the new pod's start
script (installer/sh/etcd-member-start.sh) finds itself listed, never started, and joins as
listed; the member is promoted once etcd says it is in sync, and its pod is ready before the
next. Adding a voting member instead made a 1 -> 2 cluster that needed the new member to run:
its first start failed on the lab and the tenant lost quorum.

Shrinking: the highest-numbered member is removed through a member that stays (every member
ready first), then the StatefulSet runs one replica fewer and the member's volume claim is
deleted (a later grow must start that member empty, never on a removed member's data).

Afterwards `apply` converges the objects as for any change: the member list ConfigMap, which each
member's start reads (no member restarts for it). No apiserver restarts either: they dial the
``etcd-near`` Service, which follows the ready members. Interrupted, the next run resumes from
the member list.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from installer.core.etcd_rules import EtcdOpError, Member
from installer.core.inventory import Inventory
from installer.core.pki.specs import ETCD_SERVICE
from installer.core.render.tenant import member_names, member_service
from installer.core.render.tenant_etcd_names import legacy_peer_url, member_peer_url
from installer.host.kube import STRATEGIC_MERGE, ApiClient, ApiError, rest, status_message
from installer.host.kube_objects import apply_objects
from installer.host.tenant_etcd import (
    ETCDCTL,
    component_pods,
    live_members,
    member_list,
    pod_ready,
    run_in_member,
    sts_path,
)

# etcd refuses a promotion until the learner has caught up, and a membership change while a
# peer is new or just gone (its strict reconfiguration check): asked again until the deadline
NOT_YET = ("in sync with leader", "too many requests", "unhealthy cluster", "not ready", "not started")


def count_steps(inv: Inventory, have: int) -> list[str]:
    """What changing the member count from ``have`` to ``etcdReplicas`` does, one line per member."""
    assert inv.hosted is not None
    want = inv.hosted.etcdReplicas
    if want > have:
        return [f"add {ETCD_SERVICE}-{i} as a learner (no vote), run it (StatefulSet replicas {i + 1}), promote it "
                "once in sync, wait until it is ready" for i in range(have, want)]
    return [f"remove member {ETCD_SERVICE}-{i} through a member that stays, StatefulSet replicas {i}, delete its "
            f"volume claim data-{ETCD_SERVICE}-{i}" for i in range(have - 1, want - 1, -1)]


def change_member_count(api: ApiClient, inv: Inventory, timeout: float, log: Callable[[str], None],
                        dry_run: bool = False) -> list[str]:
    """Bring the running tenant's member count to ``etcdReplicas``; lines for the report (none
    when the count is right or the tenant does not run yet)."""
    assert inv.hosted is not None
    have, want = live_members(api, inv), inv.hosted.etcdReplicas
    if have is None or have == want:
        return []
    if dry_run:
        return [f"would {line}" for line in count_steps(inv, have)]
    done = []
    for i in range(have, want):
        done.append(_grow(api, inv, i, timeout, log))
    for i in range(have - 1, want - 1, -1):
        done.append(_shrink(api, inv, i, timeout, log))
    if want == 1:
        # one member has no budget (render/tenant.py): the objects' converge writes, never deletes
        _delete(api, f"/apis/policy/v1/namespaces/{inv.hosted_namespace}/poddisruptionbudgets/etcd",
                "PodDisruptionBudget/etcd")
    return done


def _name(i: int) -> str:
    return f"{ETCD_SERVICE}-{i}"


def _delete_claim(api: ApiClient, inv: Inventory, i: int) -> None:
    # the StatefulSet's volumeClaimTemplates entry is "data" (render/tenant.py)
    _delete(api, f"/api/v1/namespaces/{inv.hosted_namespace}/persistentvolumeclaims/data-{_name(i)}",
            f"PersistentVolumeClaim/data-{_name(i)}")


def _replicas(api: ApiClient, inv: Inventory, n: int) -> None:
    rest(api, "PATCH", sts_path(inv), f"StatefulSet/{ETCD_SERVICE}", {"spec": {"replicas": n}},
         content_type=STRATEGIC_MERGE)


def _pods(api: ApiClient, inv: Inventory) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in component_pods(api, inv, "etcd")}


def _all_ready(api: ApiClient, inv: Inventory, n: int, what: str) -> str:
    """Every member 0..n-1's pod ready (a change is made only then); the first, to ask through."""
    pods = _pods(api, inv)
    waiting = [_name(i) for i in range(n) if not pod_ready(pods.get(_name(i), {}))]
    if waiting:
        raise EtcdOpError(f"{what}: etcd member(s) {', '.join(waiting)} not ready in namespace "
                          f"{inv.hosted_namespace}: a member count changes only while every member runs. "
                          "Nothing was changed")
    return _name(0)


def _ctl(api: ApiClient, inv: Inventory, via: str, args: list[str], what: str, deadline: float) -> str:
    """etcdctl in ``via``, asked again while etcd says "not yet" (NOT_YET) until ``deadline``."""
    while True:
        r = run_in_member(api, inv, via, [*ETCDCTL, *args], what, check=False, timeout=60)
        err = r.stderr.decode(errors="replace").strip()
        if r.rc == 0:
            return r.stdout.decode(errors="replace")
        if not any(s in err for s in NOT_YET) or time.monotonic() >= deadline:
            raise EtcdOpError(f"{via}: {what} failed (exit {r.rc}): {err[-500:]}")
        time.sleep(2)


def _find(members: list[Member], inv: Inventory, name: str) -> Member | None:
    """Member ``name`` as listed: by its peer URL, the one before the members' Services, or its
    name (a member not started yet has none)."""
    urls = (member_peer_url(inv, name), legacy_peer_url(inv, name))
    return next((m for m in members if any(u in m.peer_urls for u in urls) or m.name == name), None)


def _grow(api: ApiClient, inv: Inventory, i: int, timeout: float, log: Callable[[str], None]) -> str:
    name = _name(i)
    started, deadline = time.monotonic(), time.monotonic() + timeout
    via = _all_ready(api, inv, i, f"add {name}")
    members = member_list(api, inv, via)
    # members still under their legacy URLs run certificates that may not name the Services
    # yet (converge pushes the new ones after this): the new member joins as they are, and
    # move_peer_urls moves it with them
    moved = all(m.peer_urls == [member_peer_url(inv, m.name)] for m in members if m.name)
    url = (member_peer_url if moved else legacy_peer_url)(inv, name)
    # its Service first: the others reach a new member there (render/tenant.py)
    apply_objects(api, [member_service(inv, name)], inv.spec.kubernetes.version)
    mine = _find(members, inv, name)
    others = [m for m in members if m is not mine and (m.learner or not m.name)]
    if others:
        raise EtcdOpError(f"add {name}: member(s) {', '.join(m.name or m.peer_urls[0] for m in others)} not started "
                          "or not promoted: another change is half done. Nothing was changed")
    if mine is None:
        if name not in _pods(api, inv):
            # a claim left by an earlier member of that name (a shrink interrupted before its
            # delete): the new member must start empty, never on a removed member's data
            _delete_claim(api, inv, i)
        _ctl(api, inv, via, ["member", "add", name, "--learner", f"--peer-urls={url}"], f"add learner {name}", deadline)
        log(f"{name}: added as a learner")
        mine = _find(member_list(api, inv, via), inv, name)
        if mine is None:
            raise EtcdOpError(f"{via}: {name} was added but is not in the member list")
    _replicas(api, inv, i + 1)
    if mine.learner:
        log(f"{name}: started; promoting it once it is in sync")
        _ctl(api, inv, via, ["member", "promote", mine.id], f"promote {name}", deadline)
    while not pod_ready(_pods(api, inv).get(name, {})):
        if time.monotonic() >= deadline:
            raise EtcdOpError(f"{name}: promoted but its pod not ready after {timeout:g}s")
        time.sleep(2)
    line = f"added etcd member {name}: a learner, promoted once in sync, ready ({time.monotonic() - started:.0f} s)"
    log(line)
    return line


def _shrink(api: ApiClient, inv: Inventory, i: int, timeout: float, log: Callable[[str], None]) -> str:
    name = _name(i)
    started, deadline = time.monotonic(), time.monotonic() + timeout
    via = _all_ready(api, inv, i, f"remove {name}")       # the members that stay
    mine = _find(member_list(api, inv, via), inv, name)
    if mine is not None:
        _ctl(api, inv, via, ["member", "remove", mine.id], f"remove member {name}", deadline)
        log(f"{name}: removed from the cluster")
    _replicas(api, inv, i)
    while name in _pods(api, inv):
        if time.monotonic() >= deadline:
            raise EtcdOpError(f"{name}: removed, but its pod still there after {timeout:g}s")
        time.sleep(2)
    _delete_claim(api, inv, i)
    _delete(api, f"/api/v1/namespaces/{inv.hosted_namespace}/services/{name}", f"Service/{name}")
    line = (f"removed etcd member {name}, its pod, its Service and its volume claim data-{name} "
            f"({time.monotonic() - started:.0f} s)")
    log(line)
    return line


def move_peer_urls(api: ApiClient, inv: Inventory, timeout: float, log: Callable[[str], None]) -> list[str]:
    """Each member listed under another peer URL than its Service's (a tenant applied before the
    members' Services: legacy_peer_url) moved there with ``etcdctl member update``, which the
    others follow without a restart; lines for the report. Called once every member runs the
    current template: its certificate names its Service, which the others then dial."""
    if live_members(api, inv) is None:
        return []
    deadline, out = time.monotonic() + timeout, []
    via = _all_ready(api, inv, len(member_names(inv)), "move the members' peer URLs")
    for m in member_list(api, inv, via):
        want = member_peer_url(inv, m.name) if m.name else None
        if want is None or m.peer_urls == [want]:
            continue
        _ctl(api, inv, via, ["member", "update", m.id, f"--peer-urls={want}"], f"move {m.name}'s peer URL", deadline)
        out.append(f"etcd member {m.name}: peer URL {', '.join(m.peer_urls)} -> {want} (its own Service)")
        log(f"  hosting {inv.hosted_namespace}: {out[-1]}")
    return out


def _delete(api: ApiClient, path: str, what: str) -> None:
    try:
        rest(api, "DELETE", path, what)
    except ApiError as e:
        if e.status != 404:
            raise EtcdOpError(f"{what}: {status_message(e)}") from None
