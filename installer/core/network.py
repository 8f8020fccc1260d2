"""The pod network of ``cni: routes``, pure: pod CIDR allocation, host routes, the CNI config.

**Allocation.** Each worker owns one slice of ``spec.network.podCIDR``: a /``nodeCIDRMaskSize``
for IPv4; for IPv6 a /(podCIDR prefix + 16), but never smaller than a /64. Slices are
allocated once and kept in the state directory (``network.yaml``, node -> CIDR), never
derived from a worker's position in the inventory: a worker keeps its slice across re-applies,
when others are added or removed, and when the host list is reordered. A new worker takes the
lowest free slice (new workers in name order, so the result is the same however the list is
written). A worker that leaves the inventory keeps its slice until it is released explicitly
(``release``; by hand: delete its line from ``network.yaml``), because its pods' addresses may
still be in use and a new node must not reuse them while the old one could still be running.
Entries that no longer fit (podCIDR or the mask changed) are re-allocated.

**Routes.** Every worker routes each *other* worker's slice via that worker's address; with
``egress: routes`` each control host routes every worker's slice the same way, so the hidden
control plane reaches pods (webhooks, aggregated APIs, ``kubectl logs/exec`` go to the kubelet,
which needs no route). Hosts must therefore share a layer-2 network, or the network between
them must carry the pod CIDRs. The routes carry the marker ``proto 199`` so that the unit can
flush exactly its own routes (a removed worker's route disappears on the next restart). The
kernel deletes the routes of a link that goes down and never adds them back: a timer puts the
missing ones back every ``REPAIR_EVERY`` seconds (``installer/core/render/network.py``).

**No NAT between pods.** The bridge plugin runs with ``ipMasq: false``: its masquerade rule
covers every destination outside the local slice, which would hide a pod's address from pods
on other workers (and from NetworkPolicy and the control plane). Traffic that leaves the pod
network altogether (to the Internet, to upstream resolvers) is masqueraded by the routes unit
instead, with one rule per worker: source the worker's slice, destination outside podCIDR.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from installer.core import components
from installer.core.errors import StateError

ROUTE_PROTO = 199                      # marks our routes: `ip route flush proto 199`
NETWORK_NAME = "hiddenplane"           # CNI network name; host-local keeps leases in /var/lib/cni/networks/<name>
BRIDGE = "cni0"
CONFLIST = "/etc/cni/net.d/10-hiddenplane.conflist"
ROUTES_UNIT = components.unit("hiddenplane-routes")
# what puts the routes back after a link flap: a timer, and the oneshot service it runs
REPAIR_TIMER = components.unit("hiddenplane-routes-repair")
REPAIR_SERVICE = REPAIR_TIMER.removesuffix(".timer") + ".service"
REPAIR_EVERY = 5                       # seconds between two runs of the repair
MASQ_CHAIN = "HIDDENPLANE-MASQ"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def slice_prefix(pod_cidr: str | Network, mask: int) -> int:
    """The prefix length of one worker's slice."""
    net = ipaddress.ip_network(pod_cidr)
    if net.version == 4:
        return mask
    return max(net.prefixlen, min(net.prefixlen + 16, 64))


def capacity(pod_cidr: str | Network, mask: int) -> int:
    """How many slices ``pod_cidr`` holds (0 when a slice would be larger than the network)."""
    net = ipaddress.ip_network(pod_cidr)
    prefix = slice_prefix(net, mask)
    return 0 if prefix < net.prefixlen else 2 ** (prefix - net.prefixlen)


def _slice(net: Network, prefix: int, index: int) -> Network:
    size = 2 ** (net.max_prefixlen - prefix)
    return ipaddress.ip_network((int(net.network_address) + index * size, prefix))


def allocate(pod_cidr: str, mask: int, existing: Mapping[str, str],
             workers: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The new allocation (node -> CIDR, sorted by node) and why each entry changed.

    Every entry of ``existing`` that still fits (inside ``pod_cidr``, the slice prefix, no
    overlap with an entry kept before it) is kept, for current workers and departed nodes
    alike; current workers without one take the lowest free slices. Raises StateError when
    the pod CIDR has no free slice left."""
    net = ipaddress.ip_network(pod_cidr)
    prefix = slice_prefix(net, mask)
    kept: dict[str, Network] = {}
    reasons: dict[str, str] = {}
    for node in sorted(existing):
        try:
            cidr = ipaddress.ip_network(existing[node])
        except (TypeError, ValueError):
            reasons[node] = f"{existing[node]!r} was not a CIDR; re-allocated"
            continue
        if cidr.version != net.version or not cidr.subnet_of(net) or cidr.prefixlen != prefix:
            reasons[node] = f"{cidr} no longer fits podCIDR {net} at /{prefix}"
            continue
        if any(cidr.overlaps(o) for o in kept.values()):
            reasons[node] = f"{cidr} overlapped another node's slice"
            continue
        kept[node] = cidr
    # a departed node whose entry no longer fits has nothing to keep
    for node in [n for n in reasons if n not in workers]:
        reasons[node] = "released (not in the inventory, and its slice no longer fits)"

    used = {int(c.network_address) for c in kept.values()}
    total = capacity(net, mask)
    index = 0
    for node in sorted(w for w in workers if w not in kept):
        while index < total and int(_slice(net, prefix, index).network_address) in used:
            index += 1
        if index >= total:
            gone = sorted(n for n in kept if n not in workers)
            held = (f"; {len(gone)} held by nodes no longer in the inventory ({', '.join(gone)}): release "
                    "them (delete their lines from the state's network.yaml) once they are gone") if gone else ""
            raise StateError(f"no free /{prefix} left in podCIDR {net} for worker {node}: {total} slice(s), "
                             f"{len(kept)} allocated{held}; or choose a larger spec.network.podCIDR or a longer "
                             "spec.network.nodeCIDRMaskSize")
        cidr = _slice(net, prefix, index)
        kept[node] = cidr
        used.add(int(cidr.network_address))
        reasons[node] = f"pod CIDR {cidr}" + (f" ({reasons[node]})" if node in reasons else "")
    return {n: str(kept[n]) for n in sorted(kept)}, reasons


def release(allocation: Mapping[str, str], nodes: Iterable[str]) -> dict[str, str]:
    """``allocation`` without ``nodes``: their slices become free for new workers."""
    drop = set(nodes)
    return {n: c for n, c in allocation.items() if n not in drop}


@dataclass(frozen=True)
class Route:
    dst: str      # a worker's pod CIDR
    via: str      # that worker's address
    node: str


def routes_for(host: str, role: str, workers: Sequence[tuple[str, str]], allocation: Mapping[str, str],
               egress: str) -> list[Route]:
    """The routes ``host`` needs: to every other worker's slice (workers), to every worker's
    slice (control hosts with ``egress: routes``), none otherwise. ``workers`` is
    (name, address) of the current workers."""
    if role == "control" and egress != "routes":
        return []
    return [Route(allocation[name], address, name) for name, address in workers if name != host]


def conflist(cidr: str) -> dict:
    """The CNI network configuration list of a worker whose slice is ``cidr``. The runtime
    invokes ``loopback`` itself; the plugins here run in order for every pod sandbox."""
    net = ipaddress.ip_network(cidr)
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,       # cni0 holds the slice's first address: the pods' gateway
                "ipMasq": False,         # no NAT between pods on different workers (module docstring)
                "hairpinMode": True,     # a pod reaching itself through a Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(net)}]],
                    "routes": [{"dst": "0.0.0.0/0" if net.version == 4 else "::/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
