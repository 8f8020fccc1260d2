"""A hosted etcd member's start (installer/sh/etcd-member-start.sh, docs/hosted.md), with the
real etcd and etcdctl (built from their Go modules) and the cluster's own etcd certificates:
three members bootstrap at once; a member killed with its data comes back on it; a member whose
volume is lost comes back empty, is removed and added again by its own start, and gets every key
from the others (nothing lost); a snapshot handed to every member's next start is restored in
place (a new cluster: what was written after the snapshot is gone). Members run on 127.0.0.1
(every etcd certificate names it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from installer.core.etcd_rules import RESTORE_FLAGS, RESTORE_REVISION_BUMP
from installer.core.pki import issue
from installer.core.pki.specs import ETCD_CA
from installer.core.shellfiles import shell_file

from .standins.harness import free_ports

pytestmark = pytest.mark.etcd

NAMES = ("cp1", "cp2", "cp3")


class Members:
    def __init__(self, tmp: Path, material, bin_dir: Path):
        self.tmp, self.bin = tmp, bin_dir
        ports = free_ports(2 * len(NAMES))
        self.client = {n: f"https://127.0.0.1:{ports[2 * i]}" for i, n in enumerate(NAMES)}
        self.peer = {n: f"https://127.0.0.1:{ports[2 * i + 1]}" for i, n in enumerate(NAMES)}
        pki = tmp / "pki"
        pki.mkdir(mode=0o700)
        (pki / "ca.crt").write_bytes(issue.cert_pem(material.pair(ETCD_CA).cert))
        for stem, name in [("client", "etcd/healthcheck-client")] + [
                (f"{kind}-{n}", f"etcd/{kind}-{n}") for n in NAMES for kind in ("server", "peer")]:
            pair = material.pair(name)
            (pki / f"{stem}.crt").write_bytes(issue.cert_pem(pair.cert))
            (pki / f"{stem}.key").write_bytes(issue.key_pem(pair.key))
            (pki / f"{stem}.key").chmod(0o600)
        self.pki = pki
        self.procs: dict[str, subprocess.Popen] = {}
        self.legacy: dict[str, str] = {}      # a member's peer URL before the members' Services

    def data(self, name: str) -> Path:
        return self.tmp / f"data-{name}"

    def restore(self, name: str) -> Path:
        return self.tmp / f"restore-{name}"

    def start(self, name: str) -> None:
        script = shell_file(
            "etcd-member-start.sh", etcd=str(self.bin / "etcd"), etcdctl=str(self.bin / "etcdctl"), member=name,
            peer_url=self.peer[name], legacy_peer_url=self.legacy.get(name, "https://none.invalid:2380"),
            cluster=",".join(f"{n}={self.peer[n]}" for n in NAMES),
            data=str(self.data(name)), endpoints=",".join(self.client.values()),
            cacert=str(self.pki / "ca.crt"), cert=str(self.pki / "client.crt"), key=str(self.pki / "client.key"),
            etcdutl=str(self.bin / "etcdutl"), restore=str(self.restore(name)),
            restore_flags=" ".join(RESTORE_FLAGS))
        p = self.pki
        flags = [f"--listen-client-urls={self.client[name]}", f"--advertise-client-urls={self.client[name]}",
                 f"--listen-peer-urls={self.peer[name].replace('localhost', '127.0.0.1')}",
                 "--initial-cluster-token=hosted-test",
                 f"--cert-file={p}/server-{name}.crt", f"--key-file={p}/server-{name}.key",
                 f"--trusted-ca-file={p}/ca.crt", "--client-cert-auth",
                 f"--peer-cert-file={p}/peer-{name}.crt", f"--peer-key-file={p}/peer-{name}.key",
                 f"--peer-trusted-ca-file={p}/ca.crt", "--peer-client-cert-auth", "--log-level=warn"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.tmp)}
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(["/bin/sh", "-c", script, "etcd-member-start", *flags], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def ctl(self, *args: str, endpoints: str | None = None) -> subprocess.CompletedProcess:
        p = self.pki
        return subprocess.run([str(self.bin / "etcdctl"), f"--endpoints={endpoints or ','.join(self.client.values())}",
                               f"--cacert={p}/ca.crt", f"--cert={p}/client.crt", f"--key={p}/client.key",
                               "--dial-timeout=2s", "--command-timeout=5s", *args],
                              capture_output=True, text=True, timeout=30)

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n, proc in self.procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{n} exited {proc.returncode}:\n{self.log(n)[-3000:]}")
            if self.ctl("endpoint", "health").returncode == 0:
                return
            time.sleep(0.3)
        pytest.fail("not healthy:\n" + "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in NAMES))

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def members(self) -> dict[str, tuple[str, str]]:
        """name -> (id, status) of every started member, as etcd lists them."""
        out = self.ctl("member", "list", "-w", "simple")
        assert out.returncode == 0, out.stderr
        rows = [line.split(", ") for line in out.stdout.splitlines() if line.strip()]
        return {r[2]: (r[0], r[1]) for r in rows}

    def listed_unstarted(self, name: str, url: str, via: str) -> None:
        """``name``'s member removed and added again at ``url`` through ``via``, never started:
        what a start that died between its member add and etcd leaves."""
        old = self.members()[name][0]
        assert self.ctl("member", "remove", old, endpoints=self.client[via]).returncode == 0
        deadline = time.monotonic() + 60
        while (added := self.ctl("member", "add", name, f"--peer-urls={url}",
                                 endpoints=self.client[via])).returncode != 0:
            # etcd refuses a change while a peer is just gone (strict reconfiguration check)
            assert "unhealthy cluster" in added.stderr and time.monotonic() < deadline, added.stderr
            time.sleep(1)

    def all_started_with_the_answer(self, name: str) -> None:
        """Every member started, and ``name`` alone (a serializable read) has the key written
        before."""
        final = self.members()
        assert sorted(final) == list(NAMES) and all(s == "started" for _, s in final.values()), final
        local = self.ctl("get", "/registry/answer", "--print-value-only", "--consistency=s",
                         endpoints=self.client[name])
        assert local.stdout.strip() == "42", (local.stdout, local.stderr)

    def stop_all(self) -> None:
        for n in list(self.procs):
            self.kill(n)


@pytest.fixture
def members(three_controls, built_artifacts, tmp_path):
    m = Members(tmp_path, three_controls.material, built_artifacts)
    try:
        yield m
    finally:
        m.stop_all()
        shutil.rmtree(m.pki, ignore_errors=True)


def test_a_member_whose_volume_is_lost_rejoins_and_nothing_is_lost(members):
    for n in NAMES:
        members.start(n)
    members.wait_healthy()
    before = members.members()
    assert sorted(before) == list(NAMES) and all(s == "started" for _, s in before.values())
    assert all("bootstrapping" in members.log(n) for n in NAMES)
    assert members.ctl("put", "/registry/answer", "42").returncode == 0

    # the pod deleted, its volume kept: it starts on its data, the same member
    members.kill("cp2")
    members.start("cp2")
    members.wait_healthy()
    assert members.members()["cp2"] == before["cp2"]

    # the pod and its volume gone: the start removes the old member and adds this one again
    members.kill("cp3")
    shutil.rmtree(members.data("cp3"))
    members.start("cp3")
    members.wait_healthy()
    after = members.members()
    assert sorted(after) == list(NAMES) and after["cp3"][0] != before["cp3"][0], after
    assert "its data is gone: removing member" in members.log("cp3")
    # cp3 alone (a serializable read is served from its own copy) has the key written before
    local = members.ctl("get", "/registry/answer", "--print-value-only", "--consistency=s",
                        endpoints=members.client["cp3"])
    assert local.returncode == 0 and local.stdout.strip() == "42", (local.stdout, local.stderr)
    assert (members.data("cp3") / "member" / "snap" / "db").is_file()

    # a data directory with the database but no write-ahead log (a start that died before it
    # joined): not data; the start empties it and rejoins as for a lost volume
    members.kill("cp3")
    shutil.rmtree(members.data("cp3") / "member" / "wal")
    members.start("cp3")
    members.wait_healthy()
    assert "holds no write-ahead log" in members.log("cp3")
    assert sorted(members.members()) == list(NAMES)

    # a start that died between its member add and etcd: the member is listed, never started;
    # the next start joins as it is listed (no second add)
    members.kill("cp1")
    shutil.rmtree(members.data("cp1"))
    members.listed_unstarted("cp1", members.peer["cp1"], via="cp2")
    members.start("cp1")
    members.wait_healthy()
    assert "listed, never started: joining as it is listed" in members.log("cp1")
    members.all_started_with_the_answer("cp1")


def test_a_member_listed_under_its_legacy_peer_url_is_found_by_it(members):
    """A tenant applied before the members' Services lists each member under its pod's name
    (legacy_peer_url) until apply moves it: a member whose volume is lost then is still found
    (by that URL) and replaced, never added beside itself; one listed there, never started,
    joins under the URL it is listed with."""
    for n in NAMES:
        members.start(n)
    members.wait_healthy()
    before = members.members()
    assert members.ctl("put", "/registry/answer", "42").returncode == 0
    # the new peer URL: the same listener under another name every certificate holds
    members.legacy["cp3"] = members.peer["cp3"]
    members.peer["cp3"] = members.peer["cp3"].replace("127.0.0.1", "localhost")
    members.kill("cp3")
    shutil.rmtree(members.data("cp3"))
    members.start("cp3")
    members.wait_healthy()
    after = members.members()
    assert sorted(after) == list(NAMES) and after["cp3"][0] != before["cp3"][0], after
    assert "its data is gone: removing member" in members.log("cp3")
    listed = members.ctl("member", "list", "-w", "simple").stdout
    assert members.peer["cp3"] in listed and members.legacy["cp3"] not in listed, listed

    # listed under the legacy URL, never started: joins as listed (no second member)
    members.kill("cp2")
    shutil.rmtree(members.data("cp2"))
    members.legacy["cp2"] = members.peer["cp2"]
    members.listed_unstarted("cp2", members.legacy["cp2"], via="cp1")
    members.peer["cp2"] = members.peer["cp2"].replace("127.0.0.1", "localhost")
    members.start("cp2")
    members.wait_healthy()
    assert "listed, never started: joining as it is listed" in members.log("cp2")
    members.all_started_with_the_answer("cp2")


def test_a_snapshot_handed_to_every_member_is_restored_in_place_by_their_next_start(members, tmp_path):
    """What `installer etcd snapshot restore` does to a hosted tenant (engine/planes/etcd_pods.py):
    each member's volume gets restore/snapshot.db and restore/token, its pod is deleted, and the
    next start writes its member of a new cluster from the file before etcd runs."""
    for n in NAMES:
        members.start(n)
    members.wait_healthy()
    assert members.ctl("put", "/registry/before", "kept").returncode == 0
    snap = tmp_path / "snap.db"
    saved = members.ctl("snapshot", "save", str(snap), endpoints=members.client["cp1"])
    assert saved.returncode == 0, saved.stderr
    assert members.ctl("put", "/registry/after", "gone").returncode == 0
    old_ids = {n: i for n, (i, _) in members.members().items()}
    members.stop_all()
    for n in NAMES:
        members.restore(n).mkdir()
        shutil.copy(snap, members.restore(n) / "snapshot.db")
        (members.restore(n) / "token").write_text("tenant-etcd-restore-1")
    for n in NAMES:
        members.start(n)
    members.wait_healthy()
    assert all("restoring the snapshot" in members.log(n) for n in NAMES)
    assert all(not members.restore(n).exists() and (members.data(f"{n}.before-restore")).is_dir() for n in NAMES)
    got = members.ctl("get", "/registry/", "--prefix", "--keys-only")
    assert got.returncode == 0 and got.stdout.split() == ["/registry/before"], got.stdout
    # the script's etcdutl raised the revision past every client's (etcd_rules.RESTORE_FLAGS)
    header = json.loads(members.ctl("get", "/registry/before", "-w", "json").stdout)["header"]
    assert header["revision"] > RESTORE_REVISION_BUMP, header
    after = members.members()
    assert sorted(after) == list(NAMES) and all(s == "started" for _, s in after.values()), after
    assert not set(old_ids.values()) & {i for i, _ in after.values()}, "a restored cluster has new member ids"
    # the next start of a member is an ordinary one: on its data, nothing restored again
    members.kill("cp2")
    members.start("cp2")
    members.wait_healthy()
    assert members.log("cp2").count("restoring the snapshot") == 1
