"""The Python API the CLI is a thin layer over."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from . import inventory as inventory_mod
from .inventory import Inventory
from .pki import issue
from .pki.material import Changes, Material, ensure
from .render.files import HostPlan
from .render.kubeconfig import kubeconfig
from .render.plan import render_cluster, write_tree
from .state import StateDir, check_not_moved, default_state_dir, write_atomic


@dataclass
class Prepared:
    inventory: Inventory
    state: StateDir
    material: Material
    changes: Changes
    plans: dict[str, HostPlan]


def validate(path: str | Path) -> Inventory:
    return inventory_mod.load(path)


def as_inventory(inventory: str | Path | Inventory) -> Inventory:
    """A path is validated; an Inventory (e.g. one a day-2 command derived) is taken as is."""
    return inventory if isinstance(inventory, Inventory) else validate(inventory)


def state_for(inv: Inventory, state_dir: str | Path | None) -> StateDir:
    """``--state DIR``, else the default next to the inventory (see state.default_state_dir)."""
    if state_dir:
        return StateDir(Path(state_dir))
    root = default_state_dir(inv)
    check_not_moved(inv, root)
    return StateDir(root)


def prepare(path: str | Path, state_dir: str | Path | None = None,
            now: dt.datetime | None = None) -> Prepared:
    """Validate, bring the PKI in the state directory up to date, and render every host."""
    inv = validate(path)
    state = state_for(inv, state_dir)
    with state.locked():
        material, changes = ensure(inv, state.load(inv), now)
        state.save(material)
        write_admin_kubeconfig(inv, state, material)
    return Prepared(inv, state, material, changes, render_cluster(inv, material))


def write_admin_kubeconfig(inv: Inventory, state: StateDir, material: Material) -> None:
    ca = material.pair("ca")
    write_atomic(state.admin_kubeconfig,
                 kubeconfig(inv.metadata.name, inv.api_url, issue.cert_pem(ca.cert), "kubernetes-admin",
                            client=material.pair("admin")), 0o600)


def render(path: str | Path, out: str | Path, state_dir: str | Path | None = None) -> Prepared:
    p = prepare(path, state_dir)
    write_tree(p.plans, Path(out), p.inventory, p.material)
    return p


def admin_kubeconfig(path: str | Path, out: str | Path | None = None, state_dir: str | Path | None = None,
                     force: bool = False) -> tuple[Inventory, Path, bool]:
    """Write the admin kubeconfig from the state (default ``./<cluster>.kubeconfig``, 0600);
    an existing different file is kept unless ``force``. Returns (inventory, path, written)."""
    from . import kube   # the kubernetes client is slow to import; only this command needs it
    inv = validate(path)
    material = state_for(inv, state_dir).load(inv)
    kube.check_admin_material(inv, material)
    target = Path(out) if out else Path(f"{inv.metadata.name}.kubeconfig")
    return inv, target, kube.write_kubeconfig(inv, material, target, force=force)
