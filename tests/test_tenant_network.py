"""A hosted tenant's NetworkPolicies (render/tenant_network.py), the hosting cluster's enforcer
(render/addons/netpol.py) and apply's enforcement probe, without a cluster.

The policies are read here by a small evaluator of NetworkPolicy's rules (the subset they use:
pod and namespace selectors by labels, TCP/UDP ports), so that what is asserted is who can
connect to whom, as an enforcer decides it, not the shape of the YAML. The real lab proves an
enforcer decides the same (tests/test_real_hosted.py).
"""

from __future__ import annotations

import pytest
import yaml

from installer.core import inventory
from installer.core.errors import InventoryError
from installer.core.render import tenant
from installer.core.render.addons import addon_objects, netpol
from installer.core.render.tenant_network import (
    DNS_PEER,
    network_policies,
    probe_verdict,
)
from installer.lab import lab as lab_mod
from installer.lab.model import DEFAULT_SUBNET, LabPaths, LabSpec

from .test_hosted import NS, TENANT, parse, problems

API, AGENT, ADMIN = 6443, 8132, 8133


@pytest.fixture
def inv(tmp_path):
    return parse(TENANT, tmp_path)


# --- an evaluator of the rules the policies use ----------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, src: dict) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer      # no ipBlock used
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src["ns"]})
    else:
        ns_ok = src["ns"] == policy_ns
    return ns_ok and _selects(peer.get("podSelector") or {}, src["labels"])


def _port_matches(ports: list[dict], port: int, proto: str) -> bool:
    return not ports or any(p.get("protocol", "TCP") == proto and p["port"] == port for p in ports)


def _allowed_one_way(policies: list[dict], direction: str, pod: dict, peer: dict, port: int, proto: str) -> bool:
    """Whether ``pod``'s policies of ``direction`` let the connection (to or from ``peer``) be:
    isolated only when some policy of that type selects it; then some rule must allow it."""
    key = "from" if direction == "Ingress" else "to"
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod["ns"]
                 and direction in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], pod["labels"])]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(direction.lower()) or []:
            peers = rule.get(key)
            if (peers is None or any(_peer_matches(x, p["metadata"]["namespace"], peer) for x in peers)) \
                    and _port_matches(rule.get("ports") or [], port, proto):
                return True
    return False


def can_connect(policies: list[dict], src: dict, dst: dict, port: int, proto: str = "TCP") -> bool:
    return (_allowed_one_way(policies, "Egress", src, dst, port, proto)
            and _allowed_one_way(policies, "Ingress", dst, src, port, proto))


def pod_of(inv, component: str) -> dict:
    return {"ns": NS, "labels": {"hiddenplane.io/tenant": inv.metadata.name, "app.kubernetes.io/name": component}}


# a pod in another namespace wearing the tenant's apiserver labels: labels alone open nothing
OTHER = {"ns": "hp-other", "labels": {"hiddenplane.io/tenant": "tenant-a", "app.kubernetes.io/name": "kube-apiserver"}}
DNS = {"ns": "kube-system", "labels": {"k8s-app": "kube-dns"}}


# --- who reaches whom ----------------------------------------------------------------------------

def test_a_pod_of_another_namespace_reaches_only_the_two_exposed_ports(inv):
    """Another tenant's pod (labelled like ours, even) reaches the apiserver and konnectivity
    agent ports and nothing else of the tenant: not etcd, not konnectivity's admin port, not the
    controllers."""
    pols = network_policies(inv)
    etcd, api = pod_of(inv, "etcd"), pod_of(inv, "kube-apiserver")
    assert can_connect(pols, OTHER, api, API) and can_connect(pols, OTHER, api, AGENT)
    for dst, port in ((etcd, 2379), (etcd, 2380), (api, ADMIN), (api, 8134),
                      (pod_of(inv, "kube-controller-manager"), 10257), (pod_of(inv, "kube-scheduler"), 10259)):
        assert not can_connect(pols, OTHER, dst, port), (dst, port)


def test_each_component_dials_only_what_it_needs(inv):
    pols = network_policies(inv)
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
    allowed = {("etcd", "etcd", 2379), ("etcd", "etcd", 2380), ("kube-apiserver", "etcd", 2379),
               ("kube-controller-manager", "kube-apiserver", API), ("kube-scheduler", "kube-apiserver", API)}
    for src in names:
        for dst in names:
            for port in (2379, 2380, API, AGENT, ADMIN):
                want = (src, dst, port) in allowed
                assert can_connect(pols, pod_of(inv, src), pod_of(inv, dst), port) == want, (src, dst, port)
    # no way out of the namespace but DNS: not the hosting API, not another tenant
    for src in map(lambda n: pod_of(inv, n), names):
        assert can_connect(pols, src, DNS, 53, "UDP") and can_connect(pols, src, DNS, 53, "TCP")
        assert not can_connect(pols, src, OTHER, 2379) and not can_connect(pols, src, DNS, 443)


