"""Every rendered kubeconfig, read back by the real kubectl; and no worker file carries a CA's
(or any other cluster-wide) private key."""

from __future__ import annotations

import base64
import json
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from installer.core.pki import issue

LOCAL = "https://127.0.0.1:6443"
REMOTE = "https://192.168.56.230:6443"

# path in the rendered tree (or "STATE" for the state dir's admin.conf) -> (user, server, client CN)
CERT_KUBECONFIGS = {
    "cp1/etc/kubernetes/admin.conf": ("kubernetes-admin", LOCAL, "kubernetes-admin"),
    "cp1/etc/kubernetes/controller-manager.conf": ("system:kube-controller-manager", LOCAL,
                                                   "system:kube-controller-manager"),
    "cp1/etc/kubernetes/scheduler.conf": ("system:kube-scheduler", LOCAL, "system:kube-scheduler"),
    # each worker's own kube-proxy identity (a shared one would outlive `node revoke`)
    "node2/etc/kubernetes/kube-proxy.conf": ("hiddenplane:kube-proxy:node2", REMOTE, "hiddenplane:kube-proxy:node2"),
    "node3/etc/kubernetes/kube-proxy.conf": ("hiddenplane:kube-proxy:node3", REMOTE, "hiddenplane:kube-proxy:node3"),
    "STATE": ("kubernetes-admin", REMOTE, "kubernetes-admin"),
}


def kubectl_view(kubectl: str, path: Path, home: Path) -> dict:
    """``kubectl config view --raw`` of one file, minified to its current context (so a
    dangling current-context, cluster or user reference fails here)."""
    assert path.is_file(), path
    r = subprocess.run([kubectl, "config", "view", "--raw", "--minify", "-o", "json", "--kubeconfig", str(path)],
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
    assert r.returncode == 0, f"kubectl rejected {path}:\n{r.stderr}"
    return json.loads(r.stdout)


def the_one(view: dict) -> tuple[dict, dict, dict]:
    """(cluster, user, context) of a minified view, with the references checked."""
    assert len(view["clusters"]) == len(view["users"]) == len(view["contexts"]) == 1
    [cluster], [user], [context] = view["clusters"], view["users"], view["contexts"]
    assert view["current-context"] == context["name"]
    assert context["context"]["cluster"] == cluster["name"] == "lab"
    assert context["context"]["user"] == user["name"]
    return cluster, user, context


def kubeconfig_path(name: str, rendered: Path, prepared) -> Path:
    return prepared.state.admin_kubeconfig if name == "STATE" else rendered / name


@pytest.mark.parametrize("name", sorted(CERT_KUBECONFIGS))
def test_certificate_kubeconfig(name, kubectl, rendered, prepared, tmp_path):
    user_name, server, cn = CERT_KUBECONFIGS[name]
    path = kubeconfig_path(name, rendered, prepared)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cluster, user, _ = the_one(kubectl_view(kubectl, path, tmp_path))
    m = prepared.material

    assert user["name"] == user_name
    assert cluster["cluster"]["server"] == server
    ca_pem = base64.b64decode(cluster["cluster"]["certificate-authority-data"], validate=True)
    assert ca_pem == issue.cert_pem(m.cas["ca"].cert)
    assert issue.load_cert(ca_pem).subject.rfc4514_string() == "CN=kubernetes-ca"

    creds = user["user"]
    assert set(creds) == {"client-certificate-data", "client-key-data"}      # no token, no file refs
    cert = issue.load_cert(base64.b64decode(creds["client-certificate-data"], validate=True))
    key = issue.load_key(base64.b64decode(creds["client-key-data"], validate=True))
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [cn]
    assert issue.key_matches(cert, key)
    cert.verify_directly_issued_by(m.cas["ca"].cert)
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ca_keys = {p.key.public_key().public_bytes(*der) for p in m.cas.values()}
    assert key.public_key().public_bytes(*der) not in ca_keys


@pytest.mark.parametrize("node", ["node2", "node3"])
def test_bootstrap_kubeconfig(node, kubectl, rendered, prepared, tmp_path):
    path = rendered / node / "etc/kubernetes/bootstrap-kubelet.conf"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cluster, user, _ = the_one(kubectl_view(kubectl, path, tmp_path))
    token = prepared.material.tokens[node]
    assert user["user"] == {"token": token.value}
    assert user["name"] == f"system:bootstrap:{token.id}"
    assert cluster["cluster"]["server"] == REMOTE
    ca_pem = base64.b64decode(cluster["cluster"]["certificate-authority-data"], validate=True)
    assert ca_pem == issue.cert_pem(prepared.material.cas["ca"].cert)
    # each node gets its own token
    other = "node3" if node == "node2" else "node2"
    assert prepared.material.tokens[other].value not in path.read_text()


def test_all_rendered_kubeconfigs_are_covered(rendered):
    """Guard against a kubeconfig appearing that the tests above do not check."""
    found = {p.relative_to(rendered).as_posix() for p in rendered.rglob("*.conf")
             if b"kind: Config" in p.read_bytes()}
    expected = {n for n in CERT_KUBECONFIGS if n != "STATE"} | {
        "node2/etc/kubernetes/bootstrap-kubelet.conf", "node3/etc/kubernetes/bootstrap-kubelet.conf"}
    assert found == expected


# --- no cluster-wide secret on a worker -----------------------------------------------------

def fingerprints(pem: bytes) -> list[bytes]:
    """Ways a private key could be embedded: raw PEM, base64 of the PEM (kubeconfig data),
    and the PEM body on one line."""
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return [pem, base64.b64encode(pem), body]


def files_holding(root: Path, pem: bytes) -> list[str]:
    marks = fingerprints(pem)
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and any(m in p.read_bytes() for m in marks)]


