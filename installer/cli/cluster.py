"""``installer apply|plan|kubeconfig|verify``: the commands that converge or inspect a cluster."""

from __future__ import annotations

import json

import click

from installer import api
from installer.api import cluster as cluster_api
from installer.api.cluster import PHASE_NAMES, Options
from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import STATE_DEFAULT
from installer.cli.output import Progress

STATE_HELP = ("Local state directory holding the PKI (0700). "
              + STATE_DEFAULT)


def _apply_options(f):
    for option in reversed([
        click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP),
        click.option("--only", multiple=True, help=f"Run only these phases ({', '.join(PHASE_NAMES)})."),
        click.option("--skip", multiple=True, help="Skip these phases."),
        click.option("--parallel", default=10, show_default=True, help="Hosts worked on at once per phase."),
        click.option("--accept-new-host-keys", is_flag=True,
                     help="Trust and record host keys not yet in known_hosts (a changed key is still refused)."),
        click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True),
        click.option("-v", "--verbose", is_flag=True, help="Show every planned change."),
        click.option("--wait-timeout", default=180.0, show_default=True, help="Seconds to wait for health."),
    ]):
        f = option(f)
    return f


def _options(dry_run, only, skip, parallel, accept_new_host_keys, wait_timeout, force_unlock=False) -> Options:
    return Options(dry_run=dry_run, parallel=parallel, accept_new_host_keys=accept_new_host_keys,
                   only=frozenset(only), skip=frozenset(skip), force_unlock=force_unlock,
                   wait_timeout=wait_timeout)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@_apply_options
@click.option("--dry-run", is_flag=True, help="Show what would change (same as `installer plan`).")
@click.option("--force-unlock", is_flag=True, help="Break a stale apply lock.")
@domain_errors
@with_cluster
def apply(cluster, only, skip, parallel, accept_new_host_keys, fmt, verbose, wait_timeout, dry_run, force_unlock):
    """Converge every host of INVENTORY: hidden control plane, joined workers. Idempotent."""
    progress = Progress(fmt, verbose or dry_run)
    report = cluster_api.run(cluster,
                             _options(dry_run, only, skip, parallel, accept_new_host_keys, wait_timeout, force_unlock),
                        log=progress.log, on_event=progress.event, on_upload=progress.upload)
    progress.done(report, "plan" if dry_run else "apply")


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--render", "render_dir", type=click.Path(file_okay=False),
              help="Offline: write every host's files to DIR/<host>/<path> with a MANIFEST per host "
                   "(creates or updates the PKI in the state directory; contacts no host).")
@click.option("--check", is_flag=True, help="Exit 1 when changes are pending, 0 when converged.")
@_apply_options
@domain_errors
@with_cluster
def plan(cluster, render_dir, check, only, skip, parallel, accept_new_host_keys, fmt, verbose, wait_timeout):
    """Show what apply would change on the live hosts (secrets masked), or render offline."""
    if render_dir:
        p = api.render(cluster, render_dir)
        for name, why in sorted(p.changes.reasons.items()):
            click.echo(f"pki: {name}: {why}")
        for name, hp in p.plans.items():
            click.echo(f"{name} ({hp.role}): {len(hp.files)} files, {len(hp.dirs)} directories, units: "
                       + ", ".join(u.removesuffix(".service") for u in hp.units))
        click.echo(f"state: {p.state.root}")
        click.echo(f"rendered to {render_dir}/<host>/ (see MANIFEST in each)")
        return
    progress = Progress(fmt, verbose=True)
    report = cluster_api.run(cluster, _options(True, only, skip, parallel, accept_new_host_keys,
                                                       wait_timeout),
                        log=progress.log, on_event=progress.event)
    progress.done(report, "plan")
    if check and report.changed:
        raise SystemExit(1)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Where to write it (mode 0600). Default: ./<cluster>.kubeconfig")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--force", is_flag=True, help="Overwrite an existing file with other content.")
@domain_errors
@with_cluster
def kubeconfig(cluster, output, force):
    """Write an admin kubeconfig (user kubernetes-admin) for the cluster's API endpoint, or,
    without one, the first control host whose apiserver answers now."""
    inv, path, written, server, why = api.admin_kubeconfig(cluster, output, force)
    click.echo(f"{path}: {'written' if written else 'unchanged'} (user kubernetes-admin, server {server}"
               + (f"; {why}" if why else "") + ")")


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--api", "use_api", is_flag=True, help="Also ask the API that no Node is a control host.")
@domain_errors
@with_cluster
def verify(cluster, fmt, use_api):
    """Check the live hosts (testinfra over SSH, host keys verified): the control plane is hidden,
    every secret is private. Read-only; rerun any time.

    Exit 0 when every check passes, 1 when any fails, 2/3 when a host cannot be checked."""
    results = cluster_api.verify(cluster, log=lambda m: click.echo(m, err=True), api=use_api)
    failed = [r for r in results if not r.ok]
    if fmt == "json":
        click.echo(json.dumps({"ok": not failed, "failed": len(failed), "checks": [r.as_dict() for r in results]},
                              indent=2))
    else:
        for r in results:
            click.echo(r.line())
        click.echo(f"{len(results) - len(failed)}/{len(results)} checks passed"
                   + (f", {len(failed)} FAILED" if failed else ""))
    if failed:
        raise SystemExit(1)
