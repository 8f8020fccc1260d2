"""NetworkPolicy enforcement for ``cni: routes``: SIG Network's kube-network-policies.

The bridge CNI of ``cni: routes`` enforces no NetworkPolicy: the API accepts policies and
nothing acts on them. ``spec.network.policy: kube-network-policies`` adds an enforcer, a
DaemonSet in the host network namespace of every worker. For each new connection of a pod
some policy selects, the kernel hands the first packet to the enforcer (netfilter queue), which
evaluates the policies and answers accept or drop; conntrack carries the rest of the
connection. Nothing is queued for pods no policy selects.

Why this one (docs/hosted.md, "NetworkPolicy enforcement"): it is a static Go binary with no
userland tools (nftables over netlink), from SIG Network, built here from its Go module
(tools/kubebuild). kube-router v2.1.0, the only kube-router the module proxy serves, has
security flaws reported against it; Cilium is ``cni: cilium``, a whole datapath. The build
changes one file of a dependency: the verdict rule queues through the x_tables NFQUEUE target
(nft_compat) instead of nftables' ``queue`` expression, which kernels built without
CONFIG_NFT_QUEUE (the lab's) refuse (tools/kubebuild/kube-network-policies-v0.8.0).

It fails closed: a policed pod's new connections are dropped while its node's enforcer is not
running (no ``--fail-open``). Its metrics listen on the node's loopback only.
"""

from __future__ import annotations

from installer.core.inventory import Inventory
from installer.core.render.manifests import LABELS, RBAC

NETPOL = "kube-network-policies"
NETPOL_VERSION = "v0.8.0"
# not upstream's registry.k8s.io/networking/kube-network-policies: this build differs (above)
NETPOL_IMAGE = f"localhost/hiddenplane/kube-network-policies:{NETPOL_VERSION}-xtqueue"
NETPOL_BINARY = "/bin/netpol"
NAMESPACE = "kube-system"
ENFORCER_CPU = "250m"             # its CPU request: _daemonset says why
QUEUE = 100                      # the netfilter queue number (kube-proxy and the CNI use none)
NFT_TABLE = "kube-network-policies"  # its nftables table (inet): its default name
METRICS = "127.0.0.1:9080"
ROLE = "hiddenplane:kube-network-policies"
APP = {"k8s-app": NETPOL}


def enforcer(inv: Inventory) -> str:
    """``spec.network.policy``: none, or the enforcer the installer runs."""
    return inv.spec.network.policy


def _meta(name: str, namespace: str | None = NAMESPACE) -> dict:
    meta: dict = {"name": name, "labels": {**LABELS, **APP}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _daemonset() -> dict:
    container = {
        "name": NETPOL,
        "image": NETPOL_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": [NETPOL_BINARY],
        # NRI (the runtime telling it a new pod's address before the API does) is off: the
        # workers' containerd runs no NRI plugins. A pod is policed once the enforcer has seen
        # its address in the API: its first packets, sent before, are not (issues.k8s.io/85966)
        "args": ["--hostname-override=$(NODE_NAME)", f"--nfqueue-id={QUEUE}", "--disable-nri",
                 f"--metrics-bind-address={METRICS}", "--v=1"],
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        # every new connection to a policed pod waits for its verdict, and a queue it does not
        # drain drops them (fail closed): under contention it must not be the pod that waits.
        # With 50m (a CPU weight of 51 beside the tenants' 50-100m pods) it stopped answering
        # for about a minute on a busy 2-core lab node, 100-200 packets queued, 100-222 dropped
        # (nfqueue_user_dropped), a tenant's API read timing out at 30 s (CI of 515ce1b's
        # successor). 250m, as calico-node requests by default
        "resources": {"requests": {"cpu": ENFORCER_CPU, "memory": "50Mi"}, "limits": {"memory": "200Mi"}},
        # nftables and the netfilter queue need CAP_NET_ADMIN in the node's network namespace
        "securityContext": {"privileged": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
    }
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(NETPOL),
        "spec": {
            "selector": {"matchLabels": dict(APP)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": dict(APP)},
                "spec": {
                    "hostNetwork": True,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    "priorityClassName": "system-node-critical",
                    "serviceAccountName": NETPOL,
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 10,
                    "containers": [container],
                },
            },
        },
    }


def netpol_objects(inv: Inventory) -> list[dict]:
    """The enforcer's ServiceAccount, RBAC (it reads pods, namespaces and policies) and
    DaemonSet; none when ``spec.network.policy`` is ``none``."""
    if enforcer(inv) != NETPOL:
        return []
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(NETPOL)},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole", "metadata": _meta(ROLE, None),
         "rules": [{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
                   {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding", "metadata": _meta(ROLE, None),
         "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": NETPOL, "namespace": NAMESPACE}]},
        _daemonset(),
    ]
