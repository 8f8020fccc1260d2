"""Rendered systemd units pass a real `systemd-analyze verify`, and the objects the bootstrap
phase sends to the apiserver pass kubernetes_validate for the inventory's Kubernetes version.

How the units are verified (systemd 252, PID 1 need not be systemd): for each host a scratch
root directory is built holding a copy of the distribution's units (/usr/lib/systemd/system:
verify needs sysinit.target and friends), the host's rendered units in /etc/systemd/system,
an executable placeholder at every Exec*= path, and an /etc/passwd and /etc/group naming the
host's system users. `systemd-analyze --root=ROOT verify UNIT` then reads everything from that
root. verify exits 0 on mere warnings ("Unknown key ...", "Failed to parse ..."), so besides
the exit code its stderr must hold nothing beyond what a trivial unit in the same root prints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from installer.core import network
from installer.core.render.files import HostPlan
from installer.core.render.plan import CLUSTER_DIR, write_tree
from installer.host import kube, kube_objects

from . import reference as ref

UNIT_DIR = "etc/systemd/system"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
EXEC_KEYS = ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost",
             "ExecCondition")
BASELINE = "hp-baseline.service"
# a unit no one starts but the plan's timer: apply enables and starts the timer alone
RUN_BY_TIMER = {network.REPAIR_TIMER: network.REPAIR_SERVICE}
BASELINE_UNIT = """[Unit]
Description=baseline for systemd-analyze noise

[Service]
Type=oneshot
ExecStart=/usr/local/bin/hp-baseline

[Install]
WantedBy=multi-user.target
"""


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if not exe or not SYSTEM_UNITS.is_dir():
        pytest.fail("systemd-analyze and /usr/lib/systemd/system are required (Debian package: systemd)")
    return exe


@pytest.fixture(scope="module")
def system_units(tmp_path_factory) -> Path:
    """One copy of the distribution's units; each scratch root hard-links to it."""
    _systemd_analyze()
    dest = tmp_path_factory.mktemp("sysunits") / "system"
    shutil.copytree(SYSTEM_UNITS, dest, symlinks=True)
    return dest


def _placeholder(root: Path, path: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)


def _exec_paths(content: bytes) -> list[str]:
    paths = []
    for key in EXEC_KEYS:
        for value in ref.unit_values(content, "Service", key):
            if value:
                paths.append(value.split()[0].lstrip("-@:+!"))
    return paths


def make_root(base: Path, plan: HostPlan, system_units: Path, units: dict[str, bytes] | None = None) -> Path:
    """A scratch root for ``plan``'s units (or ``units``, name -> content, when given)."""
    root = base / plan.name
    lib = root / "usr/lib/systemd"
    lib.mkdir(parents=True)
    try:
        shutil.copytree(system_units, lib / "system", symlinks=True, copy_function=os.link)
    except OSError:
        shutil.copytree(system_units, lib / "system", symlinks=True)
    if units is None:
        units = {Path(f.path).name: f.content for f in plan.files.values() if f.path.startswith("/" + UNIT_DIR + "/")}
    unit_dir = root / UNIT_DIR
    unit_dir.mkdir(parents=True)
    for name, content in {**units, BASELINE: BASELINE_UNIT.encode()}.items():
        (unit_dir / name).write_bytes(content)
        (unit_dir / name).chmod(0o600)
        for exe in _exec_paths(content):
            _placeholder(root, exe)
    users = [("root", 0, "/root", "/bin/sh")] + [(u.name, 900 + i, u.home, "/usr/sbin/nologin")
                                                  for i, u in enumerate(plan.users)]
    (root / "etc/passwd").write_text("".join(f"{n}:x:{i}:{i}::{h}:{s}\n" for n, i, h, s in users))
    (root / "etc/group").write_text("".join(f"{n}:x:{i}:\n" for n, i, _, _ in users))
    return root


def verify(root: Path, unit: str) -> tuple[int, list[str]]:
    r = subprocess.run([_systemd_analyze(), f"--root={root}", "verify", unit],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip()]


def problems_of(root: Path, unit: str) -> list[str]:
    """What verify says about ``unit`` beyond the noise a trivial unit in the same root gets."""
    base_rc, base_err = verify(root, BASELINE)
    assert base_rc == 0, f"systemd-analyze cannot verify even a trivial unit here: {base_err}"
    rc, err = verify(root, unit)
    out = [line for line in err if line not in base_err]
    if rc != 0:
        out.insert(0, f"exit status {rc}")
    return out


