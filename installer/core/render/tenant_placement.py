"""Where a hosted tenant's control-plane pods run in the hosting cluster, and how its exposed
addresses reach them (docs/hosted.md, "A lost hosting node").

- Spread: etcd members and apiserver replicas on distinct hosting nodes, required unless the
  inventory accepts sharing (``hosted.spread: preferred``, which names the risk); the
  leader-elected controllers by preference; across zones where nodes are labelled.
- Each exposed address serves its own node's apiserver replica (``NodePort``): the API Service's
  ``externalTrafficPolicy`` is ``Local`` and the replicas are pinned to the nodes whose addresses
  ``expose.addresses`` lists. With the default ``Cluster`` policy every address forwarded a share
  of new connections to every replica, also to one on a hosting node that was gone and not yet
  NotReady (about 50 s on the lab: one request in four timed out through the addresses that
  stayed up). Now a lost node takes only its own address with it, whose health the workers'
  balancers already check every second (/readyz, etcd included: a returning replica is used
  again once it serves). A ``LoadBalancer`` keeps its own health checks on the nodes (the
  policy's health-check port); its replicas are not pinned.
- The replicas' roll keeps a serving replica on every exposed node (``spread``); a drained
  exposed node's replica waits for it, its address out of the balancers meanwhile.

Pure: ``placement`` reads the hosting nodes as the API lists them; host/tenant_guards.py lists
them and refuses what cannot be placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from installer.core.inventory import Inventory
from installer.core.render.tenant_network import NAME_LABEL, TENANT_LABEL

SPREAD_KEY = "kubernetes.io/hostname"
ZONE_KEY = "topology.kubernetes.io/zone"
# the components whose replicas must not share a node: etcd's quorum and the API's availability
SPREAD = ("etcd", "kube-apiserver")
API = "kube-apiserver"
# the node addresses a NodePort answers on
NODE_ADDRESS_TYPES = ("InternalIP", "ExternalIP")
EXPOSED = "spec.controlPlane.hosted.expose.addresses"


@dataclass(frozen=True)
class Placement:
    """The hosting nodes behind ``expose.addresses``, in its order (empty: not pinned)."""
    exposed: tuple[str, ...] = ()


class PlacementError(ValueError):
    """The inventory's exposed addresses or spread cannot be met by the hosting nodes."""


def _term(inv: Inventory, component: str, key: str) -> dict:
    return {"topologyKey": key,
            "labelSelector": {"matchLabels": {TENANT_LABEL: inv.metadata.name, NAME_LABEL: component}}}


def affinity(inv: Inventory, component: str, placement: Placement = Placement()) -> dict:
    """Replicas on distinct hosting nodes: required for ``SPREAD`` unless ``hosted.spread:
    preferred``, preferred for the rest (leader-elected: one running is enough). Pinned
    apiservers (``spread``) are kept apart by their spread constraint instead, which lets a
    roll's new replica start beside an old one."""
    assert inv.hosted is not None
    term = _term(inv, component, SPREAD_KEY)
    pinned = component == API and bool(placement.exposed)
    if component in SPREAD and inv.hosted.spread == "required" and not pinned:
        out: dict = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    else:
        out = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": term}]}}
    if pinned:
        out["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": SPREAD_KEY, "operator": "In", "values": sorted(placement.exposed)}]}]}}
    return out


def spread(inv: Inventory, component: str, placement: Placement = Placement()) -> list[dict]:
    """Across zones where the hosting nodes are labelled with one (best effort: a node without
    the label still takes pods). Pinned apiservers also evenly over the exposed nodes, counted
    per revision (``pod-template-hash``): at rest one on each node; in a roll the new replicas
    spread among themselves while the old ones stay, and a ReplicaSet scaling down removes
    first the replica that shares its node (the ReplicaSet controller's rank), so no exposed
    node is left without a serving replica. A cordoned exposed node still counts (taints are
    ignored): a replica drained from it waits for it rather than doubling up elsewhere."""
    out = [{"maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway", **_term(inv, component, ZONE_KEY)}]
    if component == API and placement.exposed:
        out.append({"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule", **_term(inv, component, SPREAD_KEY),
                    "matchLabelKeys": ["pod-template-hash"]})
    return out


