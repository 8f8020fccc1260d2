"""The cluster side of node day-2 operations, through the Kubernetes API (``kube.rest``: by path,
JSON in and out).

Cordon and drain (evictions, so PodDisruptionBudgets are respected; a blocked eviction is retried
until the timeout), delete the Node, the node's bootstrap token Secrets, its renewal and kube-proxy
bindings and its pending CSRs, read the serials of client certificates issued to it, and keep the
revoked-nodes admission policy current (its names only grow: read from the cluster and merged).
Every call goes through ``kube.rest`` (timeouts; a transport failure is a KubeError naming the
object).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Callable

from cryptography import x509
from cryptography.x509.oid import NameOID

from installer.core.render.manifests import kube_proxy_binding, node_renewal_binding
from installer.core.render.revocation import POLICY, identity, policy_names, policy_objects
from installer.host import kube
from installer.host.csr_approval import CSRS, decided
from installer.host.kube import (
    NODES,
    STRATEGIC_MERGE,
    TOKEN_NAMESPACE,
    ApiClient,
    ApiError,
    KubeError,
    found,
    rest,
    status_message,
)
from installer.host.kube_objects import apply_objects

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
NODE_LABEL = "hiddenplane.io/node"


class DrainError(KubeError):
    """Pods are still on the node when the drain's time is up."""


# --- cordon and drain -------------------------------------------------------------------------

def cordon(api: ApiClient, name: str) -> bool:
    """Mark the Node unschedulable; False when there is no such Node."""
    return found(api, "PATCH", f"{NODES}/{name}", f"Node/{name}", "cordon", {"spec": {"unschedulable": True}},
                 content_type=STRATEGIC_MERGE)


def uncordon(api: ApiClient, name: str) -> bool:
    """Mark the Node schedulable again; False when there is no such Node."""
    return found(api, "PATCH", f"{NODES}/{name}", f"Node/{name}", "uncordon", {"spec": {"unschedulable": False}},
                 content_type=STRATEGIC_MERGE)


@dataclass(frozen=True)
class NodeState:
    ready: bool
    kubelet: str                  # the version the kubelet reports (status.nodeInfo.kubeletVersion)
    cordoned: bool


def node_states(api: ApiClient) -> dict[str, NodeState]:
    """Every registered Node: Ready, its kubelet's version, whether it is cordoned."""
    return {name: NodeState(kube.ready(n)[0],
                            ((n.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion") or "",
                            bool((n.get("spec") or {}).get("unschedulable")))
            for name, n in kube.list_nodes(api).items()}


LEADER_LEASES = ("kube-controller-manager", "kube-scheduler")      # in kube-system


def lease_holders(api: ApiClient) -> dict[str, str | None]:
    """Who holds the controller-manager's and the scheduler's leader Lease (identity
    ``<host>_<uuid of the process>``); None for a Lease not there (yet)."""
    out = {}
    for name in LEADER_LEASES:
        try:
            lease = rest(api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/{name}",
                         f"Lease/{name}")
            out[name] = (lease.get("spec") or {}).get("holderIdentity")
        except ApiError as e:
            if e.status != 404:
                raise KubeError(f"Lease kube-system/{name}: {status_message(e)}") from None
            out[name] = None
    return out


def _pod_path(pod: dict) -> str:
    return f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"


def _key(pod: dict) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _skipped(pod: dict) -> str | None:
    """Why ``pod`` is not evicted (kubectl drain's rules): mirror pods belong to the kubelet's
    static manifests, DaemonSet pods would be re-created on the node at once."""
    meta = pod["metadata"]
    if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
        return "mirror pod"
    if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
        return "DaemonSet"
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "finished"
    return None


def pods_on(api: ApiClient, name: str) -> list[dict]:
    try:
        return rest(api, "GET", "/api/v1/pods", f"pods on {name}", query={"fieldSelector": f"spec.nodeName={name}"}
                    )["items"] or []
    except ApiError as e:
        raise KubeError(f"list the pods on {name}: {status_message(e)}") from None


def _named(ref: dict | None, field: str = "name") -> str | None:
    return (ref or {}).get(field)


def _referenced(pod: dict) -> set[tuple[str, str, str]]:
    """(resource, namespace, name) of the Secrets and ConfigMaps a pod mounts or reads: what the
    Node authorizer lets its node read while the pod is bound to it."""
    ns, spec = pod["metadata"]["namespace"], pod.get("spec") or {}
    refs: list[tuple[str, str | None]] = []
    for v in spec.get("volumes") or []:
        refs += [("secrets", _named(v.get("secret"), "secretName")), ("configmaps", _named(v.get("configMap")))]
        for src in (v.get("projected") or {}).get("sources") or []:
            refs += [("secrets", _named(src.get("secret"))), ("configmaps", _named(src.get("configMap")))]
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for e in c.get("envFrom") or []:
            refs += [("secrets", _named(e.get("secretRef"))), ("configmaps", _named(e.get("configMapRef")))]
        for e in c.get("env") or []:
            ref = e.get("valueFrom") or {}
            refs += [("secrets", _named(ref.get("secretKeyRef"))), ("configmaps", _named(ref.get("configMapKeyRef")))]
    refs += [("secrets", _named(s)) for s in spec.get("imagePullSecrets") or []]
    return {(resource, ns, name) for resource, name in refs if name}


def may_read(api: ApiClient, node: str, resource: str, namespace: str, name: str) -> bool:
    """Whether the apiserver's authorizers (the Node authorizer among them) let ``system:node:
    <node>`` get that object: a SubjectAccessReview."""
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": identity(node), "groups": ["system:nodes", "system:authenticated"],
                     "resourceAttributes": {"verb": "get", "resource": resource, "namespace": namespace,
                                            "name": name}}}
    what = f"SubjectAccessReview for {identity(node)}"
    try:
        r = rest(api, "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", what, body)
    except ApiError as e:
        raise KubeError(f"{what}: {status_message(e)}") from None
    return bool((r.get("status") or {}).get("allowed"))


