"""The revoked-nodes policy against an attacker and a stale operator (issue 21):

- revocations only grow: ``node revoke`` run from a copy of the state taken before another
  revoke keeps the name that revoke added (the live policy is read, strictly, and merged), says
  where state and cluster disagreed, and the state's ledger learns the cluster's names;
- an expression not in the exact form the installer writes is an error naming the policy, and
  nothing is written;
- the policy and its binding are compared with the live objects field by field over the whole
  spec (the apiserver's own defaults allowed for what we leave out), so a tampering that switches
  the policy off or narrows it is put back, not read as "unchanged".

Through the real API client over tests/fakeapi.py's fake transport; the CEL expression written
is evaluated by a CEL library."""

from __future__ import annotations

import copy
import shutil

import cel
import pytest

from installer import api
from installer.actions import node_retire
from installer.core.cluster import resolve
from installer.core.errors import StateError
from installer.core.ledger import Ledger, NodeRetiredError, check_inventory
from installer.core.render import revocation
from installer.core.render.manifests import LABELS
from installer.host import kube, kube_objects

from .conftest import EXAMPLE
from .fakeapi import FakeCluster, client_factory

VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAPB = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
CRB = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
VERSION = "v1.36.4"


@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture
def fake_api(prepared, cluster):
    return client_factory(prepared.material, cluster)


def state_copy(prepared, tmp_path, name: str):
    st = tmp_path / name
    shutil.copytree(prepared.state.root, st)
    return st


def denied(cluster: FakeCluster, user: str) -> bool:
    expr = cluster.store[f"{VAP}/{revocation.POLICY}"]["spec"]["validations"][0]["expression"]
    req = {"request": {"userInfo": {"username": user, "groups": ["system:nodes"]}, "operation": "CREATE",
                       "resource": {"group": "", "version": "v1", "resource": "nodes"}}}
    return cel.evaluate(expr, req) is False


def revoke(name: str, st, fake_api, log=None):
    return node_retire.revoke(resolve(EXAMPLE, st), name, hold_lock=False, host_unreachable=True, api_factory=fake_api,
                              refresh_others=False, log=log or (lambda m: None))


def writes(cluster: FakeCluster) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _ in cluster.requests if m in ("POST", "PUT", "DELETE", "PATCH")]


# --- parse_expression: the exact inverse of expression() ------------------------------------------

@pytest.mark.parametrize("names", [[], ["w1"], ["node3", "w1", "w10"], ["w2", "a", "w2", "0-x"]])
def test_parse_expression_round_trips(names):
    expr = revocation.expression(names)
    assert revocation.parse_expression(expr) == sorted(set(names))
    assert revocation.expression(revocation.parse_expression(expr)) == expr


GOOD = revocation.expression(["a", "b"])


@pytest.mark.parametrize("edited", [
    "true",
    "false",
    GOOD + " || true",
    "true || " + GOOD,
    GOOD.replace('"system:node:a", "system:node:b"', '"system:node:b", "system:node:a"'),     # reordered
    GOOD.replace('", "', '","'),                                                          # respaced
    GOOD.replace('"system:node:b"', '"system:node:a"'),                                   # duplicated
    GOOD.replace('"system:node:b"', '"kubernetes-admin"'),                                # not a node
    GOOD.replace('"system:node:b"', '"system:node:B"'),                                   # not a label
    GOOD.replace('"system:node:b"', '"system:node:"'),
    GOOD.replace('"system:node:b"', "1"),
    GOOD.replace('username in', 'username.lowerAscii() in'),
    GOOD.replace("!(", "(", 1),
    GOOD + " ",
    '!(request.userInfo.username in ["system:node:a"], ["x"])',
    '!(request.userInfo.username in ["system:node:a"]) && !(request.userInfo.username in ["x"])',
    None,
    42,
])
def test_parse_expression_refuses_anything_else(edited):
    with pytest.raises(ValueError):
        revocation.parse_expression(edited)


def test_policy_names_wants_exactly_our_one_validation():
    policy = revocation.policy_objects(["w2"])[0]
    assert revocation.policy_names(policy) == ["w2"]
    for validations in ([], None, "x", [policy["spec"]["validations"][0]] * 2,
                        [{"expression": "true"}], ["not a dict"]):
        broken = copy.deepcopy(policy)
        broken["spec"]["validations"] = validations
        with pytest.raises(ValueError):
            revocation.policy_names(broken)


