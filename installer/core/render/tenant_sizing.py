"""What a hosted tenant's control plane may take of its hosting cluster, and where it may run
(docs/hosted.md, "Neighbours"): a tenant shares nodes, memory and disk with every other tenant.

- ``SIZING`` (core/inventory_hosted.py, beside the field that overrides it key by key): each
  component's requests and memory limit, from its use at rest measured on the lab
  (benchmarks/hosted_sizing.py measures it under load too). Requests put
  every pod in the Burstable class, not BestEffort (the first evicted or OOM-killed); the memory
  limit stops one tenant's leak at its own container. No CPU limit: throttling an apiserver
  fails its probes, and CPU is shared by requests.
- A PriorityClass above ordinary workloads: under pressure the scheduler preempts those, not a
  tenant's control plane. One per tenant (cluster-scoped, named for its namespace): the admin
  who removes one tenant's access objects, or its reset, takes no other tenant's class away.
- A ResourceQuota and a LimitRange in the tenant's namespace, sized from the same figures: the
  tenant's pods with room for their rolling updates, and nothing more; its NodePorts, volumes and
  storage counted. They are the hosting admin's (``installer hosting-access`` prints them): an
  operator of least privilege may read them, not lift them.
- etcd's backend quota below its volume's size (a full disk would stop the member and fill a
  hosting node shared with others), its own compaction besides the apiservers'.
- Where the pods run: core/render/tenant_placement.py.

Pure: quantities are parsed and written here the way the API writes them back.
"""

from __future__ import annotations

from fractions import Fraction

from installer.core.inventory import Inventory
from installer.core.inventory_hosted import ETCD_MEMBER_COUNTS, SIZING, quantity
from installer.core.render.manifests import LABELS
from installer.core.render.tenant_network import TENANT_LABEL

PRIORITY_CLASS_PREFIX = "hiddenplane-tenant-"
# above every ordinary workload (0 by default), far below the system classes (2,000,000,000 and
# more), which keep the hosting cluster's own DNS, CNI and the like ahead of any tenant
PRIORITY = 1_000_000

# the emptyDirs of an apiserver pod: the konnectivity socket, and the audit log, rotated below
# its limit (a volume over its sizeLimit gets the pod evicted)
SOCKET_LIMIT = "1Mi"
AUDIT_LIMIT = "256Mi"
AUDIT_FLAGS = {"--audit-log-maxsize": "50", "--audit-log-maxbackup": "3"}     # 4 files of 50 MB at most

# etcd's backend quota, a share of its volume: the rest holds the write-ahead log and snapshots,
# and compaction's room. At most etcd's own suggested maximum.
ETCD_QUOTA_SHARE = Fraction(3, 4)
ETCD_QUOTA_MAX = 8 * 2**30
ETCD_COMPACTION = {"--auto-compaction-mode": "periodic", "--auto-compaction-retention": "10m"}


# --- quantities as the API writes them back -------------------------------------------------

_BINARY = (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))
_DECIMAL = (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))


