"""One clear message and the error's exit code for every domain error: never a traceback."""

from __future__ import annotations

import functools
import sys

import click

from ..errors import InstallerError


def domain_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InstallerError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
    return wrapper
