"""``installer certs``: certificate expiry across the state directory and the hosts; renewal."""

from __future__ import annotations

import datetime as dt
import json

import click

from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import STATE_DEFAULT
from installer.cli.output import table

STATE_HELP = ("Local state directory holding the PKI. "
              + STATE_DEFAULT)


@click.group()
def certs():
    """Inspect and renew the cluster's certificates."""


@certs.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--within", "within", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Fail when a certificate expires within this many days.")
@click.option("--offline", is_flag=True, help="Check the state directory only; contact no host.")
@click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@domain_errors
@with_cluster
def check(cluster, within, offline, fmt):
    """Every certificate in the state and as deployed on each host, soonest expiry first.

    Exit 0 when none expires within --within days, 1 when one does (or has expired),
    2/3 when the state or a host cannot be read. Read-only. The kubelet's own client
    certificate, short-lived and renewed by the kubelet, counts only when its renewal is late
    (past 90 % of its lifetime)."""
    from installer.api import certs as certs_api
    rows = certs_api.check(cluster, offline=offline, log=lambda m: click.echo(m, err=True))
    now = dt.datetime.now(dt.timezone.utc)
    expiring = [r for r in rows if r.expiring(now, within)]
    if fmt == "json":
        click.echo(json.dumps({"within": within, "expiring": len(expiring),
                               "certificates": [r.as_dict(now, within) for r in rows]}, indent=2))
    else:
        header = ("WHERE", "NAME", "SUBJECT", "ISSUER", "NOT AFTER (UTC)", "DAYS", "NOTES")
        lines = [header] + [
            (r.where, r.name, r.subject, r.issuer,
             r.not_after.strftime("%Y-%m-%d %H:%M") if r.serial else "-",
             str(r.days_left(now)) if r.serial else "-",
             "; ".join((["EXPIRED"] if r.not_after <= now else ["ROTATION LATE"] if r in expiring and r.self_rotated
                        else ["EXPIRING"] if r in expiring else []) + r.notes))
            for r in rows]
        table(lines)
        if expiring:
            click.echo(f"{len(expiring)} certificate(s) expire within {within:g} days or are not renewed "
                       "by their holder in time:")
            for r in expiring:
                click.echo(f"  {r.where}: {r.name}")
        else:
            click.echo(f"{len(rows)} certificate(s), none expires within {within:g} days")
    if expiring:
        raise SystemExit(1)


def print_report(report, fmt: str) -> None:
    """A renewal's or rotation's report on stdout (text or JSON); shared with `ca rotate`."""
    if fmt == "json":
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    for r in report.reissued:
        click.echo(f"{r.name}: {r.old_serial} -> {r.new_serial} ({r.ca}, not after {r.not_after[:16]})")
    for host, r in sorted(report.rollout.items()):
        click.echo(f"{host}: {len(r.files)} file(s): {', '.join(r.files)}")
        click.echo(f"{host}: restart: {', '.join(u.removesuffix('.service') for u in r.units) or 'nothing'}")
    for step in report.steps:
        click.echo(f"- {step}")
    for c in report.checks:
        click.echo(f"{c.host}: {c.endpoint} {c.address}:{c.port}: {c.before or '?'} -> {c.after or '?'} "
                   f"{'ok' if c.ok else 'FAILED'} ({c.note})")
    if report.backup:
        click.echo(f"backup: {report.backup}")
    for note in report.notes:
        click.echo(f"note: {note}")


@certs.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--only", "only", multiple=True, metavar="NAME",
              help="Renew only this certificate (a state name such as apiserver or etcd/server-cp1, or a "
                   "glob such as 'etcd/*'); repeatable. Default: every leaf certificate.")
@click.option("--dry-run", is_flag=True, help="List what would be re-issued, pushed and restarted; change nothing.")
@click.option("--wait-timeout", default=180.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds to wait for each component after its restart.")
@click.option("--no-api", "no_api", is_flag=True,
              help="Make no API calls (no real kube-apiserver, e.g. the contract stand-ins): a restarted "
                   "kubelet is not waited for until its Node is Ready.")
@click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@domain_errors
@with_cluster
def renew(cluster, only, dry_run, wait_timeout, no_api, fmt):
    """Re-issue leaf certificates (new keys; never a CA), push them, restart in a safe order
    (etcd member by member, apiserver host by host, then the rest, then the workers, each Node
    Ready again before the next) and check
    by TLS handshake that every endpoint presents its new certificate.

    The hosts must match the state (run `installer apply` first). The old files are kept in
    <state>/backups/renew-<time>/. Kubelet client certificates are the kubelets' own (TLS
    bootstrapping): not renewed here. Exit 0 when every endpoint presents the new certificate."""
    from installer.api import certs as certs_api
    report = certs_api.renew(cluster, only=only, dry_run=dry_run,
                             wait_timeout=wait_timeout, use_api=not no_api, log=lambda m: click.echo(m, err=True))
    print_report(report, fmt)
    if fmt == "text":
        click.echo(f"{'would renew' if dry_run else 'renewed'} {len(report.reissued)} certificate(s)"
                   + ("; nothing changed (dry run)" if dry_run else ""))
