"""What the installer approves of a bootstrap token's kubelet client CSR, decided on the bytes
alone (pure: no host, no API; installer/host/csr_approval.py reads, decides with these, writes).

The apiserver and the controller-manager's signer read a request with Go (``pem.Decode`` takes the
first block it finds, ``x509.ParseCertificateRequest`` strict DER); ``parse_request`` accepts only
the one form in which this reading and Go's cannot differ, and ``judge`` says approve, deny (with
the reason) or not ours to decide. ``parse_keys`` reads the kubelet's key files as a host prints
them; ``issued_problem`` checks the certificate the signer issued against what was approved.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from installer.core.render.worker import KUBELET_DIR

KUBELET_CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
BOOTSTRAP_USER = "system:bootstrap:"
CLIENT_USAGES = frozenset({"digital signature", "key encipherment", "client auth"})

# Where a bootstrapping kubelet keeps the key its CSR is made with (k8s.io/kubernetes
# pkg/kubelet/certificate/bootstrap: ``kubelet-client.key.tmp`` until the certificate comes; a
# key in the store's current file is used instead when one is there)
KUBELET_KEY_FILES = (f"{KUBELET_DIR}/pki/kubelet-client.key.tmp", f"{KUBELET_DIR}/pki/kubelet-client-current.pem")

_BEGIN = b"-----BEGIN CERTIFICATE REQUEST-----\n"
_END = b"\n-----END CERTIFICATE REQUEST-----"
_BASE64_LINE = re.compile(rb"[A-Za-z0-9+/]{1,64}={0,2}")
_WHITESPACE = b" \t\r\n"

_BEGIN = b"-----BEGIN CERTIFICATE REQUEST-----\n"
_END = b"\n-----END CERTIFICATE REQUEST-----"
_BASE64_LINE = re.compile(rb"[A-Za-z0-9+/]{1,64}={0,2}")
_WHITESPACE = b" \t\r\n"


@dataclass(frozen=True)
class Verdict:
    csr: str
    node: str | None          # the node the token was issued to (None: not one of ours)
    approve: bool
    message: str
    token: str = ""           # the bootstrap token id that made the request
    key: bytes = b""          # the request's public key (DER SubjectPublicKeyInfo), when parsed


def parse_request(data: bytes) -> x509.CertificateSigningRequest:
    """The certificate request in ``data``, accepted only in the one form on which Go's
    ``pem.Decode`` + ``x509.ParseCertificateRequest`` (the apiserver, the signer) and this parser
    cannot disagree: one ``CERTIFICATE REQUEST`` block at the very start, no headers, base64
    lines of 64 characters, nothing after it but whitespace, DER that re-encodes to the same
    bytes, a valid signature. ValueError naming what is wrong otherwise."""
    if not data.startswith(_BEGIN):
        raise ValueError("the request does not start with -----BEGIN CERTIFICATE REQUEST-----")
    end = data.find(_END)
    if end < 0:
        raise ValueError("the request has no -----END CERTIFICATE REQUEST----- line")
    after = data[end + len(_END):]
    if after.strip(_WHITESPACE):
        raise ValueError("bytes after the PEM block (only whitespace may follow it)")
    lines = data[len(_BEGIN):end].split(b"\n")
    if data.count(b"-----BEGIN") != 1 or b"-----END" in data[len(_BEGIN):end]:
        raise ValueError("more than one PEM block")
    for line in lines:
        if not _BASE64_LINE.fullmatch(line):
            raise ValueError("the PEM block holds a line that is not base64 (headers, spaces, CR, long lines)")
    try:
        der = base64.b64decode(b"".join(lines), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the PEM block is not valid base64") from None
    try:
        req = x509.load_der_x509_csr(der)
        if req.public_bytes(serialization.Encoding.DER) != der:
            raise ValueError("the request's DER does not re-encode to the same bytes")
        if req.public_bytes(serialization.Encoding.PEM).rstrip(b"\n") != data[:end + len(_END)]:
            raise ValueError("the PEM block is not in canonical form (64-character lines)")
        # cryptography decodes lazily: everything judge reads is read here, so that a part it
        # cannot read is this ValueError, never another exception later
        if subject_names(req.subject) is None:
            raise ValueError("the subject holds a multi-valued RDN or a value that is not a string")
        if not _go_strings(req.subject.public_bytes()):
            raise ValueError("a subject value is not a UTF8String or a valid PrintableString (what Go writes "
                             "and reads alike)")
        public_key_der(req.public_key())
        _has_extensions(req)
        valid = req.is_signature_valid
    except CRYPTO_ERRORS as e:
        raise ValueError(f"the PEM block is not a certificate request this installer can read ({type(e).__name__})"
                         ) from None
    if not valid:
        raise ValueError("the request's signature is not valid")
    return req


# what cryptography raises on DER it parses but cannot use (a version-1 request, an unknown key
# algorithm, a subject value that is not valid UTF-8 or not a string at all)
CRYPTO_ERRORS = (ValueError, TypeError, UnsupportedAlgorithm, x509.InvalidVersion, x509.DuplicateExtension,
                 x509.UnsupportedGeneralNameType)


def public_key_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def request_key(req: x509.CertificateSigningRequest) -> bytes:
    try:
        return public_key_der(req.public_key())
    except CRYPTO_ERRORS:
        return b""


_UTF8, _PRINTABLE = 0x0C, 0x13
_PRINTABLE_CHARS = re.compile(rb"[A-Za-z0-9 '()+,\-./:=?]*")


def _tlv(b: bytes, i: int) -> tuple[int, bytes, int]:
    """(tag, contents, next offset) of the DER element at ``i``."""
    tag, n = b[i], b[i + 1]
    i += 2
    if n & 0x80:
        width = n & 0x7F
        n, i = int.from_bytes(b[i:i + width], "big"), i + width
    if i + n > len(b):
        raise ValueError("truncated DER")
    return tag, b[i:i + n], i + n


def _go_strings(subject_der: bytes) -> bool:
    """Whether every attribute value of the subject (DER, as cryptography re-encodes it with the
    request's own string types) is a UTF8String or a PrintableString of printable characters:
    Go's asn1 rejects, for instance, a NumericString holding letters, which cryptography reads."""
    try:
        _, seq, _ = _tlv(subject_der, 0)
        i = 0
        while i < len(seq):
            _, rdn, i = _tlv(seq, i)
            j = 0
            while j < len(rdn):
                _, atv, j = _tlv(rdn, j)
                _, _, k = _tlv(atv, 0)
                tag, value, _ = _tlv(atv, k)
                if tag not in (_UTF8, _PRINTABLE) or (tag == _PRINTABLE and not _PRINTABLE_CHARS.fullmatch(value)):
                    return False
    except (IndexError, ValueError):
        return False
    return True


def subject_names(name: x509.Name) -> list[tuple[x509.ObjectIdentifier, str]] | None:
    """(type, value) of each RDN of ``name`` in order; None when an RDN holds more than one
    attribute or a value that is not a string."""
    out = []
    for rdn in name.rdns:
        attrs = list(rdn)
        if len(attrs) != 1 or not isinstance(attrs[0].value, str):
            return None
        out.append((attrs[0].oid, attrs[0].value))
    return out


def _subject(req: x509.CertificateSigningRequest | x509.Certificate) -> tuple[list[str], list[str]]:
    cns = [str(a.value) for a in req.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = [str(a.value) for a in req.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    return cns, orgs


def _has_extensions(req: x509.CertificateSigningRequest) -> bool:
    return len(req.extensions) > 0


def judge(name: str, username: str, request_pem: bytes, usages: list[str], token_nodes: Mapping[str, str],
          kubelet_keys: Mapping[str, Collection[bytes]] | None = None, spent: Mapping[str, str] | None = None
          ) -> Verdict | None:
    """What to do with one pending kubelet client CSR. None: not ours to decide now (a renewal,
    not made with a bootstrap token; or a request of a node whose kubelet key this run has not
    read). ``token_nodes``: bootstrap token id -> the node it was issued to; ``kubelet_keys``:
    node -> the public keys (DER) its kubelet may make its request with; ``spent``: token id ->
    the CSR already approved for it."""
    if not username.startswith(BOOTSTRAP_USER):
        return None
    token_id = username[len(BOOTSTRAP_USER):]
    node = token_nodes.get(token_id)

    def deny(why: str, key: bytes = b"") -> Verdict:
        return Verdict(name, node, False, why, token_id, key)
    if node is None:
        return deny(f"bootstrap token {token_id} was not issued by hiddenplane to any node")
    try:
        req = parse_request(request_pem)
    except ValueError as e:
        return deny(f"not exactly one PEM certificate request: {e}")
    key = request_key(req)
    cns, orgs = _subject(req)
    want = f"system:node:{node}"
    if cns != [want]:
        return deny(f"bootstrap token {token_id} belongs to node {node}: it may ask only for CN={want}, not "
                    f"{', '.join('CN=' + c for c in cns) or 'no CN'}", key)
    if orgs != ["system:nodes"]:
        return deny(f"O must be exactly system:nodes, not {orgs}", key)
    if len(subject_names(req.subject) or ()) != 2:
        return deny(f"the subject must be exactly O=system:nodes, CN={want}, nothing else: not "
                    f"{req.subject.rfc4514_string()}", key)
    if _has_extensions(req):
        return deny("a kubelet client certificate request carries no extensions (no subject alternative names)", key)
    if "client auth" not in usages or not set(usages) <= CLIENT_USAGES:
        return deny(f"usages must be client ones ({', '.join(sorted(CLIENT_USAGES))}), not {usages}", key)
    if spent and token_id in spent:
        return deny(f"bootstrap token {token_id} of node {node} already has its certificate (CSR {spent[token_id]}): "
                    "one certificate per token", key)
    if kubelet_keys is None or node not in kubelet_keys:
        return None
    if key not in kubelet_keys[node]:
        return deny(f"the request's key is not the key {node}'s kubelet holds: made by someone else with "
                    f"bootstrap token {token_id}", key)
    return Verdict(name, node, True, f"bootstrap token {token_id} is node {node}'s and the request is its "
                   "kubelet's own", token_id, key)


def keys_script() -> str:
    """Print the private keys a bootstrapping kubelet may use (nothing when there is none)."""
    return "for f in " + " ".join(KUBELET_KEY_FILES) + '; do [ -f "$f" ] && cat "$f"; done; true'


_KEY_BLOCK = re.compile(rb"-----BEGIN ((?:EC |RSA )?PRIVATE KEY)-----\n.*?\n-----END \1-----", re.S)


def parse_keys(out: bytes) -> frozenset[bytes]:
    """The public keys (DER) of the private keys in ``out``; unreadable blocks are skipped."""
    keys = set()
    for m in _KEY_BLOCK.finditer(out):
        try:
            keys.add(public_key_der(serialization.load_pem_private_key(m.group(0), password=None).public_key()))
        except (ValueError, TypeError):
            continue
    return frozenset(keys)


def issued_problem(certificate_pem: bytes, node: str, key: bytes) -> str | None:
    """Why the certificate a signer issued for ``node``'s approved request is not what was
    approved (None when it is): its subject must be exactly ``CN=system:node:<node>,
    O=system:nodes`` and its key the request's. The kubelet takes the first certificate."""
    try:
        cert = x509.load_pem_x509_certificates(certificate_pem)[0]
        cns, orgs = _subject(cert)
        issued_key = public_key_der(cert.public_key())
    except (*CRYPTO_ERRORS, IndexError):
        return "the issued certificate is not one this installer can read"
    if cns != [f"system:node:{node}"] or orgs != ["system:nodes"]:
        return f"it was issued for {cert.subject.rfc4514_string()}"
    if key and issued_key != key:
        return "it was issued for another key than the request's"
    return None


def named_node(certificate_pem: bytes) -> str | None:
    try:
        cns, _ = _subject(x509.load_pem_x509_certificates(certificate_pem)[0])
    except (*CRYPTO_ERRORS, IndexError):
        return None
    return cns[0][len("system:node:"):] if len(cns) == 1 and cns[0].startswith("system:node:") else None
