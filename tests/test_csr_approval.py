"""A join token is good for its own node only, and for one certificate
(installer/core/csr_rules.py decides on the bytes, installer/host/csr_approval.py through the API).

``judge`` on real certificate requests made with ``cryptography`` as a kubelet makes them, and on
the tricks an attacker holding a token would send; ``parse_request`` against Go's own reading of
the same bytes (the apiserver's and the signer's ``pem.Decode`` + ``x509.ParseCertificateRequest``,
compiled here); the approval through the real client over the fake transport. The real cluster
proves the rest (tests/test_real_cluster.py: a leaked token asking for another node, a request
whose PEM hides another node's name from Go, a thief racing the kubelet, are all denied).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from installer.core import csr_rules
from installer.core.csr_rules import KUBELET_CLIENT_SIGNER, judge, parse_request, public_key_der
from installer.host import csr_approval, kube

from .fakeapi import FakeCluster

API = "https://192.168.56.230:6443"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
TOKENS = {"abc123": "w1", "def456": "w2"}
USAGES = ["digital signature", "client auth"]


def request(cn: str | None, orgs: tuple[str, ...] = ("system:nodes",), san: str | None = None,
            key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    names = ([x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
             + ([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(names))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


KUBELET_KEY = ec.generate_private_key(ec.SECP256R1())       # w1's kubelet's own bootstrap key
KEYS = {"w1": {public_key_der(KUBELET_KEY.public_key())}}
OWN = request("system:node:w1", key=KUBELET_KEY)
W9 = request("system:node:w9")


def test_its_own_token_name_and_kubelet_key_is_approved():
    v = judge("csr-1", "system:bootstrap:abc123", OWN, USAGES, TOKENS, KEYS)
    assert (v.approve, v.node, v.token) == (True, "w1", "abc123") and "kubelet's own" in v.message
    assert v.key == public_key_der(KUBELET_KEY.public_key())


def test_a_thief_racing_the_kubelet_with_its_token_is_denied():
    """Same token, same name, a key the kubelet never had: a certificate only the thief could use."""
    v = judge("csr-t", "system:bootstrap:abc123", request("system:node:w1"), USAGES, TOKENS, KEYS)
    assert not v.approve and "not the key w1's kubelet holds" in v.message and "abc123" in v.message


def test_a_node_whose_kubelet_key_was_not_read_is_left_pending():
    """A host outside the run: neither approved nor denied (its own run decides)."""
    assert judge("csr-1", "system:bootstrap:abc123", OWN, USAGES, TOKENS, {}) is None
    assert judge("csr-1", "system:bootstrap:abc123", OWN, USAGES, TOKENS) is None


def test_one_certificate_per_token():
    v = judge("csr-2", "system:bootstrap:abc123", OWN, USAGES, TOKENS, KEYS, spent={"abc123": "csr-1"})
    assert not v.approve and "already has its certificate (CSR csr-1)" in v.message


@pytest.mark.parametrize("user,pem,usages,why", [
    ("system:bootstrap:abc123", request("system:node:w2"), USAGES,
     "belongs to node w1: it may ask only for CN=system:node:w1"),
    ("system:bootstrap:abc123", W9, USAGES, "not CN=system:node:w9"),
    ("system:bootstrap:zzz999", OWN, USAGES, "zzz999 was not issued by hiddenplane"),
    ("system:bootstrap:abc123", request("system:node:w1", ("system:nodes", "system:masters"), key=KUBELET_KEY), USAGES,
     "O must be exactly system:nodes"),
    ("system:bootstrap:abc123", request("system:node:w1", (), key=KUBELET_KEY), USAGES,
     "O must be exactly system:nodes"),
    ("system:bootstrap:abc123", request("system:node:w1", san="evil.example", key=KUBELET_KEY), USAGES,
     "no subject alternative"),
    ("system:bootstrap:abc123", OWN, ["digital signature", "server auth"], "usages must be"),
    ("system:bootstrap:abc123", OWN, USAGES + ["server auth"], "usages must be"),
    ("system:bootstrap:abc123", b"not a request", USAGES, "not exactly one PEM certificate request"),
])
def test_anything_else_a_bootstrap_token_asks_for_is_denied_with_the_reason(user, pem, usages, why):
    v = judge("csr-x", user, pem, usages, TOKENS, KEYS)
    assert v is not None and not v.approve and why in v.message, v


def test_renewals_are_not_ours_to_decide():
    assert judge("csr-r", "system:node:w1", OWN, USAGES, TOKENS, KEYS) is None


# --- the bytes the signer reads --------------------------------------------------------------

def _with_header(pem: bytes, header: bytes) -> bytes:
    first, rest = pem.split(b"\n", 1)
    return first + b"\n" + header + rest


def _long_lines(pem: bytes) -> bytes:
    lines = pem.strip().split(b"\n")
    body = b"".join(lines[1:-1])
    return b"\n".join([lines[0], body[:76], body[76:], lines[-1]]) + b"\n"


def _bad_signature(pem: bytes) -> bytes:
    der = bytearray(parse_request(pem).public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0x01          # inside the signature's BIT STRING
    b64 = base64.b64encode(bytes(der))
    return (b"-----BEGIN CERTIFICATE REQUEST-----\n" + b"\n".join(b64[i:i + 64] for i in range(0, len(b64), 64))
            + b"\n-----END CERTIFICATE REQUEST-----\n")


def _der(tag: int, body: bytes) -> bytes:
    n = len(body)
    length = bytes([n]) if n < 0x80 else bytes([0x80 | ((n.bit_length() + 7) // 8)]) + n.to_bytes(
        (n.bit_length() + 7) // 8, "big")
    return bytes([tag]) + length + body


def _numeric_string_org() -> bytes:
    """O=system:nodes as a NumericString (letters in it): cryptography up to 50 read it, Go's asn1
    does not. cryptography 51 refuses to build one, so the request is signed by hand: the subject's
    UTF8String tag turned into NumericString's (same length), the request info signed again."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "system:node:w1")])
    built = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    value = b"system:nodes"
    utf8 = _der(0x0C, value)
    tbs = built.tbs_certrequest_bytes
    assert tbs.count(utf8) == 1
    tbs = tbs.replace(utf8, _der(0x12, value))
    signature = key.sign(tbs, ec.ECDSA(hashes.SHA256()))
    ecdsa_sha256 = _der(0x30, _der(0x06, bytes.fromhex("2a8648ce3d040302")))
    der = _der(0x30, tbs + ecdsa_sha256 + _der(0x03, b"\x00" + signature))
    b64 = base64.b64encode(der)
    return (b"-----BEGIN CERTIFICATE REQUEST-----\n" + b"\n".join(b64[i:i + 64] for i in range(0, len(b64), 64))
            + b"\n-----END CERTIFICATE REQUEST-----\n")