# --- revocations only grow --------------------------------------------------------------------------

def test_revoke_from_an_older_state_keeps_the_other_revocation(prepared, cluster, fake_api, tmp_path):
    """The attack seen on the real lab: node3 revoked from one state; then, from a copy of the
    state taken before that, node2 revoked. node3's stolen certificate must stay denied."""
    current, older = state_copy(prepared, tmp_path, "current"), state_copy(prepared, tmp_path, "older")
    revoke("node3", current, fake_api)
    assert denied(cluster, "system:node:node3")
    out = revoke("node2", older, fake_api)
    for user in ("system:node:node2", "system:node:node3"):
        assert denied(cluster, user), user
    assert not denied(cluster, "system:node:cp1") and not denied(cluster, "kubernetes-admin")
    policy = cluster.store[f"{VAP}/{revocation.POLICY}"]
    assert revocation.policy_names(policy) == ["node2", "node3"]
    # said, and learned by the older state's ledger: a later run from it keeps node3 too
    said = [w for w in out.warnings if "already denied system:node:node3" in w]
    assert len(said) == 1 and "did not mark revoked" in said[0], out.warnings
    assert any("denies system:node:node2, system:node:node3" in d for d in out.done), out.done
    e = Ledger.load(api.state_for(prepared.inventory, older)).entries["node3"]
    assert e.state == "revoked" and e.address == "192.168.56.232" and e.role == "worker"
    assert e.history[-1]["note"] == "found in the cluster's revoked-nodes policy"
    with pytest.raises(NodeRetiredError, match="node3 was revoked"):
        check_inventory(prepared.inventory, Ledger.load(api.state_for(prepared.inventory, older)))
    # now they agree: the same revoke again writes nothing and says nothing
    cluster.requests.clear()
    again = revoke("node2", older, fake_api)
    assert again.warnings == [] and not [w for w in writes(cluster) if "admissionregistration" in w[1]]
    assert "unchanged ValidatingAdmissionPolicy hiddenplane-revoked-nodes (denies system:node:node2, " \
           "system:node:node3)" in again.done, again.done


def test_disagreements_both_ways_are_reported_and_nothing_is_dropped(prepared, cluster, fake_api, tmp_path):
    """The ledger says node3 is revoked, the cluster's policy (edited in our exact form) denies
    old9 instead, a name this state never had: both stay, both are reported."""
    st = state_copy(prepared, tmp_path, "st")
    state = api.state_for(prepared.inventory, st)
    led = Ledger()
    led.record_active(prepared.inventory)
    led.mark_revoked(led.host("node3"), [])
    led.save(state)
    for obj in revocation.policy_objects(["old9"]):
        cluster.add(VAP if obj["kind"] == "ValidatingAdmissionPolicy" else VAPB, obj)
    out = revoke("node2", st, fake_api)
    assert revocation.policy_names(cluster.store[f"{VAP}/{revocation.POLICY}"]) == ["node2", "node3", "old9"]
    assert any("already denied system:node:old9" in w for w in out.warnings), out.warnings
    assert any("marks node3 revoked but the cluster's policy hiddenplane-revoked-nodes did not deny "
               "system:node:node3" in w for w in out.warnings), out.warnings
    led = Ledger.load(state)
    assert (led.entries["old9"].state, led.entries["old9"].role, led.entries["old9"].address) == (
        "revoked", "worker", "")
    assert led.revoked_names() == ["node2", "node3", "old9"]
    # a learned name has no address: acting on it by name alone is refused, with the reason
    with pytest.raises(StateError, match="old9 is in the node ledger only as a name the cluster's"):
        led.host("old9")


def test_a_missing_policy_with_revocations_in_the_ledger_is_reported(prepared, cluster, fake_api, tmp_path):
    st = state_copy(prepared, tmp_path, "st")
    state = api.state_for(prepared.inventory, st)
    led = Ledger()
    led.record_active(prepared.inventory)
    led.mark_revoked(led.host("node3"), [])
    led.save(state)
    out = revoke("node2", st, fake_api)
    assert any("marks node3 revoked but the cluster had no policy hiddenplane-revoked-nodes" in w
               for w in out.warnings), out.warnings
    assert denied(cluster, "system:node:node3") and denied(cluster, "system:node:node2")