@pytest.fixture(params=["prepared", "three_controls"])
def cluster(request):
    return request.getfixturevalue(request.param)


def test_every_rendered_unit_passes_systemd_analyze_verify(cluster, system_units, tmp_path):
    checked, problems = 0, []
    for plan in cluster.plans.values():
        unit_files = sorted(Path(p).name for p in plan.files if p.startswith("/" + UNIT_DIR + "/"))
        units = plan.units + [RUN_BY_TIMER[u] for u in plan.units if u in RUN_BY_TIMER]
        assert unit_files == sorted(units), f"{plan.name}: unit files {unit_files} vs units {plan.units}"
        root = make_root(tmp_path, plan, system_units)
        for unit in units:
            problems += [f"{plan.name} {unit}: {line}" for line in problems_of(root, unit)]
            checked += 1
    assert checked >= sum(len(p.units) for p in cluster.plans.values()) >= 7
    assert not problems, "\n".join(problems)


def test_the_verify_harness_catches_broken_units(prepared, system_units, tmp_path):
    """Without these, a passing verify could mean the harness looks at nothing."""
    control = next(p for p in prepared.plans.values() if p.role == "control")
    worker = next(p for p in prepared.plans.values() if p.role == "worker")
    etcd = control.files["/etc/systemd/system/etcd.service"].content
    kubelet = worker.files["/etc/systemd/system/kubelet.service"].content

    # a typo'd key is only a warning (exit 0): the stderr comparison must catch it
    typo = etcd.replace(b"Restart=on-failure", b"Restart=on-failure\nRestartSecs=5")
    root = make_root(tmp_path / "typo", control, system_units, {"etcd.service": typo})
    assert verify(root, "etcd.service")[0] == 0
    assert any("RestartSecs" in line for line in problems_of(root, "etcd.service"))

    # a missing binary fails: the placeholders are what make the rendered units pass
    root = make_root(tmp_path / "nobin", control, system_units, {"etcd.service": etcd})
    (root / "usr/local/bin/etcd").unlink()
    assert problems_of(root, "etcd.service")[0].startswith("exit status")

    # kubelet Requires=containerd.service: verified alone, the dependency is missing
    root = make_root(tmp_path / "nodep", worker, system_units, {"kubelet.service": kubelet})
    assert any("containerd.service" in line for line in problems_of(root, "kubelet.service"))

    # and the unchanged unit in such a root is clean
    root = make_root(tmp_path / "clean", control, system_units, {"etcd.service": etcd})
    assert problems_of(root, "etcd.service") == []


# ---------------------------------------------------------------------------------------------
# bootstrap objects against the target version's schemas


def _bootstrap_docs(tree: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((tree / CLUSTER_DIR / "bootstrap.yaml").read_text()) if d is not None]
    assert docs, "bootstrap.yaml holds no objects"
    return docs


def _check_manifests(p, tree: Path) -> None:
    docs = _bootstrap_docs(tree)
    kube_objects.validate_objects(docs, p.inventory.spec.kubernetes.version)     # what the bootstrap phase runs
    # each worker's bootstrap token is among them
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert secrets == {f"bootstrap-token-{p.material.tokens[h.name].id}" for h in p.inventory.workers}


def test_bootstrap_manifests_validate_for_the_target_version(prepared, rendered):
    assert kube_objects.target_version(prepared.inventory.spec.kubernetes.version) == "1.36.0"
    _check_manifests(prepared, rendered)


def test_bootstrap_manifests_validate_three_controls(three_controls, tmp_path):
    write_tree(three_controls.plans, tmp_path, three_controls.inventory, three_controls.material)
    _check_manifests(three_controls, tmp_path)


def test_strict_validation_rejects_unknown_fields(prepared, rendered):
    doc = dict(_bootstrap_docs(rendered)[0])
    doc["roleReff"] = doc["roleRef"]                 # an unknown field, the known one still there
    with pytest.raises(kube.KubeError, match="roleReff"):
        kube_objects.validate_objects([doc], prepared.inventory.spec.kubernetes.version)
