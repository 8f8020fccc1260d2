"""``installer validate`` and ``installer schema``: the inventory alone, no host."""

from __future__ import annotations

import json

import click

from installer import api
from installer.cli.errors import domain_errors


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@domain_errors
def validate(inventory):
    """Check INVENTORY and report every problem at once."""
    inv = api.validate(inventory)
    click.echo(f"{inventory}: valid — cluster {inv.metadata.name}, Kubernetes {inv.spec.kubernetes.version}, "
               f"{len(inv.controls)} control host(s), {len(inv.workers)} worker(s), API {inv.api_url}")


@click.command()
def schema():
    """Print the inventory's JSON Schema (for editors)."""
    click.echo(json.dumps(api.json_schema(), indent=2))
