"""Host files of the pod network (``cni: routes``): the CNI config and the routes unit.

``hiddenplane-routes.service`` is a oneshot that, on every worker, applies the kernel settings
of ``/etc/sysctl.d/90-hiddenplane.conf`` (also where systemd-sysctl.service is skipped, e.g. in
containers; the file changing restarts this unit, so new settings take effect at once) and,
with ``cni: routes``, routes each other worker's pod CIDR via that worker and masquerades pod
traffic that leaves the pod network. On control hosts with ``egress: routes`` it only routes
every worker's pod CIDR. See ``installer/core/network.py`` for the allocation and the reasons.

**After a link flap.** The kernel deletes a route when the link its gateway is on goes down,
and adds nothing back when the link returns (ifdown/ifup, a network restart, a switch port
flap): until the next apply or boot, the host's pods lose the other workers. Wherever the routes
unit routes (``cni: routes``), ``hiddenplane-routes-repair.timer`` runs
``hiddenplane-routes-repair.service`` every ``REPAIR_EVERY`` seconds, which runs
``installer/sh/routes-repair.sh`` over the same route list (``host_routes``, rendered into both
units): each missing route is added again with ``ip route replace``, the others are left alone.
Why a timer: systemd has no event for "a link came up" that every host has (networkd's and
NetworkManager's hooks are theirs; a path unit cannot watch a carrier in sysfs), and a
long-running ``ip monitor`` loop is a daemon to keep alive; a timer is a few lines of unit, costs
one short ``sh`` a run, and never disturbs routes in use (no flush: ``ip route replace`` of a
route that is there is a no-op in the kernel). The run is quiet (systemd's start/finish lines
filtered, ``LogLevelMax=notice``) and exits 0 while the link is still down, so a flap leaves no
failed unit behind. The timer is part of the routes unit (``PartOf``): stopping that unit (routes
flushed on purpose, a teardown) stops the repair too. It is rendered with an empty list too (a
single worker): apply never stops and removes a unit that leaves the plan, so a timer rendered
only while other workers exist would outlive the last ``node remove`` with its old list and put
the removed worker's route back.
"""

from __future__ import annotations

import ipaddress
import json

from installer.core import components, network
from installer.core.egress import egress_mode
from installer.core.errors import RenderError
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import Material
from installer.core.render.files import BIN_DIR, SYSTEMD_DIR, HostDir, HostFile, HostPlan, render_template, unit_file
from installer.core.shellfiles import shell_file

CNI_DIR = "/etc/cni"
CNI_CONF_DIR = f"{CNI_DIR}/net.d"
SYSCTL_FILE = "/etc/sysctl.d/90-hiddenplane.conf"
# /lib and /sbin: present on merged-/usr systems and on older unmerged ones alike
SYSCTL_BIN = "/lib/systemd/systemd-sysctl"
IP_BIN = "/sbin/ip"
IPTABLES = {4: "/usr/sbin/iptables", 6: "/usr/sbin/ip6tables"}
REPAIR_SCRIPT = f"{BIN_DIR}/hiddenplane-routes-repair"


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


def repairs_routes(inv: Inventory, host: HostSpec) -> bool:
    """Whether the host gets the repair timer: wherever its routes unit routes (``cni: routes``),
    also while the list is empty (module docstring)."""
    return inv.spec.network.cni == "routes" and needs_routes_unit(inv, host)


def repair_script() -> bytes:
    return ("#!/bin/sh\n# Managed by hiddenplane: changes are overwritten by `installer apply`.\n"
            + shell_file("routes-repair.sh", ip=IP_BIN)).encode()


def repair_files(inv: Inventory, host: HostSpec, material: Material) -> list[HostFile]:
    """The repair's script, its service (the host's routes, as the routes unit has them) and
    its timer."""
    values = {"routes_unit": network.ROUTES_UNIT, "every": network.REPAIR_EVERY,
              "service": network.REPAIR_SERVICE, "timer": network.REPAIR_TIMER}
    service = render_template("hiddenplane-routes-repair.service.j2", script=REPAIR_SCRIPT,
                              family=ipaddress.ip_network(inv.spec.network.podCIDR).version,
                              proto=network.ROUTE_PROTO, routes=host_routes(inv, host, material), **values)
    return [HostFile(REPAIR_SCRIPT, repair_script(), 0o755),
            # restarts nothing: the timer's next run reads the new list (apply reloads systemd)
            HostFile(f"{SYSTEMD_DIR}/{network.REPAIR_SERVICE}", service, 0o600),
            unit_file(network.REPAIR_TIMER, "hiddenplane-routes-repair.timer.j2", **values)]


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
        repair_timer=network.REPAIR_TIMER if repairs_routes(inv, host) else None,
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
    _add_repair(plan, inv, host, material, 1)


def add_control_network(plan: HostPlan, inv: Inventory, host: HostSpec, material: Material) -> None:
    if needs_routes_unit(inv, host):
        plan.add(routes_unit(inv, host, material))
        plan.units.append(network.ROUTES_UNIT)
        _add_repair(plan, inv, host, material, len(plan.units))


def _add_repair(plan: HostPlan, inv: Inventory, host: HostSpec, material: Material, at: int) -> None:
    """The repair's files, and its timer among the units right after the routes unit (a
    teardown stops it first)."""
    if repairs_routes(inv, host):
        for f in repair_files(inv, host, material):
            plan.add(f)
        plan.units.insert(at, network.REPAIR_TIMER)

