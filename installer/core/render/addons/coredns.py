"""CoreDNS: the cluster DNS, as API objects (ServiceAccount, RBAC, Corefile, Deployment, Service).

The Service ``kube-system/kube-dns`` takes ``spec.network.clusterDNS``, the address every
kubelet writes into pods' resolv.conf. CoreDNS itself runs with ``dnsPolicy: Default``: its
/etc/resolv.conf is the kubelet's ``resolvConf``, and that is where it forwards names outside
the cluster unless ``spec.network.upstreamDNS`` names resolvers. On hosts running
systemd-resolved that file must not be the stub 127.0.0.53 (inside the pod it is the pod
itself); the kubelet config picks /run/systemd/resolve/resolv.conf there, and the ``loop``
plugin stays on so a loop that slips through stops CoreDNS loudly instead of answering
SERVFAIL forever.
"""

from __future__ import annotations

from installer.core.inventory import Inventory
from installer.core.render.manifests import LABELS, RBAC

COREDNS_VERSION = "v1.14.2"
COREDNS_IMAGE = f"registry.k8s.io/coredns/coredns:{COREDNS_VERSION}"
NAMESPACE = "kube-system"
NAME = "coredns"
SERVICE_NAME = "kube-dns"
APP = {"k8s-app": SERVICE_NAME}
RESOLV_CONF = "/etc/resolv.conf"     # inside the pod: the kubelet's resolvConf (dnsPolicy Default)
HEALTH_PORT = 8080
READY_PORT = 8181
METRICS_PORT = 9153
ROLE = "hiddenplane:coredns"


def _meta(name: str, namespace: str | None = NAMESPACE, **labels: str) -> dict:
    meta: dict = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = {**LABELS, **labels}
    return meta


def forward_to(inv: Inventory) -> list[str]:
    """Where CoreDNS sends names outside the cluster: ``upstreamDNS``, else the pod's resolv.conf."""
    return list(inv.spec.network.upstreamDNS) or [RESOLV_CONF]


def corefile(inv: Inventory) -> str:
    domain = inv.spec.network.clusterDomain
    return (
        ".:53 {\n"
        "    errors\n"
        "    health {\n"
        "       lameduck 5s\n"
        "    }\n"
        "    ready\n"
        f"    kubernetes {domain} in-addr.arpa ip6.arpa {{\n"
        "       pods insecure\n"
        "       fallthrough in-addr.arpa ip6.arpa\n"
        "       ttl 30\n"
        "    }\n"
        f"    prometheus :{METRICS_PORT}\n"
        f"    forward . {' '.join(forward_to(inv))} {{\n"
        "       max_concurrent 1000\n"
        "    }\n"
        "    cache 30\n"
        "    loop\n"
        "    reload\n"
        "    loadbalance\n"
        "}\n"
    )


def _rbac() -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(NAME)},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole", "metadata": _meta(ROLE, None),
         "rules": [
             {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
              "verbs": ["list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
         ]},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding", "metadata": _meta(ROLE, None),
         "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": ROLE},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
    ]


def _container() -> dict:
    return {
        "name": NAME,
        "image": COREDNS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "resources": {"limits": {"memory": "170Mi"}, "requests": {"cpu": "100m", "memory": "70Mi"}},
        "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
        "ports": [
            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": HEALTH_PORT, "scheme": "HTTP"},
            "initialDelaySeconds": 60, "timeoutSeconds": 5, "successThreshold": 1, "failureThreshold": 5,
        },
        "readinessProbe": {"httpGet": {"path": "/ready", "port": READY_PORT, "scheme": "HTTP"}},
    }


def _deployment() -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(NAME, **APP),
        "spec": {
            "replicas": 2,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "selector": {"matchLabels": dict(APP)},
            "template": {
                "metadata": {"labels": dict(APP)},
                "spec": {
                    "priorityClassName": "system-cluster-critical",
                    "serviceAccountName": NAME,
                    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    # the two replicas on different workers when there are two
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchExpressions": [
                                {"key": "k8s-app", "operator": "In", "values": [SERVICE_NAME]}]},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }]}},
                    "containers": [_container()],
                    # the node's resolver (the kubelet's resolvConf), not the cluster DNS itself
                    "dnsPolicy": "Default",
                    "volumes": [{"name": "config-volume", "configMap": {
                        "name": NAME, "items": [{"key": "Corefile", "path": "Corefile"}]}}],
                },
            },
        },
    }


def _service(inv: Inventory) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**_meta(SERVICE_NAME, **APP, **{"kubernetes.io/cluster-service": "true",
                                                     "kubernetes.io/name": "CoreDNS"}),
                     "annotations": {"prometheus.io/port": str(METRICS_PORT), "prometheus.io/scrape": "true"}},
        "spec": {
            "selector": dict(APP),
            "clusterIP": inv.spec.network.clusterDNS,
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                {"name": "metrics", "port": METRICS_PORT, "protocol": "TCP", "targetPort": METRICS_PORT},
            ],
        },
    }


def coredns_objects(inv: Inventory) -> list[dict]:
    """ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap, Deployment, Service, in the
    order they can be created."""
    return [
        *_rbac(),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(NAME), "data": {"Corefile": corefile(inv)}},
        _deployment(),
        _service(inv),
    ]