def delete_pods_and_their_reads(api: ApiClient, node: str, timeout: float, interval: float = 0.5
                                ) -> tuple[list[str], float]:
    """Force-delete every pod bound to ``node`` (its kubelet is not trusted to stop them) and
    wait until the identity may read none of the Secrets and ConfigMaps they used: while a pod
    is bound to a node, the Node authorizer lets that node read them, and the pod garbage
    collector deletes a deleted Node's pods only after 40 s or more. Returns the deleted pods
    and the seconds until nothing was readable; KubeError naming what still is after ``timeout``."""
    pods = pods_on(api, node)
    reads = set().union(*(_referenced(p) for p in pods)) if pods else set()
    deleted = []
    for p in pods:
        if found(api, "DELETE", _pod_path(p), f"Pod/{_key(p)}", "delete", query={"gracePeriodSeconds": "0"}):
            deleted.append(_key(p))
    start = time.monotonic()
    while True:
        left = sorted(f"{r[:-1]}/{ns}/{n}" for r, ns, n in reads if may_read(api, node, r, ns, n))
        if not left:
            return deleted, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise KubeError(f"{identity(node)} may still read {', '.join(left)} after {timeout:g}s")
        time.sleep(interval)


@dataclass
class DrainResult:
    evicted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def drain_plan(api: ApiClient, name: str) -> DrainResult:
    """What ``drain`` would do now, read-only: the pods it would evict (``evicted``) and those it
    leaves (``skipped``, with why)."""
    result = DrainResult()
    for pod in pods_on(api, name):
        key, why = _key(pod), _skipped(pod)
        if why:
            result.skipped.append(f"{key} ({why})")
        else:
            result.evicted.append(key)
    return result


