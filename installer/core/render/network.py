"""Host files of the pod network (``cni: routes``): the CNI config and the routes unit.

``hiddenplane-routes.service`` is a oneshot that, on every worker, applies the kernel settings
of ``/etc/sysctl.d/90-hiddenplane.conf`` (also where systemd-sysctl.service is skipped, e.g. in
containers; the file changing restarts this unit, so new settings take effect at once) and,
with ``cni: routes``, routes each other worker's pod CIDR via that worker and masquerades pod
traffic that leaves the pod network. On control hosts with ``egress: routes`` it only routes
every worker's pod CIDR. See ``installer/core/network.py`` for the allocation and the reasons.
"""

from __future__ import annotations

import ipaddress
import json

from installer.core import components, network
from installer.core.egress import egress_mode
from installer.core.errors import RenderError
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import Material
from installer.core.render.files import HostDir, HostFile, HostPlan, unit_file

CNI_DIR = "/etc/cni"
CNI_CONF_DIR = f"{CNI_DIR}/net.d"
SYSCTL_FILE = "/etc/sysctl.d/90-hiddenplane.conf"
# /lib and /sbin: present on merged-/usr systems and on older unmerged ones alike
SYSCTL_BIN = "/lib/systemd/systemd-sysctl"
IP_BIN = "/sbin/ip"
IPTABLES = {4: "/usr/sbin/iptables", 6: "/usr/sbin/ip6tables"}


def egress(inv: Inventory) -> str:
    """``routes`` or ``konnectivity`` (``spec.network.egress`` with its default)."""
    return egress_mode(inv)


def pod_cidr(material: Material, node: str) -> str:
    try:
        return material.pod_cidrs[node]
    except KeyError:
        raise RenderError(f"{node}: no pod CIDR allocated in the state (network.yaml)") from None


def host_routes(inv: Inventory, host: HostSpec, material: Material) -> list[network.Route]:
    if inv.spec.network.cni != "routes":
        return []
    workers = [(w.name, w.address) for w in inv.workers]
    for name, _ in workers:
        pod_cidr(material, name)
    return network.routes_for(host.name, host.role, workers, material.pod_cidrs, egress(inv))


def needs_routes_unit(inv: Inventory, host: HostSpec) -> bool:
    """Workers always (their sysctls); control hosts when they route to pods."""
    return host.role == "worker" or (inv.spec.network.cni == "routes" and egress(inv) == "routes")


def routes_unit(inv: Inventory, host: HostSpec, material: Material) -> HostFile:
    pod_net = ipaddress.ip_network(inv.spec.network.podCIDR)
    routes = host_routes(inv, host, material)
    worker = host.role == "worker"
    masq = worker and inv.spec.network.cni == "routes"
    if worker:
        purpose = ("Kernel settings for pods; with cni: routes, routes to the other workers' pod CIDRs "
                   "and masquerade of pod traffic leaving the pod network.")
        summary = "sysctls and routes to other workers' pods" if masq else "sysctls"
    else:
        purpose = "Routes from this hidden control host to every worker's pod CIDR (egress: routes)."
        summary = "routes to every worker's pods"
    return unit_file(
        network.ROUTES_UNIT, "hiddenplane-routes.service.j2",
        purpose=purpose, summary=summary,
        before=list(components.units("containerd", "kubelet") if worker else components.units("kube-apiserver")),
        sysctl_file=SYSCTL_FILE if worker else None, sysctl_bin=SYSCTL_BIN,
        ip=IP_BIN, family=pod_net.version, proto=network.ROUTE_PROTO, routes=routes,
        iptables=IPTABLES[pod_net.version],
        masq={"chain": network.MASQ_CHAIN, "pod_cidr": str(pod_net)} if masq else None)


def add_worker_network(plan: HostPlan, inv: Inventory, host: HostSpec, material: Material) -> None:
    """The CNI config (``cni: routes``) and the routes unit, first among the worker's units."""
    if inv.spec.network.cni == "routes":
        plan.mkdir(HostDir(CNI_DIR, 0o755))
        plan.mkdir(HostDir(CNI_CONF_DIR, 0o755))
        # containerd watches the directory and reloads the config itself: no restart
        conf = network.conflist(pod_cidr(material, host.name))
        plan.add(HostFile(network.CONFLIST, (json.dumps(conf, indent=2) + "\n").encode(), 0o644))
    plan.add(routes_unit(inv, host, material))
    plan.units.insert(0, network.ROUTES_UNIT)


def add_control_network(plan: HostPlan, inv: Inventory, host: HostSpec, material: Material) -> None:
    if needs_routes_unit(inv, host):
        plan.add(routes_unit(inv, host, material))
        plan.units.append(network.ROUTES_UNIT)

