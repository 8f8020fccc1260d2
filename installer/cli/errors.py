"""One clear message and the error's exit code for every domain error: never a traceback; and
``with_cluster``: a command's INVENTORY and ``--state`` resolved once into a ``Cluster`` (the
inventory validated, the state held for the command's whole length: two commands on one PKI
would each write their own keys)."""

from __future__ import annotations

import functools
import sys

import click

from installer import api


def domain_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except api.InstallerError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
    return wrapper


def with_cluster(fn):
    """For a command with INVENTORY and ``--state``: ``fn`` gets ``cluster`` in place of both
    (under ``domain_errors``, which reports what opening it refuses)."""
    @functools.wraps(fn)
    def wrapper(*args, inventory, state_dir, **kwargs):
        with api.open_cluster(inventory, state_dir) as cluster:
            return fn(*args, cluster=cluster, **kwargs)
    wrapper.opens_cluster = True        # tests/test_state_rules.py: no such command without it
    return wrapper


def reading_cluster(fn):
    """``with_cluster`` for a command that only reads the state (the etcd member list, a snapshot
    save: they run beside an apply, as a backup job does): resolved once, not held."""
    @functools.wraps(fn)
    def wrapper(*args, inventory, state_dir, **kwargs):
        return fn(*args, cluster=api.resolve(inventory, state_dir), **kwargs)
    wrapper.opens_cluster = True
    return wrapper


def systemd_only(command: str, instead: str = ""):
    """For a command that does not handle hosted control planes (under ``with_cluster``):
    refused on a hosted tenant before it does anything, saying what to use ``instead``."""
    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, cluster, **kwargs):
            api.refuse_hosted(cluster.inv, command, instead)
            return fn(*args, cluster=cluster, **kwargs)
        return wrapper
    return wrap
