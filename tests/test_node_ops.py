"""Node day-2 operations with no hosts: the revocation policy (schema-valid; its CEL expression
evaluated by a CEL library against sample requests), the node ledger, apply refusing retired
hosts, and drain/remove/revoke through the real Kubernetes client over a fake transport
(tests/fakeapi.py) so that every API object sent is checked."""

from __future__ import annotations

import base64
import datetime as dt
import json
import shutil
import stat

import cel
import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from installer import api
from installer.actions import node_ops, node_retire
from installer.cli.main import cli
from installer.core.cluster import resolve
from installer.core.errors import InstallerError, StateError
from installer.core.inventory import HostSpec
from installer.core.ledger import Ledger, NodeRetiredError, check_inventory
from installer.core.pki import issue, material
from installer.core.render import revocation
from installer.engine import runner
from installer.engine.context import Event, Options
from installer.host import kube, kube_objects, node_api

from .conftest import EXAMPLE
from .fakeapi import FakeCluster, client_factory

NODES = "/api/v1/nodes"
SECRETS = "/api/v1/namespaces/kube-system/secrets"
CRB = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAPB = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"


# --- the policy and its CEL expression ----------------------------------------------------------

def request(user: str, op: str = "CREATE", resource: str = "nodes") -> dict:
    return {"request": {"userInfo": {"username": user, "groups": ["system:nodes", "system:authenticated"]},
                        "operation": op, "resource": {"group": "", "version": "v1", "resource": resource}}}


def allowed(expr: str, req: dict) -> bool:
    result = cel.evaluate(expr, req)
    assert isinstance(result, bool), result
    return result


def test_policy_denies_exactly_the_revoked_identities():
    objs = revocation.policy_objects(["node3", "w1"])
    expr = objs[0]["spec"]["validations"][0]["expression"]
    for user in ("system:node:node3", "system:node:w1"):
        for op, res in (("CREATE", "nodes"), ("UPDATE", "nodes/status"), ("CREATE", "certificatesigningrequests"),
                        ("DELETE", "pods"), ("UPDATE", "leases")):
            assert not allowed(expr, request(user, op, res)), (user, op, res)
    for user in ("system:node:node2", "system:node:w10", "system:node:w", "system:node:node3x", "node3",
                 "system:bootstrap:abcdef", "kubernetes-admin", "system:kube-controller-manager",
                 "system:serviceaccount:kube-system:node3", ""):
        assert allowed(expr, request(user)), user


def test_policy_names_are_quoted_not_spliced():
    # a name cannot be a DNS label with quotes, but the expression must stay one list literal anyway
    expr = revocation.expression(['a", "b'])
    assert allowed(expr, request("system:node:b"))
    assert not allowed(expr, request('system:node:a", "b'))


