"""Real TLS handshakes with the rendered credentials: a Python ``ssl`` server playing the
apiserver (its rendered serving certificate, client certificates required from the cluster CA)
and clients holding the rendered client credentials."""

from __future__ import annotations

import base64
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from installer.core.render.control import CIPHER_SUITES

# Go's cipher suite names (the apiserver's --tls-cipher-suites) -> OpenSSL's, the stand-ins' table
from .standins.runtime import GO_CIPHERS as OPENSSL_CIPHERS

TIMEOUT = 10
PKI = "cp1/etc/kubernetes/pki"


@dataclass
class Outcome:
    peer: dict | None = None
    received: bytes | None = None
    error: BaseException | None = None
    cipher: tuple | None = None


@dataclass
class Server:
    port: int
    thread: threading.Thread
    outcome: Outcome = field(default_factory=Outcome)

    def wait(self) -> Outcome:
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "TLS server thread hung"
        return self.outcome


@pytest.fixture
def creds(rendered, tmp_path) -> dict[str, tuple[Path, Path]]:
    """Client credentials as (crt, key) files, taken from the rendered hosts."""
    out: dict[str, tuple[Path, Path]] = {}

    def from_kubeconfig(label: str, path: Path) -> None:
        user = yaml.safe_load(path.read_text())["users"][0]["user"]
        crt, key = tmp_path / f"{label}.crt", tmp_path / f"{label}.key"
        crt.write_bytes(base64.b64decode(user["client-certificate-data"]))
        key.write_bytes(base64.b64decode(user["client-key-data"]))
        out[label] = (crt, key)

    from_kubeconfig("admin", rendered / "cp1/etc/kubernetes/admin.conf")
    from_kubeconfig("controller-manager", rendered / "cp1/etc/kubernetes/controller-manager.conf")
    from_kubeconfig("kube-proxy", rendered / "node2/etc/kubernetes/kube-proxy.conf")
    for name in ("apiserver-kubelet-client", "apiserver-etcd-client", "front-proxy-client",
                 "etcd/healthcheck-client"):
        out[name] = (rendered / PKI / f"{name}.crt", rendered / PKI / f"{name}.key")
    out["kubelet-serving-node2"] = (rendered / "node2/var/lib/kubelet/pki/kubelet.crt",
                                    rendered / "node2/var/lib/kubelet/pki/kubelet.key")
    return out


def server_context(rendered: Path, restrict_ciphers: bool = True) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(rendered / PKI / "apiserver.crt", rendered / PKI / "apiserver.key")
    ctx.load_verify_locations(cafile=str(rendered / PKI / "ca.crt"))       # --client-ca-file
    ctx.verify_mode = ssl.CERT_REQUIRED
    if restrict_ciphers:
        ctx.set_ciphers(":".join(OPENSSL_CIPHERS[s] for s in CIPHER_SUITES))
    return ctx


def start_server(ctx: ssl.SSLContext) -> Server:
    """Accept one connection on 127.0.0.1, handshake, read a byte, answer b'!'."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    outcome = Outcome()

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except BaseException as e:      # noqa: BLE001 - reported through the outcome
            outcome.error = e
            listener.close()
            return
        listener.close()
        conn.settimeout(TIMEOUT)
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                outcome.peer = tls.getpeercert()
                outcome.cipher = tls.cipher()
                outcome.received = tls.recv(1)
                tls.sendall(b"!")
        except BaseException as e:      # noqa: BLE001
            outcome.error = e
        finally:
            conn.close()

    t = threading.Thread(target=run, daemon=True)
    server = Server(listener.getsockname()[1], t, outcome)
    t.start()
    return server


def client_context(cafile: Path, cred: tuple[Path, Path] | None, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)      # check_hostname + CERT_REQUIRED
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(cafile))
    if cred is not None:
        ctx.load_cert_chain(*cred)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def exchange(port: int, ctx: ssl.SSLContext, server_hostname: str) -> tuple[bytes, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
            tls.sendall(b"?")
            return tls.recv(1), tls.getpeercert()


def rdn(cert: dict, key: str) -> list[str]:
    return [v for rdn_ in cert["subject"] for k, v in rdn_ if k == key]


# --- accepted ---------------------------------------------------------------------------

@pytest.mark.parametrize("hostname", ["10.96.0.1", "kubernetes.default.svc", "kubernetes",
                                      "kubernetes.default.svc.cluster.local", "127.0.0.1",
                                      "192.168.56.230", "cp1", "localhost"])
def test_admin_reaches_apiserver_by_each_name(rendered, creds, hostname):
    server = start_server(server_context(rendered))
    got, server_cert = exchange(server.port, client_context(rendered / PKI / "ca.crt", creds["admin"]),
                                hostname)
    out = server.wait()
    assert out.error is None, out.error
    assert got == b"!" and out.received == b"?"
    assert rdn(server_cert, "commonName") == ["kube-apiserver"]
    # what the apiserver would authenticate: user kubernetes-admin in group kubeadm:cluster-admins
    assert rdn(out.peer, "commonName") == ["kubernetes-admin"]
    assert rdn(out.peer, "organizationName") == ["kubeadm:cluster-admins"]


@pytest.mark.parametrize("who,cn", [("controller-manager", "system:kube-controller-manager"),
                                    ("kube-proxy", "hiddenplane:kube-proxy:node2"),
                                    ("apiserver-kubelet-client", "kube-apiserver-kubelet-client")])
def test_other_cluster_clients_are_accepted(rendered, creds, who, cn):
    server = start_server(server_context(rendered))
    got, _ = exchange(server.port, client_context(rendered / PKI / "ca.crt", creds[who]), "10.96.0.1")
    out = server.wait()
    assert out.error is None, out.error
    assert got == b"!" and rdn(out.peer, "commonName") == [cn]


def test_tls12_with_the_cis_cipher_suites(rendered, creds):
    """Over TLS 1.2 the negotiated suite is one of the apiserver's --tls-cipher-suites."""
    server = start_server(server_context(rendered))
    ctx = client_context(rendered / PKI / "ca.crt", creds["admin"], tls12=True)
    got, _ = exchange(server.port, ctx, "kubernetes.default.svc")
    out = server.wait()
    assert out.error is None, out.error
    assert got == b"!"
    name, version, _bits = out.cipher
    assert version == "TLSv1.2"
    assert name in {OPENSSL_CIPHERS[s] for s in CIPHER_SUITES}