def test_a_first_revoke_reports_nothing(prepared, cluster, fake_api, tmp_path):
    out = revoke("node2", state_copy(prepared, tmp_path, "st"), fake_api)
    assert out.warnings == []


@pytest.mark.parametrize("expression", [
    revocation.expression(["node3"]) + " || true",
    revocation.expression(["node3"]).replace('"]', '", "kubernetes-admin"]'),
    "true",
])
def test_an_edited_policy_stops_revoke_before_any_write(prepared, cluster, fake_api, tmp_path, expression):
    st = state_copy(prepared, tmp_path, "st")
    policy, binding = revocation.policy_objects(["node3"])
    policy["spec"]["validations"][0]["expression"] = expression
    cluster.add(VAP, policy)
    cluster.add(VAPB, binding)
    with pytest.raises(kube.KubeError) as e:
        revoke("node2", st, fake_api)
    msg = str(e.value)
    assert "ValidatingAdmissionPolicy hiddenplane-revoked-nodes was edited outside the installer" in msg
    assert "nothing was written" in msg and "kubectl edit validatingadmissionpolicy" in msg
    assert writes(cluster) == []
    assert cluster.store[f"{VAP}/{revocation.POLICY}"]["spec"]["validations"][0]["expression"] == expression
    assert not Ledger.path(api.state_for(prepared.inventory, st)).exists()


def test_a_learned_entry_survives_save_and_load(prepared, tmp_path):
    state = api.state_for(prepared.inventory, state_copy(prepared, tmp_path, "st"))
    led = Ledger()
    led.learn_revoked("old9", "found in the cluster's revoked-nodes policy")
    led.learn_revoked("old9", "again")                         # already revoked: no second history line
    led.save(state)
    e = Ledger.load(state).entries["old9"]
    assert (e.state, e.role, e.address, len(e.history)) == ("revoked", "worker", "", 1)


# --- the policy and its binding, compared field by field ---------------------------------------------

def as_stored(obj: dict) -> dict:
    """What kube-apiserver 1.36 stores for our object: its defaults filled in (pkg/apis/
    admissionregistration/v1: failurePolicy Fail; matchPolicy Equivalent, empty namespace and
    object selectors, each rule's scope "*"), and a policy's status. Written out, not computed."""
    out = copy.deepcopy(obj)
    if obj["kind"] == "ValidatingAdmissionPolicy":
        spec = out["spec"]
        spec["failurePolicy"] = spec.get("failurePolicy", "Fail")
        spec["matchConstraints"].update(matchPolicy="Equivalent", namespaceSelector={}, objectSelector={})
        spec["matchConstraints"]["resourceRules"][0]["scope"] = "*"
        out["status"] = {"observedGeneration": 1, "typeChecking": {}}
    return out


def seed(cluster: FakeCluster, names=("node3",), tamper=None) -> list[dict]:
    ours = revocation.policy_objects(list(names))
    for obj in ours:
        live = as_stored(obj)
        if tamper and tamper[0] == obj["kind"]:
            tamper[1](live)
        cluster.add(VAP if obj["kind"] == "ValidatingAdmissionPolicy" else VAPB, live)
    return ours


def test_ours_with_the_apiservers_defaults_is_unchanged(prepared, cluster, fake_api):
    ours = seed(cluster)
    with fake_api() as a:
        assert kube_objects.apply_objects(a, ours, VERSION) == [
            ("ValidatingAdmissionPolicy", revocation.POLICY, "unchanged"),
            ("ValidatingAdmissionPolicyBinding", revocation.POLICY, "unchanged")]
    assert writes(cluster) == []


def _set(path: str, value):
    def tamper(obj: dict) -> None:
        *head, last = path.split(".")
        node = obj
        for k in head:
            node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        node[last] = value
    return tamper


def _append(path: str, value):
    def tamper(obj: dict) -> None:
        node = obj
        for k in path.split("."):
            node = node[k]
        node.append(value)
    return tamper


