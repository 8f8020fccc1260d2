"""A join token is good for its own node only (installer/host/csr_approval.py).

``judge`` on real certificate requests made with ``cryptography`` as a kubelet makes them; the
approval through the real client over the fake transport. The real cluster proves the rest
(tests/test_real_cluster.py: a leaked token asking for another node is denied).
"""

from __future__ import annotations

import base64

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from installer.host import csr_approval

from installer.host import kube
from installer.host.csr_approval import KUBELET_CLIENT_SIGNER, judge

from .fakeapi import FakeCluster

API = "https://192.168.56.230:6443"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
TOKENS = {"abc123": "w1", "def456": "w2"}
USAGES = ["digital signature", "client auth"]


def request(cn: str | None, orgs: tuple[str, ...] = ("system:nodes",), san: str | None = None) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    names = ([x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
             + ([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(names))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_its_own_token_and_name_is_approved():
    v = judge("csr-1", "system:bootstrap:abc123", request("system:node:w1"), USAGES, TOKENS)
    assert (v.approve, v.node) == (True, "w1") and "abc123" in v.message


@pytest.mark.parametrize("user,pem,usages,why", [
    ("system:bootstrap:abc123", request("system:node:w2"), USAGES, "belongs to node w1: it may ask only for CN=system:node:w1"),
    ("system:bootstrap:abc123", request("system:node:w9"), USAGES, "not CN=system:node:w9"),
    ("system:bootstrap:zzz999", request("system:node:w1"), USAGES, "zzz999 was not issued by hiddenplane"),
    ("system:bootstrap:abc123", request("system:node:w1", ("system:nodes", "system:masters")), USAGES,
     "O must be exactly system:nodes"),
    ("system:bootstrap:abc123", request("system:node:w1", ()), USAGES, "O must be exactly system:nodes"),
    ("system:bootstrap:abc123", request("system:node:w1", san="evil.example"), USAGES, "no subject alternative"),
    ("system:bootstrap:abc123", request("system:node:w1"), ["digital signature", "server auth"], "usages must be"),
    ("system:bootstrap:abc123", request("system:node:w1"), USAGES + ["server auth"], "usages must be"),
    ("system:bootstrap:abc123", b"not a request", USAGES, "not a PEM certificate request"),
])
def test_anything_else_a_bootstrap_token_asks_for_is_denied_with_the_reason(user, pem, usages, why):
    v = judge("csr-x", user, pem, usages, TOKENS)
    assert v is not None and not v.approve and why in v.message, v


def test_renewals_are_not_ours_to_decide():
    assert judge("csr-r", "system:node:w1", request("system:node:w1"), USAGES, TOKENS) is None


def csr(name: str, user: str, pem: bytes, signer: str = KUBELET_CLIENT_SIGNER, conditions=None) -> dict:
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {"request": base64.b64encode(pem).decode(), "signerName": signer, "username": user,
                     "usages": USAGES, "groups": ["system:bootstrappers"]},
            "status": {"conditions": conditions or []}}


def test_approve_pending_writes_one_verdict_per_bootstrap_request(prepared):
    fake = FakeCluster()
    fake.add(CSRS, csr("a-own", "system:bootstrap:abc123", request("system:node:w1")))
    fake.add(CSRS, csr("b-other", "system:bootstrap:abc123", request("system:node:w2")))
    fake.add(CSRS, csr("c-renewal", "system:node:w2", request("system:node:w2")))
    fake.add(CSRS, csr("d-serving", "system:bootstrap:abc123", request("system:node:w1"),
                       signer="kubernetes.io/kubelet-serving"))
    fake.add(CSRS, csr("e-done", "system:bootstrap:def456", request("system:node:w2"),
                       conditions=[{"type": "Approved", "status": "True", "reason": "x", "message": "y"}]))
    api = kube.api_client(API, prepared.material)
    api.pool = fake
    try:
        verdicts = csr_approval.approve_pending(api, TOKENS)
    finally:
        api.close()
    assert [(v.csr, v.approve) for v in verdicts] == [("a-own", True), ("b-other", False)]
    puts = [(p, body) for m, p, body in fake.requests if m == "PUT"]
    assert [p for p, _ in puts] == [f"{CSRS}/a-own/approval", f"{CSRS}/b-other/approval"]
    [approved] = fake.store[f"{CSRS}/a-own"]["status"]["conditions"]
    assert (approved["type"], approved["reason"]) == ("Approved", "HiddenplaneNodeToken")
    [denied] = fake.store[f"{CSRS}/b-other"]["status"]["conditions"]
    assert (denied["type"], denied["reason"]) == ("Denied", "HiddenplaneTokenMismatch")
    assert fake.store[f"{CSRS}/c-renewal"]["status"]["conditions"] == []       # the controller-manager's
    assert fake.store[f"{CSRS}/d-serving"]["status"]["conditions"] == []
