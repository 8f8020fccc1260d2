"""Checks a hosted tenant's apply makes in the hosting cluster before it changes anything there
(each refusal exit 2, naming what to do): a tenant an earlier release ran as root, a hosting
cluster too small to spread the tenant's replicas as its inventory requires."""

from __future__ import annotations

from installer.core.errors import InstallerError
from installer.core.render.tenant import root_workloads
from installer.core.render.tenant_sizing import spread_problem
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
    """Too few schedulable hosting nodes for ``spread: required`` (exit 2: nothing changed)."""


def refuse_unspreadable(api: ApiClient, inv) -> None:
    """Stop before the tenant's pods would wait unscheduled (or, on a tenant running already,
    before a roll whose new pods could not be placed): its etcd members and apiserver replicas
    each need a node of their own, and the replica a roll adds one more."""
    if inv.hosted.spread != "required":
        return
    try:
        nodes = (rest(api, "GET", "/api/v1/nodes", "the hosting cluster's nodes") or {}).get("items", [])
    except ApiError as e:
        if e.status == 403:
            raise HostingError("this hosting identity may not list the hosting cluster's nodes, which apply reads to "
                               f"spread the tenant's replicas over them: {GRANT_HINT}") from None
        raise HostingError(f"the hosting cluster's nodes cannot be listed: {status_message(e)}") from None
    if (why := spread_problem(inv, nodes)) is not None:
        raise Unspreadable(f"namespace {inv.hosted_namespace}: {why}. Nothing was changed")
