"""Where a hosted tenant's pods run and how its exposed addresses reach them
(installer/core/render/tenant_placement.py): pure, on rendered objects and listed nodes."""

from __future__ import annotations

import pytest

from installer.core.render import tenant
from installer.core.render import tenant_placement as placement
from installer.core.render.tenant_placement import Placement, PlacementError
from installer.host import kube_objects

from .test_tenant_sizing import inventory, templates

# test_hosted's tenant exposes 10.0.0.11 and 10.0.0.12 with 2 apiserver replicas and 3 members


def node(name, address=None, ready=True, cordoned=False, taint=None):
    return {"metadata": {"name": name},
            "spec": {"unschedulable": cordoned, "taints": [{"key": "k", "effect": taint}] if taint else []},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "addresses": [{"type": "Hostname", "address": name}]
                       + ([{"type": "InternalIP", "address": address}] if address else [])}}


HOSTING = [node("w1", "10.0.0.11"), node("w2", "10.0.0.12"), node("w3", "10.0.0.13")]


def test_etcd_and_the_apiservers_spread_as_a_rule_the_leaders_by_preference(prepared, tmp_path):
    plan = tenant.render_tenant(prepared.inventory, prepared.material)
    pods = templates(plan)
    for name in ("etcd", "kube-apiserver"):
        anti = pods[name]["affinity"]["podAntiAffinity"]
        assert list(anti) == ["requiredDuringSchedulingIgnoredDuringExecution"], name
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    for name in ("kube-controller-manager", "kube-scheduler"):
        assert list(pods[name]["affinity"]["podAntiAffinity"]) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    for pod in pods.values():
        (zone,) = pod["topologySpreadConstraints"]
        assert zone["topologyKey"] == "topology.kubernetes.io/zone" and zone["whenUnsatisfiable"] == "ScheduleAnyway"
    inv = inventory(tmp_path, lambda h: h.update(spread="preferred"))
    assert list(placement.affinity(inv, "etcd")["podAntiAffinity"]) == [
        "preferredDuringSchedulingIgnoredDuringExecution"]


