"""Operator-facing behaviour on a real stand-in lab (1 control + 1 worker, real etcd 3.6, sshd
and systemd): `etcd snapshot save` never overwrites a file unasked and reports the store's
real revision; `verify --api` against an endpoint that answers 404 is a failed check (exit 1)
naming the URL; sizes are human in the text report and exact in JSON, which keeps the log
lines; the etcd phase says why it could not read the members; a full disk leaves no
``.hp-new`` and no extra backups."""

from __future__ import annotations

import json
import re

import pytest

from installer.api import validate

from .labfixtures import standin_lab
from .test_apply_lab import PKI, run_installer

pytestmark = pytest.mark.lab

NAME, SUBNET = "clifix", "10.213.232.0/24"
ETCDCTL = ("/usr/local/bin/etcdctl --endpoints=https://127.0.0.1:2379 "
           f"--cacert={PKI}/etcd/ca.crt --cert={PKI}/etcd/healthcheck-client.crt "
           f"--key={PKI}/etcd/healthcheck-client.key")


@pytest.fixture(scope="module")
def clab(tmp_path_factory):
    with standin_lab(NAME, SUBNET, tmp_path_factory.mktemp("clilab"), workers=1) as lab:
        proc = apply(lab)
        lab.first_apply = proc.stdout
        yield lab


def apply(lab, *extra: str, check_rc: int | None = 0):
    return run_installer("apply", str(lab.inventory), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         "--wait-timeout", "60", *extra, check_rc=check_rc)


def store_revision(host) -> int:
    out = host.check_output(f"{ETCDCTL} endpoint status -w json")
    return json.loads(out)[0]["Status"]["header"]["revision"]


def test_text_report_sizes_are_human(clab):
    out = clab.first_apply
    assert re.search(r"^apply: .* \d+\.\d MiB uploaded, ", out, re.M), out[-2000:]
    assert not re.search(r"\d B uploaded", out)
    # the artifacts phase's event line: tens of MiB of binaries per host
    assert re.search(r"^  ~ cp1 +changed +\d+ file\(s\), \d+\.\d MiB ", out, re.M), out


def test_snapshot_save_reports_the_real_revision_and_never_overwrites(clab, tmp_path):
    cp1 = clab.host("cp1")
    inv = str(clab.inventory)
    # nothing was ever written to this store: etcd's revision is 1, the file's key bucket empty
    fresh = tmp_path / "fresh.db"
    out = run_installer("etcd", "snapshot", "save", inv, str(fresh)).stdout
    assert f"revision {store_revision(cp1)}, 0 keys" in out and store_revision(cp1) == 1, out
    assert re.search(r"snapshot from cp1, \d+\.\d KiB, hash \d+", out), out

    for i in range(3):
        cp1.check_output(f"{ETCDCTL} put /clifix/k{i} v{i}")
    revision = store_revision(cp1)
    assert revision == 4
    before = fresh.read_bytes()
    proc = run_installer("etcd", "snapshot", "save", inv, str(fresh), check_rc=2)
    assert f"{fresh} already exists" in proc.stderr and "--force" in proc.stderr, proc.stderr
    assert fresh.read_bytes() == before
    # refused before any host was asked: no snapshot file left on the host either
    assert cp1.check_output("ls /var/lib/hiddenplane | grep -c etcd-snapshot || true") == "0"

    out = run_installer("etcd", "snapshot", "save", inv, str(fresh), "--force").stdout
    assert f"revision {revision}, 3 keys" in out, out
    assert fresh.read_bytes() != before and oct(fresh.stat().st_mode & 0o777) == "0o600"


def test_verify_api_on_an_endpoint_answering_404_is_a_failed_check(clab):
    # the stand-in apiserver serves health endpoints only: /api/v1/nodes answers 404
    proc = run_installer("verify", str(clab.inventory), "--state", str(clab.state), "--api", check_rc=1)
    line = [x for x in proc.stdout.splitlines() if x.startswith("✗")]
    url = validate(clab.inventory).api_url
    assert len(line) == 1 and f"GET /api/v1/nodes on {url}" in line[0] and "404" in line[0], proc.stdout[-2000:]
    assert proc.stdout.splitlines()[-1].endswith("1 FAILED")


def test_stopped_etcd_is_named_in_the_log_which_json_keeps(clab):
    cp1 = clab.host("cp1")
    # etcd down on its only member, and a changed input so the etcd phase has work
    cp1.check_output("systemctl stop etcd && echo '# changed by hand' >> /etc/systemd/system/etcd.service")
    proc = apply(clab, "--output", "json")
    report = json.loads(proc.stdout)
    messages = [e["message"] for e in report["log"]]
    why = [m for m in messages if m.startswith("etcd: member list unavailable")]
    assert why == ["etcd: member list unavailable (etcd is not running on cp1 (inactive)); "
                   "starting the members that have data"], messages
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["time"]) for e in report["log"])
    # exact bytes stay in JSON
    assert isinstance(report["bytesUploaded"]["cp1"], int) and report["bytesUploaded"]["cp1"] > 0
    assert cp1.service("etcd").is_running


ADMIN = "/etc/kubernetes/admin.conf"


def test_full_disk_leaves_no_temporary_file_and_one_backup(clab):
    cp1 = clab.host("cp1")
    size = int(cp1.check_output(f"stat -c %s {ADMIN}"))
    pages = -(-size // 4096)
    # /etc/kubernetes on a small tmpfs holding the same files, admin.conf replaced by hand
    # (a file the installer did not write: apply backs it up before replacing it), and the
    # tmpfs filled so that exactly the new admin.conf fits, not its backup as well
    cp1.check_output("set -e; rm -rf /root/k; cp -a /etc/kubernetes /root/k; "
                     "mount -t tmpfs -o size=1m,mode=0755 tmpfs /etc/kubernetes; cp -a /root/k/. /etc/kubernetes/; "
                     f"printf 'hand-written\\n' > {ADMIN}")
    try:
        free = int(cp1.check_output("df --output=avail -B1 /etc/kubernetes | tail -1"))
        cp1.check_output(f"head -c {free - pages * 4096} /dev/zero > /etc/kubernetes/filler")
        for _ in range(2):
            proc = apply(clab, check_rc=None)
            assert proc.returncode != 0 and "No space left on device" in proc.stderr, proc.stderr[-2000:]
            assert leftovers(cp1) == [], "a failed attempt left temporary files"
            assert backups(cp1) == [], "a failed attempt left a backup"
        cp1.check_output("mount -o remount,size=2m /etc/kubernetes")
        apply(clab)
        [backup] = backups(cp1)
        assert cp1.file(backup).content_string == "hand-written\n"
        # the same foreign content again (the admin put it back): no second backup of it
        cp1.check_output(f"printf 'hand-written\\n' > {ADMIN}")
        apply(clab)
        assert backups(cp1) == [backup] and leftovers(cp1) == []
        assert cp1.file(ADMIN).content_string != "hand-written\n"
    finally:
        cp1.run("umount /etc/kubernetes")
    assert re.search(r"^apply: 0 change\(s\), 0 restart\(s\), 0 B uploaded", apply(clab).stdout, re.M)


def leftovers(host) -> list[str]:
    return host.check_output("find /etc/kubernetes -name '*.hp-new' -o -name '*.hp-bak'").split()


def backups(host) -> list[str]:
    return sorted(host.check_output("find /etc/kubernetes -name '*.hiddenplane-backup-*'").split())
