"""In-memory key and certificate generation. Nothing here touches the disk."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from installer.core.pki.specs import CertSpec

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class Pair:
    cert: x509.Certificate
    key: PrivateKey


def new_key(algorithm: str) -> PrivateKey:
    if algorithm == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if algorithm == "rsa-2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"unknown key algorithm {algorithm!r}")


def key_algorithm(key: PrivateKey) -> str:
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1":
        return "ecdsa-p256"
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size == 2048:
        return "rsa-2048"
    return "other"


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_usage(key: PrivateKey, ca: bool) -> x509.KeyUsage:
    rsa_key = isinstance(key, rsa.RSAPrivateKey)
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False,
        key_encipherment=rsa_key and not ca, data_encipherment=False, key_agreement=False,
        key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False)


def make_ca(cn: str, key: PrivateKey, days: int, now: dt.datetime) -> x509.Certificate:
    name = _name(cn)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(key, ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )


def issue(spec: CertSpec, key: PrivateKey, ca: Pair, days: int, now: dt.datetime) -> x509.Certificate:
    not_after = min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc)
    ekus = ([ExtendedKeyUsageOID.SERVER_AUTH] if spec.server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if spec.client else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(spec.cn, spec.orgs))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(key, ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if spec.sans:
        names = [x509.DNSName(d) for d in sorted(spec.dns_names)]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in sorted(spec.ips)]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca.key, hashes.SHA256())


# --- inspection ----------------------------------------------------------------------------

def sans_of(cert: x509.Certificate) -> frozenset[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(ext.get_values_for_type(x509.DNSName)) | frozenset(
        str(i) for i in ext.get_values_for_type(x509.IPAddress))


def usages_of(cert: x509.Certificate) -> tuple[bool, bool]:
    """(serverAuth, clientAuth) from the extended key usage."""
    try:
        ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return (False, False)
    return (ExtendedKeyUsageOID.SERVER_AUTH in ekus, ExtendedKeyUsageOID.CLIENT_AUTH in ekus)


def subject_of(cert: x509.Certificate) -> tuple[str, tuple[str, ...]]:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    return (cn[0].value if cn else ""), tuple(o.value for o in orgs)


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    if cert.issuer != ca.subject:
        return False
    pub = ca.public_key()
    try:
        if isinstance(pub, rsa.RSAPublicKey):
            pub.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                       cert.signature_hash_algorithm)
        else:
            pub.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    except InvalidSignature:
        return False
    return True


def key_matches(cert: x509.Certificate, key: PrivateKey) -> bool:
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return cert.public_key().public_bytes(*der) == key.public_key().public_bytes(*der)


def why_reissue(spec: CertSpec, pair: Pair, ca: Pair, algorithm: str, now: dt.datetime) -> str | None:
    """Why an existing certificate no longer fits its spec, or None when it can be kept."""
    if key_algorithm(pair.key) != algorithm:
        return "key algorithm changed"
    if not key_matches(pair.cert, pair.key):
        return "key does not match certificate"
    if not signed_by(pair.cert, ca.cert):
        return "not signed by the current CA"
    if subject_of(pair.cert) != (spec.cn, spec.orgs):
        return "subject changed"
    if sans_of(pair.cert) != spec.sans:
        return "SANs changed"
    if usages_of(pair.cert) != (spec.server, spec.client):
        return "usages changed"
    if pair.cert.not_valid_after_utc <= now:
        return "expired"
    return None


# --- PEM -----------------------------------------------------------------------------------

def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def public_pem(key: PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)


def load_cert(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


def load_key(data: bytes) -> PrivateKey:
    # Our own keys from the 0700 state directory: the RSA consistency check costs ~30 ms a key
    # and re-runs must stay fast; a mismatched key is still caught by key_matches().
    return serialization.load_pem_private_key(data, password=None, unsafe_skip_rsa_key_validation=True)
