"""Files of a worker: containerd, kubelet (TLS bootstrapping) and kube-proxy.

A worker receives no secret it shares with another host: the kubelet starts from a per-node
bootstrap token and asks the cluster for its client certificate. What it does get is its own
serving certificate (signed by the cluster CA so the apiserver can verify the kubelet), the
cluster CA certificate, and its own kube-proxy client certificate (user
``hiddenplane:kube-proxy:<node>``, whose only rights are its own ClusterRoleBinding, deleted
by `node revoke` and `node remove`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from installer.core import components
from installer.core.inventory import HostSpec, Inventory
from installer.core.inventory_model import KUBELET_EVICTION_HARD
from installer.core.network import ROUTES_UNIT
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.pki.specs import CLUSTER_CA, kube_proxy_cert, kube_proxy_user, kubelet_serving_cert
from installer.core.render.balancer import add_balancer
from installer.core.render.ciphers import CIPHER_SUITES
from installer.core.render.files import (
    BIN_DIR,
    CNI_BIN_DIR,
    K8S_DIR,
    PKI_DIR,
    HostDir,
    HostFile,
    HostPlan,
    flags,
    render_template,
    to_yaml,
    unit_file,
)
from installer.core.render.kubeconfig import kubeconfig
from installer.core.render.network import CNI_CONF_DIR, SYSCTL_FILE, add_worker_network

KUBELET_DIR = "/var/lib/kubelet"
BOOTSTRAP_KUBECONFIG = f"{K8S_DIR}/bootstrap-kubelet.conf"
KUBELET_KUBECONFIG = f"{K8S_DIR}/kubelet.conf"       # written by the kubelet when it joins, then ours
KUBELET_CLIENT_PEM = "/var/lib/kubelet/pki/kubelet-client-current.pem"   # the kubelet's rotating pair
KUBELET_CONFIG = f"{KUBELET_DIR}/config.yaml"
KUBE_PROXY_DIR = "/var/lib/kube-proxy"
KUBE_PROXY_KUBECONFIG = f"{K8S_DIR}/kube-proxy.conf"
CONTAINERD_SOCK = "unix:///run/containerd/containerd.sock"
RESOLVED_RESOLV_CONF = "/run/systemd/resolve/resolv.conf"

MODULES = ("overlay", "br_netfilter")
SYSCTLS = {
    "net.bridge.bridge-nf-call-iptables": 1,
    "net.bridge.bridge-nf-call-ip6tables": 1,
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
}


@dataclass(frozen=True)
class HostFacts:
    """What rendering needs to know about a live host (gathered by apply; absent offline)."""

    systemd_resolved: bool = False
    kubelet_joined: bool = False      # the kubelet holds a client certificate of its own
    # a control host whose etcd member `etcd member add` registered: the --initial-cluster it
    # joins with --initial-cluster-state=existing (the etcd phase's membership read)
    etcd_join: str | None = None


def containerd_config_version(inv: Inventory) -> int:
    """containerd 2.x reads config version 3 (1.x only 2): follow the declared containerd."""
    return 3 if int(inv.spec.artifacts.versions.containerd.lstrip("v").split(".")[0]) >= 2 else 2


def resolv_conf(inv: Inventory, facts: HostFacts) -> str:
    if inv.spec.network.resolvConf:
        return inv.spec.network.resolvConf
    # systemd-resolved's /etc/resolv.conf names the stub 127.0.0.53: inside a pod that is the
    # pod itself, so CoreDNS would forward to itself and its loop plugin would stop it.
    return RESOLVED_RESOLV_CONF if facts.systemd_resolved else "/etc/resolv.conf"


def kubelet_config(inv: Inventory, facts: HostFacts) -> dict:
    net = inv.spec.network
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True, "cacheTTL": "2m0s"},
            "x509": {"clientCAFile": f"{PKI_DIR}/ca.crt"},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "systemd",
        "containerRuntimeEndpoint": CONTAINERD_SOCK,
        "clusterDNS": [net.clusterDNS],
        "clusterDomain": net.clusterDomain,
        "resolvConf": resolv_conf(inv, facts),
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        # CIS 4.2.10 once joined. While it bootstraps, the kubelet's first request goes the
        # non-rotating way (pkg/kubelet/certificate/bootstrap.LoadClientCert), which keeps its
        # key in <cert-dir>/kubelet-client.key.tmp until the certificate comes; the rotating
        # manager keeps it in memory only. The installer approves only a request made with that
        # key (installer/host/csr_approval.py): a thief holding the token has another one. The
        # workers phase turns rotation on as soon as the Node registered.
        "rotateCertificates": facts.kubelet_joined,
        # the serving certificate comes from the installer (cluster CA), not from a CSR
        "serverTLSBootstrap": False,
        "tlsCertFile": f"{KUBELET_DIR}/pki/kubelet.crt",
        "tlsPrivateKeyFile": f"{KUBELET_DIR}/pki/kubelet.key",
        "tlsCipherSuites": list(CIPHER_SUITES),
        "tlsMinVersion": "VersionTLS12",
        "makeIPTablesUtilChains": True,
        "podPidsLimit": 4096,
        "seccompDefault": True,
        "failSwapOn": True,
        "registerNode": True,
        # no podCIDR: it is read only in standalone mode. The pod range is in the CNI config
        # (render/network.py) and the workers phase sets Node.spec.podCIDR to the same slice.
    }
    if inv.spec.workerHosts.evictionHard:
        cfg["evictionHard"] = {**KUBELET_EVICTION_HARD, **inv.spec.workerHosts.evictionHard}
    if inv.spec.workerHosts.cgroupV1:
        # 1.35+ refuses to start on cgroup v1 unless told not to (deprecated upstream): only for
        # workers declared to need it, never by default
        cfg["failCgroupV1"] = False
    return cfg


def kubelet_kubeconfig(inv: Inventory, ca_pem: bytes) -> bytes:
    """A joined kubelet's kubeconfig, as the kubelet writes it after bootstrapping (the names
    of pkg/kubelet/certificate/bootstrap) but with the server it must use now."""
    return to_yaml({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "default-cluster", "cluster": {
            "server": inv.worker_api_url, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": "default-auth", "user": {"client-certificate": KUBELET_CLIENT_PEM,
                                                    "client-key": KUBELET_CLIENT_PEM}}],
        "contexts": [{"name": "default-context", "context": {"cluster": "default-cluster", "namespace": "default",
                                                             "user": "default-auth"}}],
        "current-context": "default-context",
        "preferences": {},
    })


def kubelet_flags(host: HostSpec) -> list[str]:
    return flags({
        "--config": KUBELET_CONFIG,
        "--bootstrap-kubeconfig": BOOTSTRAP_KUBECONFIG,
        # written by the kubelet itself once its CSR is approved and signed
        "--kubeconfig": KUBELET_KUBECONFIG,
        "--cert-dir": f"{KUBELET_DIR}/pki",
        "--node-ip": host.address,
    })


# kube-proxy in a container (spec.workerHosts.inContainer): 0 makes it leave nf_conntrack_max and
# the two TCP timeouts as the host has them instead of writing sysctls the container may not set
CONNTRACK_IN_CONTAINER = {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}


def kube_proxy_config(inv: Inventory) -> dict:
    cfg = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": KUBE_PROXY_KUBECONFIG},
        "clusterCIDR": inv.spec.network.podCIDR,
        "mode": "iptables",
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "0.0.0.0:10256",
    }
    if inv.spec.workerHosts.inContainer:
        cfg["conntrack"] = dict(CONNTRACK_IN_CONTAINER)
    return cfg


def render_worker(inv: Inventory, host: HostSpec, material: Material, facts: HostFacts) -> HostPlan:
    plan = HostPlan(host.name, "worker")
    for d in (HostDir(K8S_DIR, 0o755), HostDir(PKI_DIR, 0o755), HostDir(KUBELET_DIR, 0o700),
              HostDir(f"{KUBELET_DIR}/pki", 0o700), HostDir(KUBE_PROXY_DIR, 0o700),
              HostDir("/etc/containerd", 0o755)):
        plan.mkdir(d)
    containerd, kubelet, proxy = components.units("containerd", "kubelet", "kube-proxy")

    ca = material.pair(CLUSTER_CA)
    ca_pem = issue.cert_pem(ca.cert)
    # the balancer verifies the apiservers with it too (its health checks)
    balancer = (components.unit("api-balancer"),) if inv.local_balancer else ()
    plan.add(HostFile(f"{PKI_DIR}/ca.crt", ca_pem, 0o644, restarts=(kubelet, *balancer), trust=True))
    serving = material.pair(kubelet_serving_cert(host.name))
    plan.add(HostFile(f"{KUBELET_DIR}/pki/kubelet.crt", issue.cert_pem(serving.cert), 0o644, restarts=(kubelet,)))
    plan.add(HostFile(f"{KUBELET_DIR}/pki/kubelet.key", issue.key_pem(serving.key), 0o600, secret=True,
                      restarts=(kubelet,)))

    bootstrap = BOOTSTRAP_KUBECONFIG
    if facts.kubelet_joined:
        # the token did its job: no bootstrap credential stays on a joined worker
        plan.absent.append(bootstrap)
        # the kubeconfig the kubelet wrote when it joined names the server it bootstrapped
        # against: ours names the server it must use now (its balancer, or a new endpoint) and
        # the certificate the kubelet rotates (CA and server are not secret, the key is a path)
        plan.add(HostFile(KUBELET_KUBECONFIG, kubelet_kubeconfig(inv, ca_pem), 0o600, restarts=(kubelet,)))
    else:
        token = material.tokens[host.name]
        plan.add(HostFile(bootstrap, kubeconfig(inv.metadata.name, inv.worker_api_url, ca_pem,
                                                f"system:bootstrap:{token.id}", token=token.value),
                          0o600, secret=True, restarts=(kubelet,)))
    # this node's own identity: a cluster from an earlier release had one shared pair here, and
    # this file (its only copy on the host) is replaced by the node's own on the next apply
    plan.add(HostFile(KUBE_PROXY_KUBECONFIG,
                      kubeconfig(inv.metadata.name, inv.worker_api_url, ca_pem, kube_proxy_user(host.name),
                                 client=material.pair(kube_proxy_cert(host.name))),
                      0o600, secret=True, restarts=(proxy,)))
    plan.add(HostFile(KUBELET_CONFIG, to_yaml(kubelet_config(inv, facts)), 0o600, restarts=(kubelet,)))
    plan.add(HostFile(f"{KUBE_PROXY_DIR}/config.yaml", to_yaml(kube_proxy_config(inv)), 0o600, restarts=(proxy,)))
    plan.add(HostFile("/etc/containerd/config.toml",
                      render_template("containerd-config.toml.j2", sandbox_image=inv.spec.artifacts.sandboxImage,
                                      cni_bin_dir=CNI_BIN_DIR, cni_conf_dir=CNI_CONF_DIR, runc=f"{BIN_DIR}/runc",
                                      version=containerd_config_version(inv),
                                      restrict_oom_score_adj=inv.spec.workerHosts.inContainer),
                      0o644, restarts=(containerd,)))
    # loaded at boot; preflight requires them loaded already (containers cannot load modules)
    plan.add(HostFile("/etc/modules-load.d/hiddenplane.conf", "".join(f"{m}\n" for m in MODULES).encode(), 0o644))
    # applied at once by hiddenplane-routes.service (render/network.py), at boot by systemd-sysctl too
    plan.add(HostFile(SYSCTL_FILE, "".join(f"{k} = {v}\n" for k, v in SYSCTLS.items()).encode(), 0o644,
                      restarts=(ROUTES_UNIT,)))
    add_worker_network(plan, inv, host, material)

    add_balancer(plan, inv, host)     # before the units that use it
    plan.add(unit_file(containerd, "containerd.service.j2", binary=f"{BIN_DIR}/containerd",
                       config="/etc/containerd/config.toml"))
    plan.add(unit_file(kubelet, "kubelet.service.j2", binary=f"{BIN_DIR}/kubelet", flags=kubelet_flags(host)))
    plan.add(unit_file(proxy, "kube-proxy.service.j2", binary=f"{BIN_DIR}/kube-proxy",
                       flags=flags({"--config": f"{KUBE_PROXY_DIR}/config.yaml"})))
    plan.units += [containerd, kubelet, proxy]     # after the routes unit
    return plan
