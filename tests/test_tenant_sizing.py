"""What a hosted tenant may take of its hosting cluster
(installer/core/render/tenant_sizing.py): pure, on rendered objects."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest

from installer.core.errors import InventoryError
from installer.core.inventory import parse
from installer.core.inventory_hosted import SIZING, quantity
from installer.core.render import tenant_sizing as sizing

from .test_hosted import TENANT
from .test_hosted import rendered as hosted_rendered

NS = "hp-tenant-a"


def inventory(tmp_path, change=lambda hosted: None):
    doc = copy.deepcopy(TENANT)
    change(doc["spec"]["controlPlane"]["hosted"])
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    return parse(doc, "tenant.yaml", tmp_path)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """test_hosted's tenant, as (its inventory, its objects)."""
    p, plan = hosted_rendered.__wrapped__(tmp_path_factory)
    return p.inventory, plan


def templates(plan):
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in plan.objects
            if o["kind"] in ("StatefulSet", "Deployment")}


def test_every_container_has_requests_and_a_memory_limit_and_no_cpu_limit(rendered):
    """Burstable, not BestEffort (the first evicted or OOM-killed under pressure); a leak stops
    at its own container; no CPU limit (a throttled apiserver fails its probes)."""
    _, plan = rendered
    seen = set()
    for pod in templates(plan).values():
        for c in pod["containers"]:
            r = c["resources"]
            assert set(r["requests"]) == {"cpu", "memory"} and set(r["limits"]) == {"memory"}, c["name"]
            assert r == SIZING[c["name"]]
            seen.add(c["name"])
    assert seen == set(SIZING)


def test_the_inventory_overrides_key_by_key_and_a_request_above_its_limit_is_refused(tmp_path):
    inv = inventory(tmp_path, lambda h: h.update(resources={"kube-apiserver": {"requests": {"memory": "1Gi"}}}))
    r = sizing.resources(inv, "kube-apiserver")
    assert r == {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    with pytest.raises(InventoryError) as e:
        inventory(tmp_path, lambda h: h.update(resources={"etcd": {"requests": {"memory": "2Gi"}}}))
    assert "resources.etcd: requests.memory 2Gi is above limits.memory 1Gi" in str(e.value), str(e.value)
    # set both, and it is the operator's sizing
    inv = inventory(tmp_path, lambda h: h.update(resources={"etcd": {"requests": {"memory": "2Gi"},
                                                                     "limits": {"memory": "3Gi"}}}))
    assert sizing.resources(inv, "etcd")["limits"] == {"memory": "3Gi"}


@pytest.mark.parametrize("value, cpu, size", [
    ("100m", "100m", None), ("2", "2", "2"), ("1500m", "1500m", None), ("1536Mi", None, "1536Mi"),
    ("1Gi", None, "1Gi"), ("1024Mi", None, "1Gi"), ("0.5Gi", None, "512Mi"), ("1000k", None, "1M"),
    ("1000", None, "1k"), ("1001", None, "1001"),
])
def test_quantities_are_written_as_the_api_writes_them_back(value, cpu, size):
    # a form the API would write back otherwise would make every apply replace the object
    if cpu is not None:
        assert sizing.cpu_text(quantity(value)) == cpu
    if size is not None:
        assert sizing.bytes_text(quantity(value)) == size


def test_the_quota_admits_the_tenant_with_its_rolls_and_nothing_more(rendered):
    inv, plan = rendered
    quota = next(o for o in plan.objects if o["kind"] == "ResourceQuota")
    hard = quota["spec"]["hard"]
    assert quota["metadata"]["namespace"] == NS
    # 3 etcd (+1 replaced), 2 apiserver pods, 2 controller-managers, 2 schedulers (+2 each: a
    # surge and one terminating)
    assert hard["pods"] == "16"
    assert hard["requests.cpu"] == "800m" and hard["requests.memory"] == "2Gi" and hard["limits.memory"] == "16Gi"
    assert hard["persistentvolumeclaims"] == "3" and hard["requests.storage"] == "3Gi"
    assert hard["services.nodeports"] == "2" and hard["services.loadbalancers"] == "0"
    # the steady tenant and one surge of every Deployment fit
    pods = templates(plan)
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in plan.objects
                if o["kind"] in ("StatefulSet", "Deployment")}
    used = Fraction(0)
    for name, pod in pods.items():
        per = sum(quantity(c["resources"]["requests"]["memory"]) for c in pod["containers"])
        used += per * (replicas[name] + (1 if name != "etcd" else 0))
    assert used <= quantity(hard["requests.memory"])


