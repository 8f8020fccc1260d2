"""`installer hosting-access`: the least-privilege hosting identity of one hosted tenant's
operator (core/render/tenant_access.py). What it grants is proven on the real lab (the second
tenant of tests/test_real_hosted.py runs apply, snapshots, member changes and reset with exactly
this, and is refused the first tenant's objects); here: what it prints, that it grants nothing
beyond its namespace, and that every request the hosted code makes is one of its rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core.render import tenant_access
from installer.host import kube_objects

from .test_hosted import NS, TENANT

ROOT = Path(__file__).resolve().parent.parent
# the modules that make the installer's requests to a hosting cluster
HOSTING_CODE = ["installer/host/hosting.py", "installer/host/tenant_etcd.py", "installer/host/tenant_members.py",
                "installer/host/podexec.py", "installer/engine/planes/hosted.py",
                "installer/engine/planes/etcd_pods.py", "installer/engine/planes/tenant_roll.py"]


@pytest.fixture
def inventory(tmp_path) -> Path:
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(TENANT))
    return path


def run(*args):
    return CliRunner().invoke(cli, ["hosting-access", *args])


def granted(docs: list[dict]) -> set[tuple[str, str, str]]:
    """(namespace or "*", resource, verb) for every rule of every Role and ClusterRole."""
    out = set()
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            scope = d["metadata"].get("namespace", "*")
            for rule in d["rules"]:
                out |= {(scope, r, v) for r in rule["resources"] for v in rule["verbs"]}
    return out


def test_it_prints_the_namespace_a_role_and_the_namespace_object_alone_cluster_wide(inventory):
    result = run(str(inventory), "--user", "alice")
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert [d["kind"] for d in docs] == ["Namespace", "PriorityClass", "ResourceQuota", "LimitRange", "Role",
                                         "RoleBinding", "ClusterRole", "ClusterRoleBinding"]
    kube_objects.validate_objects(docs, TENANT["spec"].get("kubernetes", {}).get("version", "v1.36.5"))
    namespace, priority, quota, limits, role, binding, cluster_role, cluster_binding = docs
    # the admin's, exactly as apply renders them (then apply finds them unchanged and writes none)
    from installer.api import prepare
    from installer.core.render import tenant
    p = prepare(inventory, inventory.parent / "state")
    rendered = {(o["kind"], o["metadata"]["name"]): o for o in tenant.render_tenant(p.inventory, p.material).objects}
    for o in (priority, quota, limits):
        assert o == rendered[(o["kind"], o["metadata"]["name"])]
    assert quota["metadata"]["namespace"] == limits["metadata"]["namespace"] == NS
    # labelled as the installer labels it: the ownership guard lets its first apply in
    assert namespace["metadata"]["name"] == NS
    assert namespace["metadata"]["labels"]["hiddenplane.io/tenant"] == "tenant-a"
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NS
    assert binding["subjects"] == cluster_binding["subjects"] == [
        {"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"] == f"hiddenplane-operator-{NS}"
    # cluster-wide: this one Namespace object, by name; never create (it could make any other),
    # never update (its Pod Security label is the admin's); the shared PriorityClass read by name;
    # the nodes listed (the spread check), never read one by one nor written
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [NS],
                                      "verbs": ["get", "delete"]},
                                     {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"],
                                      "resourceNames": [f"hiddenplane-tenant-{NS}"], "verbs": ["get"]},
                                     {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_nothing_is_granted_beyond_the_namespace_nor_a_way_to_widen_it(inventory):
    docs = list(yaml.safe_load_all(run(str(inventory), "--group", "team-a").output))
    rights = granted(docs)
    assert {scope for scope, _, _ in rights} == {NS, "*"}
    assert {(r, v) for scope, r, v in rights if scope == "*"} == {
        ("namespaces", "get"), ("namespaces", "delete"), ("priorityclasses", "get"), ("nodes", "list")}
    # its quota and limits read, never written: a quota its operator could raise protects nobody
    assert {v for scope, r, v in rights if r in ("resourcequotas", "limitranges")} == {"get"}
    words = {r for _, r, _ in rights} | {v for _, _, v in rights}
    # no wildcard, no RBAC of its own, no impersonation, no token minting, no volume, no node status
    for bad in ("*", "roles", "rolebindings", "clusterroles", "impersonate", "escalate", "bind",
                "serviceaccounts/token", "nodes/status", "nodes/proxy", "persistentvolumes", "pods/attach",
                "pods/portforward", "pods/ephemeralcontainers", "watch"):
        assert bad not in words, bad


def test_every_request_the_hosted_code_makes_is_a_row(inventory):
    """A namespaced resource named in a request path of the hosting code, or sent as one of the
    tenant's objects, that no row grants would be a 403 for the least-privilege operator: each
    must be a row (and a row nothing uses is a right given away)."""
    rows = {r for _, resources, _, _ in tenant_access.RULES for r in resources}
    used = set()
    for path in HOSTING_CODE:
        text = (ROOT / path).read_text()
        used |= set(re.findall(r"/namespaces/\{[^}]+\}/([a-z]+)", text))
        used |= {f"pods/{sub}" for sub in re.findall(r"/pods/\{[^}]+\}/([a-z]+)", text)}
    from installer.api import prepare
    from installer.core.render import tenant
    p = prepare(inventory, inventory.parent / "state")
    plan = tenant.render_tenant(p.inventory, p.material)
    # (the cluster-scoped ones, the Namespace and the PriorityClass, are the ClusterRole's)
    sent = {kube_objects.KINDS[(o["apiVersion"], o["kind"])][0] for o in plan.objects
            if kube_objects.KINDS[(o["apiVersion"], o["kind"])][1]}
    sent |= {"secrets", "configmaps", "leases"}     # the files' Secrets, the owner record, the apply lock
    assert used | sent == rows, (sorted(used | sent - rows), sorted(rows - used - sent))


@pytest.mark.parametrize("args, message", [
    (("--user", "a", "--group", "b"), "exactly one of --user, --group, --service-account"),
    ((), "exactly one of --user, --group, --service-account"),
    (("--service-account", "operator"), "give it as NAMESPACE/NAME"),
    (("--service-account", "/operator"), "give it as NAMESPACE/NAME"),
])
def test_a_subject_is_given_once_and_whole(inventory, args, message):
    result = run(str(inventory), *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_service_account_is_bound_in_its_own_namespace(inventory):
    docs = list(yaml.safe_load_all(run(str(inventory), "--service-account", "operators/tenant-a").output))
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tenant-a", "namespace": "operators"}]


def test_a_cluster_that_is_not_hosted_is_refused_naming_the_field(tmp_path):
    from .conftest import EXAMPLE
    result = run(str(EXAMPLE), "--user", "alice")
    assert result.exit_code == 2 and "spec.controlPlane.mode is not hosted" in result.output, result.output
