"""``installer certs``: certificate expiry across the state directory and the hosts."""

from __future__ import annotations

import datetime as dt
import json

import click

from .errors import domain_errors

STATE_HELP = ("Local state directory holding the PKI. "
              "Default: $XDG_STATE_HOME/hiddenplane/<cluster> (~/.local/state/hiddenplane/<cluster>).")


@click.group()
def certs():
    """Inspect the cluster's certificates."""


@certs.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--within", "within", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Fail when a certificate expires within this many days.")
@click.option("--offline", is_flag=True, help="Check the state directory only; contact no host.")
@click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@domain_errors
def check(inventory, state_dir, within, offline, fmt):
    """Every certificate in the state and as deployed on each host, soonest expiry first.

    Exit 0 when none expires within --within days, 1 when one does (or has expired),
    2/3 when the state or a host cannot be read. Read-only."""
    from .. import certs as certs_mod
    rows = certs_mod.check(inventory, state_dir, offline=offline, log=lambda m: click.echo(m, err=True))
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
             "; ".join((["EXPIRED"] if r.not_after <= now else ["EXPIRING"] if r in expiring else []) + r.notes))
            for r in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        for line in lines:
            click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1])
        if expiring:
            click.echo(f"{len(expiring)} certificate(s) expire within {within:g} days:")
            for r in expiring:
                click.echo(f"  {r.where}: {r.name}")
        else:
            click.echo(f"{len(rows)} certificate(s), none expires within {within:g} days")
    if expiring:
        raise SystemExit(1)
