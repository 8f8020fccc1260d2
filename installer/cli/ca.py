"""``installer ca``: rotate the cluster's certificate authorities."""

from __future__ import annotations

import click

from installer.cli.certs import STATE_HELP, print_report
from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import DRY_RUN, OUTPUT, echo_plan
from installer.cli.output import nothing_without_yes


@click.group()
def ca():
    """Certificate-authority operations."""


@ca.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--which", multiple=True, type=click.Choice(["all", "ca", "etcd-ca", "front-proxy-ca"]),
              default=("all",), show_default=True,
              help="Which CAs get a new key and certificate (repeatable). A stolen node certificate needs "
                   "only `ca`; every leaf certificate is re-issued in any case.")
@click.option("--yes", is_flag=True, help="Really do it: the control plane (and etcd, when its CA rotates) is "
                                          "down during the rotation.")
@click.option("--no-api", "no_api", is_flag=True,
              help="Make no API calls (no real kube-apiserver, e.g. the contract stand-ins): the new "
                   "bootstrap token Secrets are then created by `installer apply`.")
@click.option("--wait-timeout", default=180.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for each component after its start.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def rotate(cluster, which, yes, no_api, wait_timeout, dry_run, fmt):
    """New certificate authorities and every certificate re-issued under them, rolled out without
    losing etcd data: the complete cure for a stolen certificate (kube-apiserver has no
    revocation list). Workers bootstrap their kubelet client certificate again.

    Without --yes: print the plan, change nothing, exit 2 (--dry-run: the same, exit 0). The old CA material is kept in
    <state>/backups/ca-rotate-<time>/ (0700). The service-account key is kept."""
    from installer.api import certs as certs_api
    report = certs_api.rotate_ca(cluster, which=which, yes=yes and not dry_run,
                                  use_api=not no_api, wait_timeout=wait_timeout, log=lambda m: click.echo(m, err=True))
    if dry_run:
        echo_plan("the rotation", report.steps, fmt, notes=report.notes)
        return
    if not yes:
        nothing_without_yes("the rotation", "rotate", report.steps)
    print_report(report, fmt)
    if fmt == "text":
        click.echo(f"rotated {', '.join(r.name for r in report.reissued if r.name == r.ca)}; "
                   f"{sum(r.name != r.ca for r in report.reissued)} certificate(s) re-issued")