# --- rejected ---------------------------------------------------------------------------

def assert_client_rejected(server: Server, ctx: ssl.SSLContext, expect: str) -> None:
    """The server refuses the client certificate. Under TLS 1.3 the client may finish its
    side of the handshake first and only see the alert (or EOF) when it reads."""
    got = None
    try:
        got, _ = exchange(server.port, ctx, "10.96.0.1")
    except (ssl.SSLError, ConnectionError):
        pass
    out = server.wait()
    assert got in (None, b""), "the server answered a client it should have refused"
    assert out.received is None and out.peer is None
    assert isinstance(out.error, ssl.SSLError), out.error
    assert expect in str(out.error), out.error


@pytest.mark.parametrize("who,expect", [
    ("apiserver-etcd-client", "unable to get local issuer certificate"),     # etcd CA
    ("etcd/healthcheck-client", "unable to get local issuer certificate"),   # etcd CA
    ("front-proxy-client", "unable to get local issuer certificate"),  # front-proxy CA != client CA
    ("kubelet-serving-node2", "unsuitable certificate purpose"),  # cluster CA, but serverAuth only
])
def test_client_certificate_from_elsewhere_is_rejected(rendered, creds, who, expect):
    server = start_server(server_context(rendered))
    assert_client_rejected(server, client_context(rendered / PKI / "ca.crt", creds[who]), expect)


def test_client_without_certificate_is_rejected(rendered):
    server = start_server(server_context(rendered))
    assert_client_rejected(server, client_context(rendered / PKI / "ca.crt", None),
                           "peer did not return a certificate")


def test_client_trusting_the_etcd_ca_rejects_the_apiserver(rendered, creds):
    server = start_server(server_context(rendered))
    ctx = client_context(rendered / PKI / "etcd/ca.crt", creds["admin"])
    with pytest.raises(ssl.SSLCertVerificationError) as e:
        exchange(server.port, ctx, "10.96.0.1")
    # the server sends the cluster CA along (OpenSSL auto-chains), which the client does not trust
    assert e.value.verify_message in ("unable to get local issuer certificate",
                                      "self-signed certificate in certificate chain")
    out = server.wait()
    assert isinstance(out.error, ssl.SSLError) and out.received is None


def test_client_trusting_the_front_proxy_ca_rejects_the_apiserver(rendered, creds):
    server = start_server(server_context(rendered))
    ctx = client_context(rendered / PKI / "front-proxy-ca.crt", creds["admin"])
    with pytest.raises(ssl.SSLCertVerificationError):
        exchange(server.port, ctx, "kubernetes.default.svc")
    assert server.wait().received is None


@pytest.mark.parametrize("hostname", ["node2", "192.168.56.231", "10.96.0.10", "kubernetes.default.svc.evil"])
def test_names_outside_the_sans_are_rejected(rendered, creds, hostname):
    """Hostname verification is really on: names the certificate does not carry fail."""
    server = start_server(server_context(rendered))
    ctx = client_context(rendered / PKI / "ca.crt", creds["admin"])
    with pytest.raises(ssl.SSLCertVerificationError) as e:
        exchange(server.port, ctx, hostname)
    assert "mismatch" in e.value.verify_message
    assert server.wait().received is None
