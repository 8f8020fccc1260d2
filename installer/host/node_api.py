"""The cluster side of node day-2 operations, through the Kubernetes client library.

Cordon and drain (evictions, so PodDisruptionBudgets are respected; a blocked eviction is retried
until the timeout), delete the Node, the node's bootstrap token Secrets, its renewal binding and
its pending CSRs, read the serials of client certificates issued to it, and keep the
revoked-nodes admission policy current. Every call goes through ``kube.api_call`` (timeouts; a
transport failure is a KubeError naming the object).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Callable

from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from installer.host import kube
from installer.host.kube import TOKEN_NAMESPACE, KubeError, api_call, status_message, found
from installer.host.kube_objects import apply_objects
from installer.core.render.manifests import node_renewal_binding
from installer.core.render.revocation import identity, policy_objects

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
NODE_LABEL = "hiddenplane.io/node"


class DrainError(KubeError):
    """Pods are still on the node when the drain's time is up."""


def _gone(e: ApiException) -> bool:
    return e.status == 404


# --- cordon and drain -------------------------------------------------------------------------

def cordon(api: k8s.ApiClient, name: str) -> bool:
    """Mark the Node unschedulable; False when there is no such Node."""
    return found(f"Node/{name}", "cordon", k8s.CoreV1Api(api).patch_node, name,
                        {"spec": {"unschedulable": True}})


def uncordon(api: k8s.ApiClient, name: str) -> bool:
    """Mark the Node schedulable again; False when there is no such Node."""
    return found(f"Node/{name}", "uncordon", k8s.CoreV1Api(api).patch_node, name,
                 {"spec": {"unschedulable": False}})


@dataclass(frozen=True)
class NodeState:
    ready: bool
    kubelet: str                  # the version the kubelet reports (status.nodeInfo.kubeletVersion)
    cordoned: bool


def node_states(api: k8s.ApiClient) -> dict[str, NodeState]:
    """Every registered Node: Ready, its kubelet's version, whether it is cordoned."""
    try:
        nodes = api_call("list nodes", k8s.CoreV1Api(api).list_node).items
    except ApiException as e:
        raise KubeError(f"list nodes: {status_message(e)}") from None
    return {n.metadata.name: NodeState(kube.ready(n)[0],
                                       n.status.node_info.kubelet_version if n.status and n.status.node_info else "",
                                       bool(n.spec and n.spec.unschedulable)) for n in nodes}


LEADER_LEASES = ("kube-controller-manager", "kube-scheduler")      # in kube-system


def lease_holders(api: k8s.ApiClient) -> dict[str, str | None]:
    """Who holds the controller-manager's and the scheduler's leader Lease (identity
    ``<host>_<uuid of the process>``); None for a Lease not there (yet)."""
    coord, out = k8s.CoordinationV1Api(api), {}
    for name in LEADER_LEASES:
        try:
            lease = api_call(f"Lease/{name}", coord.read_namespaced_lease, name, "kube-system")
            out[name] = lease.spec.holder_identity if lease.spec else None
        except ApiException as e:
            if e.status != 404:
                raise KubeError(f"Lease kube-system/{name}: {status_message(e)}") from None
            out[name] = None
    return out


def _skipped(pod: k8s.V1Pod) -> str | None:
    """Why ``pod`` is not evicted (kubectl drain's rules): mirror pods belong to the kubelet's
    static manifests, DaemonSet pods would be re-created on the node at once."""
    meta = pod.metadata
    if MIRROR_ANNOTATION in (meta.annotations or {}):
        return "mirror pod"
    if any(o.kind == "DaemonSet" for o in meta.owner_references or []):
        return "DaemonSet"
    if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
        return "finished"
    return None


def pods_on(api: k8s.ApiClient, name: str) -> list[k8s.V1Pod]:
    try:
        return list(api_call(f"pods on {name}", k8s.CoreV1Api(api).list_pod_for_all_namespaces,
                          field_selector=f"spec.nodeName={name}").items)
    except ApiException as e:
        raise KubeError(f"list the pods on {name}: {status_message(e)}") from None


def _referenced(pod: k8s.V1Pod) -> set[tuple[str, str, str]]:
    """(resource, namespace, name) of the Secrets and ConfigMaps a pod mounts or reads: what the
    Node authorizer lets its node read while the pod is bound to it."""
    ns, spec, out = pod.metadata.namespace, pod.spec, set()
    for v in spec.volumes or []:
        if v.secret and v.secret.secret_name:
            out.add(("secrets", ns, v.secret.secret_name))
        if v.config_map and v.config_map.name:
            out.add(("configmaps", ns, v.config_map.name))
        for src in (v.projected.sources or []) if v.projected else []:
            if src.secret and src.secret.name:
                out.add(("secrets", ns, src.secret.name))
            if src.config_map and src.config_map.name:
                out.add(("configmaps", ns, src.config_map.name))
    for c in (spec.containers or []) + (spec.init_containers or []):
        for e in c.env_from or []:
            if e.secret_ref:
                out.add(("secrets", ns, e.secret_ref.name))
            if e.config_map_ref:
                out.add(("configmaps", ns, e.config_map_ref.name))
        for e in c.env or []:
            ref = e.value_from
            if ref and ref.secret_key_ref:
                out.add(("secrets", ns, ref.secret_key_ref.name))
            if ref and ref.config_map_key_ref:
                out.add(("configmaps", ns, ref.config_map_key_ref.name))
    for s in spec.image_pull_secrets or []:
        out.add(("secrets", ns, s.name))
    return out


