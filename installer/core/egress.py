"""Which networking mode an inventory resolves to (no imports beyond the inventory, so the PKI
table can ask too)."""

from __future__ import annotations

from installer.core.inventory import Inventory


def egress_mode(inv: Inventory) -> str:
    """``routes`` or ``konnectivity``: how the control hosts reach pods, services and kubelets.

    ``spec.network.egress`` when set; otherwise ``routes`` with ``cni: routes`` (every host,
    control hosts included, gets static routes to each worker's pod CIDR) and ``konnectivity``
    with ``cni: cilium`` (whose pod network the control hosts, not being nodes, cannot route to)
    or a hosted control plane (its pods are in another cluster).
    """
    net = inv.spec.network
    if net.egress is not None:
        return net.egress
    return "konnectivity" if net.cni == "cilium" or inv.hosted else "routes"
