"""host/probes.py without a host: the parsers on recorded answers. The etcd ones also parse the
real etcdctl's output (test_etcd.py); ``ask`` runs them on the lab hosts in every etcd member
add/remove and certificate renewal (test_etcd_members_lab.py, test_renew_lab.py, test_real_day2.py)."""

from __future__ import annotations

from installer.host import probes


def answer(stdout: str = "", rc: int = 0, stderr: str = "") -> probes.Answer:
    return probes.Answer("w1", stdout, stderr, rc)


def test_unit_started_reads_whole_seconds_or_none():
    assert probes.parse_epoch(answer("1764748800\n")) == 1764748800.0
    assert probes.parse_epoch(answer("", rc=1)) is None            # never active: the shell's test fails
    assert probes.parse_epoch(answer("date: invalid date\n", rc=1)) is None
    assert "ActiveEnterTimestamp --value kubelet.service" in probes.unit_started("kubelet.service").command


def test_health_that_is_no_list_reads_as_none_healthy():
    assert probes.parse_health(answer("Error: context deadline exceeded", rc=1)) == {}
    assert probes.parse_health(answer('[{"endpoint":"https://10.0.0.2:2379","health":false,'
                                      '"took":"5.0s","error":"context deadline exceeded"}]', rc=1)) == \
        {"https://10.0.0.2:2379": False}


def test_etcd_data_is_the_member_directory():
    p = probes.holds_etcd_data()
    assert p.command == "test -d /var/lib/etcd/member"
    assert p.parse(answer(rc=0)) is True and p.parse(answer(rc=1)) is False