def drain(api: ApiClient, name: str, timeout: float, *, log: Callable[[str], None] = print,
          interval: float = 5.0) -> DrainResult:
    """Evict every pod on ``name`` except mirror and DaemonSet pods, then wait until they are
    gone. An eviction a PodDisruptionBudget refuses (429) is retried every ``interval`` s; when
    ``timeout`` s are up with pods left, DrainError names them and why they stayed."""
    deadline = time.monotonic() + timeout
    result = DrainResult()
    waiting: dict[str, str] = {}            # ns/name -> why it is still there
    while True:
        pending = []
        for pod in pods_on(api, name):
            key = _key(pod)
            why = _skipped(pod)
            if why:
                if f"{key} ({why})" not in result.skipped:
                    result.skipped.append(f"{key} ({why})")
                continue
            pending.append(pod)
            if key in result.evicted:
                waiting.setdefault(key, "terminating")
                continue
            meta = pod["metadata"]
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": meta["name"], "namespace": meta["namespace"]}}
            try:
                rest(api, "POST", f"{_pod_path(pod)}/eviction", f"Pod/{key}", body)
                result.evicted.append(key)
                waiting[key] = "terminating"
                log(f"{name}: evicted {key}")
            except ApiError as e:
                if e.status == 404:          # gone already
                    continue
                if e.status == 429:
                    waiting[key] = f"eviction refused: {status_message(e)}"
                    continue
                if e.status == 403 and "NamespaceTerminating" in kube.causes(e):
                    # no eviction in a namespace being deleted: the pod goes with it (as kubectl drain)
                    result.evicted.append(key)
                    waiting[key] = "terminating (its namespace is being deleted)"
                    continue
                raise KubeError(f"Pod/{key}: eviction refused: {status_message(e)}") from None
        if not pending:
            return result
        if time.monotonic() >= deadline:
            raise DrainError(f"{name}: drain timed out after {timeout:g} s with {len(pending)} pod(s) left: "
                             + "; ".join(f"{k}: {w}" for k, w in sorted(waiting.items())
                                         if k in {_key(p) for p in pending}))
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


# --- deleting what let the node in ------------------------------------------------------------

def delete_node(api: ApiClient, name: str) -> bool:
    return found(api, "DELETE", f"{NODES}/{name}", f"Node/{name}", "delete")


def delete_tokens(api: ApiClient, name: str, token_ids: list[str]) -> list[str]:
    """Delete the node's bootstrap token Secrets: those labelled with its name, and those of
    ``token_ids`` (from the state). Returns the Secrets deleted."""
    secrets = f"/api/v1/namespaces/{TOKEN_NAMESPACE}/secrets"
    try:
        labelled = rest(api, "GET", secrets, "list token Secrets", query={"labelSelector": f"{NODE_LABEL}={name}"}
                        )["items"] or []
    except ApiError as e:
        raise KubeError(f"list the bootstrap token Secrets of {name}: {status_message(e)}") from None
    names = sorted({s["metadata"]["name"] for s in labelled} | {f"bootstrap-token-{t}" for t in token_ids})
    return [s for s in names if found(api, "DELETE", f"{secrets}/{s}", f"Secret/{s}", "delete")]


def delete_renewal_binding(api: ApiClient, name: str) -> bool:
    binding = node_renewal_binding(name)["metadata"]["name"]
    return kube.delete_binding(api, binding)


@dataclass
class NodeCSRs:
    pending: list[str] = field(default_factory=list)     # names of CSRs neither approved nor denied
    serials: list[str] = field(default_factory=list)     # hex serials of certificates issued to it


def _issued_serial(csr: dict, name: str) -> str | None:
    raw = (csr.get("status") or {}).get("certificate")
    if not raw:
        return None
    try:
        pem = base64.b64decode(raw, validate=True)      # JSON carries the PEM base64-encoded
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return f"{cert.serial_number:x}" if identity(name) in cns else None


def node_csrs(api: ApiClient, name: str, token_ids: list[str]) -> NodeCSRs:
    """The node's CSRs: made by ``system:node:<name>`` or by one of its bootstrap tokens."""
    users = {identity(name)} | {f"system:bootstrap:{t}" for t in token_ids}
    try:
        items = rest(api, "GET", CSRS, "list CSRs")["items"] or []
    except ApiError as e:
        raise KubeError(f"list CertificateSigningRequests: {status_message(e)}") from None
    out = NodeCSRs()
    for csr in items:
        serial = _issued_serial(csr, name)
        if (csr.get("spec") or {}).get("username") not in users and serial is None:
            continue
        if serial:
            out.serials.append(serial)
        if not decided(csr):
            out.pending.append(csr["metadata"]["name"])
    return out


def delete_csrs(api: ApiClient, names: list[str]) -> list[str]:
    return [n for n in names if found(api, "DELETE", f"{CSRS}/{n}", f"CertificateSigningRequest/{n}", "delete")]


VAPS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"


