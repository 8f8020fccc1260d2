"""etcd day 2 of a hosted tenant (planes/hosted.py, docs/hosted.md): its members are the pods of a StatefulSet in
the hosting cluster, reached through that cluster's API only (``pods/exec``: host/podexec.py).

The member list and a snapshot are etcdctl's answers in a member's container, with the client
certificate every member has (the etcd CA's peer pair). A snapshot is saved on the member's
volume (the root file system is read-only), read out with ``cat``, removed, and written on the
operator machine 0600, as for control hosts (planes/etcd_hosts.py).

A restore into the running tenant follows etcd's documented order as the control hosts' does:
the snapshot is first copied into every member and checked there (etcdutl snapshot status),
nothing stopped yet; then the apiservers, controller-managers and schedulers go (replicas 0),
each member is handed the snapshot and a new cluster token for its next start, the members'
pods are deleted together, and each new pod's start (installer/sh/etcd-member-start.sh)
writes its member of the new cluster from that file before etcd runs; the control plane is
scaled back once every member is ready. The workers' kubelets reconnect by themselves.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from installer.core.etcd_rules import EtcdOpError, Member
from installer.core.inventory import Inventory
from installer.core.render.tenant import (
    ETCD_RESTORE,
    ETCD_VOLUME,
    deployment_replicas,
    member_names,
)
from installer.engine.planes.etcd_hosts import SnapshotInfo, read_snapshot, restore_token, saved_snapshot, snapshot_dest
from installer.engine.steps import Step, plan, run_steps
from installer.host.kube import STRATEGIC_MERGE, ApiClient, ApiError, rest, status_message
from installer.host.tenant_etcd import (
    ETCDCTL,
    ETCDUTL,
    component_pods,
    member_list,
    pod_ready,
    ready_members,
    run_in_member,
    running_members,
)


def _sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


# --- members and snapshots -----------------------------------------------------------------

def members(api: ApiClient, inv: Inventory) -> list[Member]:
    # a ready member first; else any running one (a member with an alarm, NOSPACE, is not ready)
    try:
        pod = ready_members(api, inv)[0]
    except EtcdOpError:
        pod = running_members(api, inv)[0]
    return member_list(api, inv, pod)


def snapshot_save(api: ApiClient, inv: Inventory, dest, force: bool = False) -> SnapshotInfo:
    dest = snapshot_dest(dest, force)
    tmp = f"{ETCD_VOLUME}/snapshot-{int(time.time())}.db"
    q = shlex.quote(tmp)
    pod = ready_members(api, inv)[0]
    try:
        out = run_in_member(api, inv, pod, _sh(
            f"set -e; umask 077; {shlex.join(ETCDCTL)} endpoint status -w json; echo; "
            f"{shlex.join(ETCDCTL)} snapshot save {q} >/dev/null; {ETCDUTL} snapshot status {q} -w json"),
            "etcdctl snapshot save, etcdutl snapshot status").stdout.decode(errors="replace")
        data = run_in_member(api, inv, pod, ["/bin/cat", tmp], "read the snapshot").stdout
    finally:
        run_in_member(api, inv, pod, ["/bin/rm", "-f", tmp, f"{tmp}.part"], "remove the snapshot file", check=False)
    return saved_snapshot(pod, out, data, dest)


# --- restore into the running tenant -------------------------------------------------------

class _Restore:
    """What the restore's steps share."""

    def __init__(self, inv: Inventory, data: bytes, stamp: str, wait_timeout: float, log: Callable[[str], None]):
        self.inv, self.data, self.stamp, self.timeout, self.log = inv, data, stamp, wait_timeout, log
        self.api: ApiClient | None = None
        self.old_uids: set[str] = set()


def restore_plan(inv: Inventory, snapshot: str, stamp: str) -> list[str]:
    return plan(_steps(inv, str(snapshot), stamp))


def _steps(inv: Inventory, snapshot: str, stamp: str) -> list[Step[_Restore]]:
    ns, names = inv.hosted_namespace, member_names(inv)
    deployments = deployment_replicas(inv)
    return [
        Step(f"copy {snapshot} into every etcd member of namespace {ns} ({', '.join(names)}) beside its data, "
             "check it there (etcdutl snapshot status); nothing is stopped yet", _upload),
        Step(f"stop {', '.join(deployments)} (replicas 0), wait until their pods are gone", _stop_control_plane),
        Step(f"hand the snapshot to each member's next start, with cluster token {restore_token(inv, stamp)}",
             _commit),
        Step("delete every etcd member's pod: each new one restores its member from the snapshot, then starts; "
             "wait until all are ready", _restart_members),
        Step(f"start {', '.join(deployments)} again ({', '.join(str(n) for n in deployments.values())} replicas), "
             "wait until they are ready", _start_control_plane),
    ]


