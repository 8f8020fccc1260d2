"""Issue 21: kube-proxy holds one identity per node, which `node revoke` and `node remove` end,
and no worker's serving certificate names the API.

- the certificate table: one kube-proxy client certificate per worker (CN
  ``hiddenplane:kube-proxy:<node>``, no O), rendered into that worker's kubeconfig only;
- cluster-bootstrap: one ClusterRoleBinding per worker, and upstream's built-in
  ``system:node-proxier`` binding (the shared ``system:kube-proxy`` of earlier releases) left
  with no subject and ``autoupdate: "false"``, idempotently, through the real client over
  tests/fakeapi.py; the apiserver's start-up reconciliation is modelled after upstream's
  ``computeReconciledRoleBinding`` (pkg/registry/rbac/reconciliation/reconcile_rolebindings.go)
  to show why the annotation is needed;
- revoke and remove delete the node's binding, nobody else's;
- the state of an earlier release (a shared ``pki/kube-proxy.*``) moves to per-node pairs;
- renew, rotate and certs check handle the per-node rows;
- kubelet serving certificates name only their node.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import shutil
import subprocess

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from installer import api
from installer.actions import certs as certs_mod
from installer.actions import node_retire, renew, rotate
from installer.core.cluster import resolve
from installer.core.pki import issue
from installer.core.pki.specs import CLUSTER_CA, CertSpec, apiserver_sans, cert_specs
from installer.core.render.manifests import bootstrap_objects, kube_proxy_binding, shared_kube_proxy_binding
from installer.core.render.plan import render_cluster
from installer.host import kube, kube_objects

from .conftest import EXAMPLE, write_inventory
from .fakeapi import FakeCluster, client_factory
from .test_node_ops import seed_node_objects

API = "https://192.168.56.230:6443"
CRB = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
WORKERS = ("node2", "node3")
KUBE_PROXY_CONF = "/etc/kubernetes/kube-proxy.conf"
AUTOUPDATE = "rbac.authorization.kubernetes.io/autoupdate"
SHARED_USER = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:kube-proxy"}


def _cn(cert: x509.Certificate) -> list[str]:
    return [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _orgs(cert: x509.Certificate) -> list[str]:
    return [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]


def _kubeconfig_client(content: bytes) -> tuple[str, x509.Certificate, bytes]:
    doc = yaml.safe_load(content)
    user = doc["users"][0]
    cert = x509.load_pem_x509_certificate(base64.b64decode(user["user"]["client-certificate-data"]))
    return user["name"], cert, base64.b64decode(user["user"]["client-key-data"])


# --- the certificate table and what each worker gets -----------------------------------------

def test_each_worker_has_its_own_kube_proxy_certificate(prepared):
    specs = {s.name: s for s in cert_specs(prepared.inventory)}
    assert "kube-proxy" not in specs                       # no shared row any more
    for node in WORKERS:
        spec = specs[f"kube-proxy/{node}"]
        assert spec == CertSpec(f"kube-proxy/{node}", CLUSTER_CA, f"hiddenplane:kube-proxy:{node}", client=True)
        cert = prepared.material.certs[f"kube-proxy/{node}"].cert
        # no O: a group would be something a binding could grant to every worker at once
        assert _cn(cert) == [f"hiddenplane:kube-proxy:{node}"] and _orgs(cert) == []
        assert issue.sans_of(cert) == frozenset()
        cert.verify_directly_issued_by(prepared.material.cas[CLUSTER_CA].cert)
    keys = {issue.key_pem(prepared.material.certs[f"kube-proxy/{n}"].key) for n in WORKERS}
    assert len(keys) == len(WORKERS)


def test_each_worker_renders_its_own_kube_proxy_kubeconfig(prepared):
    seen = set()
    for node in WORKERS:
        f = prepared.plans[node].files[KUBE_PROXY_CONF]
        assert f.mode == 0o600 and f.secret and f.restarts == ("kube-proxy.service",)
        user, cert, key = _kubeconfig_client(f.content)
        pair = prepared.material.certs[f"kube-proxy/{node}"]
        assert user == f"hiddenplane:kube-proxy:{node}" and _cn(cert) == [user]
        assert cert.serial_number == pair.cert.serial_number and key == issue.key_pem(pair.key)
        seen.add(cert.serial_number)
    assert len(seen) == len(WORKERS)
    assert all(KUBE_PROXY_CONF not in prepared.plans[h.name].files for h in prepared.inventory.controls)


def test_state_of_an_earlier_release_moves_to_per_node_pairs(prepared, tmp_path):
    """A state holding the shared pki/kube-proxy.* (earlier releases): the next prepare issues
    each worker its own pair and renders it; the shared one is neither used nor re-issued."""
    state = tmp_path / "state"
    shutil.copytree(prepared.state.root, state)
    for node in WORKERS:
        for ext in ("crt", "key"):
            (state / "pki" / "kube-proxy" / f"{node}.{ext}").unlink()
    ca = prepared.material.cas[CLUSTER_CA]
    key = issue.new_key("ecdsa-p256")
    old = issue.issue(CertSpec("kube-proxy", CLUSTER_CA, "system:kube-proxy", client=True), key, ca, 365,
                      dt.datetime.now(dt.timezone.utc))
    (state / "pki" / "kube-proxy.crt").write_bytes(issue.cert_pem(old))
    (state / "pki" / "kube-proxy.key").write_bytes(issue.key_pem(key))
    (state / "pki" / "kube-proxy.key").chmod(0o600)

    p = api.prepare(EXAMPLE, state)
    assert {k: v for k, v in p.changes.reasons.items() if "kube-proxy" in k} == {
        f"kube-proxy/{n}": "new" for n in WORKERS}
    assert "kube-proxy" not in p.material.certs
    for node in WORKERS:
        user, cert, _ = _kubeconfig_client(p.plans[node].files[KUBE_PROXY_CONF].content)
        assert user == f"hiddenplane:kube-proxy:{node}" and cert.serial_number != old.serial_number
        assert (state / "pki" / "kube-proxy" / f"{node}.crt").is_file()


# --- cluster-bootstrap: the per-node bindings and upstream's shared one ------------------------

@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture
def client(prepared, cluster):
    a = kube.api_client(API, prepared.material)
    a.pool = cluster
    yield a
    a.close()


def upstream_node_proxier() -> dict:
    """The binding kube-apiserver creates at start (bootstrappolicy: ``NewClusterBinding(
    "system:node-proxier").Users(user.KubeProxy)`` with the default label and annotation)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:node-proxier", "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                         "annotations": {AUTOUPDATE: "true"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
            "subjects": [dict(SHARED_USER)]}


