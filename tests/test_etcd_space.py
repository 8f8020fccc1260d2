"""etcd's alarms and sizes in words (installer/core/etcd_space.py): etcdctl's real output shapes
parsed, each alarm said with what to do."""

from __future__ import annotations

import json

import pytest

from installer.core.etcd_rules import EtcdOpError
from installer.core.etcd_space import (
    Alarm,
    alarm_lines,
    compact_failed_harmlessly,
    parse_alarms,
    parse_status,
)

# etcdctl 3.6 `alarm list` (decimal member IDs; nothing at all when no alarm is raised)
ALARMS = "memberID:13803658152347727308 alarm:NOSPACE \nmemberID:10501334649042878790 alarm:CORRUPT \n"
# etcdctl 3.6 `endpoint status -w json` against one member
STATUS = json.dumps([{"Endpoint": "https://127.0.0.1:2379", "Status": {
    "header": {"cluster_id": 1, "member_id": 13803658152347727308, "revision": 4242, "raft_term": 3},
    "version": "3.6.15", "dbSize": 52428800, "dbSizeInUse": 1048576, "leader": 13803658152347727308}}])


def test_alarms_are_read_with_hex_ids_as_member_list_has_them():
    assert parse_alarms(ALARMS) == [Alarm(f"{13803658152347727308:x}", "NOSPACE"),
                                    Alarm(f"{10501334649042878790:x}", "CORRUPT")]
    assert parse_alarms("") == []


def test_each_alarm_says_what_it_means_and_what_to_do():
    nospace, corrupt = parse_alarms(ALARMS)
    lines = alarm_lines([nospace, corrupt], {nospace.member_id: "etcd-0"})
    assert lines[0].startswith(f"alarm NOSPACE on member etcd-0 ({nospace.member_id}): ")
    assert "database space exceeded" in lines[0] and "installer etcd defrag INVENTORY" in lines[0]
    assert "etcdStorage" in lines[0]
    assert "do not disarm" in lines[1] and "snapshot restore" in lines[1]
    assert "on member (" in lines[1]         # a member the list did not name: its id alone
    assert alarm_lines([Alarm("1", "NEW")], {})[0].startswith("alarm NEW on member (1): etcd raised NEW")


def test_a_members_status_gives_its_sizes_and_revision():
    s = parse_status(STATUS, "etcd-0")
    assert (s.site, s.member_id, s.db_size, s.in_use, s.revision) == (
        "etcd-0", f"{13803658152347727308:x}", 52428800, 1048576, 4242)
    with pytest.raises(EtcdOpError, match="etcd-0: etcdctl endpoint status printed no status"):
        parse_status("Error: context deadline exceeded", "etcd-0")


def test_a_compaction_already_done_is_no_failure():
    assert compact_failed_harmlessly("etcdserver: mvcc: required revision has been compacted")
    assert not compact_failed_harmlessly("context deadline exceeded")
