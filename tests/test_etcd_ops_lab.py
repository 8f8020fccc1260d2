"""`installer etcd members|snapshot save|snapshot restore` on a three-member lab etcd: keys written
before the snapshot come back on every member, keys written after it are gone; the file is 0600."""

from __future__ import annotations

import stat

import pytest

from .labfixtures import standin_lab
from .test_apply_lab import apply_json, etcdctl, run_installer

pytestmark = pytest.mark.lab

CONTROLS = ("cp1", "cp2", "cp3")


@pytest.fixture(scope="module")
def snaplab(tmp_path_factory):
    with standin_lab("snap", "10.213.240.0/24", tmp_path_factory.mktemp("snaplab"), controls=3, workers=1) as lab:
        apply_json(lab.inventory, lab.state)
        yield lab


def test_restore_without_yes_changes_nothing(snaplab, tmp_path):
    cp1 = snaplab.host("cp1")
    snap = tmp_path / "not-a-snapshot.db"
    snap.write_bytes(b"x")
    snap.chmod(0o600)
    before = cp1.check_output("ls -d /var/lib/etcd*")
    proc = run_installer("etcd", "snapshot", "restore", str(snaplab.inventory), str(snap), check_rc=2)
    assert "--yes" in proc.stderr and "stop kube-apiserver" in proc.stderr
    assert cp1.check_output("ls -d /var/lib/etcd*") == before
    for name in CONTROLS:
        h = snaplab.host(name)
        assert h.service("etcd").is_running and h.service("kube-apiserver").is_running, name


def test_members_lists_every_control_host(snaplab):
    out = run_installer("etcd", "members", str(snaplab.inventory)).stdout
    lines = out.strip().splitlines()
    assert lines[0].split()[:2] == ["NAME", "ID"]
    assert sorted(line.split()[0] for line in lines[1:]) == list(CONTROLS)
    for name in CONTROLS:
        addr = snaplab.spec.host(name).address
        assert f"https://{addr}:2380" in out and f"https://{addr}:2379" in out


def test_snapshot_save_then_restore_on_every_member(snaplab, tmp_path):
    cp1 = snaplab.host("cp1")
    etcdctl(cp1, "put", "a", "1")
    etcdctl(cp1, "put", "b", "2")
    snap = tmp_path / "backups" / "etcd.db"
    out = run_installer("etcd", "snapshot", "save", str(snaplab.inventory), str(snap)).stdout
    assert "hash" in out and "revision" in out
    assert stat.S_IMODE(snap.stat().st_mode) == 0o600 and snap.stat().st_size > 0
    assert cp1.check_output("ls /var/lib/hiddenplane | grep -c etcd-snapshot || true") == "0"

    etcdctl(cp1, "put", "c", "3")
    assert etcdctl(snaplab.host("cp3"), "get", "c", "--print-value-only") == "3"

    proc = run_installer("etcd", "snapshot", "restore", str(snaplab.inventory), str(snap), "--yes",
                         timeout=300)
    assert "restored" in proc.stdout
    for name in CONTROLS:
        h = snaplab.host(name)
        assert etcdctl(h, "get", "a", "--print-value-only") == "1", name
        assert etcdctl(h, "get", "b", "--print-value-only") == "2", name
        assert etcdctl(h, "get", "c", "--print-value-only") == "", name
        for unit in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert h.service(unit).is_running, f"{name}: {unit}"
        assert h.file("/var/lib/etcd").mode == 0o700 and h.file("/var/lib/etcd").user == "etcd", name
        assert h.check_output("ls -d /var/lib/etcd.pre-restore-* | wc -l") == "1", name
        assert h.check_output("ls /var/lib/hiddenplane | grep -c etcd-restore || true") == "0", name

    # the cluster still has its three members, and is writable
    out = run_installer("etcd", "members", str(snaplab.inventory)).stdout
    assert sorted(line.split()[0] for line in out.strip().splitlines()[1:]) == list(CONTROLS)
    etcdctl(cp1, "put", "d", "4")
    assert etcdctl(snaplab.host("cp2"), "get", "d", "--print-value-only") == "4"
