"""The inventory: a validated description of one cluster.

Validation has two layers, and both always run so that a user sees every problem at once:
field checks (pydantic: unknown fields, types, formats) and cluster checks over the whole
document (roles, overlaps, address families), which read the raw data defensively so that a
bad field elsewhere never hides them.

The field types are in ``inventory_fields``, the models in ``inventory_model``, the cluster
checks in ``inventory_rules``; this module loads a document, runs both and reports.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from installer.core import yamlsafe
from installer.core.errors import InventoryError
from installer.core.inventory_fields import API_VERSION, MAX_LINE, MAX_PROBLEMS, quoted
from installer.core.inventory_model import BastionSpec, HostSpec, Inventory, SSHSpec
from installer.core.inventory_rules import cluster_problems
from installer.core.safefs import input_file_problem

# the face of the inventory: callers import these from here, not from the parts
__all__ = ["BastionSpec", "HostSpec", "Inventory", "SSHSpec", "MAX_LINE", "MAX_PROBLEMS", "as_inventory",
           "json_schema", "load", "parse"]


def json_schema() -> dict:
    schema = Inventory.model_json_schema()
    schema.get("properties", {}).pop("base_dir", None)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"hiddenplane inventory ({API_VERSION}, kind Cluster)"
    return schema


# --- loading and error reporting -----------------------------------------------------------

def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith("function-") or part in ("literal['control','worker']",):
            continue
        elif isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,60}", part):
            out += ("." if out else "") + part
        else:   # a key a user typed: quoted, so a newline or 5 MB of it cannot break the line
            out += ("." if out else "") + quoted(part)
    return out or "(document)"


def _describe(err: dict) -> str:
    path, kind, value = _path(err["loc"]), err["type"], err.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown field"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "literal_error":
        return f"{path}: {quoted(value)} is not allowed; expected {err['ctx']['expected']}"
    if kind in ("dns1123", "ip", "cidr", "host", "version", "role", "port", "sha256", "login", "path",
                "quantity", "registry", "namespace"):
        return f"{path}: {err['msg']}"
    if kind in ("int_type", "bool_type") and isinstance(value, bool | int):
        want = "a whole number" if kind == "int_type" else "true or false"
        return f"{path}: {quoted(value)} is not {want}"
    return f"{path}: {quoted(value)}: {err['msg']}"


def _bounded(problems: list[str]) -> list[str]:
    problems = [p if len(p) <= MAX_LINE else p[:MAX_LINE] + "…" for p in dict.fromkeys(problems)]
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems = problems[:MAX_PROBLEMS] + [f"(document): {more} more problem(s) not shown"]
    return problems


def parse(data: Any, source: str = "inventory", base_dir: Path | None = None,
          problems: list[str] | None = None) -> Inventory:
    """Validate a loaded document; raise InventoryError listing every problem (``problems``
    found earlier, e.g. while parsing the file, first)."""
    base_dir = base_dir or Path(".")
    problems = list(problems or [])
    if not isinstance(data, dict):
        raise InventoryError(source, _bounded(
            problems + ["(document): expected a mapping with apiVersion, kind, metadata, spec"]))
    model = None
    try:
        model = Inventory.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        problems += [_describe(err) for err in e.errors()]
    problems += cluster_problems(data, base_dir)
    if problems:
        # one problem can be found by both layers (a role alias, say); say it once
        raise InventoryError(source, _bounded(problems))
    assert model is not None
    return model


def load(path: str | Path) -> Inventory:
    """Read, parse (bounded: see installer/core/yamlsafe.py) and validate the inventory at ``path``."""
    path = Path(path)
    if (why := input_file_problem(path)) is not None:
        raise InventoryError(str(path), [f"(file): {why}: whoever can change it can change what is done to the hosts"])
    try:
        raw = yamlsafe.read(path)
    except OSError as e:
        raise InventoryError(str(path), [f"(file): cannot read: {e.strerror}"]) from None
    try:
        data, duplicates = yamlsafe.load(raw)
    except yamlsafe.InputError as e:     # bounded too: a 30-level path of 60-character keys is one long line
        raise InventoryError(str(path), _bounded(e.problems)) from None
    return parse(data, str(path), path.parent.resolve(), problems=duplicates)


def as_inventory(inventory: "str | Path | Inventory") -> Inventory:
    """A path is loaded and validated; an Inventory (e.g. one a day-2 command derived) is taken as is."""
    return inventory if isinstance(inventory, Inventory) else load(inventory)
