"""The cluster-bootstrap API calls through the installer's API client (host/kube.py).

No kube-apiserver runs in these tests (tests/test_real_*.py have one), so the transport is faked
at its lowest level: ``ApiClient.pool`` (urllib3) is replaced by ``FakeApiServer`` (tests/fakeapi.py), which records
every (method, path, JSON body) and answers with real ``urllib3.HTTPResponse`` objects shaped
like the apiserver's (201 with the stored object, 409 AlreadyExists / 404 NotFound Status JSON,
GET of a stored object with data base64-encoded, PUT checked against resourceVersion). Everything
above the transport (paths, JSON, error mapping) is the installer's own.

TLS and the SSH tunnel are exercised for real against stand-ins: a Python ``ssl`` server with
the rendered apiserver certificate (requiring a client certificate from the cluster CA) and an
in-process paramiko SSH server that forwards ``direct-tcpip`` channels.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import os
import re
import socket
import ssl
import stat
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import paramiko
import pytest
import yaml
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core import inventory
from installer.core.pki import issue
from installer.host import apireach, kube, kube_objects
from installer.host.ssh import Remote

from .conftest import EXAMPLE
from .fakeapi import FakeCluster, _status

API = "https://192.168.56.230:6443"
CRB = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
SECRETS = "/api/v1/namespaces/kube-system/secrets"
NODES = "/api/v1/nodes"
LABELS = {"app.kubernetes.io/managed-by": "hiddenplane"}
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


# --- the fake transport -------------------------------------------------------------------------

class FakeApiServer(FakeCluster):
    """tests/fakeapi.py's fake transport, seeded by kind with the objects cluster-bootstrap sends."""

    def __init__(self, objects: list[dict] = ()):
        super().__init__()
        for o in objects:
            self.put(o)

    def put(self, obj: dict) -> None:
        self.add({"ClusterRoleBinding": CRB, "Secret": SECRETS, "Node": NODES}[obj["kind"]], obj)


@pytest.fixture
def fake():
    return FakeApiServer()


@pytest.fixture
def api(prepared, fake):
    a = kube.api_client(API, prepared.material)
    a.pool = fake
    yield a
    a.close()


# --- the objects we expect, written out ---------------------------------------------------------

def binding(name: str, role: str, kind: str, subject: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": LABELS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": subject}]}


def expected_objects(prepared) -> list[dict]:
    objs = [
        binding("hiddenplane:kubelet-bootstrap", "system:node-bootstrapper", "Group",
                "system:bootstrappers:hiddenplane"),
        # no nodeclient (auto-approval) binding: the installer approves each node's own CSR
        binding("hiddenplane:apiserver-kubelet-api-admin", "system:kubelet-api-admin", "User",
                "kube-apiserver-kubelet-client"),
        binding("hiddenplane:cluster-admins", "cluster-admin", "Group", "kubeadm:cluster-admins"),
    ]
    for node in ("node2", "node3"):
        t = prepared.material.tokens[node]
        objs.append(binding(f"hiddenplane:node-renewal:{node}",
                            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
                            "User", f"system:node:{node}"))
        objs.append({
            "apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
            "metadata": {"name": f"bootstrap-token-{t.id}", "namespace": "kube-system",
                         "labels": {**LABELS, "hiddenplane.io/node": node}},
            "stringData": {"description": f"hiddenplane: TLS bootstrap of node {node}",
                           "token-id": t.id, "token-secret": t.secret,
                           "expiration": t.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "usage-bootstrap-authentication": "true",
                           "auth-extra-groups": "system:bootstrappers:hiddenplane"},
        })
    # each worker's kube-proxy: its own user, its own binding (node revoke deletes it)
    for node in ("node2", "node3"):
        objs.append(binding(f"hiddenplane:kube-proxy:{node}", "system:node-proxier", "User",
                            f"hiddenplane:kube-proxy:{node}"))
    # upstream's binding for the shared system:kube-proxy of earlier releases: no subject, and
    # protected from the apiserver's reconciliation, which would add the subject back
    objs.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": "system:node-proxier",
                              "labels": {"kubernetes.io/bootstrapping": "rbac-defaults", **LABELS},
                              "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "false"}},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "system:node-proxier"},
                 "subjects": []})
    return objs


