"""Kubernetes objects the cluster-bootstrap phase sends through the API.

They are not host files: they go to the apiserver. Kept pure so that tests validate them
against the target version's schemas before anything is sent.
"""

from __future__ import annotations

from installer.core.inventory import Inventory
from installer.core.pki.material import Material
from installer.core.pki.specs import ADMIN_GROUP, kube_proxy_user

BOOTSTRAP_GROUP = "system:bootstrappers:hiddenplane"
SELF_NODE_CLIENT_ROLE = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
NODE_PROXIER_ROLE = "system:node-proxier"        # upstream's kube-proxy ClusterRole (bootstrap policy)
LABELS = {"app.kubernetes.io/managed-by": "hiddenplane"}
RBAC = "rbac.authorization.k8s.io"               # the RBAC API group, for every object rendered
AUTOUPDATE = "rbac.authorization.kubernetes.io/autoupdate"


def _binding(name: str, role: str, kind: str, subject: str) -> dict:
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": LABELS},
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": RBAC, "kind": kind, "name": subject}],
    }


def token_secret(node: str, material: Material) -> dict:
    t = material.tokens[node]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "bootstrap.kubernetes.io/token",
        "metadata": {"name": f"bootstrap-token-{t.id}", "namespace": "kube-system",
                     "labels": {**LABELS, "hiddenplane.io/node": node}},
        "stringData": {
            "description": f"hiddenplane: TLS bootstrap of node {node}",
            "token-id": t.id,
            "token-secret": t.secret,
            "expiration": t.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "usage-bootstrap-authentication": "true",
            "auth-extra-groups": BOOTSTRAP_GROUP,
        },
    }


# Bindings earlier releases made and this one must not leave behind: the group auto-approval of
# bootstrap CSRs let any token get a certificate for any node name (installer/host/csr_approval.py)
RETIRED_BINDINGS = ("hiddenplane:node-autoapprove-bootstrap",)


def cluster_rbac() -> list[dict]:
    # no nodeclient binding: the installer approves each node's first CSR itself
    return [
        _binding("hiddenplane:kubelet-bootstrap", "system:node-bootstrapper", "Group", BOOTSTRAP_GROUP),
        # lets `kubectl logs/exec` through: the apiserver's kubelet client may use the kubelet API
        _binding("hiddenplane:apiserver-kubelet-api-admin", "system:kubelet-api-admin", "User",
                 "kube-apiserver-kubelet-client"),
        _binding("hiddenplane:cluster-admins", "cluster-admin", "Group", ADMIN_GROUP),
    ]


def node_renewal_binding(node: str) -> dict:
    # One binding per node (not the kubeadm group binding): deleting it stops renewal for that
    # node alone, which is what `node revoke` relies on.
    return _binding(f"hiddenplane:node-renewal:{node}", SELF_NODE_CLIENT_ROLE, "User", f"system:node:{node}")


def kube_proxy_binding(node: str) -> dict:
    # One binding per node, like the renewal binding: `node revoke` and `node remove` delete it,
    # and the node's kube-proxy certificate then reads nothing (RBAC denies; reads never reach
    # admission, so the revoked-nodes policy could not stop them).
    user = kube_proxy_user(node)
    return _binding(user, NODE_PROXIER_ROLE, "User", user)


def shared_kube_proxy_binding() -> dict:
    """Upstream's built-in ClusterRoleBinding ``system:node-proxier`` with no subject, and
    protected from the apiserver's reconciliation.

    Earlier releases gave every worker one ``system:kube-proxy`` certificate (a year's validity)
    and relied on this binding, which grants that user cluster-wide reads of Services,
    EndpointSlices and Nodes: a copy taken from any worker, even one revoked since, would keep
    them. Deleting the binding is no use: every kube-apiserver start runs the RBAC bootstrap
    hook (pkg/registry/rbac/rest/storage_rbac.go, EnsureRBACPolicy), which re-creates a missing
    default binding and adds back missing subjects of an existing one, unless that one is
    annotated ``rbac.authorization.kubernetes.io/autoupdate: "false"``: then it is left exactly
    as it is (reconciliation/reconcile_rolebindings.go, ``Protected``). Upstream empties its own
    ``system:node`` binding the same way. The ClusterRole stays: the per-node bindings use it.
    The old certificate still authenticates until it expires, but is authorized for nothing.

    On a cluster upgraded from such a release, cluster-bootstrap runs before the workers
    phase: between the two, each old kube-proxy keeps its programmed rules but cannot re-list
    (403) until the workers phase gives it its own kubeconfig and restarts it."""
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": NODE_PROXIER_ROLE,
                     # upstream's label kept: it marks the object as one of the defaults
                     "labels": {"kubernetes.io/bootstrapping": "rbac-defaults", **LABELS},
                     "annotations": {AUTOUPDATE: "false"}},
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": NODE_PROXIER_ROLE},
        "subjects": [],
    }


def bootstrap_objects(inv: Inventory, material: Material, joined: frozenset[str] = frozenset()) -> list[dict]:
    """``joined``: workers whose kubelet holds its own client certificate. Their token did its
    job and was deleted (workers phase); it is never sent again."""
    objs = cluster_rbac()
    for h in inv.workers:
        objs.append(node_renewal_binding(h.name))
        if h.name not in joined:
            objs.append(token_secret(h.name, material))
    objs += [kube_proxy_binding(h.name) for h in inv.workers]
    objs.append(shared_kube_proxy_binding())
    objs += kubernetes_endpoints(inv)
    return objs


def kubernetes_endpoints(inv: Inventory) -> list[dict]:
    """With the workers' balancers: the ``kubernetes`` Service's Endpoints and EndpointSlice name
    the balancer address (the apiservers run with --endpoint-reconciler-type=none, so nothing
    else writes them), in the form the apiservers' own reconciler writes them (kubernetes
    pkg/controlplane/reconcilers/endpointsadapter.go: the Endpoints marked not to be mirrored,
    the slice named like the Service). A pod's connection to the Service reaches its own
    node's balancer, which holds that address."""
    if not inv.local_balancer:
        return []
    address, port = inv.balancer_address, inv.spec.apiServer.port
    family = "IPv6" if ":" in address else "IPv4"
    return [
        {"apiVersion": "v1", "kind": "Endpoints",
         "metadata": {"name": "kubernetes", "namespace": "default",
                      "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"}},
         "subsets": [{"addresses": [{"ip": address}],
                      "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}]},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kubernetes", "namespace": "default",
                      "labels": {"kubernetes.io/service-name": "kubernetes"}},
         "addressType": family,
         "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
         "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
    ]