def test_each_exposed_address_serves_its_own_nodes_replica(prepared):
    """The attack on availability: a hosting node cut off, not drained. Its address is lost; the
    others must not send anyone to its replica, so the Service keeps traffic on the node it
    arrives at, and a replica runs on each exposed node, also through a roll."""
    where = placement.placement(prepared.inventory, HOSTING)
    assert where == Placement(("w1", "w2"))
    rendered = tenant.render_tenant(prepared.inventory, prepared.material, where).objects
    kube_objects.validate_objects(rendered, prepared.inventory.spec.kubernetes.version)
    objects = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    assert objects[("Service", "kube-apiserver")]["spec"]["externalTrafficPolicy"] == "Local"
    deploy = objects[("Deployment", "kube-apiserver")]
    pod = deploy["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["w1", "w2"]}]
    # evenly over those nodes, counted per revision: a roll's new replica may start beside an
    # old one (the new ones spread among themselves) and the doubled-up old one goes first
    zone, nodes = pod["topologySpreadConstraints"]
    assert nodes == {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule", "topologyKey": "kubernetes.io/hostname",
                     "labelSelector": {"matchLabels": {"hiddenplane.io/tenant": "tenant-a",
                                                       "app.kubernetes.io/name": "kube-apiserver"}},
                     "matchLabelKeys": ["pod-template-hash"]}
    assert "nodeTaintsPolicy" not in nodes      # a cordoned exposed node counts: its replica waits for it
    assert list(pod["affinity"]["podAntiAffinity"]) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    for name in ("kube-controller-manager", "kube-scheduler"):
        spec = objects[("Deployment", name)]["spec"]["template"]["spec"]
        assert "nodeAffinity" not in spec["affinity"] and len(spec["topologySpreadConstraints"]) == 1
    etcd = objects[("StatefulSet", "etcd")]["spec"]["template"]["spec"]
    assert "nodeAffinity" not in etcd["affinity"]
    assert list(etcd["affinity"]["podAntiAffinity"]) == ["requiredDuringSchedulingIgnoredDuringExecution"]


def test_a_replica_is_ready_only_while_it_reaches_etcd_and_an_etcd_blip_keeps_it(prepared):
    """A replica back from a lost node must not take its address's traffic before its etcd
    connections serve; its liveness leaves etcd out (a restart cures no etcd trouble)."""
    objects = {(o["kind"], o["metadata"]["name"]): o
               for o in tenant.render_tenant(prepared.inventory, prepared.material).objects}
    api = next(c for c in objects[("Deployment", "kube-apiserver")]["spec"]["template"]["spec"]["containers"]
               if c["name"] == "kube-apiserver")
    ready, live = api["readinessProbe"], api["livenessProbe"]
    assert ready["httpGet"]["path"] == "/readyz"            # etcd and etcd-readiness included
    assert ready["periodSeconds"] * ready["failureThreshold"] >= 20 and ready.get("successThreshold", 1) == 1
    assert live["httpGet"]["path"] == "/livez?exclude=etcd"


def test_an_exposed_address_no_node_has_is_refused_naming_it_and_the_nodes(tmp_path):
    inv = inventory(tmp_path, lambda h: h["expose"].update(addresses=["10.0.0.11", "10.0.0.99"]))
    with pytest.raises(PlacementError) as e:
        placement.placement(inv, HOSTING)
    assert "spec.controlPlane.hosted.expose.addresses[1] (10.0.0.99) is no hosting node's address" in str(e.value)
    assert "w1 10.0.0.11" in str(e.value)
    multi = [node("w1", "10.0.0.11"), {**node("w2"), "status": {**node("w2")["status"], "addresses": [
        {"type": "InternalIP", "address": "10.0.0.12"}, {"type": "ExternalIP", "address": "10.0.0.99"}]}}]
    with pytest.raises(PlacementError) as e:
        placement.placement(inventory(tmp_path, lambda h: h["expose"].update(
            addresses=["10.0.0.12", "10.0.0.99"]) or h.update(spread="preferred")), multi)
    assert "addresses[1] (10.0.0.99) is node w2's, as an earlier address is" in str(e.value)


def test_a_load_balancer_keeps_its_own_health_checks_and_pins_nothing(tmp_path):
    inv = inventory(tmp_path, lambda h: h["expose"].update(type="LoadBalancer", addresses=["192.0.2.10"]))
    where = placement.placement(inv, HOSTING)
    assert where == Placement(())
    assert "nodeAffinity" not in placement.affinity(inv, "kube-apiserver", where)
    assert list(placement.affinity(inv, "kube-apiserver", where)["podAntiAffinity"]) == [
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert placement.nodes_needed(inv, where) == 3     # 2 replicas and the one a roll adds


def test_a_hosting_cluster_too_small_to_spread_is_refused_naming_the_way_out(tmp_path):
    inv = inventory(tmp_path)
    pinned = Placement(("w1", "w2"))
    assert placement.nodes_needed(inv, pinned) == 3        # 3 members; 2 replicas
    nodes = [node("w1", "10.0.0.11"), node("w2", "10.0.0.12"), node("c", ready=False), node("d", cordoned=True),
             node("cp", taint="NoSchedule"), node("e", taint="PreferNoSchedule")]
    assert placement.schedulable(nodes) == ["w1", "w2", "e"]
    assert placement.placement(inv, nodes) == pinned
    with pytest.raises(PlacementError) as e:
        placement.placement(inv, nodes[:5])
    assert "2 schedulable node(s) (w1, w2)" in str(e.value) and "needs 3" in str(e.value)
    assert "spec.controlPlane.hosted.spread: preferred" in str(e.value)
    # an exposed node cordoned: its replica, or a roll's, would have nowhere to go
    drained = [node("w1", "10.0.0.11", cordoned=True), node("w2", "10.0.0.12"), *nodes[2:], node("f")]
    with pytest.raises(PlacementError) as e:
        placement.placement(inv, drained)
    assert "need 2 of them schedulable; 1 are (w2)" in str(e.value) and "uncordon" in str(e.value)
    relaxed = inventory(tmp_path, lambda h: h.update(spread="preferred"))
    with pytest.raises(PlacementError):
        placement.placement(relaxed, drained)
    assert placement.nodes_needed(inventory(tmp_path, lambda h: h.update(apiServerReplicas=4)), pinned) == 4


def test_spread_preferred_shares_nodes_only_where_there_are_too_few(tmp_path):
    one = inventory(tmp_path, lambda h: h["expose"].update(addresses=["10.0.0.11"]) or h.update(spread="preferred"))
    where = placement.placement(one, HOSTING[:1])
    assert where == Placement(("w1",))
    # one domain: both replicas on it, the spread constraint met by any count
    (_, nodes) = placement.spread(one, "kube-apiserver", where)
    assert nodes["topologyKey"] == "kubernetes.io/hostname"
    relaxed = inventory(tmp_path, lambda h: h.update(spread="preferred"))
    assert list(placement.affinity(relaxed, "etcd", placement.placement(relaxed, HOSTING[:2]))["podAntiAffinity"]) \
        == ["preferredDuringSchedulingIgnoredDuringExecution"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """test_hosted's tenant prepared: its inventory and material."""
    from .test_hosted import rendered as hosted_rendered
    p, _ = hosted_rendered.__wrapped__(tmp_path_factory)
    return p