def may_read(api: k8s.ApiClient, node: str, resource: str, namespace: str, name: str) -> bool:
    """Whether the apiserver's authorizers (the Node authorizer among them) let ``system:node:
    <node>`` get that object: a SubjectAccessReview."""
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": identity(node), "groups": ["system:nodes", "system:authenticated"],
                     "resourceAttributes": {"verb": "get", "resource": resource, "namespace": namespace,
                                            "name": name}}}
    try:
        r = api_call(f"SubjectAccessReview for {identity(node)}", k8s.AuthorizationV1Api(api).create_subject_access_review,
                  body)
    except ApiException as e:
        raise KubeError(f"SubjectAccessReview for {identity(node)}: {status_message(e)}") from None
    return bool(r.status and r.status.allowed)


def delete_pods_and_their_reads(api: k8s.ApiClient, node: str, timeout: float, interval: float = 0.5
                                ) -> tuple[list[str], float]:
    """Force-delete every pod bound to ``node`` (its kubelet is not trusted to stop them) and
    wait until the identity may read none of the Secrets and ConfigMaps they used: while a pod
    is bound to a node, the Node authorizer lets that node read them, and the pod garbage
    collector deletes a deleted Node's pods only after 40 s or more. Returns the deleted pods
    and the seconds until nothing was readable; KubeError naming what still is after ``timeout``."""
    core = k8s.CoreV1Api(api)
    pods = pods_on(api, node)
    reads = set().union(*(_referenced(p) for p in pods)) if pods else set()
    deleted = []
    for p in pods:
        key = f"{p.metadata.namespace}/{p.metadata.name}"
        if found(f"Pod/{key}", "delete", core.delete_namespaced_pod, p.metadata.name, p.metadata.namespace,
                 grace_period_seconds=0):
            deleted.append(key)
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


def node_exists(api: k8s.ApiClient, name: str) -> bool:
    return found(f"Node/{name}", "read", k8s.CoreV1Api(api).read_node, name)


def drain_plan(api: k8s.ApiClient, name: str) -> DrainResult:
    """What ``drain`` would do now, read-only: the pods it would evict (``evicted``) and those it
    leaves (``skipped``, with why)."""
    result = DrainResult()
    for pod in pods_on(api, name):
        key, why = f"{pod.metadata.namespace}/{pod.metadata.name}", _skipped(pod)
        if why:
            result.skipped.append(f"{key} ({why})")
        else:
            result.evicted.append(key)
    return result


def drain(api: k8s.ApiClient, name: str, timeout: float, *, log: Callable[[str], None] = print,
          interval: float = 5.0) -> DrainResult:
    """Evict every pod on ``name`` except mirror and DaemonSet pods, then wait until they are
    gone. An eviction a PodDisruptionBudget refuses (429) is retried every ``interval`` s; when
    ``timeout`` s are up with pods left, DrainError names them and why they stayed."""
    core = k8s.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    result = DrainResult()
    waiting: dict[str, str] = {}            # ns/name -> why it is still there
    while True:
        pending = []
        for pod in pods_on(api, name):
            key = f"{pod.metadata.namespace}/{pod.metadata.name}"
            why = _skipped(pod)
            if why:
                if f"{key} ({why})" not in result.skipped:
                    result.skipped.append(f"{key} ({why})")
                continue
            pending.append(pod)
            if key in result.evicted:
                waiting[key] = "terminating"
                continue
            body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=pod.metadata.name,
                                                            namespace=pod.metadata.namespace))
            try:
                api_call(f"Pod/{key}", core.create_namespaced_pod_eviction, pod.metadata.name,
                      pod.metadata.namespace, body)
                result.evicted.append(key)
                waiting[key] = "terminating"
                log(f"{name}: evicted {key}")
            except ApiException as e:
                if _gone(e):
                    continue
                if e.status == 429:
                    waiting[key] = f"eviction refused: {status_message(e)}"
                    continue
                raise KubeError(f"Pod/{key}: eviction refused: {status_message(e)}") from None
        if not pending:
            return result
        if time.monotonic() >= deadline:
            raise DrainError(f"{name}: drain timed out after {timeout:g} s with {len(pending)} pod(s) left: "
                             + "; ".join(f"{k}: {w}" for k, w in sorted(waiting.items())
                                         if k in {f'{p.metadata.namespace}/{p.metadata.name}' for p in pending}))
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


