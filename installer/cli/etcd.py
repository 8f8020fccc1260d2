"""``installer etcd``: list members, save a snapshot, restore one on every member."""

from __future__ import annotations

import click

from .. import api, etcd_ops
from .errors import domain_errors


@click.group()
def etcd():
    """etcd day-2 operations: members, snapshot save, snapshot restore."""


@etcd.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@domain_errors
def members(inventory):
    """List the etcd members (asked on the first reachable control host)."""
    rows = [("NAME", "ID", "PEER URL", "CLIENT URL", "LEARNER")]
    for m in etcd_ops.members(inventory):
        rows.append((m.name, m.id, ",".join(m.peer_urls), ",".join(m.client_urls), "yes" if m.learner else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@etcd.group()
def snapshot():
    """Save or restore an etcd snapshot."""


@snapshot.command("save")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("file", type=click.Path(dir_okay=False))
@domain_errors
def save(inventory, file):
    """Take a snapshot (etcdctl snapshot save) and write it to FILE (mode 0600)."""
    info = etcd_ops.snapshot_save(inventory, file)
    click.echo(f"{info.path}: snapshot from {info.host}, {info.size} bytes, hash {info.hash}, "
               f"revision {info.revision}, {info.total_keys} keys (mode 0600)")


@snapshot.command("restore")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--yes", is_flag=True, help="Really do it: the control plane is down during the restore.")
@click.option("--wait-timeout", default=120.0, show_default=True, help="Seconds to wait for etcd health.")
@domain_errors
def restore(inventory, file, yes, wait_timeout):
    """Restore FILE on every etcd member (the control plane is stopped meanwhile)."""
    if not yes:
        inv = api.validate(inventory)
        click.echo("the restore would:", err=True)
        for step in etcd_ops.restore_plan(inv, file, "<time>"):
            click.echo(f"  - {step}", err=True)
        click.echo("error: nothing done; pass --yes to restore", err=True)
        raise SystemExit(2)
    hosts = etcd_ops.snapshot_restore(inventory, file, wait_timeout=wait_timeout,
                                      log=lambda m: click.echo(m, err=True))
    click.echo(f"restored {file} on {', '.join(hosts)}; etcd healthy, control plane started")
