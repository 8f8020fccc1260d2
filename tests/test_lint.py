"""The whole repository passes ruff (pycodestyle errors and warnings, pyflakes, import order) with
the configuration in pyproject.toml. ruff comes with the ``test`` extra: without it this fails,
it does not skip."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT


def test_ruff_finds_nothing():
    # --no-cache: a test run writes nothing into the checkout
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
