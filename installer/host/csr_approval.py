"""A join token is good for its own node only, and for one certificate: the installer approves
each node's first client certificate request itself, instead of letting the controller-manager
approve every request any bootstrap token makes.

Upstream's TLS bootstrapping lets a group of bootstrap tokens auto-approve (``nodeclient``) a CSR
for *any* ``system:node:*`` name, so a leaked token of one worker could register a node under
another name until the token expires. Here no token may auto-approve. A pending kubelet client
CSR (signer ``kubernetes.io/kube-apiserver-client-kubelet``) made by ``system:bootstrap:<id>``
is approved only when all of these hold:

- ``<id>`` is the bootstrap token the installer issued to node N, and no request made with it
  was approved before (one certificate per token);
- the request is exactly what the apiserver and the signer will read (``parse_request``): the
  apiserver and the controller-manager take the *first* PEM block Go's ``encoding/pem`` finds,
  and Python's parser may find another one in the same bytes (seen: ``x-----BEGIN ...`` hides a
  block from Go but not from Python), so anything but one canonical ``CERTIFICATE REQUEST`` block
  is denied;
- it asks for exactly ``CN=system:node:N, O=system:nodes``, no SANs, client usages only;
- its public key is the key N's kubelet holds (read over SSH from its cert dir, where the
  kubelet keeps it while it waits): a thief racing the kubelet with the same token is denied.

Every other request made with a bootstrap token is denied with the reason; a request for a node
whose kubelet key the run cannot read (a host outside the run) is left pending. After an
approval the issued certificate is read back (``check_issued``): a subject that is not the
node's deletes the CSR (and the Node it names, unless the inventory has that host) and stops the
run naming the token. Renewals (made by ``system:node:N`` itself) stay with the controller-manager
(``selfnodeclient``, one binding per node). ``judge`` and the parsers are pure; ``approve_pending``
reads, decides and writes.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from installer.core.errors import InstallerError
from installer.core.render.worker import KUBELET_DIR

if TYPE_CHECKING:   # the calls load the HTTP client: a run that never reaches the API does not
    from installer.host.kube import ApiClient
    from installer.host.ssh import Remote

KUBELET_CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
BOOTSTRAP_USER = "system:bootstrap:"
CLIENT_USAGES = frozenset({"digital signature", "key encipherment", "client auth"})
APPROVED_REASON = "HiddenplaneNodeToken"
DENIED_REASON = "HiddenplaneTokenMismatch"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"

# Where a bootstrapping kubelet keeps the key its CSR is made with (k8s.io/kubernetes
# pkg/kubelet/certificate/bootstrap: ``kubelet-client.key.tmp`` until the certificate comes; a
# key in the store's current file is used instead when one is there)
KUBELET_KEY_FILES = (f"{KUBELET_DIR}/pki/kubelet-client.key.tmp", f"{KUBELET_DIR}/pki/kubelet-client-current.pem")

_BEGIN = b"-----BEGIN CERTIFICATE REQUEST-----\n"
_END = b"\n-----END CERTIFICATE REQUEST-----"
_BASE64_LINE = re.compile(rb"[A-Za-z0-9+/]{1,64}={0,2}")
_WHITESPACE = b" \t\r\n"


class CSRError(InstallerError):
    pass


@dataclass(frozen=True)
class Verdict:
    csr: str
    node: str | None          # the node the token was issued to (None: not one of ours)
    approve: bool
    message: str
    token: str = ""           # the bootstrap token id that made the request
    key: bytes = b""          # the request's public key (DER SubjectPublicKeyInfo), when parsed


# --- what the signer will read ----------------------------------------------------------------

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


# --- the kubelet's key, read on its host -------------------------------------------------------

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


def read_kubelet_keys(remote: Remote) -> frozenset[bytes]:
    """The public keys ``remote``'s kubelet may make its client CSR with. The private keys pass
    through this process's memory only (never logged, never written)."""
    return parse_keys(remote.run(keys_script(), what="read the kubelet's bootstrap key").raw)


# --- reading, deciding, writing -----------------------------------------------------------------

