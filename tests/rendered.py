"""The rendered clusters the contract tests read: the example (1 control, 2 workers) and the
3-control variant, each written to a tree (``<tree>/<host>/<absolute path>``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from installer.api import Prepared
from installer.core.render.files import HostPlan
from installer.core.render.plan import write_tree


@dataclass
class Cluster:
    name: str
    prepared: Prepared
    tree: Path                                  # write_tree output: <tree>/<host>/<abs path>

    @property
    def plans(self) -> dict[str, HostPlan]:
        return self.prepared.plans

    def hosts(self, role: str) -> list[HostPlan]:
        return [p for p in self.plans.values() if p.role == role]

    def address(self, host: str) -> str:
        return next(h.address for h in self.prepared.inventory.spec.hosts if h.name == host)


def write(name: str, prepared: Prepared, tmp_path_factory) -> Cluster:
    tree = tmp_path_factory.mktemp(f"tree-{name}")
    write_tree(prepared.plans, tree, prepared.inventory, prepared.material)
    return Cluster(name, prepared, tree)


@pytest.fixture(scope="module", params=["prepared", "three_controls"])
def cluster(request, tmp_path_factory) -> Cluster:
    c = write(request.param, request.getfixturevalue(request.param), tmp_path_factory)
    # guard against a vacuous pass: the clusters really have both roles
    assert c.hosts("control") and c.hosts("worker")
    return c
