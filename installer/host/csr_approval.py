"""A join token is good for its own node only: the installer approves each node's first client
certificate request itself, instead of letting the controller-manager approve every request any
bootstrap token makes.

Upstream's TLS bootstrapping lets a group of bootstrap tokens auto-approve (``nodeclient``) a CSR
for *any* ``system:node:*`` name, so a leaked token of one worker could register a node under
another name until the token expires. Here no token may auto-approve. A pending kubelet client
CSR (signer ``kubernetes.io/kube-apiserver-client-kubelet``) made by ``system:bootstrap:<id>``
is approved only when ``<id>`` is the bootstrap token the installer issued to node N and the
request asks for exactly ``CN=system:node:N, O=system:nodes``, no SANs, client usages only;
every other request made with a bootstrap token is denied with the reason. Renewals (made by
``system:node:N`` itself) stay with the controller-manager (``selfnodeclient``, one binding per
node). ``judge`` is pure; ``approve_pending`` reads, decides and writes the approval.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.x509.oid import NameOID

from installer.core.errors import InstallerError

if TYPE_CHECKING:   # the calls load the HTTP client: a run that never reaches the API does not
    from installer.host.kube import ApiClient

KUBELET_CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
BOOTSTRAP_USER = "system:bootstrap:"
CLIENT_USAGES = frozenset({"digital signature", "key encipherment", "client auth"})
APPROVED_REASON = "HiddenplaneNodeToken"
DENIED_REASON = "HiddenplaneTokenMismatch"


class CSRError(InstallerError):
    pass


@dataclass(frozen=True)
class Verdict:
    csr: str
    node: str | None          # the node the token was issued to (None: not one of ours)
    approve: bool
    message: str


def _subject(pem: bytes) -> tuple[list[str], list[str], bool]:
    """(CNs, Os, has SANs) of a PEM certificate request."""
    req = x509.load_pem_x509_csr(pem)
    cns = [a.value for a in req.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = [a.value for a in req.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    try:
        req.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        sans = True
    except x509.ExtensionNotFound:
        sans = False
    return cns, orgs, sans


def judge(name: str, username: str, request_pem: bytes, usages: list[str], token_nodes: Mapping[str, str]
          ) -> Verdict | None:
    """What to do with one pending kubelet client CSR. None: not made with a bootstrap token
    (a renewal; not ours to decide). ``token_nodes``: bootstrap token id -> the node it was
    issued to."""
    if not username.startswith(BOOTSTRAP_USER):
        return None
    token_id = username[len(BOOTSTRAP_USER):]
    node = token_nodes.get(token_id)
    if node is None:
        return Verdict(name, None, False, f"bootstrap token {token_id} was not issued by hiddenplane to any node")
    try:
        cns, orgs, sans = _subject(request_pem)
    except ValueError:
        return Verdict(name, node, False, "the request is not a PEM certificate request")
    want = f"system:node:{node}"
    if cns != [want]:
        return Verdict(name, node, False, f"bootstrap token {token_id} belongs to node {node}: it may ask only for "
                       f"CN={want}, not {', '.join('CN=' + c for c in cns) or 'no CN'}")
    if orgs != ["system:nodes"]:
        return Verdict(name, node, False, f"O must be exactly system:nodes, not {orgs}")
    if sans:
        return Verdict(name, node, False, "a kubelet client certificate has no subject alternative names")
    if "client auth" not in usages or not set(usages) <= CLIENT_USAGES:
        return Verdict(name, node, False, f"usages must be client ones ({', '.join(sorted(CLIENT_USAGES))}), "
                       f"not {usages}")
    return Verdict(name, node, True, f"bootstrap token {token_id} is node {node}'s and the request is its own")


CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


def decided(csr: dict) -> bool:
    conditions = (csr.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Approved", "Denied", "Failed") for c in conditions)


def approve_pending(api: ApiClient, token_nodes: Mapping[str, str]) -> list[Verdict]:
    """Decide every pending kubelet client CSR made with a bootstrap token; returns the
    verdicts written (approved or denied), oldest first."""
    from installer.host.kube import ApiError, rest
    out = []
    for csr in sorted(_list(api), key=lambda c: c["metadata"].get("creationTimestamp") or ""):
        spec, name = csr.get("spec") or {}, csr["metadata"]["name"]
        if spec.get("signerName") != KUBELET_CLIENT_SIGNER or decided(csr):
            continue
        # spec.request: the PEM request, base64-encoded as in the API's JSON
        pem = base64.b64decode(spec.get("request") or "")
        verdict = judge(name, spec.get("username") or "", pem, list(spec.get("usages") or []), token_nodes)
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
        out.append(verdict)
    return out


def _list(api: ApiClient) -> list[dict]:
    from installer.host.kube import ApiError, rest
    try:
        return rest(api, "GET", CSRS, "list CSRs")["items"] or []
    except ApiError as e:
        raise CSRError(f"list CSRs: {e.status} {e.reason}") from None


def _signed_tokens(items: list[dict]) -> set[str]:
    """The bootstrap token ids with an approved and signed CSR among ``items``."""
    return {c["spec"]["username"][len(BOOTSTRAP_USER):] for c in items
            if ((c.get("spec") or {}).get("username") or "").startswith(BOOTSTRAP_USER)
            and (c.get("status") or {}).get("certificate")}


def approve_until_issued(api: ApiClient, token_nodes: Mapping[str, str], token_ids: list[str],
                         timeout: float, interval: float = 2.0) -> list[Verdict]:
    """Approve (``approve_pending``) until each of ``token_ids`` has a signed CSR; CSRError
    naming the nodes still waiting after ``timeout`` seconds."""
    verdicts: list[Verdict] = []
    deadline = time.monotonic() + timeout
    while True:
        verdicts += approve_pending(api, token_nodes)
        signed = _signed_tokens(_list(api))           # one list a round, for every token
        waiting = [token_nodes.get(t, t) for t in token_ids if t not in signed]
        if not waiting:
            return verdicts
        if time.monotonic() >= deadline:
            raise CSRError(f"no signed client certificate for {', '.join(waiting)} after {timeout:g}s "
                           "(is its kubelet running with its bootstrap kubeconfig?)")
        time.sleep(interval)