# the API Service's: each node (NodePort), or the load balancer as its health checks of the
# nodes (the Service's health-check port) tell it, sends only to the replicas on that node
TRAFFIC_POLICY = {"externalTrafficPolicy": "Local"}


# --- the hosting nodes ------------------------------------------------------------------------

def schedulable(nodes: list[dict]) -> list[str]:
    """The names of ``nodes`` (as the API lists them) that take the tenant's pods: Ready, not
    cordoned, no NoSchedule or NoExecute taint (the pods tolerate none)."""
    out = []
    for n in nodes:
        spec, status = n.get("spec") or {}, n.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        tainted = any(t.get("effect") in ("NoSchedule", "NoExecute") for t in spec.get("taints") or [])
        if ready and not spec.get("unschedulable") and not tainted:
            out.append(n["metadata"]["name"])
    return out


def node_addresses(node: dict) -> list[str]:
    return [a["address"] for a in (node.get("status") or {}).get("addresses") or []
            if a.get("type") in NODE_ADDRESS_TYPES and a.get("address")]


def exposed_nodes(inv: Inventory, nodes: list[dict]) -> tuple[str, ...]:
    """The node behind each of ``expose.addresses`` (NodePort; () for a LoadBalancer), or
    PlacementError naming the address no node has, or two that are one node's."""
    assert inv.hosted is not None
    if inv.hosted.expose.type != "NodePort":
        return ()
    owner = {a: n["metadata"]["name"] for n in nodes for a in node_addresses(n)}
    out: list[str] = []
    for i, address in enumerate(inv.hosted.expose.addresses):
        name = owner.get(address)
        if name is None:
            known = ", ".join(f"{n['metadata']['name']} {'/'.join(node_addresses(n)) or '-'}" for n in nodes)
            raise PlacementError(
                f"{EXPOSED}[{i}] ({address}) is no hosting node's address (nodes: {known or 'none'}): with "
                "expose.type NodePort each address is a hosting node's, serving the apiserver replica on that node")
        if name in out:
            raise PlacementError(f"{EXPOSED}[{i}] ({address}) is node {name}'s, as an earlier address is: list "
                                 "one address per hosting node (each serves that node's replica)")
        out.append(name)
    return tuple(out)


def nodes_needed(inv: Inventory, placement: Placement = Placement()) -> int:
    """Schedulable hosting nodes a required spread needs: one per etcd member, and one per
    apiserver replica (plus one for the replica a roll adds, unless pinned: see ``spread``)."""
    assert inv.hosted is not None
    return max(inv.hosted.etcdReplicas, inv.hosted.apiServerReplicas + (0 if placement.exposed else 1))


def placement(inv: Inventory, nodes: list[dict]) -> Placement:
    """Where the tenant's pods go on ``nodes``, or PlacementError saying why they cannot as the
    inventory requires and what to change."""
    assert inv.hosted is not None
    hosted, have = inv.hosted, schedulable(nodes)
    pinned = Placement(exposed_nodes(inv, nodes))
    risk = ("add nodes, or accept that replicas share a node with spec.controlPlane.hosted.spread: preferred "
            "(losing that node then takes them together: etcd's quorum, or the API)")
    if hosted.spread == "required" and len(have) < (need := nodes_needed(inv, pinned)):
        raise PlacementError(
            f"the hosting cluster has {len(have)} schedulable node(s) ({', '.join(have) or 'none'}); spreading "
            f"{hosted.etcdReplicas} etcd member(s) and {hosted.apiServerReplicas} apiserver replicas needs "
            f"{need}. {risk[0].upper()}{risk[1:]}")
    exposed = pinned.exposed
    want = min(hosted.apiServerReplicas, len(exposed)) if hosted.spread == "preferred" else hosted.apiServerReplicas
    if exposed and len(candidates := [n for n in exposed if n in have]) < want:
        raise PlacementError(
            f"the apiserver replicas, spread over the nodes {EXPOSED} names ({', '.join(exposed)}), need "
            f"{want} of them schedulable; {len(candidates)} are ({', '.join(candidates) or 'none'}): make one "
            "schedulable again (uncordon it), expose the API on more nodes, lower apiServerReplicas"
            + ("" if hosted.spread == "preferred" else f", or {risk}"))
    return pinned
