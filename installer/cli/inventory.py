"""``installer validate`` and ``installer schema``: the inventory alone, no host."""

from __future__ import annotations

import json

import click
import yaml

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


@click.command("hosting-access")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--user", help="The operator's user name, as the hosting cluster authenticates it.")
@click.option("--group", help="A group of operators.")
@click.option("--service-account", "service_account", metavar="NAMESPACE/NAME",
              help="A ServiceAccount (outside the tenant's namespace: reset deletes that).")
@domain_errors
def hosting_access(inventory, user, group, service_account):
    """Print the hosting cluster's objects for a hosted tenant's operator: its namespace, a Role
    with exactly what the installer does there, and the namespace object alone cluster-wide.

    For the hosting cluster's admin: `installer hosting-access INV --user NAME | kubectl apply -f -`.
    Nothing is contacted; docs/hosted.md, "The hosting identity"."""
    given = [(k, v) for k, v in (("User", user), ("Group", group), ("ServiceAccount", service_account)) if v]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --user, --group, --service-account")
    docs = api.hosting_access(inventory, *given[0])
    click.echo(yaml.safe_dump_all(docs, sort_keys=False), nl=False)
