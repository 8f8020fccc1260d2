"""``installer node``: list, add, drain, remove (decommission) and revoke nodes."""

from __future__ import annotations

import dataclasses

import click

from installer.api import nodes as nodes_api
from installer.cli.errors import domain_errors, with_cluster
from installer.cli.options import DRY_RUN, OUTPUT, STATE_DEFAULT, echo_json, echo_plan
from installer.cli.output import Progress, nothing_without_yes, table

STATE_HELP = ("Local state directory holding the PKI and the node ledger. "
              + STATE_DEFAULT)


def _common(f):
    for option in reversed([
        click.argument("inventory", type=click.Path(dir_okay=False)),
        click.argument("name"),
        click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP),
    ]):
        f = option(f)
    return f


def _err(line: str) -> None:
    click.echo(line, err=True)


def _plan_first(cluster, name, what: str, yes: bool, dry_run: bool, fmt: str, **kw) -> bool:
    """Without --yes (exit 2) or with --dry-run (exit 0): the steps it would run, nothing done.
    True when the command is to go on."""
    if yes and not dry_run:
        return True
    t, _ = nodes_api.node_target(cluster, name)
    plan = nodes_api.remove_plan(t, **kw)
    if not dry_run:
        nothing_without_yes(f"{what} {name}", "do it", plan)
    echo_plan(f"{what} {name}", plan, fmt, name=name)
    return False


def _outcome(out: nodes_api.Outcome, verb: str, fmt: str) -> None:
    for w in out.warnings:
        _err(f"warning: {w}")
    if fmt == "json":
        echo_json({**out.as_dict(), "dryRun": False})
        return
    for line in out.done:
        click.echo(f"  {line}")
    e = out.entry
    click.echo(f"{out.name}: {verb}" + (f" ({e.state} since {e.since}; delete it from the inventory)" if e else ""))



@click.group()
def node():
    """Node day-2 operations: list, add, drain, remove, revoke."""


@node.command("list")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help=STATE_HELP)
@click.option("--api", "use_api", is_flag=True, help="Also ask the API which nodes are registered and Ready.")
@click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@domain_errors
@with_cluster
def list_(cluster, use_api, fmt):
    """Every host with its state: active, removed or revoked (inventory + node ledger)."""
    nodes = nodes_api.list_nodes(cluster, use_api=use_api)
    if fmt == "json":
        echo_json([r.as_dict() for r in nodes])
        return
    rows = [("NAME", "ROLE", "ADDRESS", "STATE", "SINCE", "IN INVENTORY") + (("API",) if use_api else ())]
    for r in nodes:
        rows.append((r.name, r.role, r.address, r.state, r.since, "yes" if r.in_inventory else "no")
                     + ((r.registered,) if use_api else ()))
    table(rows)


