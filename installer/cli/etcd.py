"""``installer etcd``: list members (and their alarms), add or remove one, defragment, save a
snapshot, restore one on every member."""

from __future__ import annotations

import dataclasses

import click

from installer.api import etcd as etcd_api
from installer.cli.errors import domain_errors, reading_cluster, systemd_only, with_cluster
from installer.cli.options import DRY_RUN, OUTPUT, echo_json, echo_plan
from installer.cli.output import human_size, nothing_without_yes, table


@click.group()
def etcd():
    """etcd day-2 operations: members (and alarms), member add|remove, defrag, snapshot save|restore."""


@etcd.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False),
              help="Local state directory (see apply): a hosted tenant's namespace must name it as its owner.")
@OUTPUT
@domain_errors
@reading_cluster
def members(cluster, fmt):
    """List the etcd members (asked on the first reachable control host, or a hosted tenant's
    first ready member) and the alarms they raised (NOSPACE: out of space), with what to do."""
    found, raised = etcd_api.members_and_alarms(cluster)
    by_member: dict[str, list[str]] = {}
    for a in raised:
        by_member.setdefault(a.member_id, []).append(a.alarm)
    if fmt == "json":
        echo_json([{**dataclasses.asdict(m), "alarms": by_member.get(m.id, [])} for m in found])
        return
    rows = [("NAME", "ID", "PEER URL", "CLIENT URL", "LEARNER", "ALARMS")]
    for m in found:
        rows.append((m.name, m.id, ",".join(m.peer_urls), ",".join(m.client_urls), "yes" if m.learner else "no",
                     ",".join(by_member.get(m.id, [])) or "-"))
    table(rows)
    for line in etcd_api.alarm_lines(raised, {m.id: m.name for m in found}):
        click.echo(line, err=True)


@etcd.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--state", "state_dir", type=click.Path(file_okay=False),
              help="Local state directory (see apply): a hosted tenant's namespace must name it as its owner.")
@OUTPUT
@domain_errors
@with_cluster
def defrag(cluster, fmt):
    """The way out of a NOSPACE alarm, once what filled etcd is deleted: compact the history,
    defragment every member one at a time (each answers nobody meanwhile), disarm the alarm.
    Holds the apply lock."""
    done = etcd_api.defrag(cluster, log=_progress)
    if fmt == "json":
        echo_json({"done": done})
        return
    for line in done:
        click.echo(line)


def _progress(message: str) -> None:
    click.echo(message, err=True)



@etcd.group()
def snapshot():
    """Save or restore an etcd snapshot."""


@snapshot.command("save")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace FILE if it exists (without: refused, exit 2).")
@click.option("--state", "state_dir", type=click.Path(file_okay=False),
              help="Local state directory (see apply): a hosted tenant's namespace must name it as its owner.")
@OUTPUT
@domain_errors
@reading_cluster
def save(cluster, file, force, fmt):
    """Take a snapshot (etcdctl snapshot save) and write it to FILE (mode 0600). An existing
    FILE is refused unless --force."""
    info = etcd_api.snapshot_save(cluster, file, force=force)
    if fmt == "json":
        echo_json(dataclasses.asdict(info))
        return
    click.echo(f"{info.path}: snapshot from {info.host}, {human_size(info.size)}, hash {info.hash}, "
               f"revision {info.revision}, {info.total_keys} keys (mode 0600)")