def test_a_one_member_tenant_may_grow_to_three_within_its_quota(tmp_path):
    """A member count change runs before the objects (and under least privilege the quota is the
    admin's): the quota makes room for three members whatever the count, or the new member's
    claim is refused and the learner never syncs."""
    one = sizing.quota_object(inventory(tmp_path, lambda h: h.update(etcdReplicas=1)))["spec"]["hard"]
    three = sizing.quota_object(inventory(tmp_path, lambda h: h.update(etcdReplicas=3)))["spec"]["hard"]
    assert one == three and one["persistentvolumeclaims"] == "3"


def test_the_limit_range_caps_containers_at_the_largest_limit_and_claims_at_etcds_size(rendered, tmp_path):
    _, plan = rendered
    lr = next(o for o in plan.objects if o["kind"] == "LimitRange")
    container, claim = lr["spec"]["limits"]
    assert container["type"] == "Container" and container["max"] == {"memory": "2Gi"}
    assert set(container["defaultRequest"]) == {"cpu", "memory"} and "memory" in container["default"]
    assert claim == {"type": "PersistentVolumeClaim", "max": {"storage": "1Gi"}}
    inv = inventory(tmp_path, lambda h: h.update(resources={"etcd": {"limits": {"memory": "4Gi"}}}))
    assert sizing.limit_range_object(inv)["spec"]["limits"][0]["max"] == {"memory": "4Gi"}


def test_every_pod_has_the_priority_class_above_workloads_and_below_the_system(rendered):
    _, plan = rendered
    pc = next(o for o in plan.objects if o["kind"] == "PriorityClass")
    assert 0 < pc["value"] < 2_000_000_000 and pc["globalDefault"] is False
    # the tenant's own, named for its namespace: removing another tenant's takes nothing of this one
    assert "namespace" not in pc["metadata"] and pc["metadata"]["name"] == f"hiddenplane-tenant-{NS}"
    assert {p["priorityClassName"] for p in templates(plan).values()} == {pc["metadata"]["name"]}
    kinds = [o["kind"] for o in plan.objects]
    # in place before the first pod that names it, with the quota
    assert kinds.index("PriorityClass") < kinds.index("ResourceQuota") < kinds.index("StatefulSet")


def test_every_empty_dir_has_a_size_limit_the_audit_log_rotates_below(rendered):
    _, plan = rendered
    dirs = [v for pod in templates(plan).values() for v in pod["volumes"] if "emptyDir" in v]
    assert dirs and all(v["emptyDir"].get("sizeLimit") for v in dirs)
    audit = next(v for v in dirs if v["name"] == "audit")
    args = next(c["args"] for c in templates(plan)["kube-apiserver"]["containers"] if c["name"] == "kube-apiserver")
    flags = dict(a.split("=", 1) for a in args if a.startswith("--audit-log-max"))
    files = int(flags["--audit-log-maxbackup"]) + 1
    assert files * int(flags["--audit-log-maxsize"]) * 10**6 < quantity(audit["emptyDir"]["sizeLimit"])


def test_etcds_quota_is_below_its_volume_and_compacts_itself(rendered, tmp_path):
    inv, plan = rendered
    args = templates(plan)["etcd"]["containers"][0]["args"]
    assert f"--quota-backend-bytes={3 * 2**30 // 4}" in args
    assert "--auto-compaction-mode=periodic" in args and "--auto-compaction-retention=10m" in args
    big = inventory(tmp_path, lambda h: h.update(etcdStorage="50Gi"))
    assert sizing.etcd_quota_bytes(big) == 8 * 2**30            # etcd's suggested maximum


def test_a_bad_spread_value_names_the_field(tmp_path):
    with pytest.raises(InventoryError) as e:
        inventory(tmp_path, lambda h: h.update(spread="sometimes"))
    assert "spec.controlPlane.hosted.spread" in str(e.value)
