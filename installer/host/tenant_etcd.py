"""A hosted tenant's etcd members, reached through the hosting cluster's API (docs/hosted.md):
etcdctl in a member's container (``pods/exec``, host/podexec.py), the members' pods, and the
change of their number one member at a time.

The member count follows ``spec.controlPlane.hosted.etcdReplicas`` (1 or 3). A change is made
by `installer apply` before the tenant's objects are converged (phases/start_hosted.py), one
member at a time with every member ready first:

- up: the StatefulSet gets one more replica with its template as it is; the new pod's start
  (installer/sh/etcd-member-start.sh) finds the cluster, adds its member and joins empty; the
  next only once it is listed as started and ready;
- down: the highest member is removed from the cluster first (etcdctl, from member 0, which
  always stays), then its pod goes (one replica less) and its volume claim is deleted: a later
  scale-up starts that member empty, as a new one.

Then the converge writes the new template (every member's flags name the new set, the
apiservers' ``--etcd-servers`` too): each member restarts once on its data, one at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from installer.core.etcd_rules import EtcdOpError, Member, parse_members
from installer.core.inventory import Inventory
from installer.core.pki.specs import ETCD_SERVICE
from installer.core.render.control import ETCD_PKI_DIR
from installer.core.render.tenant import BIN, component_selector, member_names
from installer.host.kube import STRATEGIC_MERGE, ApiClient, ApiError, rest, status_message
from installer.host.podexec import ExecResult, pod_exec

CONTAINER = "etcd"
ETCDCTL = [f"{BIN}/etcdctl", "--endpoints=https://127.0.0.1:2379", f"--cacert={ETCD_PKI_DIR}/ca.crt",
           f"--cert={ETCD_PKI_DIR}/peer.crt", f"--key={ETCD_PKI_DIR}/peer.key", "--dial-timeout=3s",
           "--command-timeout=30s"]
ETCDUTL = f"{BIN}/etcdutl"
FIRST = f"{ETCD_SERVICE}-0"          # the member that always stays


def component_pods(api: ApiClient, inv: Inventory, component: str) -> list[dict]:
    found = rest(api, "GET", f"/api/v1/namespaces/{inv.hosted_namespace}/pods", f"the {component} pods",
                 query={"labelSelector": component_selector(inv, component)}) or {}
    return found.get("items", [])


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def ready_members(api: ApiClient, inv: Inventory, names: list[str] | None = None) -> list[str]:
    """The etcd pods of ``names`` (the inventory's members) that are ready, in member order; an
    EtcdOpError when none is."""
    ready = {p["metadata"]["name"] for p in component_pods(api, inv, "etcd") if pod_ready(p)}
    out = [m for m in names or member_names(inv) if m in ready]
    if not out:
        raise EtcdOpError(f"namespace {inv.hosted_namespace}: no etcd member's pod is ready")
    return out


def run_in_member(api: ApiClient, inv: Inventory, pod: str, argv: list[str], what: str,
                  stdin: bytes | None = None, check: bool = True, timeout: float = 300) -> ExecResult:
    r = pod_exec(api, inv.hosted_namespace, pod, CONTAINER, argv, stdin=stdin, timeout=timeout)
    if check and r.rc != 0:
        raise EtcdOpError(f"{pod}: {what} failed (exit {r.rc}): {r.stderr.decode(errors='replace').strip()[-500:]}")
    return r


def member_list(api: ApiClient, inv: Inventory, pod: str) -> list[Member]:
    out = run_in_member(api, inv, pod, [*ETCDCTL, "member", "list", "-w", "json"], "etcdctl member list").stdout
    return parse_members(out.decode(), pod)


# --- the member count ---------------------------------------------------------------------------

def _sts_path(inv: Inventory) -> str:
    return f"/apis/apps/v1/namespaces/{inv.hosted_namespace}/statefulsets/{ETCD_SERVICE}"


def live_members(api: ApiClient, inv: Inventory) -> int | None:
    """The StatefulSet's replica count; None before the first apply."""
    try:
        return int(((rest(api, "GET", _sts_path(inv), "StatefulSet/etcd") or {}).get("spec") or {}).get("replicas", 1))
    except ApiError as e:
        if e.status == 404:
            return None
        raise EtcdOpError(f"StatefulSet {inv.hosted_namespace}/etcd: {status_message(e)}") from None


def scale_plan(have: int | None, want: int) -> list[str]:
    """The members added (``+etcd-N``) or removed (``-etcd-N``), in order; none without a change."""
    if have is None or have == want:
        return []
    if want > have:
        return [f"+{ETCD_SERVICE}-{i}" for i in range(have, want)]
    return [f"-{ETCD_SERVICE}-{i}" for i in range(have - 1, want - 1, -1)]


def _all_ready(api: ApiClient, inv: Inventory, count: int) -> None:
    names = [f"{ETCD_SERVICE}-{i}" for i in range(count)]
    ready = set(ready_members(api, inv, names))
    if missing := [n for n in names if n not in ready]:
        raise EtcdOpError(f"namespace {inv.hosted_namespace}: etcd member(s) {', '.join(missing)} not ready: the "
                          "member count changes only with every member healthy; nothing was changed")


def _replicas(api: ApiClient, inv: Inventory, n: int) -> None:
    rest(api, "PATCH", _sts_path(inv), "StatefulSet/etcd", {"spec": {"replicas": n}}, content_type=STRATEGIC_MERGE)


def _until(what: str, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise EtcdOpError(f"{what}: not done after {timeout:.0f} s")
        time.sleep(2)


def _add(api: ApiClient, inv: Inventory, member: str, count: int, timeout: float) -> None:
    _replicas(api, inv, count)

    def joined() -> bool:
        pods = {p["metadata"]["name"]: p for p in component_pods(api, inv, "etcd")}
        if member not in pods or not pod_ready(pods[member]):
            return False
        listed = member_list(api, inv, FIRST)
        return sum(1 for m in listed if m.name and not m.learner) == count
    _until(f"etcd member {member} joining", joined, timeout)


def _remove(api: ApiClient, inv: Inventory, member: str, count: int, timeout: float) -> None:
    ns = inv.hosted_namespace
    listed = [m for m in member_list(api, inv, FIRST) if m.name == member]
    if listed:
        deadline = time.monotonic() + 60
        while (r := run_in_member(api, inv, FIRST, [*ETCDCTL, "member", "remove", listed[0].id],
                                  f"etcdctl member remove {member}", check=False)).rc != 0:
            # etcd refuses a change while a member is new (strict reconfiguration check)
            if time.monotonic() > deadline or b"unhealthy cluster" not in r.stderr + r.stdout:
                raise EtcdOpError(f"{FIRST}: etcdctl member remove {member}: "
                                  f"{r.stderr.decode(errors='replace').strip()[-300:]}")
            time.sleep(1)
    _replicas(api, inv, count)
    _until(f"pod {member} gone", lambda: member not in {p["metadata"]["name"]
                                                        for p in component_pods(api, inv, "etcd")}, timeout)
    try:
        rest(api, "DELETE", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/data-{member}", f"claim data-{member}")
    except ApiError as e:
        if e.status != 404:
            raise EtcdOpError(f"claim {ns}/data-{member}: {status_message(e)}") from None


def scale(api: ApiClient, inv: Inventory, timeout: float, log: Callable[[str], None],
          dry_run: bool = False) -> list[str]:
    """Bring the tenant's member count to the inventory's, one member at a time (module doc);
    the changes in words (what would be done, in a dry run)."""
    assert inv.hosted is not None
    have, want = live_members(api, inv), inv.hosted.etcdReplicas
    steps = scale_plan(have, want)
    if not steps:
        return []
    assert have is not None
    words = [f"{'add' if s[0] == '+' else 'remove'} etcd member {s[1:]}" for s in steps]
    if dry_run:
        return [f"would {w}" for w in words]
    count = have
    for step, said in zip(steps, words):
        _all_ready(api, inv, count)
        log(f"  hosting {inv.hosted_namespace}: {said} ({count} -> {count + (1 if step[0] == '+' else -1)} members)")
        if step[0] == "+":
            count += 1
            _add(api, inv, step[1:], count, timeout)
        else:
            count -= 1
            _remove(api, inv, step[1:], count, timeout)
    if count == 1:
        # one member: its PodDisruptionBudget (rendered for three) goes with the others
        try:
            rest(api, "DELETE", f"/apis/policy/v1/namespaces/{inv.hosted_namespace}/poddisruptionbudgets/etcd",
                 "PodDisruptionBudget/etcd")
        except ApiError as e:
            if e.status != 404:
                raise EtcdOpError(f"PodDisruptionBudget {inv.hosted_namespace}/etcd: {status_message(e)}") from None
    return words

