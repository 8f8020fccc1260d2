"""A hosted tenant's NetworkPolicies: who may open a connection to and from its pods.

The tenant's namespace denies every connection in and out by default; each row of POLICIES
opens what one component needs, no more:

- etcd: clients (2379) only from its own members and the tenant's apiservers, peers (2380)
  only from its own members; it dials only its members (and DNS: members are named by their
  pods' DNS names).
- kube-apiserver (and konnectivity-server in the same pod): the two ports the tenant's
  Service exposes, from anywhere (its users, its workers and their konnectivity agents come
  from outside the hosting cluster; TLS with client certificates or tokens guards both); it
  dials only the tenant's etcd. Its webhooks, aggregated APIs and kubelets are reached through
  konnectivity (the egress selector), a Unix socket inside the pod: no connection here.
- kube-controller-manager and kube-scheduler: nothing comes in; they dial only the tenant's
  apiservers (through the Service, which is where the pods' port is matched).
- every pod: DNS, the hosting cluster's CoreDNS (``k8s-app: kube-dns`` in ``kube-system``).

What the hosting cluster's own nodes send (kubelet probes) is not a pod's connection: enforcers
let a node reach its pods (NetworkPolicy's rule for node traffic). A pod in any other
namespace, another tenant's included, reaches only the two exposed ports.

The policies only hold where the hosting cluster enforces them (``spec.network.policy`` of a
cluster this installer built; docs/hosted.md): ``apply`` checks that before it claims
isolation (engine/planes). Pure: objects only.
"""

from __future__ import annotations

from dataclasses import dataclass

from installer.core import components
from installer.core.inventory import Inventory
from installer.core.render.addons import konnectivity
from installer.core.render.manifests import LABELS

ETCD_PORT, PEER_PORT = components.port("etcd", "client"), components.port("etcd", "peer")
NAME_LABEL = "app.kubernetes.io/name"
TENANT_LABEL = "hiddenplane.io/tenant"
POLICY_PREFIX = "hiddenplane-"
DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
DNS_PORTS = (("UDP", 53), ("TCP", 53))
ANYONE = "*"            # a rule with no peers: from (or to) anywhere


@dataclass(frozen=True)
class Rule:
    """Connections on ``ports`` (TCP unless named) with ``peers``: components of this tenant,
    ANYONE, or "dns"."""
    peers: tuple[str, ...]
    ports: tuple[int | tuple[str, int], ...]


@dataclass(frozen=True)
class Policy:
    name: str
    components: tuple[str, ...]         # the pods it selects; () every pod of the namespace
    ingress: tuple[Rule, ...] | None    # None: the policy says nothing of ingress
    egress: tuple[Rule, ...] | None


def policies(inv: Inventory) -> tuple[Policy, ...]:
    """The tenant's policies, one row each (the module docstring says why each is so)."""
    api = inv.spec.apiServer.port
    return (
        Policy("default-deny", (), ingress=(), egress=()),
        Policy("dns", (), ingress=None, egress=(Rule(("dns",), DNS_PORTS),)),
        Policy("etcd", ("etcd",),
               ingress=(Rule(("etcd",), (ETCD_PORT, PEER_PORT)), Rule(("kube-apiserver",), (ETCD_PORT,))),
               egress=(Rule(("etcd",), (ETCD_PORT, PEER_PORT)),)),
        Policy("kube-apiserver", ("kube-apiserver",),
               ingress=(Rule((ANYONE,), (api, konnectivity.AGENT_PORT)),),
               egress=(Rule(("etcd",), (ETCD_PORT,)),)),
        Policy("controllers", ("kube-controller-manager", "kube-scheduler"),
               ingress=None, egress=(Rule(("kube-apiserver",), (api,)),)),
    )


def selector(inv: Inventory, comps: tuple[str, ...]) -> dict:
    """The tenant's pods of ``comps`` (every pod of the namespace: ``()``)."""
    if not comps:
        return {}
    match: dict = {"matchLabels": {TENANT_LABEL: inv.metadata.name}}
    if len(comps) == 1:
        match["matchLabels"][NAME_LABEL] = comps[0]
    else:
        match["matchExpressions"] = [{"key": NAME_LABEL, "operator": "In", "values": list(comps)}]
    return match


def _peers(inv: Inventory, rule: Rule) -> list[dict] | None:
    if ANYONE in rule.peers:
        return None
    out = []
    for p in rule.peers:
        out.append(DNS_PEER if p == "dns" else {"podSelector": selector(inv, (p,))})
    return out


def _ports(rule: Rule) -> list[dict]:
    return [{"protocol": p[0], "port": p[1]} if isinstance(p, tuple) else {"protocol": "TCP", "port": p}
            for p in rule.ports]


def _rules(inv: Inventory, rules: tuple[Rule, ...], direction: str) -> list[dict]:
    out = []
    for r in rules:
        entry: dict = {"ports": _ports(r)}
        peers = _peers(inv, r)
        if peers is not None:
            entry["from" if direction == "ingress" else "to"] = peers
        out.append(entry)
    return out


def network_policies(inv: Inventory) -> list[dict]:
    """The tenant's NetworkPolicy objects, in the order they are applied (the default deny first:
    a pod is never open while its own policy is still to come)."""
    out = []
    for p in policies(inv):
        spec: dict = {"podSelector": selector(inv, p.components), "policyTypes": []}
        for direction, rules in (("ingress", p.ingress), ("egress", p.egress)):
            if rules is None:
                continue
            spec["policyTypes"].append(direction.capitalize())
            spec[direction] = _rules(inv, rules, direction)
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": POLICY_PREFIX + p.name, "namespace": inv.hosted_namespace,
                                 "labels": {**LABELS, TENANT_LABEL: inv.metadata.name}},
                    "spec": spec})
    return out


# --- the enforcement probe: apply's proof that the hosting cluster enforces these -------------

# From an etcd member, a TCP connection to an apiserver pod's secure port: the etcd row's egress
# denies it and nothing else does (the apiserver row takes anyone on that port), so it reaches
# the pod exactly when the member's node enforces nothing. Busybox's nc in etcd's image.
PROBE_SECONDS = 3
RISK = ("any pod of the hosting cluster, another tenant's included, reaches this tenant's etcd and "
        "control-plane pods, guarded by TLS alone")


def probe_argv(address: str, port: int) -> list[str]:
    return ["/bin/nc", "-w", str(PROBE_SECONDS), address, str(port)]


def probe_verdict(rc: int, stderr: str) -> str:
    """``denied`` (the connection was dropped, or rejected as an enforcer rejects: host
    unreachable), ``reached`` (it was accepted, or the pod's own kernel refused it: a packet got
    there), else ``unknown`` (a network with no route at all proves no policy either)."""
    text = stderr.lower()
    if rc == 0 or "refused" in text:
        return "reached"
    if any(w in text for w in ("timed out", "host is unreachable", "no route to host")):
        return "denied"
    return "unknown"
