"""The PKI against the kubeadm-grade certificate table (written out below for the example
inventory), checked with ``cryptography`` and with the real ``openssl`` binary; plus
idempotent, incremental issuance in the state directory, bootstrap tokens and the
secrets-encryption key."""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime as dt
import ipaddress
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from installer import api
from installer.cli.main import cli
from installer.core import inventory
from installer.core.errors import StateError
from installer.core.pki import issue
from installer.core.pki.material import ensure

from .conftest import NOW, write_inventory

OPENSSL = shutil.which("openssl")
UTC = dt.timezone.utc

# --- the expected table (kubeadm's certificates), written out for the example inventory -----
# (cp1 control 192.168.56.230; node2 192.168.56.231 and node3 192.168.56.232 workers;
#  service CIDR 10.96.0.0/12, cluster domain cluster.local, endpoint 192.168.56.230)

CAS = {  # state name -> CN
    "ca": "kubernetes-ca",
    "etcd/ca": "etcd-ca",
    "front-proxy-ca": "front-proxy-ca",
}
S, C, SC = "server", "client", "server+client"
EKU = {
    S: {ExtendedKeyUsageOID.SERVER_AUTH},
    C: {ExtendedKeyUsageOID.CLIENT_AUTH},
    SC: {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH},
}
ETCD_MEMBER_DNS = {"cp1", "localhost"}
ETCD_MEMBER_IPS = {"192.168.56.230", "127.0.0.1", "::1"}

# name -> (signing CA, CN, O, usage, DNS SANs, IP SANs)
LEAVES = {
    "apiserver": ("ca", "kube-apiserver", (), S,
                  {"kubernetes", "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local", "localhost", "cp1"},
                  {"127.0.0.1", "10.96.0.1", "192.168.56.230"}),
    "apiserver-kubelet-client": ("ca", "kube-apiserver-kubelet-client", (), C, set(), set()),
    "apiserver-etcd-client": ("etcd/ca", "kube-apiserver-etcd-client", (), C, set(), set()),
    "front-proxy-client": ("front-proxy-ca", "front-proxy-client", (), C, set(), set()),
    "etcd/healthcheck-client": ("etcd/ca", "kube-etcd-healthcheck-client", (), C, set(), set()),
    "etcd/server-cp1": ("etcd/ca", "cp1", (), SC, ETCD_MEMBER_DNS, ETCD_MEMBER_IPS),
    "etcd/peer-cp1": ("etcd/ca", "cp1", (), SC, ETCD_MEMBER_DNS, ETCD_MEMBER_IPS),
    "controller-manager": ("ca", "system:kube-controller-manager", (), C, set(), set()),
    "scheduler": ("ca", "system:kube-scheduler", (), C, set(), set()),
    # one per worker, no O: its rights are its own binding's, which `node revoke` deletes
    "kube-proxy/node2": ("ca", "hiddenplane:kube-proxy:node2", (), C, set(), set()),
    "kube-proxy/node3": ("ca", "hiddenplane:kube-proxy:node3", (), C, set(), set()),
    "admin": ("ca", "kubernetes-admin", ("kubeadm:cluster-admins",), C, set(), set()),
    # break-glass credential: kubeadm's super-admin.conf is the one system:masters identity
    "super-admin": ("ca", "kubernetes-super-admin", ("system:masters",), C, set(), set()),
    "kubelet/node2-serving": ("ca", "system:node:node2", ("system:nodes",), S, {"node2"}, {"192.168.56.231"}),
    "kubelet/node3-serving": ("ca", "system:node:node3", ("system:nodes",), S, {"node3"}, {"192.168.56.232"}),
}
ALL_NAMES = sorted(CAS) + sorted(LEAVES)

CA_DAYS, LEAF_DAYS = 3650, 365                 # the example inventory's (and kubeadm's) values
RSA_CA_DAYS, RSA_LEAF_DAYS = 1000, 30           # non-defaults, to show spec.pki is honoured


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rsa_prepared(example_doc, tmp_path_factory):
    """The example cluster with keyAlgorithm rsa-2048 and non-default validities (generated once)."""
    d = copy.deepcopy(example_doc)
    d["spec"]["pki"].update(keyAlgorithm="rsa-2048", caValidityDays=RSA_CA_DAYS,
                            certValidityDays=RSA_LEAF_DAYS)
    tmp = tmp_path_factory.mktemp("rsa")
    return api.prepare(write_inventory(tmp, d), tmp / "state")


