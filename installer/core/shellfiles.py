"""The shell scripts the tool sends to hosts, kept as files in installer/sh/ (so that shellcheck
reads them as the hosts get them: tests/test_lint.py) rather than as strings in Python."""

from __future__ import annotations

import shlex
from pathlib import Path

SH_DIR = Path(__file__).resolve().parents[1] / "sh"


def shell_file(name: str, **values: str) -> str:
    """installer/sh/``name`` with ``values`` assigned before it (shell-quoted), the way a host
    runs it: its first line (#!) is replaced by them."""
    text = (SH_DIR / name).read_text()
    if text.startswith("#!"):
        text = text.split("\n", 1)[1]
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()) + text