@dataclass
class Revocations:
    """What ``apply_revocations`` did: each object's action (``apply_objects``), the names the
    live policy denied before (None: there was no policy) and the names it denies now."""
    actions: list[tuple[str, str, str]]
    cluster: list[str] | None
    denied: list[str]


def revoked_in_cluster(api: ApiClient) -> list[str] | None:
    """The node names the live revoked-nodes policy denies; None when there is no policy.
    KubeError naming the policy when its validations are not exactly what ``node revoke`` writes
    (revocation.policy_names): someone edited it, and what it denies cannot be read safely."""
    what = f"ValidatingAdmissionPolicy/{POLICY}"
    try:
        live = rest(api, "GET", f"{VAPS}/{POLICY}", what)
    except ApiError as e:
        if e.status == 404:
            return None
        raise KubeError(f"{what}: read refused: {status_message(e)}") from None
    try:
        return policy_names(live)
    except ValueError as e:
        raise KubeError(f"ValidatingAdmissionPolicy {POLICY} was edited outside the installer ({e}); nothing "
                        "was written. Put its expression back in the form `installer node revoke` writes, keeping "
                        f"every name it denies (kubectl edit validatingadmissionpolicy {POLICY}), then run this "
                        "again") from None


def apply_revocations(api: ApiClient, revoked: list[str], k8s_version: str) -> Revocations:
    """Bring the revoked-nodes policy and its binding to deny every name in ``revoked`` and every
    name the live policy denies already: revocations only grow, so a run from a state directory
    that missed another revoke cannot undo it. The live policy is read and checked before
    anything is written (``revoked_in_cluster``); the apply lock keeps another ``node revoke``
    from writing between that read and this write."""
    cluster = revoked_in_cluster(api)
    denied = sorted(set(revoked) | set(cluster or ()))
    return Revocations(apply_objects(api, policy_objects(denied), k8s_version), cluster, denied)


REVOKED_MESSAGE = "this node identity was revoked"


def refuses(api: ApiClient, node: str) -> str | None:
    """Whether this apiserver refuses a write by ``system:node:<node>`` because of the revoked-
    nodes policy: a server-side dry run (nothing is stored) of creating its Node, made as that
    identity (impersonation). Returns the apiserver's answer when refused, else None."""
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    headers = {"Impersonate-User": identity(node), "Impersonate-Group": "system:nodes"}
    try:
        rest(api, "POST", NODES, f"Node/{node} (dry run as {identity(node)})", body, query={"dryRun": "All"},
             headers=headers)
    except ApiError as e:
        message = status_message(e)
        if e.status == 403 and REVOKED_MESSAGE in (e.body or ""):
            return message
        if e.status == 409:          # admitted, then found existing: the policy is not active yet
            return None
        raise KubeError(f"dry-run write as {identity(node)}: {message}") from None
    return None


def wait_refused_everywhere(clients: dict[str, ApiClient], nodes: list[str], timeout: float,
                            interval: float = 0.2) -> dict[str, float]:
    """Poll every apiserver (``clients``: control host -> its own apiserver) until each refuses
    every identity in ``nodes``; returns, per apiserver, the seconds until it did. KubeError
    naming the apiservers that still admit a write after ``timeout``."""
    start = time.monotonic()
    waiting = {(host, n) for host in clients for n in nodes}
    done: dict[str, float] = {}
    while waiting:
        for host, n in sorted(waiting):
            if refuses(clients[host], n):
                waiting.discard((host, n))
                if not any(h == host for h, _ in waiting):
                    done[host] = time.monotonic() - start
        if not waiting:
            break
        if time.monotonic() - start > timeout:
            raise KubeError("the revoked-nodes policy is not enforced yet by "
                            + ", ".join(sorted({h for h, _ in waiting})) + f" after {timeout:g}s")
        time.sleep(interval)
    return done


def delete_kube_proxy_binding(api: ApiClient, name: str) -> bool:
    """Delete the node's kube-proxy ClusterRoleBinding (render/manifests.py): its kube-proxy
    certificate then reads nothing (RBAC denies; reads never reach the revoked-nodes admission
    policy). False when it was not there."""
    return kube.delete_binding(api, kube_proxy_binding(name)["metadata"]["name"])