def cpu_text(v: Fraction) -> str:
    """CPU as the API writes it back: whole cores bare, else millicores (rounded up)."""
    milli = -(-v * 1000 // 1)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def bytes_text(v: Fraction) -> str:
    """A size as the API writes it back: the largest binary unit it is a whole number of, else
    the largest decimal one, else bytes (rounded up to a byte)."""
    n = int(-(-v // 1))
    for units in (_BINARY, _DECIMAL):
        for suffix, size in units:
            if n and n % size == 0:
                return f"{n // size}{suffix}"
    return str(n)


# --- each container's resources ---------------------------------------------------------------

def resources(inv: Inventory, component: str) -> dict:
    """``component``'s requests and limits: ``SIZING`` with the inventory's keys over it."""
    out = {k: dict(v) for k, v in SIZING[component].items()}
    own = inv.hosted.resources.get(component) if inv.hosted else None
    if own is not None:
        for kind in ("requests", "limits"):
            out.setdefault(kind, {}).update(getattr(own, kind))
    return {k: v for k, v in out.items() if v}


# etcd's members as the quota counts them: the most the inventory allows (etcdReplicas 1 or 3).
# A member count change runs before the objects are written (host/tenant_members.py), and under
# least privilege the quota is the admin's: sized for the count alone, a 1 -> 3 change had its
# new member's volume claim refused by the quota, and the learner never synced (the real lab)
ETCD_MEMBERS_MAX = max(ETCD_MEMBER_COUNTS)


def _pods(inv: Inventory) -> list[tuple[tuple[str, ...], int, int]]:
    """(the containers of a pod, its replicas, how many more may run during a roll or while
    pods terminate): a Deployment surges one and may hold one terminating; etcd's StatefulSet
    replaces a member in place, one may be terminating, and it may grow to ETCD_MEMBERS_MAX."""
    assert inv.hosted is not None
    return [(("etcd",), ETCD_MEMBERS_MAX, 1),
            (("kube-apiserver", "konnectivity-server"), inv.hosted.apiServerReplicas, 2),
            (("kube-controller-manager",), 2, 2), (("kube-scheduler",), 2, 2)]


def _total(inv: Inventory, kind: str, res: str) -> Fraction:
    return sum((quantity(resources(inv, c).get(kind, {}).get(res, "0")) * (n + extra)
                for containers, n, extra in _pods(inv) for c in containers), Fraction(0))


def quota_object(inv: Inventory) -> dict:
    """The tenant's ResourceQuota: its pods at their size, with their rolls' room and etcd's
    largest member count; two NodePorts (the API's and konnectivity's; a LoadBalancer allocates
    them as well); etcd's volumes."""
    assert inv.hosted is not None
    hosted = inv.hosted
    pods = sum(n + extra for _, n, extra in _pods(inv))
    hard = {"pods": str(pods),
            "requests.cpu": cpu_text(_total(inv, "requests", "cpu")),
            "requests.memory": bytes_text(_total(inv, "requests", "memory")),
            "limits.memory": bytes_text(_total(inv, "limits", "memory")),
            "services.nodeports": "2",
            "services.loadbalancers": "1" if hosted.expose.type == "LoadBalancer" else "0",
            "persistentvolumeclaims": str(ETCD_MEMBERS_MAX),
            "requests.storage": bytes_text(quantity(hosted.etcdStorage) * ETCD_MEMBERS_MAX)}
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _meta(inv, "tenant"), "spec": {"hard": hard}}


def limit_range_object(inv: Inventory) -> dict:
    """The tenant's LimitRange: no container above the largest component's memory limit, none
    without requests (a default for one that sets none), no claim above etcd's volume size."""
    assert inv.hosted is not None
    largest = max((quantity(resources(inv, c).get("limits", {}).get("memory", "0")) for c in SIZING))
    return {"apiVersion": "v1", "kind": "LimitRange", "metadata": _meta(inv, "tenant"), "spec": {"limits": [
        {"type": "Container", "max": {"memory": bytes_text(largest)},
         "default": {"memory": "256Mi"}, "defaultRequest": {"cpu": "10m", "memory": "32Mi"}},
        {"type": "PersistentVolumeClaim", "max": {"storage": inv.hosted.etcdStorage}}]}}


def priority_class(inv: Inventory) -> str:
    return f"{PRIORITY_CLASS_PREFIX}{inv.hosted_namespace}"


def priority_class_object(inv: Inventory) -> dict:
    """The tenant's own (cluster-scoped, so named for its namespace); reset deletes it."""
    return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": priority_class(inv), "labels": {**LABELS, TENANT_LABEL: inv.metadata.name}},
            "value": PRIORITY, "globalDefault": False, "preemptionPolicy": "PreemptLowerPriority",
            "description": f"hiddenplane: the control plane of hosted tenant {inv.metadata.name} (namespace "
            f"{inv.hosted_namespace}), ahead of ordinary workloads"}


def _meta(inv: Inventory, name: str) -> dict:
    return {"name": name, "namespace": inv.hosted_namespace,
            "labels": {**LABELS, TENANT_LABEL: inv.metadata.name}}


# --- etcd -------------------------------------------------------------------------------------

def etcd_quota_bytes(inv: Inventory) -> int:
    assert inv.hosted is not None
    return int(min(quantity(inv.hosted.etcdStorage) * ETCD_QUOTA_SHARE, ETCD_QUOTA_MAX))


def etcd_flags(inv: Inventory) -> dict[str, str]:
    return {"--quota-backend-bytes": str(etcd_quota_bytes(inv)), **ETCD_COMPACTION}