def test_policy_is_schema_valid_and_matches_every_write():
    policy, binding = revocation.policy_objects(["w1"])
    kube_objects.validate_objects([policy, binding], "v1.36.4")
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE", "CONNECT"}
    # "*/*" is every resource and subresource; the apiserver rejects it beside others (422)
    assert rule["resources"] == ["*/*"] and rule["apiGroups"] == ["*"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"] == {"policyName": revocation.POLICY, "validationActions": ["Deny"]}
    with pytest.raises(ValueError):
        revocation.policy_objects([])


# --- the ledger ------------------------------------------------------------------------------------

def test_ledger_lifecycle_and_permissions(prepared, tmp_path):
    state = api.state_for(prepared.inventory, tmp_path / "st")
    inv = prepared.inventory
    led = Ledger()
    led.record_active(inv)
    assert {n: e.state for n, e in led.entries.items()} == {"cp1": "active", "node2": "active", "node3": "active"}
    node3 = led.host("node3", inv)
    led.mark_removed(node3, "test")
    assert led.save(state) and not led.save(state)          # unchanged: not rewritten
    assert stat.S_IMODE(Ledger.path(state).stat().st_mode) == 0o600
    again = Ledger.load(state)
    assert again.entries["node3"].state == "removed" and again.entries["node3"].address == "192.168.56.232"
    again.record_active(inv)                                  # apply does not revive a removed host
    assert again.entries["node3"].state == "removed"
    again.reactivate(node3)
    assert again.entries["node3"].state == "active"
    again.mark_revoked(node3, ["1f"])
    again.mark_removed(node3)                                 # revoked stays revoked
    assert again.entries["node3"].state == "revoked" and again.entries["node3"].serials == ["1f"]
    with pytest.raises(NodeRetiredError, match="node3 was revoked"):
        again.reactivate(node3)
    assert [h["state"] for h in again.entries["node3"].history] == ["active", "removed", "active", "revoked"]


def test_corrupt_ledger_is_an_error_not_a_guess(prepared, tmp_path):
    state = api.state_for(prepared.inventory, tmp_path / "st")
    state.ensure_root()
    Ledger.path(state).write_text("nodes: [1, 2]\n")
    with pytest.raises(StateError, match="nodes.yaml is corrupt"):
        Ledger.load(state)


def test_apply_refuses_an_inventory_with_retired_hosts(prepared, tmp_path):
    st = tmp_path / "st"
    shutil.copytree(prepared.state.root, st)
    state = api.state_for(prepared.inventory, st)
    led = Ledger()
    led.record_active(prepared.inventory)
    led.mark_removed(led.host("node2"))
    led.mark_revoked(led.host("node3"), [])
    led.save(state)
    with pytest.raises(NodeRetiredError) as e:
        check_inventory(prepared.inventory, Ledger.load(state))
    msg = str(e.value)
    assert "node2 was removed" in msg and "installer node add INVENTORY node2" in msg
    assert "node3 was revoked" in msg and "can never join again" in msg
    # `node add --dry-run` plans a removed host coming back (the ledger is written only by the
    # real add); a revoked one is refused even then
    with pytest.raises(NodeRetiredError) as e:
        check_inventory(prepared.inventory, Ledger.load(state), returning=frozenset({"node2", "node3"}))
    assert "node2" not in str(e.value) and "node3 was revoked" in str(e.value)
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--state", str(st)])
    assert res.exit_code == 2 and "node3 was revoked" in res.output
    before = sorted(p.name for p in st.rglob("*"))
    assert sorted(p.name for p in st.rglob("*")) == before


# --- drain through the client ----------------------------------------------------------------

def pod(name: str, node: str, ns: str = "default", *, owner: str | None = None, mirror: bool = False,
        phase: str = "Running") -> dict:
    meta = {"name": name, "namespace": ns}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner, "name": "x", "uid": "u"}]
    if mirror:
        meta["annotations"] = {"kubernetes.io/config.mirror": "abc"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": phase}}


@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture
def fake_api(prepared, cluster):
    return client_factory(prepared.material, cluster)


def seed_node(cluster: FakeCluster, name: str) -> None:
    cluster.add(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}})


def test_drain_evicts_respecting_budgets_and_skips_daemonsets(cluster, fake_api):
    seed_node(cluster, "node2")
    cluster.add("/api/v1/namespaces/default/pods", pod("web-1", "node2"))
    cluster.add("/api/v1/namespaces/default/pods", pod("web-2", "node2"))
    cluster.add("/api/v1/namespaces/default/pods", pod("other", "node3"))
    cluster.add("/api/v1/namespaces/kube-system/pods", pod("agent", "node2", "kube-system", owner="DaemonSet"))
    cluster.add("/api/v1/namespaces/kube-system/pods", pod("static", "node2", "kube-system", mirror=True))
    cluster.add("/api/v1/namespaces/default/pods", pod("done", "node2", phase="Succeeded"))
    cluster.block_evictions["default/web-2"] = 2              # a PDB refuses twice, then allows
    with fake_api() as a:
        # --dry-run's answer, read-only: the same pods evicted and left as the drain below
        would = node_api.drain_plan(a, "node2")
        assert cluster.calls("POST") == [] and cluster.calls("PATCH") == []
        assert kube.node_exists(a, "node2") and not kube.node_exists(a, "node9")
        assert node_api.cordon(a, "node2")
        res = node_api.drain(a, "node2", timeout=30, interval=0.01, log=lambda m: None)
    assert sorted(res.evicted) == ["default/web-1", "default/web-2"]
    assert sorted(res.skipped) == ["default/done (finished)", "kube-system/agent (DaemonSet)",
                                   "kube-system/static (mirror pod)"]
    assert (sorted(would.evicted), sorted(would.skipped)) == (sorted(res.evicted), sorted(res.skipped))
    assert cluster.store[f"{NODES}/node2"]["spec"]["unschedulable"] is True
    assert "/api/v1/namespaces/default/pods/other" in cluster.store
    evictions = [p for p in cluster.calls("POST") if p.endswith("/eviction")]
    assert evictions.count("/api/v1/namespaces/default/pods/web-2/eviction") == 3