def test_the_probe_asks_what_only_the_policies_deny(inv):
    """apply's probe, an etcd member dialling an apiserver pod's secure port, is denied by the
    policies and by nothing else: the same connection from outside is allowed (so a denied probe
    means the policies were enforced, not that the port was closed)."""
    pols = network_policies(inv)
    assert not can_connect(pols, pod_of(inv, "etcd"), pod_of(inv, "kube-apiserver"), API)
    assert can_connect(pols, OTHER, pod_of(inv, "kube-apiserver"), API)
    assert can_connect([], pod_of(inv, "etcd"), pod_of(inv, "kube-apiserver"), API)


def test_the_default_deny_comes_first_and_every_policy_before_any_pod(inv, tmp_path):
    from installer.api import prepare
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(TENANT))
    p = prepare(path, tmp_path / "state")
    kinds = [o["kind"] for o in tenant.render_tenant(p.inventory, p.material).objects]
    last_policy = max(i for i, k in enumerate(kinds) if k == "NetworkPolicy")
    first_workload = min(i for i, k in enumerate(kinds) if k in ("StatefulSet", "Deployment"))
    assert kinds[0] == "Namespace" and last_policy < first_workload
    first = network_policies(inv)[0]["spec"]
    assert first == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}


def test_dns_is_the_hosting_clusters_coredns_by_its_namespace_name():
    # kubernetes.io/metadata.name is set by the apiserver on every namespace and cannot be
    # changed: a namespace an attacker makes cannot pose as kube-system
    assert DNS_PEER["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}


# --- the probe's verdict ------------------------------------------------------------------------

@pytest.mark.parametrize("rc, stderr, verdict", [
    (0, "", "reached"),
    (1, "nc: can't connect to remote host (10.244.1.5): Connection refused", "reached"),
    (1, "nc: timed out", "denied"),
    (1, "nc: can't connect to remote host (10.244.1.5): No route to host", "denied"),
    (1, "nc: can't connect to remote host (10.244.1.5): Host is unreachable", "denied"),
    (1, "nc: can't connect to remote host (10.244.1.5): Network is unreachable", "unknown"),
    (127, "/bin/sh: nc: not found", "unknown"),
    (1, "", "unknown"),
])
def test_the_probe_tells_dropped_from_reached(rc, stderr, verdict):
    assert probe_verdict(rc, stderr) == verdict


def test_requiring_enforcement_is_the_default_and_a_boolean(tmp_path):
    assert parse(TENANT, tmp_path).hosted.requireNetworkPolicy is True
    bad = {**TENANT, "spec": {**TENANT["spec"], "controlPlane": {
        **TENANT["spec"]["controlPlane"], "hosted": {**TENANT["spec"]["controlPlane"]["hosted"],
                                                     "requireNetworkPolicy": "no"}}}}
    assert any("requireNetworkPolicy" in p for p in problems(bad, tmp_path))


# --- the enforcer ---------------------------------------------------------------------------------

def cluster(policy: str, **network):
    return inventory.parse({"apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster", "metadata": {"name": "hosting"},
                            "spec": {"network": {"policy": policy, **network},
                                     "hosts": [{"name": "cp1", "address": "10.0.0.1", "role": "control"},
                                               {"name": "w1", "address": "10.0.0.2", "role": "worker"}]}})


def test_no_enforcer_unless_asked():
    inv = cluster("none")
    assert netpol.netpol_objects(inv) == []
    assert not any(o["metadata"]["name"] == "kube-network-policies" for o in addon_objects(inv))


def test_the_enforcer_runs_on_every_node_with_net_admin_alone_and_fails_closed():
    inv = cluster("kube-network-policies")
    objs = {(o["kind"], o["metadata"]["name"]): o for o in addon_objects(inv)}
    ds = objs[("DaemonSet", "kube-network-policies")]
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert spec["hostNetwork"] and spec["tolerations"] == [{"operator": "Exists"}]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert c["securityContext"]["privileged"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "--metrics-bind-address=127.0.0.1:9080" in c["args"]
    assert not any(a.startswith("--fail-open") for a in c["args"])
    assert c["image"] == netpol.NETPOL_IMAGE and "hiddenplane" in c["image"]     # not upstream's name
    role = objs[("ClusterRole", netpol.ROLE)]
    assert all(set(r["verbs"]) == {"list", "watch"} for r in role["rules"])


def test_an_enforcer_beside_cilium_is_refused_naming_the_field():
    with pytest.raises(InventoryError) as e:
        cluster("kube-network-policies", cni="cilium")
    want = "spec.network.policy: 'kube-network-policies' is for cni: routes"
    assert any(p.startswith(want) for p in e.value.problems)


def test_a_hosting_lab_enforces_policies_and_another_lab_does_not(tmp_path):
    spec = LabSpec.create("np", 1, 2, 0, DEFAULT_SUBNET)
    paths = LabPaths.of("np")
    assert lab_mod.inventory_doc(spec, paths, hosting=True)["spec"]["network"] == {"policy": "kube-network-policies"}
    assert "network" not in lab_mod.inventory_doc(spec, paths)["spec"]
