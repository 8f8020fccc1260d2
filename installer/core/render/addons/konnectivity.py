"""konnectivity: the apiserver's way to pods, services and kubelets when it cannot route there.

Control hosts are not nodes. With ``cni: cilium`` (or ``egress: konnectivity``) they have no
route into the pod network, yet the apiserver must reach admission webhooks, aggregated APIs,
and kubelets for logs/exec/port-forward. The apiserver-network-proxy closes that gap:

- on every control host a ``konnectivity-server`` systemd unit listens on a Unix socket for
  its local apiserver (``--egress-selector-config-file``: egress ``cluster`` over GRPC/UDS)
  and on ``AGENT_PORT`` for agents; its serving certificate is the apiserver's (whose SANs
  hold every control host's address); it checks each agent's ServiceAccount token with a
  TokenReview, as ``system:konnectivity-server`` (a client certificate, kubeconfig below),
  bound to ``system:auth-delegator``;
- on the workers a DaemonSet ``konnectivity-agent`` dials *out* to the servers and carries the
  apiserver's connections back in. One container per control host, each dialing that host
  directly with ``--server-count=1`` on every server: every server gets a tunnel from every
  worker with no load balancer in front of port 8132 (the upstream alternative, one agent
  dialing a load balancer until it has met ``--server-count`` servers, needs one). The agents
  run in the host network namespace, so the tunnel needs neither a working CNI nor pod
  masquerading towards the control hosts, and ``kubectl logs`` still works to debug a broken
  CNI. The agent token is a projected ServiceAccount token for the audience
  ``system:konnectivity-server`` (the apiserver must accept it: ``--api-audiences``); no API
  token is mounted.

Flag names follow kubernetes-sigs/apiserver-network-proxy ``cmd/server/app/options`` and
``cmd/agent/app/options`` (no binary built here checks them).
"""

from __future__ import annotations

import dataclasses

from installer.core import components
from installer.core.egress import egress_mode
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.pki.specs import CLUSTER_CA
from installer.core.render.ciphers import CIPHER_SUITES
from installer.core.render.files import (
    BIN_DIR,
    K8S_DIR,
    PKI_DIR,
    HostDir,
    HostFile,
    HostPlan,
    flags,
    to_yaml,
    unit_file,
)
from installer.core.render.kubeconfig import kubeconfig
from installer.core.render.manifests import LABELS, RBAC

KONNECTIVITY_VERSION = "v0.36.0"
AGENT_IMAGE = f"registry.k8s.io/kas-network-proxy/proxy-agent:{KONNECTIVITY_VERSION}"
SERVER_BINARY = "konnectivity-server"
UNIT = components.unit("konnectivity-server")
APISERVER_UNIT = components.unit("kube-apiserver")

SERVER_USER = "system:konnectivity-server"     # CN of its client certificate
CERT_NAME = "konnectivity-server"              # the PKI table row (installer/core/pki/specs.py)
AUDIENCE = "system:konnectivity-server"        # of the agents' ServiceAccount tokens
NAMESPACE = "kube-system"
AGENT = "konnectivity-agent"                   # DaemonSet and ServiceAccount

SOCKET_DIR = f"{K8S_DIR}/konnectivity-server"
SOCKET = f"{SOCKET_DIR}/konnectivity-server.socket"
KUBECONFIG = f"{K8S_DIR}/konnectivity-server.conf"
EGRESS_CONFIG = f"{K8S_DIR}/egress-selector-config.yaml"
SERVING_CERT, SERVING_KEY = f"{PKI_DIR}/apiserver.crt", f"{PKI_DIR}/apiserver.key"
AGENT_PORT, ADMIN_PORT, HEALTH_PORT = 8132, 8133, 8134
# agents share the worker's network namespace: container i uses these + 2*i
AGENT_ADMIN_PORT, AGENT_HEALTH_PORT = 8133, 8134
TOKEN_DIR = "/var/run/secrets/tokens"
TOKEN_FILE = "konnectivity-agent-token"


def enabled(inv: Inventory) -> bool:
    return egress_mode(inv) == "konnectivity"


