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
(``selfnodeclient``, one binding per node). The decisions on the bytes are pure
(installer/core/csr_rules.py: ``parse_request``, ``judge``, ``parse_keys``, ``issued_problem``);
this module reads, decides with them and writes.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from installer.core.csr_rules import (
    BOOTSTRAP_USER,
    KUBELET_CLIENT_SIGNER,
    Verdict,
    issued_problem,
    judge,
    keys_script,
    named_node,
    parse_keys,
)
from installer.core.errors import InstallerError

if TYPE_CHECKING:   # the calls load the HTTP client: a run that never reaches the API does not
    from installer.host.kube import ApiClient
    from installer.host.ssh import Remote

APPROVED_REASON = "HiddenplaneNodeToken"
DENIED_REASON = "HiddenplaneTokenMismatch"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


class CSRError(InstallerError):
    pass


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
        other = named_node(pem)
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
