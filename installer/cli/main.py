"""``installer``: validate, plan and (later) apply a hidden-control-plane cluster."""

from __future__ import annotations

import json

import click

from .. import __version__, api
from ..inventory import json_schema
from .errors import domain_errors
from .lab import lab

STATE_HELP = ("Local state directory holding the PKI (0700). "
              "Default: $XDG_STATE_HOME/hiddenplane/<cluster> (~/.local/state/hiddenplane/<cluster>).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="installer (hiddenplane)")
def cli():
    """Kubernetes the hard way, with a hidden control plane."""


@cli.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@domain_errors
def validate(inventory):
    """Check INVENTORY and report every problem at once."""
    inv = api.validate(inventory)
    click.echo(f"{inventory}: valid — cluster {inv.metadata.name}, Kubernetes {inv.spec.kubernetes.version}, "
               f"{len(inv.controls)} control host(s), {len(inv.workers)} worker(s), API {inv.api_url}")


@cli.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--render", "render_dir", type=click.Path(file_okay=False),
              help="Write every host's files to DIR/<host>/<path> with a MANIFEST per host.")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@domain_errors
def plan(inventory, render_dir, state_dir):
    """Compute what every host must hold (PKI is created or updated in the state directory)."""
    p = api.render(inventory, render_dir, state_dir) if render_dir else api.prepare(inventory, state_dir)
    for name, why in sorted(p.changes.reasons.items()):
        click.echo(f"pki: {name}: {why}")
    for name, hp in p.plans.items():
        click.echo(f"{name} ({hp.role}): {len(hp.files)} files, {len(hp.dirs)} directories, units: "
                   + ", ".join(u.removesuffix(".service") for u in hp.units))
    click.echo(f"state: {p.state.root}")
    if render_dir:
        click.echo(f"rendered to {render_dir}/<host>/ (see MANIFEST in each)")


@cli.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Where to write it (mode 0600). Default: ./<cluster>.kubeconfig")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--force", is_flag=True, help="Overwrite an existing file with other content.")
@domain_errors
def kubeconfig(inventory, output, state_dir, force):
    """Write an admin kubeconfig (user kubernetes-admin) for the cluster's API endpoint."""
    inv, path, written = api.admin_kubeconfig(inventory, output, state_dir, force)
    click.echo(f"{path}: {'written' if written else 'unchanged'} (user kubernetes-admin, server {inv.api_url})")


@cli.command()
def schema():
    """Print the inventory's JSON Schema (for editors)."""
    click.echo(json.dumps(json_schema(), indent=2))


cli.add_command(lab)


def main():
    cli(prog_name="installer")


if __name__ == "__main__":
    main()
