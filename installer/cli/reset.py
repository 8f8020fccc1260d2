"""``installer reset``: remove everything the installer put on the hosts."""

from __future__ import annotations

import click

from installer.api import reset as reset_api
from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import DRY_RUN, OUTPUT, STATE_DEFAULT, echo_json

STATE_HELP = ("Local state directory (kept unless --purge). "
              + STATE_DEFAULT)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--yes", is_flag=True, help="Really do it. Without it the plan is printed and nothing is done (exit 2).")
@click.option("--keep-data", is_flag=True,
              help="Keep etcd's data, the audit logs and containerd's images (and the etcd user owning the data).")
@click.option("--purge", is_flag=True, help="Also delete the local state directory (PKI, tokens, network.yaml).")
@click.option("--host", "hosts", multiple=True, metavar="NAME", help="Only this host (repeatable).")
@click.option("--ignore-unreachable", is_flag=True,
              help="Reset the reachable hosts even when some cannot be reached (they are named; not with --purge).")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def reset(cluster, yes, keep_data, purge, hosts, ignore_unreachable, dry_run, fmt):
    """Remove everything the installer put on the hosts of INVENTORY: units, binaries, files
    (an original it replaced is put back), credentials, container and CNI state, routes,
    rules, sysctls, the users it created and, unless --keep-data, etcd's data. Workers first,
    then control hosts. The local state directory is kept unless --purge.

    Exit 0 when done; 2 when not (no --yes, a host unreachable, an apply running: nothing done;
    a host that failed: rerun to finish)."""
    if dry_run:
        would = reset_api.plan(cluster, keep_data=keep_data, purge=purge, hosts=hosts)
        if fmt == "json":
            echo_json({"dryRun": True, **would})
            return
        click.echo("".join(f"- {line}\n" for line in would["steps"]), nl=False)
        for name, steps in would["hosts"].items():
            click.echo(f"{name}:")
            click.echo("".join(f"  - {line}\n" for line in steps), nl=False)
        click.echo(f"local state {would['state']}: " + ("delete it (--purge)" if purge else "kept"))
        return
    report = reset_api.reset(cluster, yes=yes, keep_data=keep_data, purge=purge,
                             hosts=hosts, ignore_unreachable=ignore_unreachable,
                             log=lambda m: click.echo(m, err=True))
    if fmt == "json":
        echo_json(report.as_dict())
        return
    for name, done in report.hosts.items():
        click.echo(f"{name}: {'reset, ' + str(len(done)) + ' change(s)' if done else 'nothing to remove'}")
    if report.unreachable:
        click.echo(f"not reset (unreachable): {', '.join(report.unreachable)}")
    if report.purged:
        click.echo(f"deleted the local state {report.state}")
    else:
        click.echo(f"local state kept: {report.state}")