FLAVOURS = {  # fixture name -> (algorithm, CA days, leaf days)
    "prepared": ("ecdsa-p256", CA_DAYS, LEAF_DAYS),
    "rsa_prepared": ("rsa-2048", RSA_CA_DAYS, RSA_LEAF_DAYS),
}


def openssl(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    if OPENSSL is None:
        pytest.fail("openssl is not installed")
    r = subprocess.run([OPENSSL, *args], capture_output=True, text=True, timeout=30)
    if ok:
        assert r.returncode == 0, f"openssl {' '.join(args)} failed:\n{r.stdout}{r.stderr}"
    return r


def write_pems(material, root: Path) -> dict[str, tuple[Path, Path]]:
    """Every CA and leaf of ``material`` as <root>/<name>.crt/.key; name -> (crt, key)."""
    out = {}
    for name in ALL_NAMES:
        pair = material.pair(name)
        crt = root / f"{name}.crt"
        key = root / f"{name}.key"
        crt.parent.mkdir(parents=True, exist_ok=True)
        crt.write_bytes(issue.cert_pem(pair.cert))
        key.write_bytes(issue.key_pem(pair.key))
        out[name] = (crt, key)
    return out


def spki(key_or_cert) -> bytes:
    pub = key_or_cert.public_key()
    return pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def subject(cert: x509.Certificate) -> tuple[list[str], list[str], set]:
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    oids = {a.oid for a in cert.subject}
    return cns, orgs, oids


def assert_key_algorithm(key, cert: x509.Certificate, algorithm: str) -> None:
    if algorithm == "ecdsa-p256":
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert isinstance(key.curve, ec.SECP256R1)
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert isinstance(cert.public_key().curve, ec.SECP256R1)
    else:
        assert isinstance(key, rsa.RSAPrivateKey) and key.key_size == 2048
        assert isinstance(cert.public_key(), rsa.RSAPublicKey) and cert.public_key().key_size == 2048


def assert_openssl_key(crt: Path, key: Path, algorithm: str) -> None:
    """openssl agrees on the key type and that the key belongs to the certificate."""
    cert_pub = openssl("x509", "-in", str(crt), "-noout", "-pubkey").stdout
    key_pub = openssl("pkey", "-in", str(key), "-pubout").stdout
    assert cert_pub == key_pub and "BEGIN PUBLIC KEY" in cert_pub
    text = openssl("x509", "-in", str(crt), "-noout", "-text").stdout
    if algorithm == "ecdsa-p256":
        assert "Public Key Algorithm: id-ecPublicKey" in text
        assert "ASN1 OID: prime256v1" in text
    else:
        assert "Public Key Algorithm: rsaEncryption" in text
        assert "Public-Key: (2048 bit)" in text


# --- the whole table ------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_exactly_the_table(flavour, request):
    m = request.getfixturevalue(flavour).material
    assert set(m.cas) == set(CAS)
    assert set(m.certs) == set(LEAVES)
    # three distinct authorities: the front-proxy CA is not the client CA, etcd has its own
    assert len({spki(p.cert) for p in m.cas.values()}) == 3


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_no_kubelet_client_certificate(flavour, request):
    """Kubelet client certificates come from TLS bootstrapping, never from the installer:
    neither in memory nor anywhere in the state directory."""
    p = request.getfixturevalue(flavour)
    on_disk = [issue.load_cert(f.read_bytes()) for f in (p.state.root / "pki").rglob("*.crt")]
    assert len(on_disk) == len(ALL_NAMES)
    certs = [pair.cert for pair in p.material.certs.values()] + on_disk
    node_certs = [c for c in certs if subject(c)[0][0].startswith("system:node:")]
    assert node_certs, "the kubelet serving certificates should be system:node:<name>"
    for c in node_certs:
        ekus = set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert ExtendedKeyUsageOID.CLIENT_AUTH not in ekus, c.subject.rfc4514_string()


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", sorted(CAS))
def test_ca(flavour, name, request, tmp_path):
    algorithm, ca_days, _ = FLAVOURS[flavour]
    p = request.getfixturevalue(flavour)
    pair = p.material.cas[name]
    cert = pair.cert

    cns, orgs, oids = subject(cert)
    assert cns == [CAS[name]] and orgs == [] and oids == {NameOID.COMMON_NAME}
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)          # self-signed with its own key

    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is True
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.digital_signature
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(cert.public_key())
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)

    span = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=ca_days) <= span <= dt.timedelta(days=ca_days, minutes=10)
    now = dt.datetime.now(UTC)
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc

    assert spki(pair.key) == spki(cert)
    assert_key_algorithm(pair.key, cert, algorithm)

    pems = write_pems(p.material, tmp_path)
    crt, key = pems[name]
    assert "OK" in openssl("verify", "-x509_strict", "-CAfile", str(crt), str(crt)).stdout
    for other in set(CAS) - {name}:
        r = openssl("verify", "-CAfile", str(pems[other][0]), str(crt), ok=False)
        assert r.returncode != 0, f"{name} verified against {other}"
    assert_openssl_key(crt, key, algorithm)
    assert "CA:TRUE" in openssl("x509", "-in", str(crt), "-noout", "-ext", "basicConstraints").stdout


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("name", sorted(LEAVES))
def test_leaf(flavour, name, request, tmp_path):
    algorithm, ca_days, leaf_days = FLAVOURS[flavour]
    p = request.getfixturevalue(flavour)
    ca_name, cn, orgs, usage, dns, ips = LEAVES[name]
    pair = p.material.certs[name]
    cert, ca = pair.cert, p.material.cas[ca_name].cert

    # identity
    got_cns, got_orgs, oids = subject(cert)
    assert got_cns == [cn]
    assert tuple(got_orgs) == orgs
    assert oids <= {NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME}

    # chain (cryptography): issued by exactly the right CA, by no other
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    for other in set(CAS) - {ca_name}:
        with pytest.raises((ValueError, InvalidSignature)):
            cert.verify_directly_issued_by(p.material.cas[other].cert)
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest

    # constraints and usages
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is False
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature
    assert not ku.value.key_cert_sign and not ku.value.crl_sign
    assert ku.value.key_encipherment is (algorithm == "rsa-2048")
    ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert ekus == EKU[usage]

    # SANs: exactly the expected names, DNS and IP kept apart
    if dns or ips:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) == dns
        assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address(i) for i in ips}
        assert len(list(san)) == len(dns) + len(ips)    # no other name types, no duplicates
    else:
        with pytest.raises(x509.ExtensionNotFound):
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)

    # validity: certValidityDays (plus clock-skew back-dating), within the CA's lifetime
    span = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=leaf_days) <= span <= dt.timedelta(days=leaf_days, minutes=10)
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc
    assert ca.not_valid_before_utc <= cert.not_valid_before_utc
    assert cert.not_valid_before_utc <= dt.datetime.now(UTC)

    # keys
    assert spki(pair.key) == spki(cert)
    assert_key_algorithm(pair.key, cert, algorithm)
    assert spki(pair.key) not in {spki(c.cert) for c in p.material.cas.values()}

    # the same with the real openssl
    pems = write_pems(p.material, tmp_path)
    crt, key = pems[name]
    ca_file = str(pems[ca_name][0])
    assert openssl("verify", "-x509_strict", "-CAfile", ca_file, str(crt)).stdout.strip() == f"{crt}: OK"
    purposes = {S: ["sslserver"], C: ["sslclient"], SC: ["sslserver", "sslclient"]}[usage]
    for purpose in purposes:
        openssl("verify", "-x509_strict", "-purpose", purpose, "-CAfile", ca_file, str(crt))
    for purpose in {"sslserver", "sslclient"} - set(purposes):
        r = openssl("verify", "-purpose", purpose, "-CAfile", ca_file, str(crt), ok=False)
        assert r.returncode != 0 and "unsuitable certificate purpose" in r.stdout + r.stderr
    for other in set(CAS) - {ca_name}:
        r = openssl("verify", "-CAfile", str(pems[other][0]), str(crt), ok=False)
        assert r.returncode != 0, f"{name} verified against {other}"
    assert_openssl_key(crt, key, algorithm)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_state_files_hold_the_material(flavour, request):
    p = request.getfixturevalue(flavour)
    for name in ALL_NAMES:
        pair = p.material.pair(name)
        assert p.state.pki(name, "crt").read_bytes() == issue.cert_pem(pair.cert)
        assert p.state.pki(name, "key").read_bytes() == issue.key_pem(pair.key)
    sa = issue.load_key(p.state.pki("sa", "key").read_bytes())
    assert spki(sa) == spki(p.material.sa_key)
    if FLAVOURS[flavour][0] == "ecdsa-p256":
        assert isinstance(sa, ec.EllipticCurvePrivateKey) and isinstance(sa.curve, ec.SECP256R1)
    else:
        assert isinstance(sa, rsa.RSAPrivateKey) and sa.key_size == 2048
    assert p.state.pki("sa", "pub").read_bytes() == issue.public_pem(sa)


