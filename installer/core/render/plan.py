"""The whole cluster's desired state, host by host, and writing it out for review."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from installer.core.inventory import Inventory
from installer.core.pki.material import Material
from installer.core.render.control import render_control
from installer.core.render.files import HostPlan, to_yaml
from installer.core.render.manifests import bootstrap_objects
from installer.core.render.worker import HostFacts, render_worker
from installer.core.safefs import write_atomic

CLUSTER_DIR = "_cluster"     # not a host: objects sent through the API


def render_cluster(inv: Inventory, material: Material,
                   facts: Mapping[str, HostFacts] | None = None) -> dict[str, HostPlan]:
    facts = facts or {}
    plans = {}
    for h in inv.spec.hosts:
        if h.role == "control":
            plans[h.name] = render_control(inv, h, material, facts.get(h.name, HostFacts()).etcd_join)
        else:
            plans[h.name] = render_worker(inv, h, material, facts.get(h.name, HostFacts()))
    return plans


def manifest_lines(plan: HostPlan) -> list[str]:
    """``path mode owner:group sha256`` per file; directories end in / with '-' as digest."""
    rows = [f"{d.path}/ {d.mode:04o} {d.owner}:{d.group} -" for d in plan.dirs.values()]
    rows += [f"{f.path} {f.mode:04o} {f.owner}:{f.group} {f.sha256}" for f in plan.files.values()]
    return sorted(rows)


def write_tree(plans: dict[str, HostPlan], out: Path, inv: Inventory, material: Material) -> int:
    """Write ``out/<host>/<absolute path>`` with host modes, plus a MANIFEST per host."""
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)   # the tree holds private keys
    count = 0
    for name, plan in plans.items():
        root = out / name
        for d in plan.dirs.values():
            (root / d.path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for f in plan.files.values():
            write_atomic(root / f.path.lstrip("/"), f.content, f.mode)
            count += 1
        write_atomic(root / "MANIFEST", ("\n".join(manifest_lines(plan)) + "\n").encode(), 0o644)
    docs = b"".join(b"---\n" + to_yaml(o) for o in bootstrap_objects(inv, material))
    write_atomic(out / CLUSTER_DIR / "bootstrap.yaml", docs, 0o600)
    return count
