"""The Python API the CLI is a thin layer over (the CLI imports nothing else of the package).

This module is light (inventory, PKI, rendering: no SSH, no API client), so `installer
validate` stays fast; the commands that reach hosts are in its submodules, imported only by the
commands that need them: ``api.cluster`` (apply, plan, verify), ``api.nodes``, ``api.etcd``,
``api.certs`` (check, renew, CA rotation) and ``api.reset``."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from installer.core import inventory as inventory_mod
from installer.core.cluster import Cluster, open_cluster, resolve
from installer.core.errors import InstallerError
from installer.core.inventory import Inventory, as_inventory, json_schema
from installer.core.inventory_hosted import refuse_hosted
from installer.core.pki.material import Changes, Material, ensure
from installer.core.render import tenant_access
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster, write_tree
from installer.core.state import StateDir, state_for, write_admin_kubeconfig

# part of the API: every domain error (its exit_code is the CLI's), the Cluster every command
# takes (open_cluster holds its state, resolve does not), the inventory's JSON schema
__all__ = ["Cluster", "InstallerError", "Prepared", "admin_kubeconfig", "as_inventory", "hosting_access", "json_schema",
           "open_cluster", "refuse_hosted",
           "resolve", "prepare", "render", "state_for", "validate", "write_admin_kubeconfig"]


@dataclass
class Prepared:
    inventory: Inventory
    state: StateDir
    material: Material
    changes: Changes
    plans: dict[str, HostPlan]


def validate(path: str | Path) -> Inventory:
    return inventory_mod.load(path)


def hosting_access(path: str | Path, kind: str, name: str) -> list[dict]:
    """The hosting cluster's objects that let ``kind`` ``name`` (User, Group, ServiceAccount as
    NAMESPACE/NAME) operate the hosted tenant of ``path`` and nothing else
    (core/render/tenant_access.py)."""
    return tenant_access.for_operator(inventory_mod.load(path), str(path), kind, name)


def prepare(path: str | Path | Inventory | Cluster, state_dir: str | Path | None = None,
            now: dt.datetime | None = None) -> Prepared:
    """Validate, bring the PKI in the state directory up to date, and render every host."""
    if isinstance(path, Cluster):           # the command's own: its state held already
        inv, state = path.inv, path.state
    else:
        inv = as_inventory(path)
        state = state_for(inv, state_dir)
    with state.locked():
        material, changes = ensure(inv, state.load(inv), now)
        state.save(material)
        write_admin_kubeconfig(inv, state, material)
    return Prepared(inv, state, material, changes, render_cluster(inv, material))


def render(cluster: Cluster, out: str | Path) -> Prepared:
    p = prepare(cluster)
    write_tree(p.plans, Path(out), p.inventory, p.material)
    return p


def admin_kubeconfig(cluster: Cluster, out: str | Path | None = None,
                     force: bool = False) -> tuple[Inventory, Path, bool, str, str | None]:
    """Write the admin kubeconfig from the state (default ``./<cluster>.kubeconfig``, 0600);
    an existing different file is kept unless ``force``. Its server: the endpoint, or the first
    control host whose apiserver answers now (``apireach.answering_server``). Returns (inventory,
    path, written, server, why the server is not the first control host's or None)."""
    from installer.host import apireach  # SSH's libraries: only the commands that reach hosts load them
    inv, material = cluster.inv, cluster.material
    apireach.check_admin_material(inv, material)
    target = Path(out) if out else Path(f"{inv.metadata.name}.kubeconfig")
    server, why = apireach.answering_server(inv)
    return inv, target, apireach.write_kubeconfig(inv, material, target, force=force, server=server), server, why