# what an attacker holding w1's token sends so that the installer reads w1 and Go another name;
# the first one got a w9 certificate approved on the real lab before this check
TRICKS = {
    "a block Go does not see (BEGIN mid-line), then w9": b"x" + OWN + W9,
    "END mid-line, then w9": OWN.replace(b"\n-----END", b"-----END") + W9,
    "two blocks, w9 first": W9 + OWN,
    "two blocks, own first": OWN + W9,
    "headers in the block": _with_header(OWN, b"Proc-Type: 4,ENCRYPTED\n\n"),
    "junk before": b"junk\n" + OWN,
    "whitespace before": b"\n" + OWN,
    "junk after": OWN + b"junk",
    "CRLF line ends": OWN.replace(b"\n", b"\r\n"),
    "NEW CERTIFICATE REQUEST": OWN.replace(b"CERTIFICATE REQUEST", b"NEW CERTIFICATE REQUEST"),
    "76-character lines": _long_lines(OWN),
    "a signature that does not verify": _bad_signature(OWN),
    "DER only": parse_request(OWN).public_bytes(serialization.Encoding.DER),
    "a NumericString subject value (found by fuzz/fuzz_csr.py)": _numeric_string_org(),
}


@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_every_request_but_one_canonical_block_is_denied(trick):
    with pytest.raises(ValueError):
        parse_request(TRICKS[trick])
    v = judge("csr-x", "system:bootstrap:abc123", TRICKS[trick], USAGES, TOKENS, KEYS)
    assert v is not None and not v.approve and "not exactly one PEM certificate request" in v.message, v


