"""The certificate table: every identity the cluster needs, declared kubeadm-style.

One row per certificate (name, signing CA, CN, O, usages, SANs). The names double as file
stems in the state directory and on the hosts, so ``etcd/server-cp1`` is
``pki/etcd/server-cp1.crt`` + ``.key``. Kubelet *client* certificates are absent on purpose:
kubelets obtain them through TLS bootstrapping.

Per-node rows (one per worker): the kubelet's serving certificate and kube-proxy's client
certificate. kube-proxy's identity is the node's own so that `node revoke` can end it (its
ClusterRoleBinding, render/manifests.py); a shared one would outlive every revocation.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from installer.core.egress import egress_mode
from installer.core.inventory import Inventory
from installer.core.inventory_fields import apiserver_san_values
from installer.core.inventory_hosted import ETCD_MEMBER_COUNTS, hosted_san_values

CLUSTER_CA = "ca"
ETCD_CA = "etcd/ca"
FRONT_PROXY_CA = "front-proxy-ca"

FRONT_PROXY_CLIENT_CN = "front-proxy-client"
ADMIN_GROUP = "kubeadm:cluster-admins"


def kube_proxy_user(node: str) -> str:
    """The user a worker's kube-proxy authenticates as: no O (no group), so the only rights it
    has are those of its own binding, which `node revoke` and `node remove` delete."""
    return f"hiddenplane:kube-proxy:{node}"


def kube_proxy_cert(node: str) -> str:
    return f"kube-proxy/{node}"


def kubelet_serving_cert(node: str) -> str:
    return f"kubelet/{node}-serving"


@dataclass(frozen=True)
class CASpec:
    name: str
    cn: str


@dataclass(frozen=True)
class CertSpec:
    name: str
    ca: str
    cn: str
    orgs: tuple[str, ...] = ()
    server: bool = False
    client: bool = False
    dns_names: frozenset[str] = field(default_factory=frozenset)
    ips: frozenset[str] = field(default_factory=frozenset)

    @property
    def sans(self) -> frozenset[str]:
        return self.dns_names | self.ips


CAS = (
    CASpec(CLUSTER_CA, "kubernetes-ca"),
    CASpec(ETCD_CA, "etcd-ca"),
    CASpec(FRONT_PROXY_CA, "front-proxy-ca"),
)


def _split_sans(values) -> tuple[frozenset[str], frozenset[str]]:
    dns, ips = set(), set()
    for v in values:
        try:
            ips.add(str(ipaddress.ip_address(v)))
        except ValueError:
            dns.add(v)
    return frozenset(dns), frozenset(ips)


def apiserver_sans(inv: Inventory) -> tuple[frozenset[str], frozenset[str]]:
    hosted = hosted_san_values(inv.metadata.name, inv.hosted.model_dump()) if inv.hosted else []
    return _split_sans(apiserver_san_values(inv.spec.network.clusterDomain, inv.kubernetes_service_ip,
                                            inv.endpoint, [*inv.spec.apiServer.extraSANs, *hosted],
                                            [(h.name, h.address) for h in inv.controls]))


# a hosted tenant's etcd members are the pods of one StatefulSet: one server and one peer
# certificate for all of them, naming each pod's DNS name through the headless Service
HOSTED_ETCD = "hosted"
# the CN of the one peer certificate every member of a hosted etcd shares: its members accept no
# other certificate of the etcd CA as a peer (render/tenant.py, --peer-cert-allowed-cn)
HOSTED_PEER_CN = "etcd-peer"
ETCD_SERVICE = "etcd"
# the apiservers' one etcd address: a Service that prefers its client's own node's member
# (render/tenant.py, near_service)
ETCD_NEAR = "etcd-near"


def hosted_etcd_sans(namespace: str) -> tuple[frozenset[str], frozenset[str]]:
    svc = f"{ETCD_SERVICE}.{namespace}.svc"
    # each member's own Service (render/tenant.py, member_service), for every count a tenant
    # may grow to: a member added later needs no new certificate; the pods' names under the
    # headless Service too, which tenants applied before those Services still dial until apply
    # moves them
    members = [f"{ETCD_SERVICE}-{i}.{namespace}.svc" for i in range(max(ETCD_MEMBER_COUNTS))]
    return _split_sans([*members, f"{ETCD_NEAR}.{namespace}.svc", f"*.{svc}", svc, f"*.{ETCD_SERVICE}",
                        "localhost", "127.0.0.1", "::1"])


def etcd_member_sans(name: str, address: str) -> tuple[frozenset[str], frozenset[str]]:
    return _split_sans([name, "localhost", address, "127.0.0.1", "::1"])


def cert_specs(inv: Inventory) -> list[CertSpec]:
    dns, ips = apiserver_sans(inv)
    specs = [
        CertSpec("apiserver", CLUSTER_CA, "kube-apiserver", server=True, dns_names=dns, ips=ips),
        CertSpec("apiserver-kubelet-client", CLUSTER_CA, "kube-apiserver-kubelet-client", client=True),
        CertSpec("apiserver-etcd-client", ETCD_CA, "kube-apiserver-etcd-client", client=True),
        CertSpec("front-proxy-client", FRONT_PROXY_CA, FRONT_PROXY_CLIENT_CN, client=True),
        CertSpec("etcd/healthcheck-client", ETCD_CA, "kube-etcd-healthcheck-client", client=True),
        CertSpec("controller-manager", CLUSTER_CA, "system:kube-controller-manager", client=True),
        CertSpec("scheduler", CLUSTER_CA, "system:kube-scheduler", client=True),
        CertSpec("admin", CLUSTER_CA, "kubernetes-admin", (ADMIN_GROUP,), client=True),
        # Break-glass identity in system:masters: kept in the state only, never on a host, for
        # when RBAC itself is broken (admin's binding is ordinary RBAC and can be deleted).
        CertSpec("super-admin", CLUSTER_CA, "kubernetes-super-admin", ("system:masters",), client=True),
    ]
    if egress_mode(inv) == "konnectivity":
        # konnectivity-server's kubeconfig: TokenReviews of agent tokens (bound to
        # system:auth-delegator); it serves agents with the apiserver's own pair
        specs.append(CertSpec("konnectivity-server", CLUSTER_CA, "system:konnectivity-server", client=True))
    if inv.hosted:
        d, i = hosted_etcd_sans(inv.hosted_namespace)
        for kind, cn in (("server", "etcd-server"), ("peer", HOSTED_PEER_CN)):
            specs.append(CertSpec(f"etcd/{kind}-{HOSTED_ETCD}", ETCD_CA, cn, server=True, client=True,
                                  dns_names=d, ips=i))
    for h in inv.controls:
        d, i = etcd_member_sans(h.name, h.address)
        specs.append(CertSpec(f"etcd/server-{h.name}", ETCD_CA, h.name, server=True, client=True, dns_names=d, ips=i))
        specs.append(CertSpec(f"etcd/peer-{h.name}", ETCD_CA, h.name, server=True, client=True, dns_names=d, ips=i))
    for h in inv.workers:
        # this node's name and address only: the inventory refuses a worker named or addressed
        # like the API (inventory_rules.py), so no serving certificate of a worker names the API
        d, i = _split_sans([h.name, h.address])
        specs.append(CertSpec(kubelet_serving_cert(h.name), CLUSTER_CA, f"system:node:{h.name}",
                              ("system:nodes",), server=True, dns_names=d, ips=i))
        specs.append(CertSpec(kube_proxy_cert(h.name), CLUSTER_CA, kube_proxy_user(h.name), client=True))
    return specs
