"""etcd on day 2: the member list, one member added or removed at a time, snapshots. The run's
control plane reaches the members (engine/planes/: etcdctl over SSH on control hosts, or in a
hosted tenant's member pods through the hosting cluster's API)."""

from installer.actions.etcd_members import add as member_add
from installer.actions.etcd_members import remove as member_remove
from installer.core.etcd_rules import Member
from installer.core.inventory import Inventory
from installer.engine.planes.etcd_hosts import SnapshotInfo
from installer.engine.run import open_run


def members(inv: Inventory) -> list[Member]:
    with open_run(inv) as run:
        return run.plane.members(run)


def snapshot_save(inv: Inventory, dest, force: bool = False) -> SnapshotInfo:
    with open_run(inv) as run:
        return run.plane.snapshot_save(run, dest, force=force)


def restore_plan(inv: Inventory, snapshot: str, stamp: str) -> list[str]:
    with open_run(inv) as run:
        return run.plane.restore_plan(inv, snapshot, stamp)


def snapshot_restore(inv: Inventory, snapshot, wait_timeout: float = 120, log=print) -> list[str]:
    """Restore ``snapshot`` into every member, holding the apply lock; the members restored."""
    with open_run(inv, log=log) as run, run.hold():
        return run.plane.snapshot_restore(run, snapshot, wait_timeout)


__all__ = ["SnapshotInfo", "member_add", "member_remove", "members", "restore_plan", "snapshot_restore",
           "snapshot_save"]
