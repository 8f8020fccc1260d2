"""A hosted tenant's pods under Pod Security "restricted" (render/tenant.py), without a cluster.

``restricted_violations`` reads a pod spec as the Pod Security Standards' restricted profile
does (https://kubernetes.io/docs/concepts/security/pod-security-standards/, the checks of
k8s.io/pod-security-admission's policy package at "latest"), so that every pod the tenant
renders is checked field by field here; the real lab proves the hosting apiserver admits them
into a namespace enforcing it (tests/test_real_hosted.py).
"""

from __future__ import annotations

import pytest
import yaml

from installer.core.render import tenant, tenant_access

from .test_hosted import NS, TENANT

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}


def restricted_violations(spec: dict) -> list[str]:
    out = []
    pod_sc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for v in spec.get("volumes") or []:
        kind = next(k for k in v if k != "name")
        if kind not in ALLOWED_VOLUMES:
            out.append(f"volume {v['name']}: {kind}")
    containers = (spec.get("initContainers") or []) + spec["containers"]
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities not dropped (ALL)")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added {caps['add']}")
        if not (sc.get("runAsNonRoot") if "runAsNonRoot" in sc else pod_sc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot not true")
        if (sc.get("runAsUser") if "runAsUser" in sc else pod_sc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{name}: hostPort")
    return out


@pytest.fixture
def objects(tmp_path):
    from installer.api import prepare
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(TENANT))
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    p = prepare(path, tmp_path / "state")
    return tenant.render_tenant(p.inventory, p.material).objects


def test_every_pod_of_the_tenant_is_restricted(objects):
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert {o["metadata"]["name"] for o in workloads} == {"etcd", "kube-apiserver", "kube-controller-manager",
                                                          "kube-scheduler"}
    for o in workloads:
        spec = o["spec"]["template"]["spec"]
        assert restricted_violations(spec) == [], o["metadata"]["name"]
        # the files the pods read are their group's: fsGroup, the user not root
        sc = spec["securityContext"]
        assert sc["runAsUser"] != 0 and sc["fsGroup"] == sc["runAsGroup"] == sc["runAsUser"]


def test_the_checker_sees_what_restricted_refuses():
    base = {"securityContext": tenant.pod_security_context(), "containers": [
        {"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(base) == []
    for change, says in (
        (lambda s: s["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True), "allowPrivilege"),
        (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), "added"),
        (lambda s: s.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "hostPath"),
        (lambda s: s.update(hostNetwork=True), "hostNetwork"),
        (lambda s: s["containers"][0]["securityContext"].update(runAsUser=0), "runAsUser 0"),
    ):
        spec = yaml.safe_load(yaml.safe_dump(base))
        change(spec)
        assert any(says in v for v in restricted_violations(spec)), says


def test_the_namespace_enforces_restricted_and_its_operator_cannot_lift_it(tmp_path):
    """The label is the admin's (from `installer hosting-access`): the operator may read and
    delete its namespace, not update it, so it cannot relabel it to run privileged pods through
    the Deployments it may create."""
    from .test_hosted import parse
    inv = parse(TENANT, tmp_path)
    ns = tenant.namespace_object(inv)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert ns["metadata"]["name"] == NS
    assert set(tenant_access.NAMESPACE_VERBS) == {"get", "delete"}
    printed = tenant_access.access_objects(inv, tenant_access.subject("User", "alice"))
    assert printed[0] == ns


def _workload(kind: str, name: str, security: dict | None) -> dict:
    spec = {"containers": [{"name": "c"}]}
    if security is not None:
        spec["securityContext"] = security
    return {"kind": kind, "metadata": {"name": name, "labels": {tenant.TENANT_LABEL: "tenant-a"}},
            "spec": {"template": {"spec": spec}}}


def test_a_tenant_an_earlier_release_ran_as_root_is_named_and_nothing_else():
    live = [_workload("StatefulSet", "etcd", None), _workload("Deployment", "kube-apiserver", {"runAsUser": 0}),
            _workload("Deployment", "kube-scheduler", tenant.pod_security_context())]
    assert tenant.root_workloads(live) == ["StatefulSet etcd", "Deployment kube-apiserver"]
    assert tenant.root_workloads([live[2]]) == []
