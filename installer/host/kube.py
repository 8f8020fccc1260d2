"""Talking to the cluster's API from the operator machine (the official ``kubernetes`` client).

- ``api_client``: an ApiClient authenticated with a client certificate from the state's PKI and
  verifying the apiserver against the cluster CA (never ``verify_ssl=False``).
- reaching the API (``api_access``: an apiserver that answers, or an SSH tunnel) and the admin
  kubeconfig: ``host/apireach.py``.
- applying the bootstrap and add-on objects: ``host/kube_objects.py``.
- ``wait_nodes_ready``, ``set_pod_cidr``, ``token_consumed``, ``delete_bootstrap_token``: the
  workers phase.

Which credential: the admin certificate (O=kubeadm:cluster-admins) is authorized only through the
``hiddenplane:cluster-admins`` binding, which is itself one of the bootstrap objects. The first
cluster-bootstrap run must therefore use ``credential="super-admin"`` (O=system:masters, kept in
the state only), as kubeadm does for the same binding; later runs and day-to-day use take
``admin``.
"""

from __future__ import annotations

import datetime as dt
import json
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import quote, urlencode

import urllib3

from installer.core.errors import StateError
from installer.core.pki.material import Material
from installer.core.tlsfiles import ca_pem, load_client_cert
from installer.host.apireach import KubeError

RBAC_GROUP = "rbac.authorization.k8s.io"
# what every request accepts and every body is sent as (a patch says its own kind)
JSON = "application/json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
TOKEN_NAMESPACE = "kube-system"


class ApiError(Exception):
    """The apiserver answered with an error status; ``body`` is its answer (a Status JSON)."""

    def __init__(self, status: int, reason: str, body: str = ""):
        super().__init__(f"{status} {reason}")
        self.status, self.reason, self.body = status, reason, body


# (connect, read) seconds for every request
REQUEST_TIMEOUT = urllib3.Timeout(connect=10.0, read=60.0)


class ApiClient:
    """HTTPS to one apiserver: a client certificate from the state, the cluster CA as the only
    trust anchor, requests by path with JSON in and out (``rest``).

    Its own and small: the official client took 0.12 s to import before doing anything, and its
    typed API classes 0.06-0.5 s each. ``context`` already holds the client certificate and
    trusts the cluster CA alone (``api_client`` makes it)."""

    def __init__(self, server_url: str, context: ssl.SSLContext, tls_server_name: str | None = None):
        self.host = server_url.rstrip("/")
        # sent with every request (a hosting cluster's bearer token: host/hosting.py)
        self.headers: dict[str, str] = {}
        self.tls_server_name = tls_server_name
        # streams (a pod's exec: host/podexec.py) go through a context of their own that checks
        # the server's name in the TLS handshake; only a hosting client has one
        self.stream_context: ssl.SSLContext | None = None
        # urllib3 checks the name itself (IP SANs included), against tls_server_name when given
        context.check_hostname = False
        self.pool = urllib3.PoolManager(ssl_context=context, server_hostname=tls_server_name,
                                        assert_hostname=tls_server_name, retries=urllib3.Retry(2, redirect=0))

    def request(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str],
                query: Mapping[str, str] | None) -> urllib3.BaseHTTPResponse:
        url = self.host + quote(path, safe="/:") + (f"?{urlencode(query)}" if query else "")
        return self.pool.request(method, url, body=body, headers={**self.headers, **headers}, timeout=REQUEST_TIMEOUT,
                                 preload_content=True)

    def close(self) -> None:
        self.pool.clear()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def api_client(server_url: str, material: Material, *, credential: str = "admin",
               tls_server_name: str | None = None) -> ApiClient:
    """An ApiClient for ``server_url`` (``https://host:port``) authenticating with the state's
    ``credential`` pair (``admin`` or ``super-admin``) and trusting only the cluster CA.

    ``tls_server_name`` sets SNI *and* the name the server certificate is verified against; it
    is not needed for a tunnel to ``https://127.0.0.1:PORT`` (127.0.0.1 is an apiserver SAN).
    Python's TLS loads a client key only from a path: the key goes through an anonymous
    in-memory file (``tlsfiles.load_client_cert``), never a file on disk a kill could leave."""
    if material.cas.get("ca") is None or material.certs.get(credential) is None:
        raise StateError(f"the state holds no cluster CA or {credential} certificate: run `installer plan` first")
    context = ssl.create_default_context(cadata=ca_pem(material))
    load_client_cert(context, material, credential)
    return ApiClient(server_url, context, tls_server_name)


