"""``installer reset``: remove everything the installer put on the hosts."""

from __future__ import annotations

import click


@click.command()
def reset():
    """Remove everything the installer put on the hosts."""
    raise click.UsageError("not implemented yet")
