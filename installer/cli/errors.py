"""One clear message and the error's exit code for every domain error: never a traceback.

A command with an INVENTORY and a ``--state`` option holds the state directory (an flock)
for its whole length: two commands on one PKI would each write their own keys."""

from __future__ import annotations

import functools
import inspect
import sys

import click

from installer import api


def domain_errors(fn):
    params = inspect.signature(fn).parameters
    holds_state = "inventory" in params and "state_dir" in params

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if holds_state:
                inv = api.validate(kwargs["inventory"])
                with api.state_for(inv, kwargs["state_dir"]).locked(create=False):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except api.InstallerError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
    return wrapper