def test_trailing_whitespace_is_what_go_ignores_too():
    assert parse_request(OWN + b"\n \t\n").subject == parse_request(OWN).subject


GO_READER = """package main

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"io"
	"os"
)

// what the apiserver's and the signer's ParseCSR read (pkg/apis/certificates/helpers.go)
func main() {
	var inputs []string
	data, _ := io.ReadAll(os.Stdin)
	json.Unmarshal(data, &inputs)
	out := []map[string]string{}
	for _, in := range inputs {
		raw, _ := base64.StdEncoding.DecodeString(in)
		r := map[string]string{}
		block, _ := pem.Decode(raw)
		if block == nil || block.Type != "CERTIFICATE REQUEST" {
			r["error"] = "no block"
		} else if csr, err := x509.ParseCertificateRequest(block.Bytes); err != nil {
			r["error"] = err.Error()
		} else {
			r["subject"] = csr.Subject.String()
			r["key"] = base64.StdEncoding.EncodeToString(csr.RawSubjectPublicKeyInfo)
		}
		out = append(out, r)
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


@pytest.fixture(scope="module")
def go_reader(tmp_path_factory) -> Path:
    go = shutil.which("go")
    assert go, "go is not on PATH (scripts/test requires it): this test compiles Go's own reading of a CSR"
    d = tmp_path_factory.mktemp("goreader")
    (d / "main.go").write_text(GO_READER)
    (d / "go.mod").write_text("module goreader\n\ngo 1.22\n")
    subprocess.run([go, "build", "-o", str(d / "reader"), "."], cwd=d, check=True, capture_output=True, timeout=300)
    return d / "reader"


def go_reads(reader: Path, inputs: list[bytes]) -> list[dict]:
    out = subprocess.run([str(reader)], input=json.dumps([base64.b64encode(i).decode() for i in inputs]),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out)


def test_what_the_installer_accepts_go_reads_the_same(go_reader):
    """The differential: for every request parse_request accepts, Go's ParseCSR reads the same
    subject and key; for the attack that got through before, Python's PEM loader and Go disagree
    (the reason parse_request exists)."""
    inputs = [OWN, OWN + b"\n \n", W9, *TRICKS.values()]
    for data, go in zip(inputs, go_reads(go_reader, inputs)):
        try:
            req = parse_request(data)
        except ValueError:
            continue
        cn = req.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert go.get("subject") == f"CN={cn},O=system:nodes", (data, go)
        assert base64.b64decode(go["key"]) == public_key_der(req.public_key())
    attack = TRICKS["a block Go does not see (BEGIN mid-line), then w9"]
    [go] = go_reads(go_reader, [attack])
    python_reads = x509.load_pem_x509_csr(attack).subject.rfc4514_string()
    assert go["subject"] == "CN=system:node:w9,O=system:nodes" and "system:node:w1" in python_reads


# --- the kubelet's key ------------------------------------------------------------------------

def broken_armor(label: str) -> bytes:
    """A PEM block of ``label`` whose body is not base64: no key in it (made here, so that no
    key armor is written literally in the repository)."""
    return f"-----BEGIN {label}-----\nbroken\n-----END {label}-----\n".encode()


def test_the_kubelets_keys_are_read_from_both_files_it_may_use():
    """kubelet-client.key.tmp (PKCS#8 or SEC1) while it waits; the store's current file (a
    certificate and its key) when one is there; anything else in the output is ignored."""
    tmp = ec.generate_private_key(ec.SECP256R1())
    current = ec.generate_private_key(ec.SECP256R1())
    out = (tmp.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
           + b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
           + current.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                   serialization.NoEncryption())
           + broken_armor("EC PRIVATE KEY"))
    assert csr_rules.parse_keys(out) == {public_key_der(tmp.public_key()), public_key_der(current.public_key())}
    assert csr_rules.parse_keys(b"") == frozenset()
    script = csr_rules.keys_script()
    assert "/var/lib/kubelet/pki/kubelet-client.key.tmp" in script and "kubelet-client-current.pem" in script


# --- through the API client -------------------------------------------------------------------

def csr(name: str, user: str, pem: bytes, signer: str = KUBELET_CLIENT_SIGNER, conditions=None,
        created: str = "2026-01-01T00:00:00Z") -> dict:
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"request": base64.b64encode(pem).decode(), "signerName": signer, "username": user,
                     "usages": USAGES, "groups": ["system:bootstrappers"]},
            "status": {"conditions": conditions or []}}


@pytest.fixture
def client(prepared):
    fake = FakeCluster()
    api = kube.api_client(API, prepared.material)
    api.pool = fake
    yield api, fake
    api.close()


def test_approve_pending_writes_one_verdict_per_bootstrap_request(client):
    api, fake = client
    fake.add(CSRS, csr("a-own", "system:bootstrap:abc123", OWN))
    fake.add(CSRS, csr("b-other", "system:bootstrap:abc123", request("system:node:w2")))
    fake.add(CSRS, csr("b-thief", "system:bootstrap:abc123", request("system:node:w1")))
    fake.add(CSRS, csr("c-renewal", "system:node:w2", request("system:node:w2")))
    fake.add(CSRS, csr("d-serving", "system:bootstrap:abc123", OWN, signer="kubernetes.io/kubelet-serving"))
    asked = []

    def keys_of(nodes):
        asked.append(set(nodes))
        return KEYS
    verdicts = csr_approval.approve_pending(api, TOKENS, keys_of)
    assert asked == [{"w1"}]                 # read once, for the nodes with a waiting request
    assert [(v.csr, v.approve) for v in verdicts] == [("a-own", True), ("b-other", False), ("b-thief", False)]
    puts = [p for m, p, _ in fake.requests if m == "PUT"]
    assert puts == [f"{CSRS}/a-own/approval", f"{CSRS}/b-other/approval", f"{CSRS}/b-thief/approval"]
    [approved] = fake.store[f"{CSRS}/a-own"]["status"]["conditions"]
    assert (approved["type"], approved["reason"]) == ("Approved", "HiddenplaneNodeToken")
    [denied] = fake.store[f"{CSRS}/b-thief"]["status"]["conditions"]
    assert (denied["type"], denied["reason"]) == ("Denied", "HiddenplaneTokenMismatch")
    assert fake.store[f"{CSRS}/c-renewal"]["status"]["conditions"] == []       # the controller-manager's
    assert fake.store[f"{CSRS}/d-serving"]["status"]["conditions"] == []


def test_a_second_request_with_a_spent_token_is_denied_even_with_the_kubelets_key(client):
    api, fake = client
    fake.add(CSRS, csr("first", "system:bootstrap:abc123", OWN,
                       conditions=[{"type": "Approved", "status": "True", "reason": "x", "message": "y"}]))
    fake.add(CSRS, csr("second", "system:bootstrap:abc123", request("system:node:w1", key=KUBELET_KEY),
                       created="2026-01-01T00:01:00Z"))
    [v] = csr_approval.approve_pending(api, TOKENS, lambda nodes: KEYS)
    assert (v.csr, v.approve) == ("second", False) and "one certificate per token" in v.message


def test_two_waiting_requests_of_one_token_get_one_approval(client):
    api, fake = client
    fake.add(CSRS, csr("a", "system:bootstrap:abc123", OWN))
    fake.add(CSRS, csr("b", "system:bootstrap:abc123", request("system:node:w1", key=KUBELET_KEY),
                       created="2026-01-01T00:01:00Z"))
    verdicts = csr_approval.approve_pending(api, TOKENS, lambda nodes: KEYS)
    assert [(v.csr, v.approve) for v in verdicts] == [("a", True), ("b", False)]


def test_nothing_waiting_reads_no_key(client):
    api, fake = client
    fake.add(CSRS, csr("done", "system:bootstrap:abc123", OWN,
                       conditions=[{"type": "Approved", "status": "True", "reason": "x", "message": "y"}]))

    def keys_of(nodes):
        raise AssertionError("a converged cluster must cost no SSH round trip")
    assert csr_approval.approve_pending(api, TOKENS, keys_of) == []


def _issue(pem: bytes, cn: str) -> str:
    """A certificate for ``pem``'s key with subject ``cn``, as a (misbehaving) signer would."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")]))
            .public_key(x509.load_pem_x509_csr(pem).public_key()).serial_number(7)
            .not_valid_before(now).not_valid_after(now + dt.timedelta(hours=1))
            .sign(ca_key, hashes.SHA256()))
    return base64.b64encode(cert.public_bytes(serialization.Encoding.PEM)).decode()