@snapshot.command("restore")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--yes", is_flag=True, help="Really do it: the control plane is down during the restore.")
@click.option("--wait-timeout", default=120.0, show_default=True, help="Seconds to wait for etcd health.")
@click.option("--state", "state_dir", type=click.Path(file_okay=False),
              help="Local state directory (see apply): a hosted tenant's namespace must name it as its owner.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
def restore(cluster, file, yes, wait_timeout, dry_run, fmt):
    """Restore FILE on every etcd member (the control plane is stopped meanwhile). A hosted
    tenant's members are restored in place: their pods restart on the snapshot."""
    if dry_run or not yes:
        plan = etcd_api.restore_plan(cluster, file, "<time>")
        if not dry_run:
            nothing_without_yes("the restore", "restore", plan)
        echo_plan("the restore", plan, fmt)
        return
    hosts = etcd_api.snapshot_restore(cluster, file, wait_timeout=wait_timeout, log=_progress)
    if fmt == "json":
        echo_json({"dryRun": False, "snapshot": file, "hosts": hosts})
        return
    click.echo(f"restored {file} on {', '.join(hosts)}; etcd healthy, control plane started")


@etcd.group()
def member():
    """Add or remove one etcd member (a control host), one at a time, never losing quorum.

    Refused, with the reason and nothing changed (exit 4): a change while another is half
    done (a learner left over) or while the inventory's control hosts differ from the members
    by more than this host; removing from a 2-member cluster; any change without a healthy
    quorum now or after it; an even member count unless --allow-even.
    """


# a hosted tenant's members are the pods of its etcd StatefulSet (host/tenant_etcd.py)
TENANT_MEMBERS = ("a hosted tenant's etcd members are spec.controlPlane.hosted.etcdReplicas (1 or 3): change it "
                  "and run `installer apply` (one member at a time, a new one a learner first: docs/hosted.md)")

ALLOW_EVEN_HELP = ("Allow an even member count: only as one step of replacing a host "
                   "(3 -> 2 while a dead member is replaced, then 2 -> 3).")


@member.command("add")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("name")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help="Local state directory (see apply).")
@click.option("--allow-even", is_flag=True, help=ALLOW_EVEN_HELP)
@click.option("--wait-timeout", default=180.0, show_default=True,
              help="Seconds to wait for the learner to catch up and for health.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
@systemd_only("etcd member add", TENANT_MEMBERS)
def member_add(cluster, name, allow_even, wait_timeout, dry_run, fmt):
    """Join control host NAME (already in INVENTORY) to etcd: registered as a learner, its member
    started with --initial-cluster-state=existing, promoted once in sync; then every control
    host is converged so the apiservers name the new member."""
    change = etcd_api.member_add(cluster, name, allow_even=allow_even,
                              wait_timeout=wait_timeout, log=_progress, dry_run=dry_run)
    if dry_run:
        echo_plan("the addition", change.steps, fmt)
        return
    if fmt == "json":
        echo_json({"dryRun": False, **dataclasses.asdict(change)})
        return
    click.echo(f"{name}: etcd member {change.member_id} added and promoted; "
               f"{len(change.members)} voting members, all healthy")


@member.command("remove")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("name")
@click.option("--state", "state_dir", type=click.Path(file_okay=False), help="Local state directory (see apply).")
@click.option("--allow-even", is_flag=True, help=ALLOW_EVEN_HELP)
@click.option("--host-unreachable", is_flag=True,
              help="NAME is gone: only remove its member (nothing is stopped or moved on it).")
@click.option("--yes", is_flag=True, help="Really do it (without: check, print the steps, exit 2).")
@click.option("--wait-timeout", default=180.0, show_default=True, help="Seconds to wait for health.")
@DRY_RUN
@OUTPUT
@domain_errors
@with_cluster
@systemd_only("etcd member remove", TENANT_MEMBERS)
def member_remove(cluster, name, allow_even, host_unreachable, yes, wait_timeout, dry_run, fmt):
    """Remove etcd member NAME: stop its control plane and etcd, `etcdctl member remove` through
    another member, move its /var/lib/etcd aside, check the others healthy. NAME may already be
    deleted from INVENTORY. Afterwards, delete NAME from the inventory and run `installer apply`."""
    change = etcd_api.member_remove(cluster, name, allow_even=allow_even,
                                 host_unreachable=host_unreachable, wait_timeout=wait_timeout,
                                 log=_progress, dry_run=dry_run or not yes)
    if dry_run:
        echo_plan("the removal", change.steps, fmt)
        return
    if not yes:
        nothing_without_yes("the removal", "remove", change.steps)
    if fmt == "json":
        echo_json({"dryRun": False, **dataclasses.asdict(change)})
        return
    click.echo(f"{name}: etcd member {change.member_id} removed; {len(change.members)} members healthy: "
               f"{', '.join(m.name for m in change.members)}. Next: {change.next}.")
