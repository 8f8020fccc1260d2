"""Who owns a hosted tenant's namespace (pure: the rule, and the object that records it).

A tenant's namespace holds its keys and its etcd volumes, and its reset deletes it: a command
must never act on a namespace that is not its tenant's. Names collide easily (two teams call
their cluster ``prod``; an inventory names an application's namespace, or the other tenant's),
so the namespace proves whose it is in two steps:

- its label ``hiddenplane.io/tenant`` is the tenant's name: the installer set it when it made the
  namespace (or the hosting cluster's admin did, making one for this tenant). A namespace without
  it is never adopted, written or deleted;
- the ConfigMap ``hiddenplane-owner`` in it names the state directory that applied the tenant
  there: a random id the state keeps (``StateDir.tenant_id``), written by the first apply. Another
  state (another cluster of the same name, a wrong ``--state``) holds another id, or none.

A namespace whose owner is not recorded yet (made by a release before this one, or by the
hosting admin for a tenant not applied yet) passes on its label; the next apply records the
owner. The apply's CA guard (core/trust.py) still compares the CA files the namespace holds.

The state also keeps the namespace's UID (``StateDir.namespace_uid``), recorded by the apply
that holds the namespace's lock. A label and a ConfigMap can be copied: someone with rights on
namespaces could delete the tenant's, make one of the same name with both, and have the
state's next command write keys there or delete it. The UID cannot be chosen: another one is
refused. ``reset`` forgets it with the namespace.
"""

from __future__ import annotations

from installer.core.errors import InstallerError, StateError
from installer.core.render.manifests import LABELS
from installer.core.render.tenant import TENANT_LABEL

OWNER = "hiddenplane-owner"         # the ConfigMap naming the state that applied the tenant
SHOWN = 8                           # characters of an id in a message (it is no secret: a tag)


class NotOurNamespace(StateError):
    """The namespace an inventory names is not its tenant's: nothing was changed."""


class NoNamespace(InstallerError):
    """The tenant's namespace does not exist: only `apply` makes it (a day-2 command or a reset
    never makes one to act on); nothing was changed."""


def owner_object(namespace: str, tenant: str, state_id: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": OWNER, "namespace": namespace, "labels": {**LABELS, TENANT_LABEL: tenant}},
            "data": {"tenant": tenant, "state": state_id}}


def ownership_problem(namespace: str, tenant: str, live: dict | None, owner: dict | None,
                      state_id: str | None, state_uid: str | None = None) -> str | None:
    """Why ``namespace`` (``live``: the object, None when there is none) may not be used for
    ``tenant`` by the state whose id is ``state_id`` and which recorded the namespace's UID
    ``state_uid`` (``owner``: the data of its owner ConfigMap, None when it has none), or None."""
    if live is None:
        return None                 # none yet: apply makes it
    labels = (live.get("metadata") or {}).get("labels") or {}
    if labels.get(TENANT_LABEL) != tenant:
        found = f"is {labels[TENANT_LABEL]!r}" if TENANT_LABEL in labels else "is missing"
        return (f"namespace {namespace} in the hosting cluster is not tenant {tenant}'s (its label {TENANT_LABEL} "
                f"{found}): the installer never adopts, writes or deletes a namespace it did not make for this "
                "tenant; name the tenant's own namespace (spec.controlPlane.hosted.namespace); nothing was changed")
    if owner is not None:
        recorded = owner.get("state") or ""
        if recorded != state_id:
            ours = f"{state_id[:SHOWN]}…" if state_id else "none"
            return (f"namespace {namespace} in the hosting cluster holds another tenant named {tenant}: another "
                    f"state directory applied it (its owner id {recorded[:SHOWN]}…, this state's {ours}). Two "
                    "clusters with one name, or a wrong --state; nothing was changed")
    # (an owner not recorded yet passes: the next apply records it)
    uid = (live.get("metadata") or {}).get("uid")
    if state_uid and uid != state_uid:
        return (f"namespace {namespace} in the hosting cluster is not the one this state applied tenant {tenant} "
                f"in: it was deleted and made again (its UID is {uid}, this state's {state_uid}), and its labels "
                "may be copies. If you made it again yourself (the tenant's volumes are gone with the old one), "
                "delete the state's tenant-namespace-uid file to take it over; nothing was changed")
    return None