def rest(api: ApiClient, method: str, path: str, what: str, body: dict | None = None, *,
         content_type: str = JSON, query: Mapping[str, str] | None = None,
         headers: Mapping[str, str] | None = None) -> dict | None:
    """One request by its path (``/api/v1/nodes``, ``/apis/apps/v1/...``); the answer is the
    apiserver's JSON as it came (None when empty). An error status raises ApiError; no answer,
    or TLS failing, is a KubeError naming ``what``."""
    sent = {"Accept": JSON, **({"Content-Type": content_type} if body is not None else {}), **(headers or {})}
    try:
        resp = api.request(method, path, json.dumps(body).encode() if body is not None else None, sent, query)
    except urllib3.exceptions.HTTPError as e:
        cause = getattr(e, "reason", e)
        if isinstance(cause, urllib3.exceptions.SSLError) or isinstance(e, urllib3.exceptions.SSLError):
            raise KubeError(f"{what}: TLS with the API failed: {cause}") from None
        raise KubeError(f"{what}: cannot reach the API: {e}") from None
    text = resp.data.decode(errors="replace") if resp.data else ""
    if not 200 <= resp.status <= 299:
        raise ApiError(resp.status, resp.reason or "", text)
    return json.loads(text) if text else None


def status_message(e: ApiError) -> str:
    try:
        body = json.loads(e.body or "")
        return f"{e.status} {body.get('reason') or e.reason}: {body.get('message', '')}".rstrip(": ")
    except (TypeError, ValueError, AttributeError):
        return f"{e.status} {e.reason}"


def reason(e: ApiError) -> str | None:
    try:
        return json.loads(e.body or "").get("reason")
    except (TypeError, ValueError, AttributeError):
        return None


def causes(e: ApiError) -> list[str]:
    """The reasons of the Status's ``details.causes`` (e.g. NamespaceTerminating)."""
    try:
        return [c.get("reason") for c in (json.loads(e.body or "").get("details") or {}).get("causes") or []]
    except (TypeError, ValueError, AttributeError):
        return []


# --- the workers phase ----------------------------------------------------------------------

NODES = "/api/v1/nodes"
CRBS = f"/apis/{RBAC_GROUP}/v1/clusterrolebindings"


def _heartbeat(value: str | None) -> float | None:
    try:
        return dt.datetime.fromisoformat(value).timestamp() if value else None
    except ValueError:
        return None


def ready(node: dict, since: float | None = None) -> tuple[bool, str]:
    """Whether the Node (the API's JSON) is Ready, and its Ready condition in words."""
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            beat = _heartbeat(c.get("lastHeartbeatTime"))
            if since is not None and (beat is None or beat < since):
                return False, f"Ready={c.get('status')} from before the kubelet's restart"
            return c.get("status") == "True", f"Ready={c.get('status')}" + (
                f" ({c['reason']}: {c.get('message', '')})" if c.get("reason") else "")
    return False, "no Ready condition yet"


def list_nodes(api: ApiClient) -> dict[str, dict]:
    """Every registered Node by name (the API's JSON)."""
    try:
        items = rest(api, "GET", NODES, "list nodes")["items"] or []
    except ApiError as e:
        raise KubeError(f"list nodes: {status_message(e)}") from None
    return {n["metadata"]["name"]: n for n in items}


def wait_nodes_ready(api: ApiClient, names: Sequence[str], timeout: float, *,
                     interval: float = 2.0, registered_only: bool = False,
                     each_round: Callable[[], None] | None = None,
                     since: float | Mapping[str, float] | None = None) -> None:
    """Poll (one list of Nodes per round) until every named Node has Ready=True (or, with
    ``registered_only``, exists); KubeError naming each node that is missing or not ready when
    ``timeout`` seconds have passed. ``each_round`` runs before each look (e.g. approving the
    CSRs the nodes wait for). ``since`` (epoch seconds on the node's clock, one for all or one
    per node name): only a Ready condition the kubelet posted since then counts (a restarted
    kubelet reports NotReady first, while the API still shows its predecessor's Ready)."""
    deadline = time.monotonic() + timeout
    while True:
        if each_round is not None:
            each_round()
        nodes = list_nodes(api)
        waiting = {}
        for name in names:
            if name not in nodes:
                waiting[name] = "not registered"
            elif not registered_only:
                ok, why = ready(nodes[name], since.get(name) if isinstance(since, Mapping) else since)
                if not ok:
                    waiting[name] = why
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise KubeError(f"nodes not {'registered' if registered_only else 'Ready'} after {timeout:g}s: "
                            + "; ".join(f"{n}: {w}" for n, w in waiting.items()))
        time.sleep(interval)


