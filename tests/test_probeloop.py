"""Pure: how the fault tests split timed requests at a fault's edges (tests/probeloop.py)."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import stat
import tempfile
import time

from installer.core.pki import issue
from installer.core.pki.specs import CertSpec
from tests import probeloop

ROWS = [(99.0, True, ""), (100.0, False, "TimeoutError: timed out"), (100.5, True, ""), (150.0, True, ""),
        (220.0, True, ""), (221.0, False, "URLError: refused"), (260.0, True, "")]


def test_each_request_counts_in_the_span_it_started_in_and_an_edge_opens_the_next():
    assert probeloop.within(ROWS, 100.0, 110.0) == ROWS[1:3]
    assert probeloop.columns(ROWS, 100.0, 110.0, 220.0, 300.0).split() == ["1/2", "0/1", "1/3"]


def test_failures_are_told_as_seconds_after_the_fault_or_after_its_end():
    assert probeloop.when(ROWS, 100.0, 220.0) == "c+0.0 r+1.0"
    many = [(100.0 + i, False, "x") for i in range(10)]
    assert probeloop.when(many, 100.0, 300.0).endswith("c+7.0 ...")


def test_a_loop_records_every_call_and_what_failed():
    calls = []

    def call(i: int) -> None:
        calls.append(i)
        if i == 2:
            raise ConnectionRefusedError("refused")
    loop = probeloop.Loop(call, 0.01)
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    rows = loop.end()
    assert [ok for _, ok, _ in rows[:3]] == [True, False, True]
    assert rows[1][2] == "ConnectionRefusedError: refused"


def test_the_admins_key_is_on_disk_only_while_loaded(tmp_path, monkeypatch):
    """The joined certificate and key go to a 0600 file that is gone when the context returns."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, key = issue.new_key("ecdsa-p256"), issue.new_key("ecdsa-p256")
    ca = issue.Pair(issue.make_ca("kubernetes", ca_key, 1, now), ca_key)
    pki, scratch = tmp_path / "pki", tmp_path / "scratch"
    pki.mkdir()
    scratch.mkdir()
    (pki / "ca.crt").write_bytes(issue.cert_pem(ca.cert))
    (pki / "admin.crt").write_bytes(issue.cert_pem(issue.issue(CertSpec("admin", "ca", "admin", client=True),
                                                               key, ca, 1, now)))
    (pki / "admin.key").write_bytes(issue.key_pem(key))
    modes = []
    load = ssl.SSLContext.load_cert_chain

    def spy(self, name, *args, **kwargs):
        modes.append(stat.S_IMODE(os.stat(name).st_mode))
        return load(self, name, *args, **kwargs)
    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert isinstance(probeloop.admin_context(pki), ssl.SSLContext)
    assert modes == [0o600]
    assert not list(scratch.iterdir())


def test_by_node_groups_pods_by_the_node_they_run_on():
    pods = [{"metadata": {"name": "etcd-0"}, "spec": {"nodeName": "w1"}},
            {"metadata": {"name": "kube-apiserver-a"}, "spec": {"nodeName": "w1"}},
            {"metadata": {"name": "etcd-1"}, "spec": {"nodeName": "w2"}},
            {"metadata": {"name": "etcd-2"}, "spec": {}}]
    assert probeloop.by_node(pods) == {"w1": ["etcd-0", "kube-apiserver-a"], "w2": ["etcd-1"], "-": ["etcd-2"]}


def test_tcp_clients_reads_the_established_peers_of_one_port():
    dump = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:094B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0F0AA8C0:094B 0A0AA8C0:C350 01 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 0100007F:094B 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 0F0AA8C0:094C 0B0AA8C0:C351 01 00000000:00000000 00:00000000 00000000     0        0 4 1
   4: 0F0AA8C0:094B 0C0AA8C0:C352 06 00000000:00000000 00:00000000 00000000     0        0 5 1
"""
    dump6 = """  sl  local_address                         remote_address                        st
   0: 0000000000000000FFFF00002600F40A:094B 0000000000000000FFFF00002600F40A:D8C8 01 00000000:00000000
   1: 0000000000000000FFFF00002600F40A:094B 0000000000000000FFFF00000100007F:A40E 01 00000000:00000000
   2: 00000000000000000000000001000000:094B 00000000000000000000000001000000:A40F 01 00000000:00000000
"""
    # the listener (0A), the peer port (094C) and a connection in TIME_WAIT (06) are no client;
    # an IPv4 client of a dual-stack listener is named as IPv4 (as on the lab: etcd's members)
    assert probeloop.tcp_clients(dump + dump6, 2379) == {"192.168.10.10", "127.0.0.1", "10.244.0.38", "::1"}