def _upload(r: _Restore) -> None:
    assert r.api is not None
    part = f"{ETCD_RESTORE}.part"
    names = member_names(r.inv)
    missing = set(names) - set(ready_members(r.api, r.inv))
    if missing:
        raise EtcdOpError(f"namespace {r.inv.hosted_namespace}: etcd member(s) {', '.join(sorted(missing))} not "
                          "ready: every member gets the snapshot, nothing was changed")
    done = []
    try:
        for pod in names:
            done.append(pod)
            run_in_member(r.api, r.inv, pod, _sh(
                'set -e; umask 077; rm -rf "$1"; mkdir -p "$1"; cat > "$1/snapshot.db"; printf %s "$2" > "$1/token"; '
                f'{ETCDUTL} snapshot status "$1/snapshot.db" -w json >/dev/null') + ["sh", part,
                                                                                   restore_token(r.inv, r.stamp)],
                "copy and check the snapshot", stdin=r.data)
    except Exception:
        for pod in done:
            run_in_member(r.api, r.inv, pod, ["/bin/rm", "-rf", part], "remove the snapshot copy", check=False)
        raise


def _scale(r: _Restore, replicas: dict[str, int]) -> None:
    assert r.api is not None
    for name, n in replicas.items():
        rest(r.api, "PATCH", f"/apis/apps/v1/namespaces/{r.inv.hosted_namespace}/deployments/{name}",
             f"Deployment/{name}", {"spec": {"replicas": n}}, content_type=STRATEGIC_MERGE)


def _until(r: _Restore, done: Callable[[], str], what: str) -> None:
    """Until ``done()`` says nothing is left (its answer otherwise: what is still waited for)."""
    deadline, last = time.monotonic() + r.timeout, ""
    while left := done():
        if left != last:
            r.log(f"  hosting {r.inv.hosted_namespace}: {left}")
            last = left
        if time.monotonic() > deadline:
            raise EtcdOpError(f"namespace {r.inv.hosted_namespace}: {what} not done after {r.timeout:.0f} s: {left}"
                              + STOPPED)
        time.sleep(2)


STOPPED = ("; the tenant's control plane is stopped: `installer etcd snapshot restore` again, or "
           "`installer apply` to start it on the data etcd has")


def _stop_control_plane(r: _Restore) -> None:
    assert r.api is not None
    _scale(r, {name: 0 for name in deployment_replicas(r.inv)})

    def left() -> str:
        pods = [p["metadata"]["name"] for c in deployment_replicas(r.inv) for p in component_pods(r.api, r.inv, c)]
        return f"{len(pods)} pod(s) still running: {', '.join(pods)}" if pods else ""
    _until(r, left, "stopping the control plane")


def _commit(r: _Restore) -> None:
    assert r.api is not None
    done = []
    for pod in member_names(r.inv):
        try:
            run_in_member(r.api, r.inv, pod, _sh(f'rm -rf {ETCD_RESTORE}; mv {ETCD_RESTORE}.part {ETCD_RESTORE}'),
                 "hand over the snapshot")
        except EtcdOpError as e:
            # a member handed the snapshot restores it at its next start, whatever happens here
            raise EtcdOpError(f"{e}; handed over to {', '.join(done) or 'no member'} already{STOPPED}") from None
        done.append(pod)


def _restart_members(r: _Restore) -> None:
    assert r.api is not None
    ns = r.inv.hosted_namespace
    r.old_uids = {p["metadata"]["uid"] for p in component_pods(r.api, r.inv, "etcd")}
    for pod in member_names(r.inv):
        try:
            rest(r.api, "DELETE", f"/api/v1/namespaces/{ns}/pods/{pod}", f"pod {pod}")
        except ApiError as e:
            if e.status != 404:
                raise EtcdOpError(f"pod {ns}/{pod}: cannot delete it: {status_message(e)}{STOPPED}") from None

    def left() -> str:
        pods = {p["metadata"]["name"]: p for p in component_pods(r.api, r.inv, "etcd")}
        waiting = [m for m in member_names(r.inv)
                   if m not in pods or pods[m]["metadata"]["uid"] in r.old_uids or not pod_ready(pods[m])]
        return f"etcd member(s) not back and ready: {', '.join(waiting)}" if waiting else ""
    _until(r, left, "the etcd members' restore")


def _start_control_plane(r: _Restore) -> None:
    from installer.host.hosting import wait_workloads
    assert r.api is not None
    replicas = deployment_replicas(r.inv)
    _scale(r, replicas)
    wait_workloads(r.api, r.inv.hosted_namespace, [("Deployment", n) for n in replicas], r.timeout, r.log)


def snapshot_restore(api: ApiClient, inv: Inventory, snapshot, wait_timeout: float = 120,
                     log: Callable[[str], None] = print) -> list[str]:
    """Restore ``snapshot`` into every member of the running tenant (the run holds its Lease);
    the members restored."""
    data, stamp = read_snapshot(snapshot)
    r = _Restore(inv, data, stamp, wait_timeout, log)
    r.api = api
    run_steps("etcd snapshot restore", _steps(inv, str(snapshot), stamp), r, log)
    return member_names(inv)