def test_revoke_force_deletes_the_pods_and_waits_until_their_secrets_are_unreadable(cluster, fake_api):
    """While a pod is bound to a node the Node authorizer lets that node read its Secrets (on
    the real lab a stolen certificate read one after revoke, before the pod GC came)."""
    p = pod("uses", "node2")
    p["spec"]["volumes"] = [{"name": "s", "secret": {"secretName": "app-secret"}},
                            {"name": "p", "projected": {"sources": [{"configMap": {"name": "app-config"}}]}}]
    p["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "env-secret"}}]
    cluster.add("/api/v1/namespaces/default/pods", p)
    cluster.add("/api/v1/namespaces/default/pods", pod("elsewhere", "node3"))
    with fake_api() as a:
        deleted, _ = node_api.delete_pods_and_their_reads(a, "node2", timeout=1, interval=0.01)
    assert deleted == ["default/uses"]
    assert "/api/v1/namespaces/default/pods/uses" not in cluster.store
    assert "/api/v1/namespaces/default/pods/elsewhere" in cluster.store
    reviews = [b["spec"] for m, path, b in cluster.requests if path.endswith("/subjectaccessreviews")]
    assert {(r["resourceAttributes"]["resource"], r["resourceAttributes"]["name"]) for r in reviews} == {
        ("secrets", "app-secret"), ("configmaps", "app-config"), ("secrets", "env-secret")}
    assert {r["user"] for r in reviews} == {"system:node:node2"}


def test_drain_times_out_naming_the_blocked_pod(cluster, fake_api):
    seed_node(cluster, "node2")
    cluster.add("/api/v1/namespaces/db/pods", pod("primary", "node2", "db"))
    cluster.block_evictions["db/primary"] = 10**6
    with fake_api() as a, pytest.raises(node_api.DrainError) as e:
        node_api.drain(a, "node2", timeout=0.05, interval=0.01, log=lambda m: None)
    assert "db/primary: eviction refused" in str(e.value) and "disruption budget" in str(e.value)


def test_drain_waits_for_a_pod_whose_namespace_is_being_deleted(cluster, fake_api):
    """No eviction can be created in a terminating namespace (403, cause NamespaceTerminating: the
    real lab's drain met one, a tenant's namespace deleted just before): the pod goes with its
    namespace, so it is waited for as an evicted pod, as kubectl drain does; another 403 still
    stops the drain."""
    seed_node(cluster, "node2")
    cluster.add("/api/v1/namespaces/old/pods", pod("etcd-0", "node2", "old"))
    path = "/api/v1/namespaces/old/pods/etcd-0/eviction"
    cause = {"reason": "NamespaceTerminating", "message": "namespace old is being terminated", "field": "metadata"}
    cluster.fail[("POST", path)] = (403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                          "reason": "Forbidden", "message": 'pods "etcd-0" is forbidden: unable to '
                                          "create new content in namespace old because it is being terminated",
                                          "details": {"name": "etcd-0", "kind": "pods", "causes": [cause]}})
    with fake_api() as a, pytest.raises(node_api.DrainError) as e:
        node_api.drain(a, "node2", timeout=0.05, interval=0.01, log=lambda m: None)
    assert "old/etcd-0: terminating (its namespace is being deleted)" in str(e.value)
    del cluster.store["/api/v1/namespaces/old/pods/etcd-0"]          # the namespace's deletion took it
    with fake_api() as a:
        assert node_api.drain(a, "node2", timeout=1, interval=0.01, log=lambda m: None).evicted == []
    # a 403 for anything else is no such thing
    cluster.add("/api/v1/namespaces/old/pods", pod("etcd-0", "node2", "old"))
    cluster.fail[("POST", path)] = (403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                          "reason": "Forbidden", "message": "forbidden", "details": {}})
    with fake_api() as a, pytest.raises(kube.KubeError, match="eviction refused"):
        node_api.drain(a, "node2", timeout=0.05, interval=0.01, log=lambda m: None)