def bootstrap(prepared) -> list[dict]:
    from installer.core.render.manifests import bootstrap_objects
    return bootstrap_objects(prepared.inventory, prepared.material)


def post_path(obj: dict) -> str:
    return CRB if obj["kind"] == "ClusterRoleBinding" else SECRETS


def item_path(obj: dict) -> str:
    return f"{post_path(obj)}/{obj['metadata']['name']}"


# --- apply_objects --------------------------------------------------------------------------------

def test_first_run_sends_exactly_the_bootstrap_objects_in_order(prepared, api, fake):
    want = expected_objects(prepared)
    assert bootstrap(prepared) == want
    for o in want[4:]:
        if o["kind"] == "Secret":
            assert RFC3339.match(o["stringData"]["expiration"])
    done = kube_objects.apply_objects(api, bootstrap(prepared), prepared.inventory.spec.kubernetes.version)
    assert done == [(o["kind"], o["metadata"]["name"], "created") for o in want]
    # every object read first (404), then the creates in order
    assert fake.requests == [("GET", item_path(o), None) for o in want] + [("POST", post_path(o), o) for o in want]
    assert all(h.get("Content-Type") == "application/json" for (m, _, _), h in zip(fake.requests, fake.headers)
               if m == "POST")
    assert all(h.get("Accept", "").startswith("application/json") for h in fake.headers)
    # the apiserver turned each token's stringData into data: what a kubelet's token resolves to
    secret = fake.store[item_path(want[4])]
    t = prepared.material.tokens["node2"]
    assert base64.b64decode(secret["data"]["token-secret"]).decode() == t.secret


def test_second_run_changes_nothing(prepared, api, fake):
    version = prepared.inventory.spec.kubernetes.version
    kube_objects.apply_objects(api, bootstrap(prepared), version)
    fake.requests.clear()
    done = kube_objects.apply_objects(api, bootstrap(prepared), version)
    want = expected_objects(prepared)
    assert done == [(o["kind"], o["metadata"]["name"], "unchanged") for o in want]
    # one GET per object; no create, no PUT, no DELETE
    assert [(m, p) for m, p, _ in fake.requests] == [("GET", item_path(o)) for o in want]


def test_changed_role_ref_is_deleted_and_created(prepared, api, fake):
    want = expected_objects(prepared)
    old = copy.deepcopy(want[0])
    old["roleRef"]["name"] = "system:basic-user"
    fake.put(old)
    done = kube_objects.apply_objects(api, bootstrap(prepared), prepared.inventory.spec.kubernetes.version)
    assert done[0] == ("ClusterRoleBinding", "hiddenplane:kubelet-bootstrap", "replaced")
    assert all(a == "created" for _, _, a in done[1:])
    writes = [r for r in fake.requests if r[0] != "GET"]
    assert writes[:2] == [("DELETE", f"{CRB}/hiddenplane:kubelet-bootstrap", None), ("POST", CRB, want[0])]
    assert fake.store[f"{CRB}/hiddenplane:kubelet-bootstrap"]["roleRef"] == want[0]["roleRef"]


def test_changed_subjects_are_replaced_keeping_foreign_labels(prepared, api, fake):
    want = expected_objects(prepared)
    old = copy.deepcopy(want[1])
    old["subjects"][0]["name"] = "someone-else"
    old["metadata"]["labels"] = {"team": "infra"}
    fake.put(old)
    rv = fake.store[item_path(old)]["metadata"]["resourceVersion"]
    done = kube_objects.apply_objects(api, bootstrap(prepared), prepared.inventory.spec.kubernetes.version)
    assert done[1] == ("ClusterRoleBinding", "hiddenplane:apiserver-kubelet-api-admin", "replaced")
    puts = [(p, b) for m, p, b in fake.requests if m == "PUT"]
    assert len(puts) == 1 and not any(m == "DELETE" for m, _, _ in fake.requests)
    path, body = puts[0]
    assert path == item_path(want[1])
    assert body["subjects"] == want[1]["subjects"] and body["roleRef"] == want[1]["roleRef"]
    assert body["metadata"]["resourceVersion"] == rv
    assert body["metadata"]["labels"] == {"team": "infra", **LABELS}


