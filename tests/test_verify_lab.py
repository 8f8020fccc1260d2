"""`installer verify` on a real lab: passes on a converged lab, and catches real breakage on
the hosts (a private key made readable, a kubelet binary or node credential on a control host,
a stopped kube-proxy), naming host and check; an unknown host key is refused, never accepted."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from installer.actions.verify import ssh_config
from installer.core.inventory import load
from installer.lab import lab as lab_mod

from .conftest import ROOT
from .labfixtures import start_lab

INSTALLER = str(Path(sys.executable).with_name("installer"))
NAME, SUBNET = "verify", "10.213.204.0/24"


def installer(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vlab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verifylab")
    lab = start_lab(NAME, SUBNET, tmp)
    try:
        subprocess.run([sys.executable, "-m", "tests.standins", "install", str(lab.paths.artifacts)], cwd=ROOT,
                       check=True, capture_output=True)
        lab.state = tmp / "state"
        proc = installer("apply", str(lab.inventory), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         "--wait-timeout", "60", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield lab
    finally:
        lab_mod.down(NAME, log=lambda *_: None)


def verify_json(lab, inventory: Path | None = None) -> tuple[int, dict | None, str]:
    proc = installer("verify", str(inventory or lab.inventory), "--state", str(lab.state), "--output", "json")
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else None), proc.stderr


def failures(report: dict) -> set[tuple[str, str]]:
    return {(c["host"], c["check"]) for c in report["checks"] if not c["ok"]}


@pytest.mark.lab
def test_converged_lab_passes_every_check(vlab):
    proc = installer("verify", str(vlab.inventory), "--state", str(vlab.state))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("✗")]
    checks = [line for line in lines if line.startswith("✓")]
    for expected in ("✓ cp1  no kubelet binary", "✓ cp1  no containerd.service unit", "✓ cp1  no containerd socket",
                     "✓ cp1  no node credential /etc/kubernetes/kubelet.conf",
                     "✓ cp1  etcd.service running and enabled",
                     "✓ cp1  /var/lib/etcd 0700 etcd:etcd", "✓ cp1  /etc/kubernetes/pki/ca.key 0600 root:root",
                     "✓ cp1  /etc/etcd/pki/server.key 0600 etcd:etcd",
                     "✓ cp1  /etc/kubernetes/admin.conf 0600 root:root",
                     "✓ cp1  /etc/systemd/system/kube-apiserver.service 0600 root:root",
                     "✓ w1  kube-proxy.service running and enabled", "✓ w2  no etcd binary",
                     "✓ w1  no signing key /etc/kubernetes/pki/ca.key",
                     "✓ w2  /var/lib/kubelet/config.yaml 0600 root:root",
                     "✓ w1  /etc/kubernetes/kube-proxy.conf 0600 root:root"):
        assert expected in checks, expected
    assert {line.split()[1] for line in checks} == {"cp1", "w1", "w2"}
    assert lines[-1] == f"{len(checks)}/{len(checks)} checks passed"


BREAKAGES = {
    "readable-key": ("cp1", "chmod 0644 /etc/kubernetes/pki/apiserver.key",
                     "chmod 0600 /etc/kubernetes/pki/apiserver.key",
                     {("cp1", "/etc/kubernetes/pki/apiserver.key 0600 root:root")}),
    "kubelet-binary": ("cp1", "install -m 0755 /dev/null /usr/local/bin/kubelet", "rm -f /usr/local/bin/kubelet",
                       {("cp1", "no kubelet binary")}),
    # an empty kubeconfig is also a kubeconfig not locked down: both are reported
    "node-credential": ("cp1", "touch /etc/kubernetes/kubelet.conf", "rm -f /etc/kubernetes/kubelet.conf",
                        {("cp1", "no node credential /etc/kubernetes/kubelet.conf"),
                         ("cp1", "/etc/kubernetes/kubelet.conf 0600 root:root")}),
    "stopped-kube-proxy": ("w1", "systemctl stop kube-proxy", "systemctl start kube-proxy",
                           {("w1", "kube-proxy.service running and enabled")}),
}


@pytest.mark.lab
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_breakage_is_caught_and_named(vlab, breakage):
    name, brk, restore, expected = BREAKAGES[breakage]
    host = vlab.host(name)
    host.run_expect([0], brk)
    try:
        rc, report, stderr = verify_json(vlab)
        assert rc == 1, stderr
        assert report["ok"] is False
        assert failures(report) == expected
        if breakage == "stopped-kube-proxy":
            detail = [c["detail"] for c in report["checks"] if (c["host"], c["check"]) in expected]
            assert detail == ["not running"]
    finally:
        host.run_expect([0], restore)


@pytest.mark.lab
def test_restored_lab_passes_again(vlab):
    w1 = vlab.host("w1")
    deadline = time.monotonic() + 30
    while not w1.service("kube-proxy").is_running and time.monotonic() < deadline:
        time.sleep(0.5)
    rc, report, stderr = verify_json(vlab)
    assert rc == 0 and failures(report) == set(), (stderr, failures(report) if report else None)
    assert report["ok"] is True and report["failed"] == 0


@pytest.mark.lab
def test_unknown_host_key_is_refused_and_not_accepted(vlab, tmp_path):
    cp1 = vlab.spec.host("cp1").address
    known = tmp_path / "known_hosts"
    kept = [line for line in vlab.paths.known_hosts.read_text().splitlines()
            if cp1 not in line.split()[0].split(",")]
    known.write_text("\n".join(kept) + "\n")
    doc = yaml.safe_load(vlab.inventory.read_text())
    doc["spec"]["ssh"]["knownHosts"] = str(known)
    if doc["spec"].get("artifacts", {}).get("path"):
        doc["spec"]["artifacts"]["path"] = str((vlab.inventory.parent / doc["spec"]["artifacts"]["path"]).resolve())
    inv = tmp_path / "verify.inventory.yaml"
    inv.write_text(yaml.safe_dump(doc))
    before = known.read_bytes()

    rc, report, stderr = verify_json(vlab, inv)
    assert rc == 3, stderr
    assert report is None and "Traceback" not in stderr
    assert "cp1" in stderr and cp1 in stderr and f"not in {known}" in stderr, stderr
    # only cp1 is named (the temporary directory's random name may hold "w1": leave it out)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith("error: cp1:") for line in errors), stderr
    assert not re.search(r"\bw[12]\b", stderr.replace(str(known), "")), stderr
    assert known.read_bytes() == before          # nothing was accepted


def test_ssh_config_verifies_host_keys(tmp_path):
    inv_path = tmp_path / "inv.yaml"
    doc = yaml.safe_load((ROOT / "inventory.example.yaml").read_text())
    doc["spec"]["ssh"] = {"user": "admin", "port": 2222, "keyPath": "keys/id", "knownHosts": "kh"}
    inv_path.write_text(yaml.safe_dump(doc))
    text = ssh_config(load(inv_path), tmp_path / "cm")
    block = text.split("Host node2\n")[1].split("\nHost ")[0]
    for line in ("HostName 192.168.56.231", "User admin", "Port 2222", f"IdentityFile {tmp_path}/keys/id",
                 "IdentitiesOnly yes", f"UserKnownHostsFile {tmp_path}/kh", "StrictHostKeyChecking yes",
                 "BatchMode yes", f"ControlPath {tmp_path}/cm/%C"):
        assert f"  {line}\n" in block + "\n", line
    assert "accept-new" not in text and "StrictHostKeyChecking no" not in text


def test_verify_session_dir_is_private_and_removed():
    from installer.actions.verify import _Session
    s = _Session(load(ROOT / "inventory.example.yaml"))
    try:
        assert stat.S_IMODE(s.dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(s.config.stat().st_mode) == 0o600
    finally:
        s.close()
    assert not s.dir.exists()
