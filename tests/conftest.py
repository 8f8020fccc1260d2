"""Shared fixtures: the example inventory, a prepared cluster (PKI in a temp state dir),
and its rendered tree. Everything is generated per test session; nothing is committed."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path

import pytest
import yaml

from installer import api
from installer.core import inventory
from installer.core.render.plan import write_tree

pytest_plugins = ["tests.builtfixtures", "tests.labfixtures", "tests.realcluster", "tests.rendered"]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "inventory.example.yaml"


@pytest.fixture(autouse=True)
def _quiet_window(request):
    """``@pytest.mark.quiet(lab)``: the test, its function fixtures included, in a quiet window of
    that lab (tests/quiet.py)."""
    mark = request.node.get_closest_marker("quiet")
    if mark is None:
        yield
        return
    from tests import quiet
    with quiet.window(mark.args[0], request.node.name):
        yield


@pytest.fixture(scope="session")
def example_doc() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


@pytest.fixture
def doc(example_doc) -> dict:
    """A fresh, mutable copy of the example inventory document."""
    return copy.deepcopy(example_doc)


def write_inventory(tmp_path: Path, data: dict, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The example cluster with its PKI generated in a session temp state directory."""
    state = tmp_path_factory.mktemp("state")
    return api.prepare(EXAMPLE, state)


@pytest.fixture(scope="session")
def rendered(prepared, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out")
    write_tree(prepared.plans, out, prepared.inventory, prepared.material)
    return out


@pytest.fixture(scope="session")
def three_controls(tmp_path_factory, example_doc):
    """A 3-control, 2-worker variant on loopback-free addresses, prepared in its own state."""
    d = copy.deepcopy(example_doc)
    d["spec"]["hosts"] = [
        {"name": "cp1", "address": "192.168.56.230", "role": "control"},
        {"name": "cp2", "address": "192.168.56.233", "role": "control"},
        {"name": "cp3", "address": "192.168.56.234", "role": "control"},
        {"name": "node2", "address": "192.168.56.231", "role": "worker"},
        {"name": "node3", "address": "192.168.56.232", "role": "worker"},
    ]
    tmp = tmp_path_factory.mktemp("three")
    return api.prepare(write_inventory(tmp, d), tmp / "state")


NOW = dt.datetime.now(dt.timezone.utc)
__all__ = ["EXAMPLE", "ROOT", "write_inventory", "inventory", "NOW"]