# --- remove and revoke through the client -------------------------------------------------------

def csr(name: str, user: str, *, issued_to: str | None = None, key=None, ca=None, approved=False) -> dict:
    obj = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
           "spec": {"request": base64.b64encode(b"-----BEGIN CERTIFICATE REQUEST-----").decode(),
                    "signerName": "kubernetes.io/kube-apiserver-client-kubelet", "username": user,
                    "usages": ["client auth"]},
           "status": {}}
    if approved:
        obj["status"]["conditions"] = [{"type": "Approved", "status": "True", "reason": "AutoApproved",
                                        "message": "ok"}]
    if issued_to:
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issued_to),
                                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes")]))
                .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(0xABC123)
                .not_valid_before(now).not_valid_after(now + dt.timedelta(hours=24)).sign(ca.key, hashes.SHA256()))
        obj["status"]["certificate"] = base64.b64encode(issue.cert_pem(cert)).decode()
    return obj


def seed_node_objects(cluster: FakeCluster, prepared, node: str) -> str:
    """Node, token Secret, renewal binding, one pending and one issued CSR; returns the token id."""
    seed_node(cluster, node)
    tid = prepared.material.tokens[node].id
    cluster.add(SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": f"bootstrap-token-{tid}", "namespace": "kube-system",
        "labels": {"hiddenplane.io/node": node}}, "type": "bootstrap.kubernetes.io/token", "data": {}})
    cluster.add(SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "bootstrap-token-zzzzzz", "namespace": "kube-system",
        "labels": {"hiddenplane.io/node": "someone-else"}}, "type": "bootstrap.kubernetes.io/token", "data": {}})
    from installer.core.render.manifests import node_renewal_binding
    cluster.add(CRB, node_renewal_binding(node))
    cluster.add(CRB, node_renewal_binding("keep-me"))
    key = ec.generate_private_key(ec.SECP256R1())
    cluster.add(CSRS, csr(f"csr-{node}-issued", f"system:bootstrap:{tid}", issued_to=f"system:node:{node}",
                          key=key, ca=prepared.material.pair("ca"), approved=True))
    cluster.add(CSRS, csr(f"csr-{node}-pending", f"system:node:{node}"))
    cluster.add(CSRS, csr("csr-other-pending", "system:node:another"))
    return tid


@pytest.fixture
def state_copy(prepared, tmp_path):
    st = tmp_path / "state"
    shutil.copytree(prepared.state.root, st)
    return st


def test_revoke_sends_policy_first_then_deletes_the_way_back(prepared, cluster, fake_api, state_copy):
    tid = seed_node_objects(cluster, prepared, "node3")
    out = node_retire.revoke(resolve(EXAMPLE, state_copy), "node3",
                             hold_lock=False, host_unreachable=True, api_factory=fake_api,
                          refresh_others=False, log=lambda m: None)
    writes = [(m, p) for m, p, _ in cluster.requests if m in ("POST", "PUT", "DELETE", "PATCH")]
    assert writes[0] == ("POST", VAP) and writes[1] == ("POST", VAPB)      # the policy before anything else
    assert ("DELETE", f"{CRB}/hiddenplane:node-renewal:node3") in writes
    assert ("DELETE", f"{SECRETS}/bootstrap-token-{tid}") in writes
    assert ("DELETE", f"{CSRS}/csr-node3-pending") in writes
    assert writes[-1] == ("DELETE", f"{NODES}/node3")
    # nothing of anyone else's
    assert f"{SECRETS}/bootstrap-token-zzzzzz" in cluster.store
    assert f"{CRB}/hiddenplane:node-renewal:keep-me" in cluster.store
    assert f"{CSRS}/csr-other-pending" in cluster.store and f"{CSRS}/csr-node3-issued" in cluster.store
    policy = cluster.store[f"{VAP}/{revocation.POLICY}"]
    assert policy["spec"]["validations"][0]["expression"] == revocation.expression(["node3"])
    assert cluster.store[f"{VAPB}/{revocation.POLICY}"]["spec"]["validationActions"] == ["Deny"]
    e = Ledger.load(api.state_for(prepared.inventory, state_copy)).entries["node3"]
    assert e.state == "revoked" and e.serials == ["abc123"] and out.entry.serials == ["abc123"]
    assert any("ValidatingAdmissionPolicy" in d for d in out.done)

    # a second revocation keeps the first name in the policy (replaced, not recreated)
    seed_node_objects(cluster, prepared, "node2")
    node_retire.revoke(resolve(EXAMPLE, state_copy), "node2",
                       hold_lock=False, host_unreachable=True, api_factory=fake_api,
                    refresh_others=False, log=lambda m: None)
    expr = cluster.store[f"{VAP}/{revocation.POLICY}"]["spec"]["validations"][0]["expression"]
    assert expr == revocation.expression(["node2", "node3"])
    assert not allowed(expr, request("system:node:node3")) and not allowed(expr, request("system:node:node2"))
    assert ("PUT", f"{VAP}/{revocation.POLICY}") in [(m, p) for m, p, _ in cluster.requests]
    # and the inventory that still lists them is refused by apply
    with pytest.raises(NodeRetiredError):
        runner.context(resolve(EXAMPLE, state_copy), Options(), log=lambda m: None)