def test_token_secret_left_when_equal_and_replaced_when_expiry_differs(prepared, api, fake):
    want = expected_objects(prepared)
    same, changed = copy.deepcopy(want[4]), copy.deepcopy(want[6])
    changed["stringData"]["expiration"] = "2020-01-01T00:00:00Z"
    fake.put(same)
    fake.put(changed)
    done = kube_objects.apply_objects(api, bootstrap(prepared), prepared.inventory.spec.kubernetes.version)
    assert done[4] == ("Secret", same["metadata"]["name"], "unchanged")
    assert done[6] == ("Secret", changed["metadata"]["name"], "replaced")
    puts = [(p, b) for m, p, b in fake.requests if m == "PUT"]
    assert [p for p, _ in puts] == [item_path(want[6])]
    assert puts[0][1]["stringData"] == want[6]["stringData"] and puts[0][1]["type"] == "bootstrap.kubernetes.io/token"
    data = fake.store[item_path(want[6])]["data"]
    assert base64.b64decode(data["expiration"]).decode() == want[6]["stringData"]["expiration"]


def test_invalid_manifest_is_refused_before_any_request(prepared, api, fake):
    objs = bootstrap(prepared)
    objs[2]["roleReff"] = objs[2].pop("roleRef")
    objs[4]["stringData"]["token-id"] = 123          # not a string
    with pytest.raises(kube.KubeError) as e:
        kube_objects.apply_objects(api, objs, "v1.36.4")
    assert fake.calls("GET") == [item_path(o) for o in objs]       # read, nothing written
    assert len(fake.requests) == len(objs)
    msg = str(e.value)
    assert "2 object(s) invalid for Kubernetes 1.36.0" in msg
    assert "ClusterRoleBinding/hiddenplane:cluster-admins" in msg and objs[4]["metadata"]["name"] in msg


def test_target_version():
    assert kube_objects.target_version("v1.36.4") == "1.36.0" == kube_objects.target_version("1.36.9")
    with pytest.raises(ValueError):
        kube_objects.target_version("1.36")


def test_refusal_names_the_object_and_the_reason(prepared, api, fake):
    fake.fail[("POST", CRB)] = (403, _status(403, "Forbidden", 'User "kubernetes-admin" cannot create '
                                            'resource "clusterrolebindings"'))
    with pytest.raises(kube.KubeError, match=r"ClusterRoleBinding/hiddenplane:kubelet-bootstrap: create refused: "
                                             r"403 Forbidden: User \"kubernetes-admin\" cannot"):
        kube_objects.apply_objects(api, bootstrap(prepared), "v1.36.4")
    assert [m for m, _, _ in fake.requests] == ["GET"] * len(bootstrap(prepared)) + ["POST"]


def test_unreachable_api_is_a_clear_error(prepared):
    port = free_port()
    with kube.api_client(f"https://127.0.0.1:{port}", prepared.material) as a:
        with pytest.raises(kube.KubeError, match=r"cannot reach the API"):
            kube.token_consumed(a, "node2")


# --- the workers phase ----------------------------------------------------------------------------

def node(name: str, ready: str | None, reason: str = "KubeletReady") -> dict:
    conds = [] if ready is None else [{"type": "Ready", "status": ready, "reason": reason,
                                       "message": f"kubelet is {'' if ready == 'True' else 'not '}ready"}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "status": {"conditions": conds}}


