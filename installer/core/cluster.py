"""One cluster, resolved once per command: its inventory parsed and validated, its state directory
found and held (an flock: two commands on one PKI would each write their own keys), and what is
derived from them read or rendered when first asked for.

``open_cluster`` is how a command gets one (the CLI's ``with_cluster``), ``resolve`` one not
held; the runner, every action that reads the state and the API facade take a Cluster, never a
path and a state directory again. A derived inventory
(a node left out, another version) is ``cluster.with_inventory(inv)``, on the same state.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

from installer.core.inventory import Inventory, as_inventory
from installer.core.pki.material import Material
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster
from installer.core.state import StateDir, state_for


@dataclass(eq=False)
class Cluster:
    inv: Inventory
    state: StateDir

    @cached_property
    def material(self) -> Material:
        """The PKI the state holds (nothing issued: ``installer plan``/``apply`` do that)."""
        return self.state.load(self.inv)

    @cached_property
    def plans(self) -> dict[str, HostPlan]:
        """Every host's rendered plan, from the state's PKI."""
        return render_cluster(self.inv, self.material)

    def with_inventory(self, inv: Inventory) -> Cluster:
        return Cluster(inv, self.state)


@contextmanager
def open_cluster(inventory: str | Path | Inventory, state_dir: str | Path | None = None, *,
                 create: bool = False) -> Iterator[Cluster]:
    """The cluster of ``inventory`` (a path, parsed and validated here, or an Inventory) and its
    state (``state_dir``, else the default next to the inventory), held for the block. With
    ``create=False`` a state directory that does not exist is left so (nothing to hold)."""
    cluster = resolve(inventory, state_dir)
    with cluster.state.locked(create=create):
        yield cluster


def resolve(inventory: str | Path | Inventory, state_dir: str | Path | None = None) -> Cluster:
    """The cluster of ``inventory`` and its state directory, not held: for a caller that holds it
    itself (``open_cluster``) or only reads (the Python API, tests). Apply holds it for its run."""
    inv = as_inventory(inventory)
    return Cluster(inv, state_for(inv, state_dir))