def test_revoke_refuses_a_control_host(prepared, state_copy, fake_api, cluster):
    with pytest.raises(node_ops.NodeOpError, match="control host"):
        node_retire.revoke(resolve(EXAMPLE, state_copy), "cp1",
                           hold_lock=False, host_unreachable=True, api_factory=fake_api,
                        refresh_others=False)
    assert cluster.requests == []


def test_remove_with_host_unreachable_does_the_cluster_side(prepared, cluster, fake_api, state_copy):
    tid = seed_node_objects(cluster, prepared, "node2")
    cluster.add("/api/v1/namespaces/default/pods", pod("web", "node2"))
    out = node_retire.remove(resolve(EXAMPLE, state_copy), "node2",
                             hold_lock=False, host_unreachable=True, api_factory=fake_api,
                          refresh_others=False, timeout=10, log=lambda m: None)
    paths = [(m, p) for m, p, _ in cluster.requests]
    assert ("PATCH", f"{NODES}/node2") in paths
    assert ("POST", "/api/v1/namespaces/default/pods/web/eviction") in paths
    for gone in (f"{NODES}/node2", f"{SECRETS}/bootstrap-token-{tid}", f"{CRB}/hiddenplane:node-renewal:node2",
                 f"{CSRS}/csr-node2-pending"):
        assert gone not in cluster.store, gone
    assert not [p for m, p in paths if p.startswith(VAP)]                 # removal is not revocation
    assert Ledger.load(api.state_for(prepared.inventory, state_copy)).entries["node2"].state == "removed"
    assert out.entry.state == "removed" and "deleted Node node2" in out.done
    # its token joined it once (an issued CSR made with it stays in the cluster for an hour, and
    # marks it used): the state forgets it, so `node add` issues a new token and sends its Secret
    st = api.state_for(prepared.inventory, state_copy)
    assert "node2" not in st.load(prepared.inventory).tokens and "node3" in st.load(prepared.inventory).tokens
    assert any("dropped its bootstrap token" in d for d in out.done)
    assert (st.tokens_path.stat().st_mode & 0o777) == 0o600
    again, changes = material.ensure(prepared.inventory, st.load(prepared.inventory))
    assert again.tokens["node2"].id != tid and "token/node2" in changes.reasons


def test_remove_stops_when_the_drain_is_blocked(prepared, cluster, fake_api, state_copy):
    seed_node_objects(cluster, prepared, "node2")
    cluster.add("/api/v1/namespaces/db/pods", pod("primary", "node2", "db"))
    cluster.block_evictions["db/primary"] = 10**6
    with pytest.raises(node_ops.NodeOpError, match="stays cordoned and nothing else was done"):
        node_retire.remove(resolve(EXAMPLE, state_copy), "node2",
                           hold_lock=False, api_factory=fake_api, refresh_others=False,
                           timeout=0.05, log=lambda m: None)
    assert f"{NODES}/node2" in cluster.store and cluster.store[f"{NODES}/node2"]["spec"]["unschedulable"]
    assert not Ledger.path(api.state_for(prepared.inventory, state_copy)).exists()


