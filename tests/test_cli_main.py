"""The command line's shape: lazy subcommands, so `validate` and `--help` stay fast."""

from __future__ import annotations

import subprocess
import sys

import click

from installer.cli.main import LAZY, cli

from .conftest import EXAMPLE, ROOT

PROBE = """
import sys
from installer.cli.main import cli
try:
    cli(sys.argv[1:], standalone_mode=False)
finally:
    print("LOADED", " ".join(sorted(m for m in sys.modules if m.split(".")[0] in
                                    ("urllib3", "jsonschema", "kubernetes_validate", "fabric", "paramiko"))))
"""


def loaded_by(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("LOADED")][-1]
    return set(line.split()[1:])


def test_validate_and_help_load_no_client_library():
    for args in (["validate", str(EXAMPLE)], ["--help"], ["schema"]):
        assert loaded_by(*args) == set(), args


def test_every_lazy_command_resolves_to_its_click_command():
    ctx = click.Context(cli)
    for name in LAZY:
        cmd = cli.get_command(ctx, name)
        assert isinstance(cmd, click.Command) and cmd.name == name
    assert set(cli.list_commands(ctx)) == set(LAZY) | {"validate", "schema"}


def test_apply_loads_the_api_client_only_when_it_reaches_the_api():
    # a stand-in or not-yet-bootstrapped cluster's apply never talks to the API: its imports
    # stay without the HTTP client and the schemas (host/kube.py, kube_objects.py load them)
    code = ("import sys, installer.cli.cluster, installer.engine.runner; print(' '.join(sorted("
            "m for m in sys.modules if m.split('.')[0] in ('urllib3', 'jsonschema', 'kubernetes_validate'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""