def service_account_issuer(inv: Inventory) -> str:
    """The apiserver's ``--service-account-issuer`` (as control.py renders it): also the
    default, and so the first, API audience."""
    return f"https://kubernetes.default.svc.{inv.spec.network.clusterDomain}"


# --- the apiserver side -----------------------------------------------------------------------

def egress_selector_config(socket: str = SOCKET, controlplane: bool = False) -> dict:
    """``cluster`` (what upstream dials in the cluster's network: Services' webhooks, the
    aggregated APIs, logs, exec, port-forward) through konnectivity; with ``controlplane`` also
    what it dials by URL (admission and conversion webhooks given a URL, authentication,
    authorization, audit and tracing webhooks; apiserver/pkg/util/webhook/authentication.go and
    the callers of ``egressselector.ControlPlane``). A hosted tenant's apiserver sits in the
    hosting cluster's pod network: a URL its tenant's admin chooses must be dialled from the
    tenant's own network (an agent on its workers), never from there. ``etcd`` stays direct."""
    via = {"proxyProtocol": "GRPC", "transport": {"uds": {"udsName": socket}}}
    names = ["cluster", "controlplane"] if controlplane else ["cluster"]
    return {
        "apiVersion": "apiserver.k8s.io/v1beta1",
        "kind": "EgressSelectorConfiguration",
        "egressSelections": [{"name": n, "connection": via} for n in names],
    }


def apiserver_egress_flags(inv: Inventory) -> dict[str, object]:
    """kube-apiserver flags to merge into control.py's (empty with ``egress: routes``).

    ``--api-audiences`` replaces the default (the issuer alone), so the issuer comes first and
    stays: ServiceAccount tokens without an explicit audience keep working."""
    if not enabled(inv):
        return {}
    return {
        "--egress-selector-config-file": EGRESS_CONFIG,
        "--api-audiences": [service_account_issuer(inv), AUDIENCE],
    }


# --- the server on each control host -------------------------------------------------------

def server_flags(inv: Inventory, host: HostSpec) -> list[str]:
    return flags({
        "--mode": "grpc",
        "--uds-name": SOCKET,
        "--delete-existing-uds-file": True,
        "--server-port": 0,                       # the apiserver comes over the socket only
        "--cluster-cert": SERVING_CERT,
        "--cluster-key": SERVING_KEY,
        "--agent-port": AGENT_PORT,
        "--agent-bind-address": host.address,
        "--admin-port": ADMIN_PORT,
        "--admin-bind-address": "127.0.0.1",
        "--health-port": HEALTH_PORT,
        "--health-bind-address": "127.0.0.1",
        # each agent pod dials every control host itself (see the module docstring)
        "--server-count": 1,
        "--agent-namespace": NAMESPACE,
        "--agent-service-account": AGENT,
        "--authentication-audience": AUDIENCE,
        "--kubeconfig": KUBECONFIG,
        "--cipher-suites": CIPHER_SUITES,
        "--tls-min-version": "VersionTLS12",
    })


def render_konnectivity_server(plan: HostPlan, inv: Inventory, host: HostSpec, material: Material) -> None:
    """Add the server to a control host's plan: socket directory, kubeconfig, egress selector
    config (read by the apiserver), the unit (started before the apiserver). Call it after
    render_control has added the apiserver's serving pair: that pair now restarts this unit
    too. A no-op with ``egress: routes``."""
    if not enabled(inv):
        return
    plan.mkdir(HostDir(SOCKET_DIR, 0o700))
    local = f"https://127.0.0.1:{inv.spec.apiServer.port}"
    ca_pem = issue.cert_pem(material.pair(CLUSTER_CA).cert)
    plan.add(HostFile(KUBECONFIG, kubeconfig(inv.metadata.name, local, ca_pem, SERVER_USER,
                                             client=material.pair(CERT_NAME)),
                      0o600, secret=True, restarts=(UNIT,)))
    plan.add(HostFile(EGRESS_CONFIG, to_yaml(egress_selector_config()), 0o600, restarts=(APISERVER_UNIT,)))
    for path in (SERVING_CERT, SERVING_KEY):
        f = plan.files.get(path)
        if f is not None and UNIT not in f.restarts:
            plan.files[path] = dataclasses.replace(f, restarts=(*f.restarts, UNIT))
    plan.add(unit_file(UNIT, "konnectivity-server.service.j2", binary=f"{BIN_DIR}/{SERVER_BINARY}",
                       flags=server_flags(inv, host), socket_dir=SOCKET_DIR))
    at = plan.units.index(APISERVER_UNIT) if APISERVER_UNIT in plan.units else len(plan.units)
    plan.units.insert(at, UNIT)


