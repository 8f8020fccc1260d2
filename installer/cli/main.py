"""``installer``: the command line, a thin layer over the Python API (installer/api.py).

Subcommands are imported when invoked (``LazyGroup``): `--help` loads nothing but click, and
`validate` only the inventory model, not the SSH and API clients other commands need."""

from __future__ import annotations

import importlib

import click

from installer import __version__

# name -> (module, attribute, one-line help for `installer --help`)
LAZY = {
    "validate": ("installer.cli.inventory", "validate", "Check INVENTORY and report every problem at once."),
    "schema": ("installer.cli.inventory", "schema", "Print the inventory's JSON Schema (for editors)."),
    "hosting-access": ("installer.cli.inventory", "hosting_access",
                       "Print the hosting cluster's RBAC for a hosted tenant's operator (least privilege)."),
    "apply": ("installer.cli.cluster", "apply",
              "Converge every host of INVENTORY: hidden control plane, joined workers."),
    "plan": ("installer.cli.cluster", "plan", "Show what apply would change on the live hosts, or render offline."),
    "kubeconfig": ("installer.cli.cluster", "kubeconfig", "Write an admin kubeconfig for the cluster's API endpoint."),
    "verify": ("installer.cli.cluster", "verify", "Check the live hosts: hidden control plane, private secrets."),
    "lab": ("installer.cli.lab", "lab", "Build, inspect and remove a lab of local hosts (Linux, root)."),
    "etcd": ("installer.cli.etcd", "etcd", "etcd day-2 operations: members, member add|remove, snapshots."),
    "certs": ("installer.cli.certs", "certs", "Certificate expiry across the state and the hosts; renewal."),
    "ca": ("installer.cli.ca", "ca", "Rotate a CA across the cluster."),
    "node": ("installer.cli.node", "node", "Node day-2 operations: list, add, drain, remove, revoke."),
    "reset": ("installer.cli.reset", "reset", "Tear the cluster down on every host."),
    "upgrade": ("installer.cli.upgrade", "upgrade", "Roll the cluster to new versions, one host at a time."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *LAZY])

    def get_command(self, ctx, name):
        if name in LAZY:
            module, attr, _ = LAZY[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        rows = [(n, LAZY[n][2] if n in LAZY else self.commands[n].get_short_help_str(limit=80))
                for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="installer (hiddenplane)")
def cli():
    """Kubernetes the hard way, with a hidden control plane."""


def main():
    cli(prog_name="installer")


if __name__ == "__main__":
    main()
