"""etcd's space on day 2: the alarms `installer etcd members` reports, and `installer etcd
defrag`, the way out of a NOSPACE alarm (core/etcd_space.py says what each alarm means).

A member whose backend reaches its quota raises NOSPACE: the cluster then takes reads and
deletes only. Deleting objects frees pages inside the backend but not the file; what gets a
cluster writing again is etcd's documented order: compact the history to the current revision,
defragment every member (one at a time: a member defragmenting answers nobody), disarm the
alarm. The run's control plane reaches each member alone (a control host's local member, a
tenant's member pod): ``etcd_sites`` and ``etcdctl_at``.
"""

from __future__ import annotations

from typing import Callable

from installer.core.etcd_rules import EtcdOpError
from installer.core.etcd_space import Alarm, Space, compact_failed_harmlessly, mib, parse_alarms, parse_status

STATUS = ["endpoint", "status", "-w", "json"]
DEFRAG_TIMEOUT = 300.0          # a member's defragmentation rewrites its whole backend file


def alarms(run) -> list[Alarm]:
    """The alarms raised in the cluster (asked of the first member that answers)."""
    plane, errors = run.plane, []
    for site in plane.etcd_sites(run):
        try:
            return parse_alarms(plane.etcdctl_at(run, site, ["alarm", "list"], "etcdctl alarm list"))
        except EtcdOpError as e:
            errors.append(str(e))
    raise EtcdOpError("no member answered etcdctl alarm list: " + "; ".join(errors))


def spaces(run) -> list[Space]:
    plane = run.plane
    return [parse_status(plane.etcdctl_at(run, s, STATUS, "etcdctl endpoint status"), s) for s in plane.etcd_sites(run)]


def defrag(run, log: Callable[[str], None]) -> list[str]:
    """Compact, defragment every member in turn, disarm NOSPACE; what was done, with each
    member's database size before and after. A CORRUPT alarm is never disarmed: it stops the
    run before anything is done."""
    plane = run.plane
    raised = alarms(run)
    if any(a.alarm == "CORRUPT" for a in raised):
        raise EtcdOpError("a member raised CORRUPT: its data differs from the others'; defragmenting and disarming "
                          "would let it serve. Nothing was done. Remove and add that member again, or restore a "
                          "snapshot")
    before = spaces(run)
    revision = max(s.revision for s in before)
    done = []
    try:
        plane.etcdctl_at(run, before[0].site, ["compaction", str(revision)], "etcdctl compaction")
        done.append(f"compacted the history to revision {revision}")
    except EtcdOpError as e:
        if not compact_failed_harmlessly(str(e)):
            raise
        done.append(f"the history was compacted already (revision {revision})")
    log(done[-1])
    for s in before:
        log(f"{s.site}: defragmenting ({mib(s.db_size)}, {mib(s.in_use)} in use)")
        plane.etcdctl_at(run, s.site, ["defrag"], "etcdctl defrag", timeout=DEFRAG_TIMEOUT)
    after = {s.site: s for s in spaces(run)}
    done += [f"{s.site}: defragmented, {mib(s.db_size)} -> {mib(after[s.site].db_size)}" for s in before
             if s.site in after]
    if any(a.alarm == "NOSPACE" for a in raised):
        plane.etcdctl_at(run, before[0].site, ["alarm", "disarm"], "etcdctl alarm disarm")
        done.append("disarmed NOSPACE: etcd takes writes again")
        log(done[-1])
    left = alarms(run)
    if left:
        raise EtcdOpError("alarms still raised after the defragmentation: "
                          + ", ".join(f"{a.alarm} ({a.member_id})" for a in left)
                          + ": the database is still over its quota; delete more, or give etcd more room")
    return done