def set_pod_cidr(api: ApiClient, node: str, cidr: str) -> str:
    """Make ``Node.spec.podCIDR`` (and ``podCIDRs``) the installer's allocation for ``node``.

    The installer, not the controller-manager (``--allocate-node-cidrs=false``), owns pod CIDRs:
    with ``cni: routes`` they are in each worker's CNI config and every host's routes before any
    Node exists, and this records the same slice on the Node for tools that read it; with
    ``cni: cilium`` (``ipam.mode: kubernetes``) this is where Cilium takes each node's range. The
    apiserver lets the field be set once: an empty one is patched ("set"), an equal one left
    ("unchanged"); a different one is an error naming both (the Node must be deleted and
    re-registered to change it)."""
    what = f"Node/{node}"
    try:
        live = rest(api, "GET", f"{NODES}/{node}", what)
    except ApiError as e:
        raise KubeError(f"{what}: {status_message(e)}") from None
    have = (live.get("spec") or {}).get("podCIDR")
    if have == cidr:
        return "unchanged"
    if have:
        raise KubeError(f"{what}: spec.podCIDR is {have} but the installer allocated {cidr} (state "
                        "network.yaml); the field cannot change: delete the Node so the kubelet re-registers it, "
                        "or put the node's allocation back in network.yaml")
    body = {"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}}
    try:
        rest(api, "PATCH", f"{NODES}/{node}", what, body, content_type=STRATEGIC_MERGE)
    except ApiError as e:
        raise KubeError(f"{what}: setting spec.podCIDR refused: {status_message(e)}") from None
    return "set"


def node_readiness(api: ApiClient) -> dict[str, bool]:
    """Every registered Node and whether it is Ready."""
    return {name: ready(n)[0] for name, n in list_nodes(api).items()}


def node_names(api: ApiClient) -> list[str]:
    """Names of every registered Node (control hosts must never be among them)."""
    return sorted(list_nodes(api))


def token_consumed(api: ApiClient, node: str) -> bool:
    """Whether the node's bootstrap token has done its job.

    Definition: a Node object named ``node`` exists. The kubelet authenticates with the
    bootstrap token only to submit its client-certificate CSR; it registers its Node only once
    that CSR was approved and signed, with the new client certificate (system:node:<node>), so
    an existing Node means the kubelet holds its own credential and the token is no longer
    needed. (A Node left over from an earlier install would count too: remove stale Nodes
    before re-joining a host.)"""
    return node_exists(api, node)


def node_exists(api: ApiClient, name: str) -> bool:
    return found(api, "GET", f"{NODES}/{name}", f"Node/{name}", "read")


def found(api: ApiClient, method: str, path: str, what: str, verb: str, body: dict | None = None,
          **kw) -> bool:
    """``method`` on the object at ``path`` (named ``what``); False when it is not there (404:
    for a delete, what we wanted), KubeError naming it and ``verb`` on any other refusal."""
    try:
        rest(api, method, path, what, body, **kw)
        return True
    except ApiError as e:
        if e.status == 404:
            return False
        raise KubeError(f"{what}: {verb} refused: {status_message(e)}") from None


def binding_exists(api: ApiClient, name: str) -> bool:
    return found(api, "GET", f"{CRBS}/{name}", f"ClusterRoleBinding/{name}", "read")


def delete_binding(api: ApiClient, name: str) -> bool:
    """Delete the ClusterRoleBinding ``name``; False when it was not there."""
    return found(api, "DELETE", f"{CRBS}/{name}", f"ClusterRoleBinding/{name}", "delete")


def delete_bootstrap_token(api: ApiClient, token_id: str) -> bool:
    """Delete ``kube-system/bootstrap-token-<id>``; False when it was already gone."""
    name = f"bootstrap-token-{token_id}"
    return found(api, "DELETE", f"/api/v1/namespaces/{TOKEN_NAMESPACE}/secrets/{name}", f"Secret/{name}", "delete")


RESTARTED_AT = "hiddenplane.io/restartedAt"


def restart_workload(api: ApiClient, kind: str, namespace: str, name: str, stamp: str) -> bool:
    """A rolling restart of a Deployment or DaemonSet (what ``kubectl rollout restart`` does: a
    new pod-template annotation); False when there is no such object."""
    plural = {"Deployment": "deployments", "DaemonSet": "daemonsets"}[kind]
    patch = {"spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: stamp}}}}}
    return found(api, "PATCH", f"/apis/apps/v1/namespaces/{namespace}/{plural}/{name}", f"{kind}/{namespace}/{name}",
                 "restart", patch, content_type=STRATEGIC_MERGE)
