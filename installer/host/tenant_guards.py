"""Checks a hosted tenant's apply makes in the hosting cluster before it changes anything there
(each refusal exit 2, naming what to do): a tenant an earlier release ran as root, a hosting
cluster too small to spread the tenant's replicas as its inventory requires, an exposed address
that is no hosting node's."""

from __future__ import annotations

from installer.core.errors import InstallerError
from installer.core.render.tenant import root_workloads
from installer.core.render.tenant_placement import Placement, PlacementError, placement
from installer.host.hosting import GRANT_HINT, HostingError, get_object
from installer.host.kube import ApiClient, ApiError, rest, status_message
from installer.host.tenant_etcd import sts_path


class RootTenant(InstallerError):
    """A tenant applied by a release that ran its control plane as root (exit 2: nothing changed)."""


def refuse_root_tenant(api: ApiClient, inv) -> None:
    """Stop before a tenant whose etcd runs as root is rolled to non-root pods: its data is
    root's, which a non-root member cannot read, and no root container may fix that under Pod
    Security "restricted" (the other workloads hold no data: they roll as they are). The way
    over keeps the data (docs/hosted.md)."""
    found = root_workloads([{**sts, "kind": "StatefulSet"}] if (sts := get_object(api, sts_path(inv))) else [])
    if found:
        raise RootTenant(f"namespace {inv.hosted_namespace}: {', '.join(found)} run as root (applied by an earlier "
                         "release); this release runs them as a non-root user under Pod Security \"restricted\", "
                         "and etcd's members could not read their data. Nothing was changed. Move the tenant over "
                         "with its data: `installer etcd snapshot save`, `installer reset`, `installer apply`, "
                         "`installer etcd snapshot restore` (docs/hosted.md)")


class Unspreadable(InstallerError):
    """The hosting nodes cannot take the tenant's pods as its inventory requires (exit 2:
    nothing changed)."""


def place(api: ApiClient, inv) -> Placement:
    """Where the tenant's pods go (core/render/tenant_placement.py), read from the hosting
    nodes; stops before the pods would wait unscheduled (or, on a tenant running already,
    before a roll whose new pods could not be placed), or an exposed address serves nothing."""
    try:
        nodes = (rest(api, "GET", "/api/v1/nodes", "the hosting cluster's nodes") or {}).get("items", [])
    except ApiError as e:
        if e.status == 403:
            raise HostingError("this hosting identity may not list the hosting cluster's nodes, which apply reads to "
                               f"place the tenant's replicas on them: {GRANT_HINT}") from None
        raise HostingError(f"the hosting cluster's nodes cannot be listed: {status_message(e)}") from None
    try:
        return placement(inv, nodes)
    except PlacementError as e:
        raise Unspreadable(f"namespace {inv.hosted_namespace}: {e}. Nothing was changed") from None
