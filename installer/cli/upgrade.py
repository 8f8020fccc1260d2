"""``installer upgrade``: a rolling upgrade of a running cluster."""

from __future__ import annotations

import click

from installer.api import upgrade as upgrade_api
from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import OUTPUT, STATE_DEFAULT, echo_json


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=f"Local state directory. {STATE_DEFAULT}")
@click.option("--to", "to", metavar="VERSION",
              help="Target Kubernetes version (default: the inventory's spec.kubernetes.version).")
@click.option("--plan", "--dry-run", "plan_only", is_flag=True,
              help="Print the checks and the order, per host; change nothing (exit 0). Shows where an interrupted "
                   "upgrade stopped.")
@click.option("--max-unavailable", default=1, show_default=True, type=click.IntRange(min=1),
              help="Workers upgraded at the same time (each cordoned and drained first).")
@click.option("--drain-timeout", default=300.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for a worker's evictions (PodDisruptionBudgets respected).")
@click.option("--wait-timeout", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for each host's components (and each Node Ready) after its turn.")
@click.option("--force", is_flag=True, help="Upgrade although a Node is NotReady or etcd is unhealthy.")
@click.option("--no-api", "no_api", is_flag=True,
              help="Make no API calls (no real kube-apiserver, e.g. the contract stand-ins): workers are not "
                   "cordoned, drained or waited for.")
@OUTPUT
@domain_errors
@with_cluster
def upgrade(cluster, to, plan_only, max_unavailable, drain_timeout, wait_timeout, force, no_api, fmt):
    """Roll the cluster of INVENTORY to a new Kubernetes (and etcd patch) version without an
    outage: an etcd snapshot first (kept), etcd one member at a time when its version changes,
    each control host alone (apiserver first, /readyz before the next), then the workers
    --max-unavailable at a time (cordon, drain, new kubelet and kube-proxy, Ready, uncordon).
    Follows the version-skew policy: one minor at a time, never down a minor (a patch down within
    the minor is the rollback). Re-running finishes an interrupted upgrade.

    Exit 0 when done (or with --plan), 2 bad input, 3 a step failed (re-run to finish), 4 refused
    by the skew rules or the cluster's health (nothing changed)."""
    report = upgrade_api.upgrade(cluster, to=to, plan_only=plan_only,
                                 max_unavailable=max_unavailable,
                                 drain_timeout=drain_timeout, wait_timeout=wait_timeout, force=force,
                                 use_api=not no_api, log=lambda m: click.echo(m, err=True))
    if fmt == "json":
        echo_json(report.as_dict())
        return
    click.echo(f"upgrade {report.current} -> {report.target} ({report.kind})")
    for c in report.checks:
        click.echo(f"check: {c}")
    if plan_only:
        click.echo("would:")
        for step in report.steps:
            click.echo(f"  - {step}")
        return
    for step, seconds in report.timings:
        click.echo(f"{seconds:7.1f} s  {step}")
    if report.snapshot:
        click.echo(f"etcd snapshot kept: {report.snapshot}")
    click.echo(f"upgraded to {report.target} in {report.seconds:.1f} s")
