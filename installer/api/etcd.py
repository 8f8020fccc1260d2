"""etcd on day 2: the member list, one member added or removed at a time, snapshots. A hosted
tenant's members are pods of its hosting cluster (actions/etcd_hosted.py); a control plane on
control hosts is reached over SSH (actions/etcd_ops.py)."""

from installer.actions.etcd_hosted import actions_for
from installer.actions.etcd_members import add as member_add
from installer.actions.etcd_members import remove as member_remove
from installer.actions.etcd_ops import SnapshotInfo
from installer.core.etcd_rules import Member
from installer.core.inventory import Inventory


def members(inv: Inventory) -> list[Member]:
    return actions_for(inv).members(inv)


def snapshot_save(inv: Inventory, dest, force: bool = False) -> SnapshotInfo:
    return actions_for(inv).snapshot_save(inv, dest, force=force)


def restore_plan(inv: Inventory, snapshot: str, stamp: str) -> list[str]:
    return actions_for(inv).restore_plan(inv, snapshot, stamp)


def snapshot_restore(inv: Inventory, snapshot, wait_timeout: float = 120, log=print) -> list[str]:
    return actions_for(inv).snapshot_restore(inv, snapshot, wait_timeout=wait_timeout, log=log)


__all__ = ["member_add", "member_remove", "members", "restore_plan", "snapshot_restore", "snapshot_save"]
