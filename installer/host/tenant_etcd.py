"""A hosted tenant's etcd members, reached through the hosting cluster's API (docs/hosted.md):
etcdctl in a member's container (``pods/exec``, host/podexec.py), the members' pods, and the
running member count (a change of it: host/tenant_members.py).
"""

from __future__ import annotations

from installer.core.etcd_rules import EtcdOpError, Member, parse_members
from installer.core.inventory import Inventory
from installer.core.pki.specs import ETCD_SERVICE
from installer.core.render.control import ETCD_PKI_DIR
from installer.core.render.tenant import BIN, component_selector, member_names
from installer.host.kube import ApiClient, ApiError, rest, status_message
from installer.host.podexec import ExecResult, pod_exec

CONTAINER = "etcd"
ETCDCTL = [f"{BIN}/etcdctl", "--endpoints=https://127.0.0.1:2379", f"--cacert={ETCD_PKI_DIR}/ca.crt",
           f"--cert={ETCD_PKI_DIR}/peer.crt", f"--key={ETCD_PKI_DIR}/peer.key", "--dial-timeout=3s",
           "--command-timeout=30s"]
ETCDUTL = f"{BIN}/etcdutl"


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


def running_members(api: ApiClient, inv: Inventory) -> list[str]:
    """The etcd pods whose etcd container runs, ready or not (a member with an alarm fails its
    readiness probe, etcdctl's health), in member order; an EtcdOpError when none does."""
    running = {p["metadata"]["name"] for p in component_pods(api, inv, "etcd")
               if any(c.get("name") == CONTAINER and "running" in (c.get("state") or {})
                      for c in (p.get("status") or {}).get("containerStatuses") or [])}
    out = [m for m in member_names(inv) if m in running]
    if not out:
        raise EtcdOpError(f"namespace {inv.hosted_namespace}: no etcd member's container is running")
    return out


def etcdctl_in(api: ApiClient, inv: Inventory, pod: str, args: list[str], what: str, timeout: float) -> str:
    """etcdctl ``args`` in ``pod`` against its own member only (its command timeout ``timeout``)."""
    argv = [a for a in ETCDCTL if not a.startswith("--command-timeout=")] + [f"--command-timeout={int(timeout)}s"]
    return run_in_member(api, inv, pod, [*argv, *args], what, timeout=timeout + 30).stdout.decode(errors="replace")


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

def sts_path(inv: Inventory) -> str:
    return f"/apis/apps/v1/namespaces/{inv.hosted_namespace}/statefulsets/{ETCD_SERVICE}"


def live_members(api: ApiClient, inv: Inventory) -> int | None:
    """The StatefulSet's replica count; None before the first apply."""
    try:
        return int(((rest(api, "GET", sts_path(inv), "StatefulSet/etcd") or {}).get("spec") or {}).get("replicas", 1))
    except ApiError as e:
        if e.status == 404:
            return None
        raise EtcdOpError(f"StatefulSet {inv.hosted_namespace}/etcd: {status_message(e)}") from None
