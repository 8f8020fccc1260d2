"""Rolling a hosted tenant's control plane (planes/hosted.py, docs/hosted.md): in ``installer
upgrade`` its control plane is the objects of its namespace in the hosting cluster, so its turn
is theirs; its workers' turns are the same as any cluster's (actions/upgrade.py). Every function
takes the hosting cluster's client of the command's plane (``HostedPlane.api``).

What runs is read from the pods (their images' tags): a rollout cut short leaves old pods, and
the oldest counts, as the oldest control host does. The control plane's turn in the same order
as control hosts': etcd first when its version changes (the StatefulSet's rolling update: one
member at a time, each ready, that is healthy, before the next), then the apiserver replicas
(a rolling update that adds one new replica before it takes an old one away: ``maxSurge 1``,
``maxUnavailable 0``), then the controller-managers and schedulers; each component's objects
(its files' Secrets and ConfigMaps with it) are applied alone and waited for before the next.

`certs renew` rolls the same way (``roll``); `ca rotate` stops the whole control plane first
(``stop``: members of two CAs cannot talk) and starts it with its new files.
"""

from __future__ import annotations

import time

from installer.core.errors import InstallerError
from installer.core.inventory import Inventory
from installer.core.pki.specs import HOSTED_ETCD
from installer.core.render.tenant import deployment_replicas, render_tenant
from installer.core.render.tenant_network import NAME_LABEL
from installer.core.render.tenant_placement import Placement
from installer.core.upgrade_rules import HostState, oldest
from installer.host.kube import STRATEGIC_MERGE, ApiClient, rest
from installer.host.tenant_etcd import component_pods, pod_ready

# the virtual control host of a hosted tenant, as the upgrade's order names it
CONTROL = HOSTED_ETCD


def _tag(image: str) -> str:
    return image.rpartition(":")[2]


def control_state(api: ApiClient, inv: Inventory) -> tuple[HostState, dict[str, bool]]:
    """The tenant's control plane as one control host of the upgrade's order (the oldest
    Kubernetes and etcd its pods run), and each etcd member's pod -> ready (its readiness is
    etcd's endpoint health)."""
    kube = [_tag(c["image"]) for name in deployment_replicas(inv) for p in component_pods(api, inv, name)
            for c in p["spec"]["containers"] if c["name"] == name]
    members = component_pods(api, inv, "etcd")
    etcd = ["v" + _tag(c["image"]).split("-")[0] for p in members for c in p["spec"]["containers"]
            if c["name"] == "etcd"]
    health = {p["metadata"]["name"]: pod_ready(p) for p in members}
    return HostState(CONTROL, "control", oldest(kube), oldest(etcd)), health


NAMESPACE_WIDE = ("Namespace", "PriorityClass", "ResourceQuota", "LimitRange", "NetworkPolicy")


def component_objects(inv: Inventory, material, components: tuple[str, ...], placement=None) -> list[dict]:
    """The tenant's rendered objects of ``components`` (by their component label), after what
    holds for the whole namespace (the Namespace, its priority, quota and NetworkPolicies): a roll
    re-applies those too."""
    objects = render_tenant(inv, material, placement or Placement()).objects
    return [o for o in objects if o["kind"] in NAMESPACE_WIDE
            or (o["metadata"].get("labels") or {}).get(NAME_LABEL) in components]


def roll(api: ApiClient, inv: Inventory, material, components: tuple[str, ...], timeout: float, log) -> list[str]:
    """Apply ``components``' objects as ``inv`` renders them and wait for their workloads."""
    from installer.host import hosting, tenant_guards
    tenant_guards.refuse_root_tenant(api, inv)
    objects = component_objects(inv, material, components, tenant_guards.place(api, inv))
    workloads = [(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    changed = hosting.converge(api, objects, inv.spec.kubernetes.version)
    for kind, name, action in changed:
        if action != "unchanged":
            log(f"  hosting {inv.hosted_namespace}: {action} {kind} {name}")
    return hosting.wait_workloads(api, inv.hosted_namespace, workloads, timeout, log)


def running_pods(api: ApiClient, inv: Inventory, components: tuple[str, ...]) -> set[str]:
    """The names of ``components``' pods that run and are not being deleted: once a roll is
    done, the new ReplicaSet's only (a pod's name is its hostname, the start of a leader's identity)."""
    return {p["metadata"]["name"] for c in components for p in component_pods(api, inv, c)
            if not p["metadata"].get("deletionTimestamp")}


ETCD = ("etcd",)
APISERVER = ("kube-apiserver",)
CONTROLLERS = ("kube-controller-manager", "kube-scheduler")


# --- stopping and starting the whole control plane (a CA rotation) -------------------------------

def stop(api: ApiClient, inv: Inventory, timeout: float, log, etcd: bool = False) -> None:
    """Every apiserver, controller-manager and scheduler (and with ``etcd`` every member) gone:
    replicas 0, waited until no pod of them is left; the members' volumes stay."""
    ns = inv.hosted_namespace
    names = [*deployment_replicas(inv), *(["etcd"] if etcd else [])]
    for name in names:
        kind = "statefulsets" if name == "etcd" else "deployments"
        rest(api, "PATCH", f"/apis/apps/v1/namespaces/{ns}/{kind}/{name}", f"{kind}/{name}",
             {"spec": {"replicas": 0}}, content_type=STRATEGIC_MERGE)
    deadline, last = time.monotonic() + timeout, ""
    while pods := [p["metadata"]["name"] for n in names for p in component_pods(api, inv, n)]:
        line = f"{len(pods)} pod(s) still running: {', '.join(pods)}"
        if line != last:
            log(f"  hosting {ns}: {line}")
            last = line
        if time.monotonic() > deadline:
            raise InstallerError(f"namespace {ns}: {line} after {timeout:.0f} s")
        time.sleep(2)


ALL = ETCD + APISERVER + CONTROLLERS