CA_KEYS = ("ca", "etcd/ca", "front-proxy-ca")


@pytest.mark.parametrize("worker", ["node2", "node3"])
def test_no_ca_private_key_on_workers(worker, rendered, prepared):
    root = rendered / worker
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "kube-proxy.conf" for p in files) and len(files) > 5
    for name in CA_KEYS:
        key_pem = issue.key_pem(prepared.material.cas[name].key)
        assert prepared.state.pki(name, "key").read_bytes() == key_pem
        assert files_holding(root, key_pem) == [], f"{worker} holds the {name} private key"


def test_scan_finds_ca_key_where_it_belongs(rendered, prepared):
    """The scan above is not vacuous: on the control host it finds ca.key (file and nothing else
    embeds it) and, base64-encoded, admin's key inside admin.conf."""
    root = rendered / "cp1"
    assert files_holding(root, issue.key_pem(prepared.material.cas["ca"].key)) == [
        "etc/kubernetes/pki/ca.key"]
    assert files_holding(root, issue.key_pem(prepared.material.certs["admin"].key)) == [
        "etc/kubernetes/admin.conf"]


@pytest.mark.parametrize("worker", ["node2", "node3"])
def test_worker_holds_only_its_own_private_keys(worker, rendered, prepared):
    """A worker gets its kubelet serving key and its own kube-proxy client key, and no other key of
    the cluster: not the service-account key, another node's key (serving or kube-proxy), or a
    control-plane identity."""
    m = prepared.material
    root = rendered / worker
    allowed = {f"kubelet/{worker}-serving", f"kube-proxy/{worker}"}
    for name, pair in m.certs.items():
        held = files_holding(root, issue.key_pem(pair.key))
        if name in allowed:
            assert held, f"{worker} lacks its {name} key"
        else:
            assert held == [], f"{worker} holds the {name} private key in {held}"
    assert files_holding(root, issue.key_pem(m.sa_key)) == []
    enc = m.encryption_key_b64.encode()
    assert not [p for p in root.rglob("*") if p.is_file() and enc in p.read_bytes()]