@node.command()
@_common
@click.option("--skip", multiple=True, help="Skip these apply phases (e.g. cluster-bootstrap with no real API).")
@click.option("--allow-even", is_flag=True, help="Control host: allow an even etcd member count (a replacement step).")
@click.option("--accept-new-host-keys", is_flag=True, help="Trust and record the new host's key if not yet known.")
@click.option("--wait-timeout", default=180.0, show_default=True, help="Seconds to wait for health.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def add(cluster, name, skip, allow_even, accept_new_host_keys, wait_timeout, dry_run, fmt):
    """Join NAME (already added to INVENTORY): only its certificates and bootstrap token are
    issued, only it is changed, plus the pod routes on the other hosts. Refused when the
    inventory holds other pending changes (run `installer apply` for those). A control host
    joins etcd as a learner and is promoted. --dry-run: a worker's planned changes (as
    `installer plan` shows them), a control host's steps."""
    progress = Progress(fmt, verbose=True)
    result = nodes_api.add(cluster, name, skip=frozenset(skip), allow_even=allow_even,
                           accept_new_host_keys=accept_new_host_keys, wait_timeout=wait_timeout,
                           log=progress.log, dry_run=dry_run)
    if isinstance(result, nodes_api.Change):
        if dry_run:
            echo_plan(f"node add {name}", result.steps, fmt)
        elif fmt == "json":
            echo_json({"dryRun": False, **dataclasses.asdict(result)})
        else:
            click.echo(f"{name}: etcd member {result.member_id} added and promoted; "
                       f"{len(result.members)} voting members, all healthy")
        return
    if result is None:
        click.echo(f"{name}: nothing to change (already joined)" if fmt == "text" else "{}")
        return
    for ev in result.events:
        progress.event(ev)
    progress.done(result, f"node add {name}" + (" (dry run)" if dry_run else ""))


@node.command()
@_common
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for evictions.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def drain(cluster, name, timeout, dry_run, fmt):
    """Cordon NAME and evict its pods (PodDisruptionBudgets respected; mirror and DaemonSet pods
    stay). Fails, leaving the node cordoned, when pods remain after --timeout. --dry-run: the
    pods it would evict and leave now."""
    res = nodes_api.drain(cluster, name, timeout=timeout, log=_err, dry_run=dry_run)
    if dry_run:
        echo_plan(f"draining {name}", [f"cordon Node {name}"] + [f"evict {p}" for p in res.evicted]
                  + [f"leave {p}" for p in res.skipped], fmt, name=name, evicted=res.evicted, skipped=res.skipped)
        return
    if fmt == "json":
        echo_json({"dryRun": False, "name": name, "evicted": res.evicted, "skipped": res.skipped})
        return
    click.echo(f"{name}: drained, {len(res.evicted)} pod(s) evicted"
               + (f"; left to the node: {', '.join(res.skipped)}" if res.skipped else ""))


@node.command()
@_common
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the drain.")
@click.option("--host-unreachable", is_flag=True,
              help="The host is gone: do the cluster-side part only (the drain does not wait for it).")
@click.option("--skip-cluster", is_flag=True,
              help="Do the host-side part only (no Kubernetes API, e.g. a lab with stand-ins).")
@click.option("--allow-even", is_flag=True, help="Control host: allow an even etcd member count (a replacement step).")
@click.option("--accept-new-host-keys", is_flag=True, help="Trust and record the host's key if not yet known.")
@click.option("--yes", is_flag=True, help="Really do it (without: print what would be done, change nothing).")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def remove(cluster, name, timeout, host_unreachable, skip_cluster, allow_even, accept_new_host_keys, yes, dry_run,
           fmt):
    """Decommission NAME: cordon, drain, delete the Node, its token, renewal binding and pending
    CSRs; on the host stop everything, kill every container and shim, remove credentials, CNI
    state, routes and data; drop its routes on the other hosts; mark it removed."""
    if host_unreachable and skip_cluster:
        raise click.UsageError("--host-unreachable and --skip-cluster together leave nothing to do")
    if not _plan_first(cluster, name, "node remove", yes, dry_run, fmt,
                       skip_cluster=skip_cluster, host_unreachable=host_unreachable):
        return
    out = nodes_api.remove(cluster, name, timeout=timeout, skip_cluster=skip_cluster,
                          host_unreachable=host_unreachable, allow_even=allow_even,
                          accept_new_host_keys=accept_new_host_keys, log=_err)
    _outcome(out, "removed", fmt)


@node.command()
@_common
@click.option("--host-unreachable", is_flag=True, help="The host is gone or untrusted: do not try to wipe it.")
@click.option("--accept-new-host-keys", is_flag=True, help="Trust and record the host's key if not yet known.")
@click.option("--yes", is_flag=True, help="Really do it (without: print what would be done, change nothing).")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def revoke(cluster, name, host_unreachable, accept_new_host_keys, yes, dry_run, fmt):
    """Revoke NAME for good, even against a stolen certificate: deny every write by
    system:node:NAME (ValidatingAdmissionPolicy), delete its renewal binding, bootstrap token,
    pending CSRs and Node, record it in the ledger, wipe the host when reachable. The name can
    never join again. See docs/day2.md for what this cannot do (no CRL in Kubernetes)."""
    if not _plan_first(cluster, name, "node revoke", yes, dry_run, fmt, skip_cluster=False,
                       host_unreachable=host_unreachable, revoke=True):
        return
    out = nodes_api.revoke(cluster, name, host_unreachable=host_unreachable,
                          accept_new_host_keys=accept_new_host_keys, log=_err)
    _outcome(out, "revoked", fmt)