def apiserver_answer(obj: dict) -> dict:
    """What the apiserver returns for a stored binding: an empty subject list is omitted."""
    out = copy.deepcopy(obj)
    if not out.get("subjects"):
        out.pop("subjects", None)
    return out


def reconcile_at_start(stored: dict) -> dict:
    """kube-apiserver's RBAC post-start hook on one default binding (upstream
    computeReconciledRoleBinding, union mode): a binding annotated autoupdate "false" is
    Protected and left as it is; otherwise missing default subjects are added back."""
    if (stored["metadata"].get("annotations") or {}).get(AUTOUPDATE) == "false":
        return stored
    out = copy.deepcopy(stored)
    subjects = out.get("subjects") or []
    if SHARED_USER not in subjects:
        out["subjects"] = subjects + [dict(SHARED_USER)]
    return out


def test_bootstrap_objects_bind_each_worker_and_empty_the_shared_binding(prepared):
    objs = bootstrap_objects(prepared.inventory, prepared.material)
    crbs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRoleBinding"}
    for node in WORKERS:
        b = crbs[f"hiddenplane:kube-proxy:{node}"]
        assert b == kube_proxy_binding(node)
        assert b["roleRef"]["name"] == "system:node-proxier"
        assert b["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                  "name": f"hiddenplane:kube-proxy:{node}"}]
    shared = crbs["system:node-proxier"]
    assert shared["subjects"] == [] and shared["metadata"]["annotations"] == {AUTOUPDATE: "false"}
    # no binding anywhere names the old shared user, nor a group a kube-proxy certificate could hold
    assert not [o for o in crbs.values() if SHARED_USER in o["subjects"]]
    assert not [o for o in crbs.values() for s in o["subjects"]
                if s["kind"] == "Group" and s["name"].startswith("hiddenplane:kube-proxy")]
    # joined workers keep their kube-proxy binding (only the token goes)
    joined = bootstrap_objects(prepared.inventory, prepared.material, frozenset(WORKERS))
    assert {o["metadata"]["name"] for o in joined} >= {f"hiddenplane:kube-proxy:{n}" for n in WORKERS}
    kube_objects.validate_objects(objs, prepared.inventory.spec.kubernetes.version)


def test_shared_binding_is_emptied_once_and_stays_empty(prepared, cluster, client):
    version = prepared.inventory.spec.kubernetes.version
    cluster.add(CRB, upstream_node_proxier())
    path = f"{CRB}/system:node-proxier"
    # before: the apiserver's reconciliation keeps the shared user bound
    assert SHARED_USER in reconcile_at_start(cluster.store[path])["subjects"]

    done = kube_objects.apply_objects(client, bootstrap_objects(prepared.inventory, prepared.material), version)
    assert ("ClusterRoleBinding", "system:node-proxier", "replaced") in done
    for node in WORKERS:
        assert ("ClusterRoleBinding", f"hiddenplane:kube-proxy:{node}", "created") in done
    live = cluster.store[path]
    assert live["subjects"] == [] and live["metadata"]["annotations"] == {AUTOUPDATE: "false"}
    assert live["metadata"]["labels"]["kubernetes.io/bootstrapping"] == "rbac-defaults"
    assert live["roleRef"]["name"] == "system:node-proxier"        # replaced, never deleted

    # the apiserver restarts: the annotation keeps it from adding system:kube-proxy back, and it
    # answers without the empty list; the next apply finds nothing to do
    cluster.store[path] = apiserver_answer(reconcile_at_start(cluster.store[path]))
    cluster.requests.clear()
    done = kube_objects.apply_objects(client, bootstrap_objects(prepared.inventory, prepared.material), version)
    assert all(a == "unchanged" for _, _, a in done), done
    assert not [m for m, _, _ in cluster.requests if m != "GET"]

    # someone sets autoupdate back to "true" (or deletes the binding): the next apply repairs it
    # before a restart could hand the shared identity its rights again
    cluster.store[path]["metadata"]["annotations"][AUTOUPDATE] = "true"
    done = kube_objects.apply_objects(client, [shared_kube_proxy_binding()], version)
    assert done == [("ClusterRoleBinding", "system:node-proxier", "replaced")]
    assert cluster.store[path]["metadata"]["annotations"][AUTOUPDATE] == "false"
    del cluster.store[path]
    done = kube_objects.apply_objects(client, [shared_kube_proxy_binding()], version)
    assert done == [("ClusterRoleBinding", "system:node-proxier", "created")]
    assert reconcile_at_start(cluster.store[path])["subjects"] == []


# --- revoke and remove end the node's kube-proxy identity --------------------------------------

@pytest.fixture
def fake_api(prepared, cluster):
    return client_factory(prepared.material, cluster)


@pytest.fixture
def state_copy(prepared, tmp_path):
    st = tmp_path / "state"
    shutil.copytree(prepared.state.root, st)
    return st


@pytest.mark.parametrize("how", ["revoke", "remove"])
def test_revoke_and_remove_delete_only_the_nodes_kube_proxy_binding(prepared, cluster, fake_api, state_copy, how):
    seed_node_objects(cluster, prepared, "node3")
    for node in WORKERS:
        cluster.add(CRB, kube_proxy_binding(node))
    lines: list[str] = []
    run = node_retire.revoke if how == "revoke" else node_retire.remove
    extra = {} if how == "revoke" else {"timeout": 10}
    out = run(resolve(EXAMPLE, state_copy), "node3", hold_lock=False, host_unreachable=True, api_factory=fake_api,
              refresh_others=False, log=lines.append, **extra)
    assert ("DELETE", f"{CRB}/hiddenplane:kube-proxy:node3") in [(m, p) for m, p, _ in cluster.requests]
    assert f"{CRB}/hiddenplane:kube-proxy:node3" not in cluster.store
    assert f"{CRB}/hiddenplane:kube-proxy:node2" in cluster.store            # nobody else's
    assert "deleted ClusterRoleBinding hiddenplane:kube-proxy:node3" in out.done
    assert "node3: deleted ClusterRoleBinding hiddenplane:kube-proxy:node3" in lines


def test_a_binding_already_gone_is_no_error(prepared, cluster, fake_api, state_copy):
    seed_node_objects(cluster, prepared, "node3")
    out = node_retire.revoke(resolve(EXAMPLE, state_copy), "node3", hold_lock=False, host_unreachable=True,
                             api_factory=fake_api, refresh_others=False, log=lambda m: None)
    assert not [d for d in out.done if "kube-proxy" in d] and out.entry.state == "revoked"


# --- renew, rotate, certs check -----------------------------------------------------------------

def test_renew_picks_and_rolls_out_one_nodes_kube_proxy_certificate(prepared):
    inv, old = prepared.inventory, prepared.material
    names = renew.leaf_names(inv, old)
    assert {f"kube-proxy/{n}" for n in WORKERS} <= set(names) and "kube-proxy" not in names
    assert renew.leaf_names(inv, old, ["kube-proxy/*"]) == [f"kube-proxy/{n}" for n in WORKERS]
    new = renew.reissue(inv, old, ["kube-proxy/node2"])
    assert new.certs["kube-proxy/node2"].cert.serial_number != old.certs["kube-proxy/node2"].cert.serial_number
    assert _cn(new.certs["kube-proxy/node2"].cert) == ["hiddenplane:kube-proxy:node2"]
    out = renew.rollout(inv, old, new)
    assert set(out) == {"node2"}
    assert out["node2"].files == [KUBE_PROXY_CONF] and out["node2"].units == ["kube-proxy.service"]


def test_ca_rotation_reissues_every_kube_proxy_certificate_under_the_new_ca(prepared):
    inv, old = prepared.inventory, prepared.material
    new = rotate.rotated(inv, old, [CLUSTER_CA])
    for node in WORKERS:
        cert = new.certs[f"kube-proxy/{node}"].cert
        cert.verify_directly_issued_by(new.cas[CLUSTER_CA].cert)
        assert _cn(cert) == [f"hiddenplane:kube-proxy:{node}"]
        _, rendered, _ = _kubeconfig_client(render_cluster(inv, new)[node].files[KUBE_PROXY_CONF].content)
        assert rendered.serial_number == cert.serial_number


def test_certs_check_reads_the_kube_proxy_certificate_out_of_the_kubeconfig(prepared, tmp_path):
    """Only the client certificate leaves the host (the kubeconfig also holds the key); its serial
    is compared with the node's own; a worker still holding another certificate is marked."""
    plans = {h.name: prepared.plans[h.name] for h in prepared.inventory.spec.hosts}
    expected = certs_mod.expected_paths(prepared.inventory, plans)
    for node in WORKERS:
        assert expected[node][KUBE_PROXY_CONF] == prepared.material.certs[f"kube-proxy/{node}"].cert.serial_number
    assert expected["cp1"]["/etc/kubernetes/admin.conf"] == prepared.material.certs["admin"].cert.serial_number
    assert "/etc/kubernetes/bootstrap-kubelet.conf" not in expected["node2"]        # a token, no certificate

    conf = tmp_path / "kube-proxy.conf"
    conf.write_bytes(prepared.plans["node2"].files[KUBE_PROXY_CONF].content)
    raw = subprocess.run(["sh", "-c", certs_mod.fetch_script([str(conf), str(tmp_path / "absent.conf")])],
                         capture_output=True, check=True).stdout
    key = prepared.material.certs["kube-proxy/node2"].key
    assert b"PRIVATE KEY" not in raw and base64.b64encode(issue.key_pem(key)) not in raw
    rows = certs_mod.host_rows("node2", {str(conf): expected["node2"][KUBE_PROXY_CONF]}, raw)
    assert len(rows) == 1 and rows[0].subject == "hiddenplane:kube-proxy:node2" and rows[0].notes == []
    # the same file on node3 (or the shared certificate of an earlier release) differs from the state
    rows = certs_mod.host_rows("node3", {str(conf): expected["node3"][KUBE_PROXY_CONF]}, raw)
    assert rows[0].notes == ["differs from state"]


# --- kubelet serving certificates name only their node -----------------------------------------

def test_kubelet_serving_certificates_name_only_their_node(doc, tmp_path):
    doc["spec"]["apiServer"].update(endpoint="api.example.com", extraSANs=["k8s.example.com", "192.168.56.240"])
    p = api.prepare(write_inventory(tmp_path, doc), tmp_path / "state")
    dns, ips = apiserver_sans(p.inventory)
    for h in p.inventory.workers:
        cert = p.material.certs[f"kubelet/{h.name}-serving"].cert
        assert issue.sans_of(cert) == {h.name, h.address}
        assert not issue.sans_of(cert) & (dns | ips)
        assert _cn(cert) == [f"system:node:{h.name}"] and _orgs(cert) == ["system:nodes"]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usages) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]    # authenticates to nothing
        served = p.plans[h.name].files["/var/lib/kubelet/pki/kubelet.crt"].content
        assert x509.load_pem_x509_certificate(served).serial_number == cert.serial_number


def test_inventory_reports_every_worker_named_like_the_api_at_once(doc, tmp_path):
    from click.testing import CliRunner

    from installer.cli.main import cli
    doc["spec"]["apiServer"].update(endpoint="api.example.com", extraSANs=["192.168.56.240"])
    doc["spec"]["hosts"] += [{"name": "kubernetes", "address": "192.168.56.241", "role": "worker"},
                             {"name": "api", "address": "192.168.56.242", "role": "worker"},
                             {"name": "w9", "address": "192.168.56.240", "role": "worker"},
                             {"name": "localhost", "address": "192.168.56.243", "role": "worker"}]
    result = CliRunner().invoke(cli, ["validate", str(write_inventory(tmp_path, doc))])
    assert result.exit_code == 2, result.output
    for line in ("spec.hosts[3].name: 'kubernetes' is a name of the API:",
                 "spec.hosts[4].name: 'api' is a name of the API (the first label of 'api.example.com'):",
                 "spec.hosts[5].address: '192.168.56.240' is an address of the API "
                 "(spec.apiServer.extraSANs[0] '192.168.56.240'):",
                 "spec.hosts[6].name: 'localhost' is a name of the API:"):
        assert line in result.output, result.output
    assert "Traceback" not in result.output
