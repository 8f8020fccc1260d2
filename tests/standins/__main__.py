"""``python -m tests.standins install DIR`` (run from the repository root)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import COMPONENTS, install


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.standins",
        description="Contract stand-ins (not Kubernetes) for " + ", ".join(COMPONENTS) + ".")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="write the five stand-in scripts into DIR and record them in DIR/SHA256SUMS")
    p.add_argument("directory", metavar="DIR", type=Path)
    args = parser.parse_args(argv)
    try:
        written = install(args.directory)
    except Exception as e:  # noqa: BLE001 - one clear line, no traceback
        print(f"tests.standins: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(args.directory / "SHA256SUMS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
