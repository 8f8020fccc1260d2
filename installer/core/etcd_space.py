"""etcd's space, in words a person acts on: the alarms its members raised (NOSPACE: the backend
reached ``--quota-backend-bytes``, and the cluster takes reads and deletes only), each member's
database size, and the way out (``installer etcd defrag``: compact, defragment each member in
turn, disarm). Pure: etcdctl's output in, facts and sentences out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from installer.core.etcd_rules import EtcdOpError

# what an alarm means for the cluster's users, and what to do (etcd's own names)
ALARMS = {
    "NOSPACE": ("its database reached its quota: etcd now takes reads and deletes only, and every write through the "
                "API fails with \"etcdserver: mvcc: database space exceeded\"",
                "delete what filled it (kubectl delete ...), then run `installer etcd defrag INVENTORY`: it "
                "compacts the history, defragments every member one at a time and disarms the alarm; or give "
                "etcd more room (a hosted tenant: spec.controlPlane.hosted.etcdStorage, which sizes its quota)"),
    "CORRUPT": ("its data differs from the other members' (a corruption check failed): it must not serve",
                "remove the member and add it again (`installer etcd member remove` / `add`), or restore a "
                "snapshot (`installer etcd snapshot restore`); do not disarm this alarm"),
}


@dataclass(frozen=True)
class Alarm:
    member_id: str      # hex, as etcdctl member list and Member.id have it
    alarm: str          # NOSPACE, CORRUPT


@dataclass(frozen=True)
class Space:
    site: str           # where it was asked (a control host, a member's pod)
    member_id: str      # hex
    db_size: int        # bytes the backend file takes
    in_use: int         # bytes of it in use (the rest is what a defragmentation gives back)
    revision: int


_ALARM_LINE = re.compile(r"memberID:(\d+) alarm:([A-Z]+)")


def parse_alarms(out: str) -> list[Alarm]:
    """``etcdctl alarm list`` (one ``memberID:<decimal> alarm:<NAME>`` line each; none: empty)."""
    return [Alarm(f"{int(m.group(1)):x}", m.group(2)) for m in _ALARM_LINE.finditer(out)]


def parse_status(out: str, site: str) -> Space:
    """``etcdctl endpoint status -w json`` against one member."""
    try:
        (entry,) = json.loads(out)
        status = entry["Status"]
        header = status["header"]
        return Space(site, f"{int(header['member_id']):x}", int(status["dbSize"]),
                     int(status.get("dbSizeInUse", status["dbSize"])), int(header["revision"]))
    except (ValueError, KeyError, TypeError) as e:
        raise EtcdOpError(f"{site}: etcdctl endpoint status printed no status ({e}): {out[:200]}") from None


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def alarm_lines(alarms: list[Alarm], names: dict[str, str]) -> list[str]:
    """A sentence per alarm (``names``: member id -> name): what it means and what to do."""
    out = []
    for a in alarms:
        what, todo = ALARMS.get(a.alarm, (f"etcd raised {a.alarm}", "see etcd's documentation for this alarm"))
        who = names.get(a.member_id, "")
        out.append(f"alarm {a.alarm} on member {who + ' ' if who else ''}({a.member_id}): {what}. What to do: {todo}")
    return out


def compact_failed_harmlessly(stderr: str) -> bool:
    """A compaction to a revision already compacted (the apiservers compact every 5 minutes,
    etcd itself too): nothing left to do there."""
    return "required revision has been compacted" in stderr
