"""The least-privilege hosting identity of one hosted tenant's operator (docs/hosted.md): what the
hosting cluster's admin applies so that the installer works for this tenant and nothing else.

Pure: the objects, rendered from the inventory; ``installer hosting-access`` prints them.

- the tenant's Namespace, made by the admin (labelled as the installer would label it, so its
  ownership guard lets the first apply in): the identity may not create namespaces, so it can
  make no other;
- a Role and RoleBinding in that namespace, one rule per row of ``RULES``: exactly the requests
  the installer makes there (host/hosting.py, host/tenant_*.py, host/podexec.py, the planes);
- the tenant's ResourceQuota, LimitRange and PriorityClass (render/tenant_sizing.py): the
  admin's, read by the operator, never written by it (a quota its operator could raise would
  protect no neighbour, a priority it could raise would preempt them);
- a ClusterRole and ClusterRoleBinding for that one Namespace object (resourceNames): reading
  and deleting it. A RoleBinding inside the namespace would grant that too (the apiserver counts
  a namespace's own object as in it), but it goes first when ``reset`` deletes the namespace, and
  reset watches the namespace go until it is gone. The same ClusterRole reads the tenant's
  PriorityClass (by name) and lists the nodes: apply refuses a hosting cluster too small to spread the
  tenant's replicas before it changes anything (their names, labels, taints and conditions).

Nothing else cluster-scoped: no PersistentVolume, no other namespace, no node written. With it,
another tenant's Secrets, pods and namespace are 403 (tests/test_real_hosted.py proves it).
"""

from __future__ import annotations

from installer.core.errors import InstallerError, InventoryError
from installer.core.inventory import Inventory
from installer.core.render import tenant_sizing
from installer.core.render.manifests import LABELS, RBAC
from installer.core.render.tenant import namespace_object

ROLE = "hiddenplane-operator"

# (API group, resources, verbs, why): the namespaced requests the installer makes, and which
# code makes them. A request not covered here is a 403 on the real lab (the test's tenant B
# runs apply, snapshots, member changes and reset with exactly these).
RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str], ...] = (
    ("", ("configmaps", "secrets", "services"), ("get", "list", "create", "update", "delete"),
     "the control plane's files, its Services; the owner record; held_files reads them back"),
    ("apps", ("statefulsets", "deployments"), ("get", "list", "create", "update", "patch", "delete"),
     "etcd's StatefulSet and the components' Deployments; rolls and member counts patch them"),
    ("policy", ("poddisruptionbudgets",), ("get", "create", "update", "delete"),
     "the budgets that keep a hosting drain from taking a quorum"),
    ("networking.k8s.io", ("networkpolicies",), ("get", "create", "update", "delete"),
     "the tenant's NetworkPolicies (render/tenant_network.py)"),
    ("coordination.k8s.io", ("leases",), ("get", "create", "update", "delete"),
     "the apply lock"),
    ("", ("pods",), ("get", "list", "delete"),
     "waits, problems named, a member's pod restarted"),
    ("", ("pods/exec",), ("create", "get"),
     "etcdctl in a member's container (members, snapshots, restore): its websocket is a GET (get), "
     "and from Kubernetes 1.35 the apiserver asks for create as well "
     "(AuthorizePodWebsocketUpgradeCreatePermission, on by default)"),
    ("", ("persistentvolumeclaims",), ("get", "list", "delete"),
     "a removed member's volume; reset counts them"),
    ("", ("resourcequotas", "limitranges"), ("get",),
     "read to see them as rendered: they are the admin's (this output), the operator cannot lift them"),
)
# the Namespace object itself: read (the ownership guard), deleted (reset). Not updated: its
# labels are the admin's (it made the namespace from this output), among them Pod Security's
# "restricted", which an operator who could relabel it could lift, and then run privileged pods
# through the Deployments it may create
NAMESPACE_VERBS = ("get", "delete")

SUBJECT_KINDS = ("User", "Group", "ServiceAccount")


def subject(kind: str, name: str) -> dict:
    """An RBAC subject; a ServiceAccount as ``namespace/name``."""
    if kind not in SUBJECT_KINDS:
        raise ValueError(f"subject kind {kind!r}: one of {', '.join(SUBJECT_KINDS)}")
    if kind == "ServiceAccount":
        ns, sep, sa = name.partition("/")
        if not sep or not ns or not sa:
            raise ValueError(f"service account {name!r}: give it as NAMESPACE/NAME")
        return {"kind": kind, "name": sa, "namespace": ns}
    if not name:
        raise ValueError(f"{kind.lower()} name is empty")
    return {"kind": kind, "name": name, "apiGroup": RBAC}


def access_objects(inv: Inventory, who: dict) -> list[dict]:
    """What the hosting cluster's admin applies for ``inv``'s operator ``who`` (a ``subject``)."""
    assert inv.hosted is not None, "hosting access is for spec.controlPlane.mode: hosted"
    ns = inv.hosted_namespace
    cluster_name = f"{ROLE}-{ns}"
    meta = {"labels": dict(LABELS)}
    rules = [{"apiGroups": [group], "resources": list(resources), "verbs": list(verbs)}
             for group, resources, verbs, _ in RULES]
    return [
        namespace_object(inv), tenant_sizing.priority_class_object(inv), tenant_sizing.quota_object(inv),
        tenant_sizing.limit_range_object(inv),
        {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": {**meta, "name": ROLE, "namespace": ns},
         "rules": rules},
        {"apiVersion": f"{RBAC}/v1", "kind": "RoleBinding", "metadata": {**meta, "name": ROLE, "namespace": ns},
         "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": ROLE}, "subjects": [who]},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole", "metadata": {**meta, "name": cluster_name},
         "rules": [{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [ns],
                    "verbs": list(NAMESPACE_VERBS)},
                   {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"],
                    "resourceNames": [tenant_sizing.priority_class(inv)], "verbs": ["get"]},
                   {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding", "metadata": {**meta, "name": cluster_name},
         "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": cluster_name}, "subjects": [who]},
    ]


def for_operator(inv: Inventory, source: str, kind: str, name: str) -> list[dict]:
    """``access_objects`` for ``kind`` ``name``; a cluster that is not hosted, or a subject not
    given whole, refused (exit 2) before anything is printed."""
    if inv.hosted is None:
        raise InventoryError(source, ["spec.controlPlane.mode is not hosted: a hosting identity is for hosted "
                                      "tenants only"])
    try:
        who = subject(kind, name)
    except ValueError as e:
        raise InstallerError(str(e)) from None
    return access_objects(inv, who)