def test_wait_nodes_ready(api, fake):
    fake.put(node("node2", "True"))
    fake.put(node("node3", "True"))
    kube.wait_nodes_ready(api, ["node2", "node3"], timeout=0, interval=0)
    assert fake.requests == [("GET", NODES, None)]


def test_only_a_ready_posted_since_the_kubelets_restart_counts(api, fake):
    """After a kubelet restart the API still shows its predecessor's Ready for a few seconds."""
    stale = node("node2", "True")
    stale["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-02T01:48:40Z"
    fake.put(stale)
    restarted = dt.datetime(2026, 12, 2, 1, 48, 48, tzinfo=dt.timezone.utc).timestamp()
    with pytest.raises(kube.KubeError, match="node2: Ready=True from before the kubelet's restart"):
        kube.wait_nodes_ready(api, ["node2"], timeout=0.05, interval=0.01, since=restarted)
    fresh = node("node2", "True")
    fresh["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-02T01:48:55Z"
    fake.put(fresh)
    kube.wait_nodes_ready(api, ["node2"], timeout=0, interval=0, since=restarted)


def test_each_node_is_held_to_its_own_kubelets_restart(api, fake):
    """The workers phase restarts the kubelet of each node that joined in this run (and no other):
    a node restarted later than its Ready is waited for, a node not restarted is not."""
    for name, beat in (("node2", "2026-12-02T01:48:40Z"), ("node3", "2026-12-02T01:48:40Z")):
        n = node(name, "True")
        n["status"]["conditions"][0]["lastHeartbeatTime"] = beat
        fake.put(n)
    restarted = {"node2": dt.datetime(2026, 12, 2, 1, 48, 48, tzinfo=dt.timezone.utc).timestamp()}
    with pytest.raises(kube.KubeError) as e:
        kube.wait_nodes_ready(api, ["node2", "node3"], timeout=0.05, interval=0.01, since=restarted)
    assert "node2: Ready=True from before the kubelet's restart" in str(e.value) and "node3" not in str(e.value)


def test_wait_nodes_ready_times_out_naming_each_node(api, fake):
    fake.put(node("node2", "False", "KubeletNotReady"))
    with pytest.raises(kube.KubeError) as e:
        kube.wait_nodes_ready(api, ["node2", "node3"], timeout=0.05, interval=0.01)
    assert "node2: Ready=False (KubeletNotReady: kubelet is not ready)" in str(e.value)
    assert "node3: not registered" in str(e.value)
    assert len(fake.requests) >= 2


def test_token_consumed_means_the_node_registered(api, fake):
    assert kube.token_consumed(api, "node2") is False
    fake.put(node("node2", None))
    assert kube.token_consumed(api, "node2") is True
    assert fake.requests == [("GET", f"{NODES}/node2", None)] * 2
    assert kube.node_names(api) == ["node2"]


def test_set_pod_cidr_sets_once_and_refuses_a_different_one(api, fake):
    fake.put(node("node2", "True"))
    assert kube.set_pod_cidr(api, "node2", "10.244.0.0/24") == "set"
    assert fake.requests == [("GET", f"{NODES}/node2", None),
                             ("PATCH", f"{NODES}/node2", {"spec": {"podCIDR": "10.244.0.0/24",
                                                                   "podCIDRs": ["10.244.0.0/24"]}})]
    assert fake.headers[1]["Content-Type"] == "application/strategic-merge-patch+json"
    assert fake.store[f"{NODES}/node2"]["spec"]["podCIDRs"] == ["10.244.0.0/24"]
    fake.requests.clear()
    assert kube.set_pod_cidr(api, "node2", "10.244.0.0/24") == "unchanged"
    assert fake.requests == [("GET", f"{NODES}/node2", None)]
    with pytest.raises(kube.KubeError) as e:
        kube.set_pod_cidr(api, "node2", "10.244.7.0/24")
    assert "Node/node2: spec.podCIDR is 10.244.0.0/24 but the installer allocated 10.244.7.0/24" in str(e.value)
    with pytest.raises(kube.KubeError, match="Node/node9: 404 NotFound"):
        kube.set_pod_cidr(api, "node9", "10.244.1.0/24")


def test_delete_bootstrap_token(prepared, api, fake):
    tok = expected_objects(prepared)[4]
    fake.put(tok)
    tid = tok["stringData"]["token-id"]
    assert kube.delete_bootstrap_token(api, tid) is True
    assert kube.delete_bootstrap_token(api, tid) is False
    assert [(m, p) for m, p, _ in fake.requests] == [("DELETE", f"{SECRETS}/bootstrap-token-{tid}")] * 2


# --- the client: credentials in memory, real TLS ----------------------------------------------------

def test_client_key_is_loaded_from_memory_and_gone_at_once(prepared, monkeypatch):
    """ssl loads a key only from a path: the path is an anonymous in-memory file (0600, on no
    filesystem, so a kill leaves nothing), closed before api_client returns."""
    seen = []
    real = ssl.SSLContext.load_cert_chain

    def spy(self, certfile, keyfile=None, password=None):
        fd = Path(certfile)
        seen.append((str(certfile), os.readlink(fd), stat.S_IMODE(os.stat(fd).st_mode), fd.read_bytes(), keyfile))
        real(self, certfile, keyfile, password)
    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    with kube.api_client(API, prepared.material) as a, \
            kube.api_client(API, prepared.material, credential="super-admin") as b:
        assert len(seen) == 2
        for (path, target, mode, _, keyfile) in seen:
            assert re.fullmatch(r"/proc/self/fd/\d+", path) and target.startswith("/memfd:") and keyfile is None
            assert mode == 0o600
            # gone while the client lives: the key is in the TLS context's memory only
            assert not (Path(path).is_symlink() and os.readlink(path).startswith("/memfd:"))
        admin, sup = prepared.material.pair("admin"), prepared.material.pair("super-admin")
        assert seen[0][3] == issue.cert_pem(admin.cert) + issue.key_pem(admin.key)
        assert seen[1][3] == issue.cert_pem(sup.cert) + issue.key_pem(sup.key)
        assert a.host == b.host == API


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VERSION = {"major": "1", "minor": "36", "gitVersion": "v1.36.4", "gitCommit": "x", "gitTreeState": "clean",
           "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64"}


@pytest.fixture(scope="module")
def tls_apiserver(prepared, tmp_path_factory):
    """A Python ssl server with the apiserver certificate, requiring a client certificate from
    the cluster CA, answering GET /version; records the client's CN and the SNI it sent."""
    d = tmp_path_factory.mktemp("apiserver")
    m = prepared.material
    (d / "ca.crt").write_bytes(issue.cert_pem(m.pair("ca").cert))
    (d / "tls.crt").write_bytes(issue.cert_pem(m.pair("apiserver").cert))
    (d / "tls.key").write_bytes(issue.key_pem(m.pair("apiserver").key))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "tls.crt", d / "tls.key")
    ctx.load_verify_locations(d / "ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    seen: dict[str, list] = {"cn": [], "sni": []}
    ctx.sni_callback = lambda sock, name, c: seen["sni"].append(name)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            cn = dict(x[0] for x in self.connection.getpeercert()["subject"])["commonName"]
            seen["cn"].append(cn)
            body = json.dumps(VERSION).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # the handshake happens in each handler thread, so a silent client blocks only itself
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], seen
    srv.shutdown()
    srv.server_close()


def test_client_verifies_the_apiserver_on_127_0_0_1(prepared, tls_apiserver):
    port, seen = tls_apiserver
    with kube.api_client(f"https://127.0.0.1:{port}", prepared.material) as a:
        assert kube.rest(a, "GET", "/version", "version")["gitVersion"] == "v1.36.4"
    assert seen["cn"][-1] == "kubernetes-admin"


def test_tls_server_name_is_what_the_certificate_is_checked_against(prepared, tls_apiserver):
    port, seen = tls_apiserver
    with kube.api_client(f"https://127.0.0.1:{port}", prepared.material,
                         tls_server_name="kubernetes.default.svc") as a:
        assert kube.rest(a, "GET", "/version", "version")["major"] == "1"
    assert seen["sni"][-1] == "kubernetes.default.svc"
    with kube.api_client(f"https://127.0.0.1:{port}", prepared.material, tls_server_name="not-a-san.example") as a:
        with pytest.raises(kube.KubeError,
                           match=r"Node/node2: TLS with the API failed: hostname 'not-a-san.example' doesn't match"):
            kube.token_consumed(a, "node2")


def test_a_server_with_a_certificate_of_another_ca_is_refused(prepared, tmp_path):
    """On the network: a man in the middle with an apiserver-like certificate (same names) from
    a CA of its own gets no request."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    now = dt.datetime.now(dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    real = prepared.material.pair("apiserver").cert
    fake = (x509.CertificateBuilder().subject_name(real.subject).issuer_name(real.issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(real.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "tls.crt").write_bytes(issue.cert_pem(fake))
    (tmp_path / "tls.key").write_bytes(issue.key_pem(key))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.load_verify_locations(cadata=issue.cert_pem(prepared.material.pair("ca").cert).decode())
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)

        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with kube.api_client(f"https://127.0.0.1:{srv.server_address[1]}", prepared.material) as a:
            with pytest.raises(kube.KubeError, match="certificate verify failed"):
                kube.rest(a, "GET", "/version", "version")
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen == []


# --- api_access: direct, or an SSH tunnel through the first control host ---------------------------

def lo_inventory(tmp_path: Path, api_port: int, ssh_port: int = 22, key: str = "id", known: str = "known_hosts"):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["apiServer"] = {"port": api_port}
    doc["spec"]["ssh"] = {"user": "root", "port": ssh_port, "keyPath": key, "knownHosts": known}
    doc["spec"]["hosts"] = [{"name": "cp1", "address": "127.0.0.1", "role": "control"},
                            {"name": "node2", "address": "127.0.0.2", "role": "worker"}]
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc))
    return inventory.load(p)


def test_api_access_direct_when_the_endpoint_answers(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        inv = lo_inventory(tmp_path, listener.getsockname()[1])

        def no_ssh(host):
            raise AssertionError("no tunnel may be opened when the API is reachable")
        with apireach.api_access(inv, no_ssh) as url:
            assert url == inv.api_url == f"https://127.0.0.1:{listener.getsockname()[1]}"


class _ForwardingSSH(paramiko.ServerInterface):
    """An SSH server playing a control host: public-key login, and direct-tcpip channels to
    ``targets`` (its 'loopback' destinations mapped to real local ports)."""

    def __init__(self, client_key, targets, seen):
        self.client_key, self.targets, self.seen, self.pending = client_key, targets, seen, {}

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        ok = username == "root" and key.get_base64() == self.client_key.get_base64()
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_direct_tcpip_request(self, chanid, origin, destination):
        self.seen.append(tuple(destination))
        if tuple(destination) not in self.targets:
            return paramiko.OPEN_FAILED_CONNECT_FAILED
        self.pending[chanid] = self.targets[tuple(destination)]
        return paramiko.OPEN_SUCCEEDED


def _pump(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                if isinstance(s, socket.socket):
                    s.shutdown(socket.SHUT_RDWR)     # wakes the opposite pump (close alone would not)
                s.close()
            except OSError:
                pass


@pytest.fixture
def ssh_control_host(tmp_path):
    """(port, key path, known_hosts path, destinations seen, set_targets)."""
    host_key, client_key = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    client_key.write_private_key_file(str(tmp_path / "id"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key.get_name()} {host_key.get_base64()}\n")
    seen, targets, transports = [], {}, []

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            t = paramiko.Transport(sock)
            t.add_server_key(host_key)
            iface = _ForwardingSSH(client_key, targets, seen)
            t.start_server(server=iface)
            transports.append(t)
            threading.Thread(target=channels, args=(t, iface), daemon=True).start()

    def channels(t, iface):
        while t.is_active():
            chan = t.accept(0.2)
            if chan is None:
                continue
            out = socket.create_connection(iface.pending.pop(chan.get_id()))
            threading.Thread(target=_pump, args=(chan, out), daemon=True).start()
            threading.Thread(target=_pump, args=(out, chan), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield port, seen, targets
    try:
        listener.shutdown(socket.SHUT_RDWR)           # wakes serve()'s accept
    except OSError:
        pass
    listener.close()
    for t in transports:
        t.close()


def test_api_access_tunnels_through_the_control_host(prepared, tls_apiserver, ssh_control_host, tmp_path):
    tls_port, seen_tls = tls_apiserver
    ssh_port, seen, targets = ssh_control_host
    api_port = free_port()                       # nothing listens there on this machine
    inv = lo_inventory(tmp_path, api_port, ssh_port)
    targets[("127.0.0.1", api_port)] = ("127.0.0.1", tls_port)   # the control host's own apiserver
    made = []

    def factory(host):
        made.append(Remote(host, inv))
        return made[-1]
    with apireach.api_access(inv, factory, probe_timeout=0.5) as url:
        assert url != inv.api_url and re.fullmatch(r"https://127\.0\.0\.1:\d+", url)
        with kube.api_client(url, prepared.material) as a:
            assert kube.rest(a, "GET", "/version", "version")["gitVersion"] == "v1.36.4"
    assert [r.name for r in made] == ["cp1"] and not made[0].connected      # closed: we made it
    assert set(seen) == {("127.0.0.1", api_port)}
    assert seen_tls["cn"][-1] == "kubernetes-admin"


def test_api_access_reuses_a_given_remote_and_leaves_it_open(prepared, tls_apiserver, ssh_control_host, tmp_path):
    tls_port, _ = tls_apiserver
    ssh_port, _, targets = ssh_control_host
    api_port = free_port()
    inv = lo_inventory(tmp_path, api_port, ssh_port)
    targets[("127.0.0.1", api_port)] = ("127.0.0.1", tls_port)
    remote = Remote(inv.controls[0], inv)
    try:
        with apireach.api_access(inv, {"cp1": remote}, prepared.material, probe_timeout=0.5) as url:
            with kube.api_client(url, prepared.material) as a:
                kube.rest(a, "GET", "/version", "version")
        assert remote.connected
    finally:
        remote.close()


# --- installer kubeconfig -------------------------------------------------------------------------

@pytest.mark.kubectl
def test_kubeconfig_command(prepared, tmp_path, monkeypatch, kubectl):
    monkeypatch.chdir(tmp_path)
    state = str(prepared.state.root)
    r = CliRunner().invoke(cli, ["kubeconfig", str(EXAMPLE), "--state", state])
    assert r.exit_code == 0, r.output
    path = tmp_path / "lab.kubeconfig"
    assert "lab.kubeconfig: written" in r.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    out = subprocess.run([kubectl, "config", "view", "--raw", "--kubeconfig", str(path), "-o", "json"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    view = json.loads(out.stdout)
    assert view["clusters"][0]["cluster"]["server"] == prepared.inventory.api_url == API
    [user] = view["users"]
    assert user["name"] == "kubernetes-admin"
    assert base64.b64decode(user["user"]["client-certificate-data"]) == issue.cert_pem(
        prepared.material.pair("admin").cert)
    assert base64.b64decode(view["clusters"][0]["cluster"]["certificate-authority-data"]) == issue.cert_pem(
        prepared.material.pair("ca").cert)
    assert view["current-context"] == "kubernetes-admin@lab"

    # again: unchanged; another file at the path is kept unless --force
    r = CliRunner().invoke(cli, ["kubeconfig", str(EXAMPLE), "--state", state, "-o", str(path)])
    assert r.exit_code == 0 and "unchanged" in r.output
    path.write_text("someone else's\n")
    r = CliRunner().invoke(cli, ["kubeconfig", str(EXAMPLE), "--state", state, "-o", str(path)])
    assert r.exit_code == 2 and "exists with other content; pass --force" in r.output
    assert path.read_text() == "someone else's\n"
    r = CliRunner().invoke(cli, ["kubeconfig", str(EXAMPLE), "--state", state, "-o", str(path), "--force"])
    assert r.exit_code == 0 and "written" in r.output
    assert path.read_bytes() == prepared.state.admin_kubeconfig.read_bytes()


def test_kubeconfig_command_needs_a_pki(tmp_path):
    r = CliRunner().invoke(cli, ["kubeconfig", str(EXAMPLE), "--state", str(tmp_path / "empty"),
                                 "-o", str(tmp_path / "k")])
    assert r.exit_code == 2 and "run `installer plan`" in r.output
    assert not (tmp_path / "k").exists() and not (tmp_path / "empty").exists()


def test_joined_workers_get_no_token_secret_again(prepared):
    """Once a worker's kubelet holds its own certificate its token Secret is deleted (workers
    phase) and cluster-bootstrap never sends it again; the renewal binding stays."""
    from installer.core.render.manifests import bootstrap_objects
    objs = bootstrap_objects(prepared.inventory, prepared.material, frozenset({"node2"}))
    secrets = [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"]
    assert secrets == [f"bootstrap-token-{prepared.material.tokens['node3'].id}"]
    bindings = [o["metadata"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert {"hiddenplane:node-renewal:node2", "hiddenplane:node-renewal:node3"} <= set(bindings)


def test_wait_for_registration_only(api, fake):
    fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node2"},
              "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}})
    kube.wait_nodes_ready(api, ["node2"], 5, interval=0.01, registered_only=True)
    with pytest.raises(kube.KubeError, match="nodes not registered after 0.05s: node3: not registered"):
        kube.wait_nodes_ready(api, ["node2", "node3"], 0.05, interval=0.01, registered_only=True)


def test_plan_objects_reads_only_and_tells_what_apply_would_do(prepared, api, fake):
    objs = bootstrap(prepared)
    assert {a for _, _, a in kube_objects.plan_objects(api, objs, "v1.36.5")} == {"created"}
    assert all(m == "GET" for m, _, _ in fake.requests)
    kube_objects.apply_objects(api, objs, "v1.36.5")
    fake.requests.clear()
    assert {a for _, _, a in kube_objects.plan_objects(api, objs, "v1.36.5")} == {"unchanged"}
    changed = copy.deepcopy(objs)
    changed[0]["subjects"][0]["name"] = "someone-else"
    assert kube_objects.plan_objects(api, changed, "v1.36.5")[0][2] == "replaced"
    assert all(m == "GET" for m, _, _ in fake.requests)


def test_validation_takes_the_nearest_older_schemas_and_names_what_it_cannot_check(prepared):
    objs = bootstrap(prepared)
    kube_objects.validate_objects(objs, "v1.36.9")
    oldest = min(kube_objects.utils.all_versions(), key=kube_objects._minor)
    with pytest.raises(kube.KubeError, match=r"ClusterRoleBinding/hiddenplane:kubelet-bootstrap: .*1\.99"):
        kube_objects.validate_objects(objs, "v1.99.0")
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(kube.KubeError, match=r"1 object\(s\) invalid .*\n  Widget/w: .*Widget"):
        kube_objects.validate_objects([widget, *objs], "v1.36.0")
    # the same strict schemas kubernetes-validate itself uses: what it refuses, we refuse
    bad = copy.deepcopy(objs[0])
    bad["subjectz"] = bad.pop("subjects")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.36.0", strict=True)
    with pytest.raises(kube.KubeError, match="subjectz"):
        kube_objects.validate_objects([bad], "v1.36.0")
    assert kube_objects._minor(oldest) <= (1, 36)
