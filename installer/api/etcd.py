"""etcd on day 2: the member list, one member added or removed at a time, snapshots. The run's
control plane reaches the members (engine/planes/: etcdctl over SSH on control hosts, or in a
hosted tenant's member pods through the hosting cluster's API)."""

from installer.actions import etcd_space
from installer.actions.etcd_members import add as member_add
from installer.actions.etcd_members import remove as member_remove
from installer.core.cluster import Cluster
from installer.core.etcd_rules import Member
from installer.core.etcd_space import Alarm, alarm_lines
from installer.core.inventory import Inventory
from installer.engine.planes.etcd_hosts import SnapshotInfo
from installer.engine.run import open_run


def members(target: Cluster | Inventory) -> list[Member]:
    """The members (``target``'s state is read, not held: this runs beside an apply)."""
    with open_run(target, hold_state=False) as run:
        return run.plane.members(run)


def members_and_alarms(target: Cluster | Inventory) -> tuple[list[Member], list[Alarm]]:
    """The members and the alarms they raised (NOSPACE, CORRUPT), in one run."""
    with open_run(target, hold_state=False) as run:
        return run.plane.members(run), etcd_space.alarms(run)


def defrag(target: Cluster | Inventory, log=print) -> list[str]:
    """Compact, defragment every member in turn, disarm NOSPACE (actions/etcd_space.py), holding
    the apply lock: no roll restarts a member meanwhile."""
    with open_run(target, log=log) as run, run.hold():
        return etcd_space.defrag(run, log)


def snapshot_save(target: Cluster | Inventory, dest, force: bool = False) -> SnapshotInfo:
    """A snapshot written to ``dest`` (``target``'s state read, not held, as for ``members``)."""
    with open_run(target, hold_state=False) as run:
        return run.plane.snapshot_save(run, dest, force=force)


def restore_plan(target: Cluster | Inventory, snapshot: str, stamp: str) -> list[str]:
    with open_run(target) as run:
        return run.plane.restore_plan(run.inv, snapshot, stamp)


def snapshot_restore(target: Cluster | Inventory, snapshot, wait_timeout: float = 120, log=print) -> list[str]:
    """Restore ``snapshot`` into every member, holding the state and the apply lock; the members
    restored."""
    with open_run(target, log=log) as run, run.hold():
        return run.plane.snapshot_restore(run, snapshot, wait_timeout)


__all__ = ["SnapshotInfo", "alarm_lines", "defrag", "member_add", "member_remove", "members", "members_and_alarms",
           "restore_plan", "snapshot_restore", "snapshot_save"]