def decided(csr: dict) -> bool:
    conditions = (csr.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Approved", "Denied", "Failed") for c in conditions)


def _approved(csr: dict) -> bool:
    return any(c.get("type") == "Approved" for c in (csr.get("status") or {}).get("conditions") or [])


def bootstrap_token(csr: dict) -> str | None:
    user = (csr.get("spec") or {}).get("username") or ""
    return user[len(BOOTSTRAP_USER):] if user.startswith(BOOTSTRAP_USER) else None


def spent_tokens(items: list[dict]) -> dict[str, str]:
    """token id -> the CSR approved for it, among ``items``."""
    return {t: c["metadata"]["name"] for c in items
            if (t := bootstrap_token(c)) and _approved(c)}


KeysOf = Callable[[set[str]], Mapping[str, Collection[bytes]]]


def approve_pending(api: ApiClient, token_nodes: Mapping[str, str], keys_of: KeysOf | None = None) -> list[Verdict]:
    """Decide every pending kubelet client CSR made with a bootstrap token; returns the
    verdicts written (approved or denied), oldest first. ``keys_of(nodes)`` reads the kubelet
    keys of those nodes it can (called after the list, once, only when a request waits: the
    kubelet writes its key before it makes its request)."""
    from installer.host.kube import ApiError, rest
    items = sorted(_list(api), key=lambda c: c["metadata"].get("creationTimestamp") or "")
    spent = spent_tokens(items)
    waiting = [c for c in items if (c.get("spec") or {}).get("signerName") == KUBELET_CLIENT_SIGNER
               and not decided(c) and bootstrap_token(c) is not None]
    nodes = {n for c in waiting if (n := token_nodes.get(bootstrap_token(c) or ""))}
    keys = dict(keys_of(nodes)) if keys_of is not None and nodes else {}
    out = []
    for csr in waiting:
        spec, name = csr.get("spec") or {}, csr["metadata"]["name"]
        # spec.request: the PEM request, base64-encoded as in the API's JSON
        try:
            pem = base64.b64decode(spec.get("request") or "", validate=True)
        except (binascii.Error, ValueError):
            pem = b""
        verdict = judge(name, spec.get("username") or "", pem, list(spec.get("usages") or []), token_nodes,
                        keys, spent)
        if verdict is None:
            continue
        condition = {"type": "Approved" if verdict.approve else "Denied", "status": "True",
                     "reason": APPROVED_REASON if verdict.approve else DENIED_REASON, "message": verdict.message}
        status = csr.setdefault("status", {})
        status["conditions"] = [*(status.get("conditions") or []), condition]
        try:
            rest(api, "PUT", f"{CSRS}/{name}/approval", f"CSR {name}", csr)
        except ApiError as e:
            if e.status == 409:          # changed meanwhile (decided by someone else): next round
                continue
            raise CSRError(f"CSR {name}: approval refused: {e.status} {e.reason}") from None
        if verdict.approve:
            spent[verdict.token] = name
        out.append(verdict)
    return out


def issued_tokens(api: ApiClient) -> set[str]:
    """The bootstrap token ids a certificate was issued for (the controller-manager deletes
    issued CSRs after an hour: a registered Node is the lasting sign)."""
    return {t for c in _list(api) if (t := bootstrap_token(c)) and (c.get("status") or {}).get("certificate")}


def delete_token_secrets(api: ApiClient, token_nodes: Mapping[str, str]) -> list[str]:
    """Delete the bootstrap token Secrets of ``token_nodes`` (token id -> node) that exist: one
    list of token Secrets, one DELETE for each found. Returns the nodes whose Secret went."""
    from installer.host.kube import TOKEN_NAMESPACE, ApiError, found, rest
    secrets = f"/api/v1/namespaces/{TOKEN_NAMESPACE}/secrets"
    try:
        items = rest(api, "GET", secrets, "list bootstrap token Secrets",
                     query={"fieldSelector": "type=bootstrap.kubernetes.io/token"})["items"] or []
    except ApiError as e:
        raise CSRError(f"list bootstrap token Secrets: {e.status} {e.reason}") from None
    there = {s["metadata"]["name"] for s in items}
    return [token_nodes[t] for t in sorted(token_nodes, key=lambda t: token_nodes[t])
            if f"bootstrap-token-{t}" in there
            and found(api, "DELETE", f"{secrets}/bootstrap-token-{t}", f"Secret/bootstrap-token-{t}", "delete")]


def _list(api: ApiClient) -> list[dict]:
    from installer.host.kube import ApiError, rest
    try:
        return rest(api, "GET", CSRS, "list CSRs")["items"] or []
    except ApiError as e:
        raise CSRError(f"list CSRs: {e.status} {e.reason}") from None


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


def _named_node(certificate_pem: bytes) -> str | None:
    try:
        cns, _ = _subject(x509.load_pem_x509_certificates(certificate_pem)[0])
    except (*CRYPTO_ERRORS, IndexError):
        return None
    return cns[0][len("system:node:"):] if len(cns) == 1 and cns[0].startswith("system:node:") else None


def check_issued(api: ApiClient, approved: list[Verdict], keep_nodes: Collection[str] = ()) -> list[Verdict]:
    """Read back the certificate issued for each approved request; returns those not issued
    yet. A certificate that is not what was approved: the CSR is deleted, and the Node its
    subject names (unless it is one of ``keep_nodes``, the inventory's hosts), then CSRError
    naming the token."""
    from installer.host.kube import NODES, ApiError, found, rest
    left = []
    for v in approved:
        try:
            csr = rest(api, "GET", f"{CSRS}/{v.csr}", f"CSR {v.csr}")
        except ApiError as e:
            if e.status == 404:  # deleted (garbage-collected once old): nothing issued to check
                continue
            raise CSRError(f"CSR {v.csr}: read refused: {e.status} {e.reason}") from None
        raw = (csr.get("status") or {}).get("certificate")
        if not raw:
            left.append(v)
            continue
        try:
            pem = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            pem = b""
        problem = issued_problem(pem, v.node or "", v.key)
        if problem is None:
            continue
        done = []
        other = _named_node(pem)
        if other and other != v.node and other not in keep_nodes and \
                found(api, "DELETE", f"{NODES}/{other}", f"Node/{other}", "delete"):
            done.append(f"deleted Node {other}")
        if found(api, "DELETE", f"{CSRS}/{v.csr}", f"CSR {v.csr}", "delete"):
            done.append(f"deleted CSR {v.csr}")
        raise CSRError(f"CSR {v.csr}, approved for bootstrap token {v.token} of node {v.node}: {problem}; "
                       f"{', '.join(done) or 'nothing deleted'}. That certificate stays valid until it expires "
                       "(spec.pki.kubeletClientCertHours): treat the token as stolen")
    return left


def approve_until_issued(api: ApiClient, token_nodes: Mapping[str, str], token_ids: list[str],
                         timeout: float, keys_of: KeysOf | None = None, interval: float = 2.0,
                         keep_nodes: Collection[str] = ()) -> list[Verdict]:
    """Approve (``approve_pending``) until each of ``token_ids`` has a signed CSR that is what
    was approved (``check_issued``); CSRError naming the nodes still waiting after ``timeout``
    seconds."""
    verdicts: list[Verdict] = []
    approved: list[Verdict] = []
    deadline = time.monotonic() + timeout
    while True:
        new = approve_pending(api, token_nodes, keys_of)
        verdicts += new
        approved = check_issued(api, approved + [v for v in new if v.approve], keep_nodes)
        items = _list(api)                 # one list a round, for every token
        signed = {t for c in items if (t := bootstrap_token(c)) and (c.get("status") or {}).get("certificate")}
        waiting = [token_nodes.get(t, t) for t in token_ids if t not in signed]
        if not waiting and not approved:
            return verdicts
        if time.monotonic() >= deadline:
            raise CSRError(f"no signed client certificate for {', '.join(waiting) or 'the approved requests'} after "
                           f"{timeout:g}s (is its kubelet running with its bootstrap kubeconfig?)")
        time.sleep(interval)