# --- what add/remove may change on the other hosts ---------------------------------------------

def test_foreign_changes_allow_only_the_node_and_the_routes():
    rep = runner.Report(events=[
        Event("workers", "node3", "changed", detail=["~ /etc/kubernetes/kubelet.conf 0600 root:root sha256:1"]),
        Event("workers", "node2", "changed", detail=[
            "~ /etc/systemd/system/hiddenplane-routes.service 0644 root:root sha256:2",
            # the same routes, for the repair after a link flap
            "~ /etc/systemd/system/hiddenplane-routes-repair.service 0600 root:root sha256:4",
            "* restart hiddenplane-routes.service"]),
        Event("pki", "(local)", "changed", detail=["token/node3: new"]),
        Event("cluster-bootstrap", "(api)", "changed", detail=["would apply Secret x"]),
    ])
    assert node_ops.foreign_changes(rep, "node3") == []
    rep.events.append(Event("control-plane", "cp1", "changed", detail=["* restart kube-apiserver.service"]))
    assert node_ops.foreign_changes(rep, "node3") == ["cp1: * restart kube-apiserver.service"]
    # the repair's timer or script changing is not a route: apply's
    rep.events[-1] = Event("workers", "node2", "changed", detail=[
        "~ /etc/systemd/system/hiddenplane-routes-repair.timer 0600 root:root sha256:5"])
    assert node_ops.foreign_changes(rep, "node3") == [
        "node2: ~ /etc/systemd/system/hiddenplane-routes-repair.timer 0600 root:root sha256:5"]
    # a control host added or removed: every worker's balancer lists one server more or less
    rep.events[-1] = Event("workers", "node2", "changed", detail=[
        "~ /etc/kubernetes/api-balancer.cfg 0644 root:root sha256:3", "* reload hiddenplane-api-balancer.service"])
    assert node_ops.foreign_changes(rep, "node3") == []


# --- the CLI -----------------------------------------------------------------------------------

def test_remove_without_yes_prints_the_plan_and_changes_nothing(state_copy):
    res = CliRunner().invoke(cli, ["node", "remove", str(EXAMPLE), "node2", "--state", str(state_copy)])
    assert res.exit_code == 2, res.output
    assert "cordon and drain Node node2" in res.output and "pass --yes" in res.output
    assert not (state_copy / "nodes.yaml").exists()


def test_dry_run_prints_the_same_steps_and_exits_0_in_text_and_json(state_copy):
    base = ["node", "revoke", str(EXAMPLE), "node2", "--state", str(state_copy)]
    text = CliRunner().invoke(cli, [*base, "--dry-run"])
    assert text.exit_code == 0, text.output
    doc = json.loads(CliRunner().invoke(cli, [*base, "--dry-run", "--output", "json"]).output)
    assert doc["dryRun"] is True and doc["name"] == "node2"
    assert [f"  - {s}" for s in doc["steps"]] == text.output.splitlines()[1:]
    assert doc["steps"][0].startswith("deny every write by system:node:node2")
    assert not (state_copy / "nodes.yaml").exists()
    # --dry-run wins over --yes: still nothing done
    assert CliRunner().invoke(cli, [*base, "--dry-run", "--yes"]).exit_code == 0
    assert not (state_copy / "nodes.yaml").exists()


def test_a_run_goes_through_exactly_the_steps_its_plan_lists(prepared, cluster, fake_api, state_copy):
    """The plan (without --yes) and the run come from one list: a run's steps are the plan's
    lines, in the plan's order (here without the other hosts' routes: no hosts in this test)."""
    seed_node_objects(cluster, prepared, "node2")
    seen: list[str] = []
    out = node_retire.remove(resolve(EXAMPLE, state_copy), "node2", hold_lock=False, host_unreachable=True,
                             api_factory=fake_api, refresh_others=False, timeout=10, log=seen.append)
    t, _ = node_ops.node_target(resolve(EXAMPLE, state_copy), "node2")
    plan = node_retire.remove_plan(t, skip_cluster=False, host_unreachable=True)
    routes = [p for p in plan if p.startswith("drop the routes")]
    assert out.steps == [p for p in plan if p not in routes][:len(out.steps)] and len(out.steps) == 3
    assert [line for line in seen if "] " in line] == [f"node2: [{i}/3] {s}" for i, s in enumerate(out.steps, 1)]
    assert out.as_dict()["state"] == "removed" and "deleted Node node2" in out.as_dict()["done"]