def test_leaf_validity_capped_by_ca(doc, tmp_path):
    """A leaf never outlives its CA, whatever certValidityDays says."""
    doc["spec"]["pki"].update(caValidityDays=10, certValidityDays=365)
    p = api.prepare(write_inventory(tmp_path, doc), tmp_path / "state")
    ca = p.material.cas["ca"].cert
    assert ca.not_valid_after_utc - ca.not_valid_before_utc <= dt.timedelta(days=10, minutes=10)
    for name, (ca_name, *_rest) in LEAVES.items():
        assert p.material.certs[name].cert.not_valid_after_utc == \
            p.material.cas[ca_name].cert.not_valid_after_utc, name


def test_front_proxy_cn_matches_allowed_names(prepared, rendered):
    unit = (rendered / "cp1/etc/systemd/system/kube-apiserver.service").read_text()
    allowed = re.search(r"--requestheader-allowed-names=(\S+)", unit).group(1)
    cn = subject(prepared.material.certs["front-proxy-client"].cert)[0][0]
    assert allowed.split(",") == [cn] == ["front-proxy-client"]


# --- the state directory: idempotence and incremental issuance ----------------------------

def snapshot(root: Path) -> dict[str, tuple[bytes, int, int, int]]:
    """relative path -> (content, mode, inode, mtime_ns) of every file under root."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            st = f.stat()
            out[f.relative_to(root).as_posix()] = (f.read_bytes(), stat.S_IMODE(st.st_mode), st.st_ino,
                                                   st.st_mtime_ns)
    return out


def changed_files(before: dict, after: dict) -> set[str]:
    """Paths added, removed or whose content differs."""
    return {k for k in before.keys() | after.keys()
            if k not in before or k not in after or before[k][0] != after[k][0]}


@pytest.fixture
def fresh(doc, tmp_path):
    """A freshly prepared copy of the example in tmp_path; returns (doc, inventory path, state dir)."""
    inv = write_inventory(tmp_path, doc)
    state = tmp_path / "state"
    first = api.prepare(inv, state)
    assert set(first.changes.reasons) == set(ALL_NAMES) | {
        "sa", "encryption-key", "token/node2", "token/node3", "network/node2", "network/node3"}
    assert all(first.changes.reasons[n] == "new CA" for n in CAS)
    return doc, inv, state


def test_second_prepare_is_a_no_op(fresh):
    _, inv, state = fresh
    before = snapshot(state)
    again = api.prepare(inv, state)
    assert not again.changes and again.changes.reasons == {}
    after = snapshot(state)
    assert after == before        # same bytes, modes, and not even rewritten (inode, mtime)
    assert {"admin.conf", "secrets/tokens.yaml", "secrets/encryption.key", "pki/sa.key", "pki/sa.pub",
            "pki/ca.crt", "pki/etcd/ca.key", "pki/kubelet/node3-serving.crt"} <= set(after)
    assert len([k for k in after if k.startswith("pki/") and k.endswith(".crt")]) == len(ALL_NAMES)


def test_adding_a_worker_issues_only_its_material(fresh, tmp_path):
    doc, inv, state = fresh
    before = snapshot(state)
    old_tokens = yaml.safe_load(state.joinpath("secrets/tokens.yaml").read_text())
    doc["spec"]["hosts"].append({"name": "node4", "address": "192.168.56.235", "role": "worker"})
    write_inventory(tmp_path, doc)
    p = api.prepare(inv, state)
    assert p.changes.reasons == {"kubelet/node4-serving": "new", "kube-proxy/node4": "new", "token/node4": "new",
                                 "network/node4": "pod CIDR 10.244.2.0/24"}
    after = snapshot(state)
    assert changed_files(before, after) == {
        "pki/kubelet/node4-serving.crt", "pki/kubelet/node4-serving.key", "pki/kube-proxy/node4.crt",
        "pki/kube-proxy/node4.key", "secrets/tokens.yaml", "network.yaml"}
    new_tokens = yaml.safe_load(state.joinpath("secrets/tokens.yaml").read_text())
    assert set(new_tokens) == {"node2", "node3", "node4"}
    assert {k: new_tokens[k] for k in ("node2", "node3")} == old_tokens
    cert = p.material.certs["kubelet/node4-serving"].cert
    assert subject(cert)[0] == ["system:node:node4"]
    assert issue.sans_of(cert) == {"node4", "192.168.56.235"}
    cert.verify_directly_issued_by(p.material.cas["ca"].cert)


def test_extra_san_reissues_only_apiserver_and_keeps_its_key(fresh, tmp_path):
    doc, inv, state = fresh
    before = snapshot(state)
    old = issue.load_cert(state.joinpath("pki/apiserver.crt").read_bytes())
    doc["spec"]["apiServer"]["extraSANs"] = ["api.lab.example", "192.168.56.240"]
    write_inventory(tmp_path, doc)
    p = api.prepare(inv, state)
    assert p.changes.reasons == {"apiserver": "SANs changed"}
    after = snapshot(state)
    assert changed_files(before, after) == {"pki/apiserver.crt"}
    assert after["pki/apiserver.key"] == before["pki/apiserver.key"]
    new = issue.load_cert(after["pki/apiserver.crt"][0])
    assert new.serial_number != old.serial_number
    assert issue.sans_of(new) == issue.sans_of(old) | {"api.lab.example", "192.168.56.240"}
    assert spki(new) == spki(old)
    new.verify_directly_issued_by(p.material.cas["ca"].cert)
    # and a further run is a no-op again
    assert not api.prepare(inv, state).changes
    assert snapshot(state) == after


@pytest.mark.parametrize("name", ["scheduler", "etcd/peer-cp1", "kubelet/node2-serving"])
def test_deleted_leaf_is_reissued_alone(fresh, name):
    _, inv, state = fresh
    for ext in ("crt", "key"):
        (state / "pki" / f"{name}.{ext}").unlink()
    before = snapshot(state)
    p = api.prepare(inv, state)
    assert p.changes.reasons == {name: "new"}
    after = snapshot(state)
    assert changed_files(before, after) == {f"pki/{name}.crt", f"pki/{name}.key"}
    assert {k: v for k, v in after.items() if k in before} == before    # nothing else touched
    ca_name = LEAVES[name][0]
    p.material.certs[name].cert.verify_directly_issued_by(p.material.cas[ca_name].cert)
    assert subject(p.material.certs[name].cert)[0] == [LEAVES[name][1]]


def test_deleted_ca_reissues_exactly_what_it_signed(fresh):
    """Re-creating the etcd CA re-issues the etcd-signed leaves (keeping their keys) and
    nothing else."""
    _, inv, state = fresh
    for ext in ("crt", "key"):
        (state / "pki" / f"etcd/ca.{ext}").unlink()
    before = snapshot(state)
    p = api.prepare(inv, state)
    etcd_leaves = sorted(n for n, row in LEAVES.items() if row[0] == "etcd/ca")
    assert etcd_leaves == ["apiserver-etcd-client", "etcd/healthcheck-client", "etcd/peer-cp1",
                           "etcd/server-cp1"]
    assert p.changes.reasons == {"etcd/ca": "new CA",
                                 **{n: "not signed by the current CA" for n in etcd_leaves}}
    after = snapshot(state)
    assert changed_files(before, after) == {"pki/etcd/ca.crt", "pki/etcd/ca.key"} | {
        f"pki/{n}.crt" for n in etcd_leaves}
    for n in etcd_leaves:
        p.material.certs[n].cert.verify_directly_issued_by(p.material.cas["etcd/ca"].cert)


def test_expired_ca_is_a_clear_error(doc, tmp_path):
    """An expired CA is not replaced behind the operator's back, and prepare says why instead of
    crashing while issuing under it."""
    doc["spec"]["pki"].update(caValidityDays=1, certValidityDays=1)
    path = write_inventory(tmp_path, doc)
    p = api.prepare(path, tmp_path / "state")
    inv = inventory.load(path)
    later = dt.datetime.now(UTC) + dt.timedelta(days=2)
    with pytest.raises(StateError, match=r"kubernetes-ca certificate \(pki/ca\.crt\) expired"):
        ensure(inv, p.state.load(inv), now=later)
    # an expired leaf under a valid CA is simply re-issued
    doc["spec"]["pki"].update(caValidityDays=10)
    path2 = write_inventory(tmp_path, doc, "inv2.yaml")
    p2 = api.prepare(path2, tmp_path / "state2")
    inv2 = inventory.load(path2)
    m, ch = ensure(inv2, p2.state.load(inv2), now=later)
    assert set(ch.reasons) == set(LEAVES) | {"token/node2", "token/node3"}
    assert all(ch.reasons[n] == "expired" for n in LEAVES)
    for n in LEAVES:
        assert m.certs[n].cert.not_valid_after_utc > later
        assert spki(m.certs[n].key) == spki(p2.material.certs[n].key)     # keys kept


def test_permissions(fresh):
    _, inv, state = fresh
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    snap = snapshot(state)
    # .lock: empty, the flock of whoever uses the state (0600 like everything not public)
    secret = [k for k in snap if k.endswith(".key") or k.startswith("secrets/") or k in ("admin.conf", ".lock")]
    assert len([k for k in secret if k.startswith("pki/")]) == len(ALL_NAMES) + 1    # + sa.key
    assert {"secrets/tokens.yaml", "secrets/encryption.key", "admin.conf"} <= set(secret)
    for k in secret:
        assert snap[k][1] == 0o600, k
    for k in set(snap) - set(secret):
        assert (k.endswith((".crt", ".pub")) or k == "network.yaml") and snap[k][1] == 0o644, k
    for d in [state, *[p for p in state.rglob("*") if p.is_dir()]]:
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, d


def test_loosened_permissions_are_restored(fresh):
    _, inv, state = fresh
    state.chmod(0o755)
    (state / "pki/ca.key").chmod(0o644)
    (state / "admin.conf").chmod(0o644)
    before = snapshot(state)
    p = api.prepare(inv, state)
    assert not p.changes
    after = snapshot(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert after["pki/ca.key"][1] == 0o600 and after["admin.conf"][1] == 0o600
    assert changed_files(before, after) == set()       # same bytes: the CA key is kept


# --- bootstrap tokens -----------------------------------------------------------------------

TOKEN_RE = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}$")


def test_tokens_in_prepared(prepared):
    toks = prepared.material.tokens
    assert set(toks) == {"node2", "node3"}              # one per worker, none for cp1
    assert len({t.id for t in toks.values()}) == 2
    for t in toks.values():
        assert TOKEN_RE.match(t.value), t.value
        assert t.value == f"{t.id}.{t.secret}"


def test_token_expiry_reuse_and_replacement(doc, tmp_path):
    ttl = 6
    doc["spec"]["pki"]["bootstrapTokenTTLHours"] = ttl
    path = write_inventory(tmp_path, doc)
    state_dir = tmp_path / "state"
    now = dt.datetime.now(UTC).replace(microsecond=0)
    p = api.prepare(path, state_dir, now=now)
    toks = p.material.tokens
    assert set(toks) == {"node2", "node3"}
    for t in toks.values():
        assert TOKEN_RE.match(t.value)
        assert t.expires == now + dt.timedelta(hours=ttl)

    # persisted with the expiry (timezone included) and read back identically
    inv = inventory.load(path)
    loaded = p.state.load(inv)
    assert loaded.tokens == toks
    on_disk = yaml.safe_load((state_dir / "secrets/tokens.yaml").read_text())
    assert {n: f"{v['id']}.{v['secret']}" for n, v in on_disk.items()} == {n: t.value for n, t in toks.items()}

    # more than a quarter of the TTL left: reused, nothing changes
    m, ch = ensure(inv, loaded, now=now + dt.timedelta(hours=ttl * 0.7))
    assert m.tokens == toks
    assert not ch

    # in its last quarter: replaced, so no host gets a token about to expire
    m, ch = ensure(inv, loaded, now=now + dt.timedelta(hours=ttl) - dt.timedelta(minutes=1))
    assert ch.reasons == {"token/node2": "expiring", "token/node3": "expiring"}
    assert all(m.tokens[n].id != toks[n].id for n in toks)

    # expired: replaced with a fresh token, valid for the TTL from the new now
    later = now + dt.timedelta(hours=ttl, seconds=1)
    m, ch = ensure(inv, loaded, now=later)
    assert ch.reasons == {"token/node2": "expired", "token/node3": "expired"}
    for node, t in m.tokens.items():
        assert TOKEN_RE.match(t.value)
        assert t.id != toks[node].id and t.secret != toks[node].secret
        assert t.expires == later + dt.timedelta(hours=ttl)
    # everything else is kept
    assert {n: p_.cert for n, p_ in m.certs.items()} == {n: p_.cert for n, p_ in loaded.certs.items()}
    assert m.encryption_key == loaded.encryption_key and m.sa_key is loaded.sa_key


# --- secrets encryption at rest -------------------------------------------------------------

def test_encryption_key_and_config(prepared, rendered):
    key = prepared.material.encryption_key
    assert isinstance(key, bytes) and len(key) == 32
    assert base64.b64decode(prepared.state.encryption_key_path.read_bytes().strip()) == key

    path = rendered / "cp1/etc/kubernetes/encryption-config.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cfg = yaml.safe_load(path.read_text())
    assert cfg["apiVersion"] == "apiserver.config.k8s.io/v1" and cfg["kind"] == "EncryptionConfiguration"
    [res] = cfg["resources"]
    assert res["resources"] == ["secrets"]
    providers = res["providers"]
    # the first provider encrypts every write; identity last reads data written before encryption
    assert [list(p_) for p_ in providers] == [["secretbox"], ["identity"]]
    [k] = providers[0]["secretbox"]["keys"]
    assert base64.b64decode(k["secret"], validate=True) == key
    assert providers[-1] == {"identity": {}}
    unit = (rendered / "cp1/etc/systemd/system/kube-apiserver.service").read_text()
    assert "--encryption-provider-config=/etc/kubernetes/encryption-config.yaml" in unit


def test_changing_key_algorithm_on_existing_state_is_refused(doc, tmp_path):
    path = write_inventory(tmp_path, doc)
    api.prepare(path, tmp_path / "state")
    doc["spec"]["pki"]["keyAlgorithm"] = "rsa-2048"
    before = {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()}
    with pytest.raises(StateError, match="key is ecdsa-p256 but spec.pki.keyAlgorithm is rsa-2048"):
        api.prepare(write_inventory(tmp_path, doc), tmp_path / "state")
    # refused before anything was written
    assert {p: p.read_bytes() for p in before} == before


def test_changed_usages_are_reissued(prepared):
    from installer.core.pki.issue import why_reissue
    from installer.core.pki.specs import cert_specs
    spec = next(s for s in cert_specs(prepared.inventory) if s.name == "kube-proxy/node2")
    server_too = dataclasses.replace(spec, server=True)
    pair, ca = prepared.material.certs["kube-proxy/node2"], prepared.material.cas["ca"]
    assert why_reissue(spec, pair, ca, "ecdsa-p256", NOW) is None
    assert why_reissue(server_too, pair, ca, "ecdsa-p256", NOW) == "usages changed"


@pytest.mark.parametrize("name,content,message", [
    ("secrets/encryption.key", b"not-base64!!\n", "is not a base64 32-byte key"),
    ("secrets/encryption.key", b"c2hvcnQ=\n", "is not a base64 32-byte key"),
    ("secrets/tokens.yaml", b"node2: [unclosed\n", "tokens.yaml is corrupt"),
    ("pki/apiserver.crt", b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n", "is not valid PEM"),
])
def test_corrupt_state_is_a_clear_error(doc, tmp_path, name, content, message):
    path = write_inventory(tmp_path, doc)
    api.prepare(path, tmp_path / "state")
    (tmp_path / "state" / name).write_bytes(content)
    result = CliRunner().invoke(cli, ["plan", str(path), "--state", str(tmp_path / "state")])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and "PRIVATE KEY" not in result.output
