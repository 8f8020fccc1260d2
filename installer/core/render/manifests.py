"""Kubernetes objects the cluster-bootstrap phase sends through the API.

They are not host files: they go to the apiserver. Kept pure so that tests validate them
against the target version's schemas before anything is sent.
"""

from __future__ import annotations

from installer.core.inventory import Inventory
from installer.core.pki.material import Material
from installer.core.pki.specs import ADMIN_GROUP

BOOTSTRAP_GROUP = "system:bootstrappers:hiddenplane"
SELF_NODE_CLIENT_ROLE = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
LABELS = {"app.kubernetes.io/managed-by": "hiddenplane"}


def _binding(name: str, role: str, kind: str, subject: str) -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": LABELS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": subject}],
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


def bootstrap_objects(inv: Inventory, material: Material, joined: frozenset[str] = frozenset()) -> list[dict]:
    """``joined``: workers whose kubelet holds its own client certificate. Their token did its
    job and was deleted (workers phase); it is never sent again."""
    objs = cluster_rbac()
    for h in inv.workers:
        objs.append(node_renewal_binding(h.name))
        if h.name not in joined:
            objs.append(token_secret(h.name, material))
    return objs