P, B = "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"
TAMPERING = {
    "matchConditions false switches it off": (P, _set("spec.matchConditions",
                                                      [{"name": "off", "expression": "false"}])),
    "a paramKind": (P, _set("spec.paramKind", {"apiVersion": "v1", "kind": "ConfigMap"})),
    "a namespaceSelector": (P, _set("spec.matchConstraints.namespaceSelector", {"matchLabels": {"x": "y"}})),
    "an objectSelector": (P, _set("spec.matchConstraints.objectSelector",
                                  {"matchExpressions": [{"key": "x", "operator": "Exists"}]})),
    "excludeResourceRules": (P, _set("spec.matchConstraints.excludeResourceRules", [{
        "apiGroups": [""], "apiVersions": ["*"], "operations": ["CREATE"], "resources": ["nodes"], "scope": "*"}])),
    "matchPolicy Exact": (P, _set("spec.matchConstraints.matchPolicy", "Exact")),
    "a rule's scope Namespaced": (P, _set("spec.matchConstraints.resourceRules.0.scope", "Namespaced")),
    "failurePolicy Ignore": (P, _set("spec.failurePolicy", "Ignore")),
    "another validation": (P, _append("spec.validations", {"expression": "true"})),
    "a variable": (P, _set("spec.variables", [{"name": "v", "expression": "true"}])),
    "auditAnnotations": (P, _set("spec.auditAnnotations", [{"key": "k", "valueExpression": "'v'"}])),
    "a messageExpression": (P, _set("spec.validations.0.messageExpression", "'allowed'")),
    "an ownerReference (the garbage collector deletes it with its owner)": (P, _set("metadata.ownerReferences", [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "short-lived", "uid": "u1"}])),
    "the binding's paramRef": (B, _set("spec.paramRef", {"name": "p", "parameterNotFoundAction": "Allow"})),
    "the binding's matchResources": (B, _set("spec.matchResources",
                                             {"namespaceSelector": {"matchLabels": {"a": "b"}}})),
    "the binding's matchResources excluding nodes": (B, _set("spec.matchResources", {"excludeResourceRules": [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["nodes"]}]})),
    "validationActions Warn": (B, _set("spec.validationActions", ["Warn"])),
    "validationActions Audit": (B, _set("spec.validationActions", ["Audit"])),
    "the binding names another policy": (B, _set("spec.policyName", "something-else")),
}


@pytest.mark.parametrize("what", TAMPERING)
def test_a_tampered_policy_or_binding_is_put_back_exactly(prepared, cluster, fake_api, what):
    kind, tamper = TAMPERING[what]
    ours = seed(cluster, tamper=(kind, tamper))
    with fake_api() as a:
        done = kube_objects.apply_objects(a, ours, VERSION)
    assert dict((k, action) for k, _, action in done) == {P: "unchanged", B: "unchanged", kind: "replaced"}
    mine = next(o for o in ours if o["kind"] == kind)
    path = f"{VAP if kind == P else VAPB}/{revocation.POLICY}"
    puts = [body for m, p, body in cluster.requests if m == "PUT"]
    assert len(puts) == 1 and puts[0]["spec"] == mine["spec"]
    assert "ownerReferences" not in puts[0]["metadata"] and "ownerReferences" not in cluster.store[path]["metadata"]
    assert cluster.store[path]["spec"] == mine["spec"]
    # and the next run finds it unchanged (the apiserver's defaults filled in again)
    cluster.store[path]["spec"] = as_stored(mine)["spec"]
    cluster.requests.clear()
    with fake_api() as a:
        assert {action for _, _, action in kube_objects.apply_objects(a, ours, VERSION)} == {"unchanged"}


def test_a_cluster_role_binding_with_a_subject_added_is_put_back(prepared, cluster, fake_api):
    from installer.core.render.manifests import node_renewal_binding
    ours = node_renewal_binding("node2")
    live = copy.deepcopy(ours)
    live["subjects"].append({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"})
    cluster.add(CRB, live)
    with fake_api() as a:
        assert kube_objects.apply_objects(a, [ours], VERSION) == [("ClusterRoleBinding", ours["metadata"]["name"],
                                                                   "replaced")]
    assert cluster.store[f"{CRB}/{ours['metadata']['name']}"]["subjects"] == ours["subjects"]


def test_foreign_labels_and_annotations_alone_leave_the_policy_unchanged(prepared, cluster, fake_api):
    """Metadata others add (a label, an annotation) does not change what the policy denies."""
    def tag(obj):
        obj["metadata"]["labels"] = {**LABELS, "team": "infra"}
        obj["metadata"]["annotations"] = {"note": "seen"}
    ours = seed(cluster, tamper=(P, tag))
    with fake_api() as a:
        assert {action for _, _, action in kube_objects.apply_objects(a, ours, VERSION)} == {"unchanged"}
