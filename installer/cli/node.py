"""``installer node``: add, drain, remove, revoke and list nodes."""

from __future__ import annotations

import click


@click.group()
def node():
    """Node day-2 operations: list, add, drain, remove, revoke."""
