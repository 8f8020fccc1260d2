"""The names a hosted tenant's etcd members are reached at (docs/hosted.md, "Addresses that
outlive a roll" and "A lost hosting node"): each member's own Service, and the one Service the
apiservers dial. Pure: names only; render/tenant.py makes the Services.
"""

from __future__ import annotations

from installer.core import components
from installer.core.inventory import Inventory
from installer.core.pki.specs import ETCD_NEAR, ETCD_SERVICE

ETCD_PORT, PEER_PORT = components.port("etcd", "client"), components.port("etcd", "peer")


# Each member is reached at its own ClusterIP Service (``member_service``), never at its pod's
# address: a member's pod comes back from a roll with a new address, and the hosting cluster's
# DNS keeps answering the old one for as long as it caches (30 s with CoreDNS as kubeadm and we
# set it up). Through the headless Service's pod names, a roll of the three members outran that
# cache: the apiservers dialed two stale addresses and a stopping member, and two restarted
# members could not dial each other (no quorum): 10-20 s without etcd in every roll on the lab,
# and with both replicas unready the tenant's Service refused connections (CI of 2acfb75).
# A Service's address never changes; its endpoint follows the pod within a second.

def member_host(inv: Inventory, member: str) -> str:
    """The DNS name of member ``member``'s Service (a pod's name, as the StatefulSet names it)."""
    return f"{member}.{inv.hosted_namespace}.svc"


def member_peer_url(inv: Inventory, member: str) -> str:
    """The peer URL of etcd member ``member``: every start and every membership change uses it."""
    return f"https://{member_host(inv, member)}:{PEER_PORT}"


def legacy_peer_url(inv: Inventory, member: str) -> str:
    """The peer URL tenants applied before the members' Services had (the pod's name under the
    headless Service): `apply` moves a running tenant's members off it (host/tenant_members.py)."""
    return f"https://{member}.{ETCD_SERVICE}.{inv.hosted_namespace}.svc:{PEER_PORT}"


def member_client_url(inv: Inventory, member: str) -> str:
    return f"https://{member_host(inv, member)}:{ETCD_PORT}"


# The apiservers dial etcd at one Service that sends each new connection to a member on the
# client's own hosting node when one is ready there, else to any ready member. Listing every
# member instead, each replica's etcd client spread its requests over all of them (round robin),
# so when a hosting node was cut off, the surviving replica's requests sent on its connection
# to the lost member waited until gRPC's keepalive gave that connection up (10 s, not a flag of
# the apiserver): 1-2 failed tenant requests per path at every cut (CI of a2cbb8f, dd2baaa), and
# a few more after the return while the returning member caught up. The systemd mode learnt the
# same (docs/ha.md: each apiserver uses its own host's member). The choice is made per
# connection: an apiserver whose member left (a roll) stays on the member it reconnected to
# until its next restart. Ready members only: a learner or a member catching up gets no client.

def near_url(inv: Inventory) -> str:
    return f"https://{ETCD_NEAR}.{inv.hosted_namespace}.svc:{ETCD_PORT}"