def test_list_shows_inventory_and_ledger(prepared, state_copy, tmp_path):
    state = api.state_for(prepared.inventory, state_copy)
    led = Ledger()
    led.record_active(prepared.inventory)
    led.mark_revoked(HostSpec(name="old1", address="192.168.56.240", role="worker"), ["ff"])
    led.save(state)
    res = CliRunner().invoke(cli, ["node", "list", str(EXAMPLE), "--state", str(state_copy), "--output", "json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in yaml.safe_load(res.output)}
    assert rows["cp1"]["role"] == "control" and rows["node2"]["state"] == "active"
    assert rows["old1"]["state"] == "revoked" and rows["old1"]["in_inventory"] is False
    res = CliRunner().invoke(cli, ["node", "list", str(EXAMPLE), "--state", str(state_copy)])
    assert res.output.splitlines()[0].split()[:4] == ["NAME", "ROLE", "ADDRESS", "STATE"]


def test_unknown_node_is_named(state_copy):
    res = CliRunner().invoke(cli, ["node", "remove", str(EXAMPLE), "nope", "--state", str(state_copy), "--yes"])
    assert res.exit_code != 0 and "no host named nope" in res.output


# --- a run limited to some hosts (node add, etcd member add) ---------------------------------------

def test_a_limited_run_plans_only_its_hosts_but_connects_and_locks_the_controls(state_copy):
    from installer.engine.phases import build
    ctx = runner.context(resolve(EXAMPLE, state_copy), Options(hosts=frozenset({"node3"})), log=lambda m: None)
    assert [h.name for h in ctx.hosts()] == ["node3"] and ctx.hosts("control") == []
    connect = next(p for p in build() if p.name == "connect")
    assert connect.prepare(ctx) == ["node3", "cp1"]          # cp1: the lock and the API tunnel
    with pytest.raises(InstallerError, match="no host named nope"):
        runner.context(resolve(EXAMPLE, state_copy), Options(hosts=frozenset({"nope"})), log=lambda m: None)


def test_revocation_counts_as_enforced_only_when_each_apiserver_refuses_the_identity(prepared):
    """node_api.refuses: a dry-run create of the Node as the revoked identity, refused by the
    policy (403 with its message); admitted (409 AlreadyExists, or created) is not enforced."""
    from installer.host import kube, node_api

    from .fakeapi import FakeCluster, _status

    def client(fake):
        a = kube.api_client("https://192.168.56.230:6443", prepared.material)
        a.pool = fake
        return a
    denied, admitted = FakeCluster(), FakeCluster()
    denied.fail[("POST", "/api/v1/nodes")] = (403, _status(
        403, "Forbidden", 'nodes "w2" is forbidden: ValidatingAdmissionPolicy \'hiddenplane-revoked-nodes\' with '
        "binding 'hiddenplane-revoked-nodes' denied request: this node identity was revoked by hiddenplane"))
    admitted.fail[("POST", "/api/v1/nodes")] = (409, _status(409, "AlreadyExists", 'nodes "w2" already exists'))
    a, b = client(denied), client(admitted)
    try:
        assert "this node identity was revoked" in node_api.refuses(a, "w2")
        assert node_api.refuses(b, "w2") is None
        method, path, _ = denied.requests[0]
        assert (method, path) == ("POST", "/api/v1/nodes")
        assert denied.headers[0]["Impersonate-User"] == "system:node:w2"
        assert node_api.wait_refused_everywhere({"cp1": a}, ["w2"], timeout=1).keys() == {"cp1"}
        with pytest.raises(kube.KubeError, match="not enforced yet by cp2"):
            node_api.wait_refused_everywhere({"cp1": a, "cp2": b}, ["w2"], timeout=0.3, interval=0.1)
    finally:
        a.close()
        b.close()
