"""etcd on day 2: the member list, one member added or removed at a time, snapshots."""

from installer.actions.etcd_members import add as member_add
from installer.actions.etcd_members import remove as member_remove
from installer.actions.etcd_ops import members, restore_plan, snapshot_restore, snapshot_save

__all__ = ["member_add", "member_remove", "members", "restore_plan", "snapshot_restore", "snapshot_save"]