# --- the agents: API objects ----------------------------------------------------------------

def _container_name(i: int, target: str) -> str:
    name = f"to-{target}"
    return name if len(name) <= 63 else f"to-control-{i}"


def agent_targets(inv: Inventory) -> list[tuple[str, str, int]]:
    """(name, address, port) of each place the agents dial: every control host's server; for a
    hosted tenant every address exposing its servers (each agent container keeps dialing its
    address until it holds a tunnel to every replica: the servers' --server-count)."""
    if inv.hosted:
        return [(f"api-{i}", a, inv.hosted.expose.konnectivityPort) for i, a in enumerate(inv.hosted.expose.addresses)]
    return [(h.name, h.address, AGENT_PORT) for h in inv.controls]


def _agent_container(i: int, target: tuple[str, str, int]) -> dict:
    health = AGENT_HEALTH_PORT + 2 * i
    name, address, port = target
    return {
        "name": _container_name(i, name),
        "image": AGENT_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/proxy-agent"],
        "args": flags({
            "--proxy-server-host": address,
            "--proxy-server-port": port,
            "--ca-cert": f"{TOKEN_DIR}/ca.crt",
            "--service-account-token-path": f"{TOKEN_DIR}/{TOKEN_FILE}",
            "--admin-server-port": AGENT_ADMIN_PORT + 2 * i,
            "--health-server-port": health,
        }),
        "resources": {"requests": {"cpu": "10m", "memory": "30Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 65534,
            "runAsGroup": 65534,
        },
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": health},
                          "initialDelaySeconds": 15, "timeoutSeconds": 15},
        "volumeMounts": [{"name": "konnectivity", "mountPath": TOKEN_DIR, "readOnly": True}],
    }


def agent_objects(inv: Inventory) -> list[dict]:
    """ServiceAccount, the server's auth-delegator binding, the agent DaemonSet ([] with
    ``egress: routes``)."""
    if not enabled(inv):
        return []
    app = {"k8s-app": AGENT}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": AGENT, "namespace": NAMESPACE, "labels": dict(LABELS)},
         # the agent needs no API access: only its projected, audience-bound token
         "automountServiceAccountToken": False},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "hiddenplane:konnectivity-server", "labels": dict(LABELS)},
         "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "system:auth-delegator"},
         "subjects": [{"apiGroup": RBAC, "kind": "User", "name": SERVER_USER}]},
        {"apiVersion": "apps/v1", "kind": "DaemonSet",
         "metadata": {"name": AGENT, "namespace": NAMESPACE, "labels": {**LABELS, **app}},
         "spec": {
             "selector": {"matchLabels": dict(app)},
             "updateStrategy": {"type": "RollingUpdate"},
             "template": {
                 "metadata": {"labels": dict(app)},
                 "spec": {
                     "priorityClassName": "system-cluster-critical",
                     "serviceAccountName": AGENT,
                     "automountServiceAccountToken": False,
                     "hostNetwork": True,
                     "dnsPolicy": "ClusterFirstWithHostNet",
                     "nodeSelector": {"kubernetes.io/os": "linux"},
                     "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                     "containers": [_agent_container(i, t) for i, t in enumerate(agent_targets(inv))],
                     "volumes": [{"name": "konnectivity", "projected": {"sources": [
                         {"serviceAccountToken": {"path": TOKEN_FILE, "audience": AUDIENCE,
                                                  "expirationSeconds": 3600}},
                         {"configMap": {"name": "kube-root-ca.crt",
                                        "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                     ]}}],
                 },
             },
         }},
    ]
