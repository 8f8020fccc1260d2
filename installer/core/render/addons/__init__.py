"""Cluster add-ons: what a cluster needs beyond the control plane and the joined workers.

- ``coredns``: the cluster DNS (API objects).
- ``konnectivity``: the apiserver's egress to the cluster when control hosts cannot route to
  the pod network (a systemd unit on each control host, apiserver flags and config, an agent
  DaemonSet).
- ``cilium``: the pod network with ``cni: cilium`` (Helm values and command line).
- ``netpol``: the NetworkPolicy enforcer of ``cni: routes`` (``spec.network.policy``).

Pure rendering, like the rest of ``render``: nothing here talks to a host or the API.
"""

from __future__ import annotations

from installer.core.egress import egress_mode
from installer.core.inventory import Inventory
from installer.core.render.addons.cilium import (
    CILIUM_CHART,
    CILIUM_VERSION,
    NAMESPACE,
    RELEASE,
    cilium_chart,
    cilium_values,
    cilium_values_yaml,
    helm_argv,
)
from installer.core.render.addons.coredns import COREDNS_IMAGE, COREDNS_VERSION, coredns_objects, corefile
from installer.core.render.addons.konnectivity import (
    AGENT_IMAGE,
    KONNECTIVITY_VERSION,
    SERVER_BINARY,
    agent_objects,
    apiserver_egress_flags,
    egress_selector_config,
    render_konnectivity_server,
    server_flags,
)
from installer.core.render.addons.netpol import NETPOL_IMAGE, NETPOL_VERSION, netpol_objects

__all__ = [
    "AGENT_IMAGE", "CILIUM_CHART", "CILIUM_VERSION", "COREDNS_IMAGE", "COREDNS_VERSION",
    "KONNECTIVITY_VERSION", "NAMESPACE", "NETPOL_IMAGE", "NETPOL_VERSION", "RELEASE", "SERVER_BINARY",
    "addon_objects", "agent_objects",
    "apiserver_egress_flags", "cilium_chart", "cilium_values", "cilium_values_yaml", "coredns_objects",
    "corefile", "egress_mode", "egress_selector_config", "helm_argv", "netpol_objects", "render_konnectivity_server",
    "server_flags",
]


def addon_objects(inv: Inventory) -> list[dict]:
    """Every add-on object sent through the API, in creation order: CoreDNS, the konnectivity
    agents (none with ``egress: routes``), the NetworkPolicy enforcer (none with ``policy: none``).
    Cilium is not here: Helm installs it."""
    return coredns_objects(inv) + agent_objects(inv) + netpol_objects(inv)
