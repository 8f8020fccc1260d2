"""What both harnesses share: a failure's signature, and the libFuzzer entry point.

A signature names a failure without its data: ``AssertionError: <the property's words>`` (the
harnesses' messages are ``<fixed words>: <details>``), or ``<exception type> in <file>:<function>``
for the innermost frame in the installer package. tests/test_fuzz.py passes the signatures of
the crashes still open (its OPEN table; each replayed as a strict xfail) in
HIDDENPLANE_FUZZ_OPEN, one a line, so that a CI run keeps looking for new failures instead of
stopping at a known one; any other failure stops the run as a crash.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "installer"


def signature(exc: BaseException) -> str:
    if isinstance(exc, AssertionError):
        return "AssertionError: " + str(exc).split(": ", 1)[0]
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE)]
    where = (ours or frames)[-1] if frames else None
    at = f" in {Path(where.filename).resolve().relative_to(ROOT) if ours else Path(where.filename).name}:{where.name}" \
        if where else ""
    return f"{type(exc).__name__}{at}"


def run(check: Callable[[bytes], None], argv: list[str], atheris, custom_mutator=None) -> None:
    if atheris is None:
        sys.exit("atheris is not installed: .venv/bin/python -m pip install -e '.[test]'")
    tolerated = {s for s in os.environ.get("HIDDENPLANE_FUZZ_OPEN", "").split("\n") if s}

    def target(data: bytes) -> None:
        try:
            check(data)
        except Exception as e:
            if signature(e) not in tolerated:
                raise

    atheris.Setup(argv, target if tolerated else check, custom_mutator=custom_mutator)
    atheris.Fuzz()