# --- deleting what let the node in ------------------------------------------------------------

def delete_node(api: k8s.ApiClient, name: str) -> bool:
    return found(f"Node/{name}", "delete", k8s.CoreV1Api(api).delete_node, name)


def delete_tokens(api: k8s.ApiClient, name: str, token_ids: list[str]) -> list[str]:
    """Delete the node's bootstrap token Secrets: those labelled with its name, and those of
    ``token_ids`` (from the state). Returns the Secrets deleted."""
    core = k8s.CoreV1Api(api)
    try:
        labelled = api_call("list token Secrets", core.list_namespaced_secret, TOKEN_NAMESPACE,
                         label_selector=f"{NODE_LABEL}={name}").items
    except ApiException as e:
        raise KubeError(f"list the bootstrap token Secrets of {name}: {status_message(e)}") from None
    names = sorted({s.metadata.name for s in labelled} | {f"bootstrap-token-{t}" for t in token_ids})
    return [s for s in names
            if found(f"Secret/{s}", "delete", core.delete_namespaced_secret, s, TOKEN_NAMESPACE)]


def delete_renewal_binding(api: k8s.ApiClient, name: str) -> bool:
    binding = node_renewal_binding(name)["metadata"]["name"]
    return found(f"ClusterRoleBinding/{binding}", "delete",
                        k8s.RbacAuthorizationV1Api(api).delete_cluster_role_binding, binding)


@dataclass
class NodeCSRs:
    pending: list[str] = field(default_factory=list)     # names of CSRs neither approved nor denied
    serials: list[str] = field(default_factory=list)     # hex serials of certificates issued to it


def _decided(csr) -> bool:
    return any(c.type in ("Approved", "Denied", "Failed") for c in (csr.status.conditions if csr.status else None) or [])


def _issued_serial(csr, name: str) -> str | None:
    raw = csr.status.certificate if csr.status else None
    if not raw:
        return None
    try:
        # JSON carries the PEM base64-encoded; the client hands the field over as that string
        pem = base64.b64decode(raw, validate=True) if isinstance(raw, str) else bytes(raw)
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return f"{cert.serial_number:x}" if identity(name) in cns else None


def node_csrs(api: k8s.ApiClient, name: str, token_ids: list[str]) -> NodeCSRs:
    """The node's CSRs: made by ``system:node:<name>`` or by one of its bootstrap tokens."""
    users = {identity(name)} | {f"system:bootstrap:{t}" for t in token_ids}
    try:
        items = api_call("list CSRs", k8s.CertificatesV1Api(api).list_certificate_signing_request).items
    except ApiException as e:
        raise KubeError(f"list CertificateSigningRequests: {status_message(e)}") from None
    out = NodeCSRs()
    for csr in items:
        serial = _issued_serial(csr, name)
        if csr.spec.username not in users and serial is None:
            continue
        if serial:
            out.serials.append(serial)
        if not _decided(csr):
            out.pending.append(csr.metadata.name)
    return out


def delete_csrs(api: k8s.ApiClient, names: list[str]) -> list[str]:
    certs = k8s.CertificatesV1Api(api)
    return [n for n in names if found(f"CertificateSigningRequest/{n}", "delete",
                                             certs.delete_certificate_signing_request, n)]


def apply_revocations(api: k8s.ApiClient, revoked: list[str], k8s_version: str) -> list[tuple[str, str, str]]:
    """Create or update the revoked-nodes policy and its binding for every name in ``revoked``."""
    return apply_objects(api, policy_objects(revoked), k8s_version)


REVOKED_MESSAGE = "this node identity was revoked"


def refuses(api: k8s.ApiClient, node: str) -> str | None:
    """Whether this apiserver refuses a write by ``system:node:<node>`` because of the revoked-
    nodes policy: a server-side dry run (nothing is stored) of creating its Node, made as that
    identity (impersonation). Returns the apiserver's answer when refused, else None."""
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    headers = {"Impersonate-User": identity(node), "Impersonate-Group": "system:nodes"}
    try:
        api_call(f"Node/{node} (dry run as {identity(node)})", k8s.CoreV1Api(api).create_node, body,
              dry_run="All", _headers=headers)
    except ApiException as e:
        message = status_message(e)
        if e.status == 403 and REVOKED_MESSAGE in (e.body or ""):
            return message
        if e.status == 409:          # admitted, then found existing: the policy is not active yet
            return None
        raise KubeError(f"dry-run write as {identity(node)}: {message}") from None
    return None


def wait_refused_everywhere(clients: dict[str, k8s.ApiClient], nodes: list[str], timeout: float,
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