def test_an_issued_certificate_that_is_not_what_was_approved_stops_the_run(client):
    api, fake = client
    fake.add(CSRS, csr("a-own", "system:bootstrap:abc123", OWN))
    [v] = csr_approval.approve_pending(api, TOKENS, lambda nodes: KEYS)
    assert csr_approval.check_issued(api, [v]) == [v]          # not issued yet: still waiting
    fake.store[f"{CSRS}/a-own"]["status"]["certificate"] = _issue(OWN, "system:node:w9")
    fake.add("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "w9"}})
    with pytest.raises(csr_approval.CSRError) as e:
        csr_approval.check_issued(api, [v], keep_nodes={"w1", "w2"})
    assert "bootstrap token abc123 of node w1" in str(e.value) and "CN=system:node:w9" in str(e.value)
    assert "deleted Node w9" in str(e.value) and "deleted CSR a-own" in str(e.value)
    assert f"{CSRS}/a-own" not in fake.store and "/api/v1/nodes/w9" not in fake.store


def test_a_wrongly_issued_certificate_naming_an_inventory_host_leaves_that_node(client):
    api, fake = client
    fake.add(CSRS, csr("a-own", "system:bootstrap:abc123", OWN))
    [v] = csr_approval.approve_pending(api, TOKENS, lambda nodes: KEYS)
    fake.store[f"{CSRS}/a-own"]["status"]["certificate"] = _issue(OWN, "system:node:w2")
    fake.add("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "w2"}})
    with pytest.raises(csr_approval.CSRError):
        csr_approval.check_issued(api, [v], keep_nodes={"w1", "w2"})
    assert "/api/v1/nodes/w2" in fake.store


def test_the_right_certificate_passes(client):
    api, fake = client
    fake.add(CSRS, csr("a-own", "system:bootstrap:abc123", OWN))
    [v] = csr_approval.approve_pending(api, TOKENS, lambda nodes: KEYS)
    fake.store[f"{CSRS}/a-own"]["status"]["certificate"] = _issue(OWN, "system:node:w1")
    assert csr_approval.check_issued(api, [v]) == []


def test_token_secrets_are_deleted_with_one_list(client):
    api, fake = client
    secrets = "/api/v1/namespaces/kube-system/secrets"
    fake.add(secrets, {"apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
                       "metadata": {"name": "bootstrap-token-abc123", "namespace": "kube-system"}})
    assert csr_approval.delete_token_secrets(api, {"abc123": "w1", "def456": "w2"}) == ["w1"]
    assert [m for m, _, _ in fake.requests] == ["GET", "DELETE"]
