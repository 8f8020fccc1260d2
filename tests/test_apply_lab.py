"""`installer apply` on real lab hosts: real sshd, systemd, etcd (mTLS), containerd; the five
Kubernetes binaries are the contract stand-ins (the real ones cannot be had here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from installer.core.pki import issue
from installer.host.health import client_context, https_get

from .conftest import ROOT
from .labfixtures import standin_lab

pytestmark = pytest.mark.lab

INSTALLER = str(Path(sys.executable).with_name("installer"))
PKI = "/etc/kubernetes/pki"


def run_installer(*args: str, check_rc: int | None = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)
    if check_rc is not None:
        assert proc.returncode == check_rc, \
            f"rc={proc.returncode}\nstdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-3000:]}"
    return proc


def apply_json(inventory: Path, state: Path, *extra: str) -> dict:
    proc = run_installer("apply", str(inventory), "--state", str(state), "--skip", "cluster-bootstrap",
                         "--output", "json", "--wait-timeout", "60", *extra)
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def applab(tmp_path_factory):
    with standin_lab("apply", "10.213.202.0/24", tmp_path_factory.mktemp("applab")) as lab:
        yield lab


def etcdctl(host, *args: str) -> str:
    return host.check_output(
        "/usr/local/bin/etcdctl --endpoints=https://127.0.0.1:2379 "
        f"--cacert={PKI}/etcd/ca.crt --cert={PKI}/apiserver-etcd-client.crt --key={PKI}/apiserver-etcd-client.key "
        + " ".join(args) + " 2>&1")


def served_certificate(inventory: Path, state: Path, address: str, port: int) -> bytes:
    """The DER certificate the apiserver presents, read over a handshake with the admin client."""
    import socket

    from installer.api import prepare
    material = prepare(inventory, state).material
    with client_context(material) as ctx, socket.create_connection((address, port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=address) as tls:
        return tls.getpeercert(binary_form=True)


def test_cold_apply_converges_the_lab(applab):
    report = apply_json(applab.inventory, applab.state)
    assert report["changes"] > 0
    cp1, workers = applab.host("cp1"), applab.hosts("worker")

    # etcd answers over mTLS with the apiserver's client certificate
    assert "is healthy" in etcdctl(cp1, "endpoint", "health")
    for unit in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        assert cp1.service(unit).is_running and cp1.service(unit).is_enabled, unit
    for name, w in workers.items():
        for unit in ("containerd", "kubelet", "kube-proxy"):
            assert w.service(unit).is_running and w.service(unit).is_enabled, f"{name}: {unit}"

    # the apiserver stand-in serves /livez with the rendered certificate, verified with our CA
    state = yaml.safe_load(applab.inventory.read_text())
    from installer.api import prepare
    material = prepare(applab.inventory, applab.state).material
    with client_context(material) as tls:
        assert https_get(tls, applab.spec.host("cp1").address, 6443, "/livez")[0] == 200
    assert state["metadata"]["name"] == "apply"

    # every key and kubeconfig 0600, root-owned (etcd's own files owned by etcd)
    keys = cp1.check_output("find /etc/kubernetes /etc/etcd -name '*.key' -o -name '*.conf' | sort").split()
    assert len(keys) > 10
    for path in keys:
        f = cp1.file(path)
        assert f.mode == 0o600, path
        assert f.user == ("etcd" if path.startswith("/etc/etcd/") else "root"), path
    for name, w in workers.items():
        for path in ("/etc/kubernetes/kube-proxy.conf", "/etc/kubernetes/bootstrap-kubelet.conf",
                     "/var/lib/kubelet/pki/kubelet.key", "/var/lib/kubelet/config.yaml"):
            assert w.file(path).mode == 0o600 and w.file(path).user == "root", f"{name}:{path}"

    # hidden control plane: nothing of a node on cp1; nothing of the control plane on workers
    for path in ("/usr/local/bin/kubelet", "/usr/local/bin/containerd", "/usr/local/bin/kube-proxy",
                 "/etc/systemd/system/kubelet.service", "/etc/systemd/system/containerd.service",
                 "/run/containerd/containerd.sock", "/var/lib/kubelet", "/etc/kubernetes/kubelet.conf",
                 "/opt/cni/bin"):
        assert not cp1.file(path).exists, f"cp1 has {path}"
    assert not cp1.exists("kubelet") and not cp1.exists("containerd")
    for name, w in workers.items():
        for path in ("/usr/local/bin/etcd", "/usr/local/bin/kube-apiserver", f"{PKI}/ca.key", "/var/lib/etcd"):
            assert not w.file(path).exists, f"{name} has {path}"


def test_plan_check_is_clean_after_apply(applab):
    proc = run_installer("plan", str(applab.inventory), "--state", str(applab.state), "--skip",
                         "cluster-bootstrap", "--check")
    assert "0 change(s)" in proc.stdout


def test_second_apply_changes_nothing(applab):
    report = apply_json(applab.inventory, applab.state)
    assert report["changes"] == 0, [e for e in report["events"] if e["action"] == "changed"]
    assert report["restarts"] == []
    assert set(report["bytesUploaded"].values()) == {0}
    assert max(report["roundTrips"].values()) <= 2, report["roundTrips"]


def test_changing_one_flag_restarts_only_that_unit(applab, tmp_path):
    doc = yaml.safe_load(applab.inventory.read_text())
    # the lab has it off (no registry): turn it on
    assert doc["spec"]["apiServer"]["alwaysPullImages"] is False
    doc["spec"]["apiServer"]["alwaysPullImages"] = True
    changed = tmp_path / "apply.inventory.yaml"
    changed.write_text(yaml.safe_dump(doc))
    report = apply_json(changed, applab.state)
    assert report["restarts"] == ["cp1:kube-apiserver.service"]
    unit = applab.host("cp1").file("/etc/systemd/system/kube-apiserver.service").content_string
    assert "AlwaysPullImages" in unit
    # and back, so later tests start from the lab's own inventory
    assert apply_json(applab.inventory, applab.state)["restarts"] == ["cp1:kube-apiserver.service"]


def test_unreachable_worker_is_named_and_nothing_is_written(applab, tmp_path):
    doc = yaml.safe_load(applab.inventory.read_text())
    doc["spec"]["hosts"].append({"name": "w9", "address": "10.213.202.99", "role": "worker"})
    bad = tmp_path / "apply.inventory.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = run_installer("apply", str(bad), "--state", str(tmp_path / "state-w9"), "--skip", "cluster-bootstrap",
                         check_rc=3, timeout=120)
    assert "w9" in proc.stderr and "cannot reach 10.213.202.99" in proc.stderr
    # the reachable hosts were not touched: the original inventory is still converged
    run_installer("plan", str(applab.inventory), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                  "--check")


def test_a_live_lock_is_respected(applab, tmp_path):
    cp1 = applab.host("cp1")
    cp1.run_expect([0], "mkdir -p /var/lib/hiddenplane && echo "
                   f"'{{\"machine\": \"elsewhere\", \"pid\": 1, \"since\": {int(time.time())}}}' "
                   "> /var/lib/hiddenplane/apply.lock")
    try:
        doc = yaml.safe_load(applab.inventory.read_text())
        # something to change (the lab has it off), so a lock is needed
        doc["spec"]["apiServer"]["alwaysPullImages"] = True
        changed = tmp_path / "apply.inventory.yaml"
        changed.write_text(yaml.safe_dump(doc))
        proc = run_installer("apply", str(changed), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                             check_rc=3)
        assert "another command holds the apply lock" in proc.stderr and "elsewhere" in proc.stderr
    finally:
        cp1.run("rm -f /var/lib/hiddenplane/apply.lock")
    run_installer("plan", str(applab.inventory), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                  "--check")


def test_a_state_of_another_cluster_is_refused_before_anything_changes(applab, tmp_path):
    """The README's commands typed without the lab's --state once found an empty state: plan said
    "ca: new CA" and apply would have pushed it to every host."""
    other = tmp_path / "other-state"
    for command in ("plan", "apply"):
        proc = run_installer(command, str(applab.inventory), "--state", str(other), "--skip", "cluster-bootstrap",
                             check_rc=2)
        err = proc.stderr
        assert f"the hosts trust other CAs than the state directory {other}: nothing was changed" in err, err
        assert "cp1 /etc/kubernetes/pki/ca.crt: the host trusts" in err and "w1 /etc/kubernetes/pki/ca.crt" in err
        assert "would have made a new one" in err and "installer ca rotate" in err and "installer reset" in err
    assert not (other / "pki").exists()
    for host in applab.hosts().values():
        assert not host.file("/var/lib/hiddenplane/apply.lock").exists
    run_installer("plan", str(applab.inventory), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                  "--check")


def test_a_noop_run_clears_the_stale_lock_its_own_machine_left(applab):
    from installer.host.applylock import holder
    gone = subprocess.Popen(["true"])
    gone.wait()                                  # a pid that no longer runs
    cp1 = applab.host("cp1")
    # this machine's lock as the installer writes it (machine id, boot id, pid namespace): a
    # host name alone no longer makes a lock this machine's
    stale = json.dumps({**holder(), "pid": gone.pid, "run": "x" * 32})
    cp1.run_expect([0], f"mkdir -p /var/lib/hiddenplane && echo '{stale}' > /var/lib/hiddenplane/apply.lock")
    proc = run_installer("apply", str(applab.inventory), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                         "--wait-timeout", "60")
    assert f"cp1: clearing a stale apply lock (process {gone.pid} on this machine is gone)" in proc.stdout + proc.stderr
    assert not cp1.file("/var/lib/hiddenplane/apply.lock").exists
    assert "apply: 0 change(s)" in proc.stdout, proc.stdout


def test_a_killed_runs_remote_commands_are_ended_before_its_lock_is_taken_over(applab):
    """What a SIGKILLed run leaves: its lock naming a pid gone from this machine, and a command
    with the run's mark still running on a host (a wait loop, an etcdctl)."""
    from installer.host.applylock import holder, scope_of
    gone = subprocess.Popen(["true"])
    gone.wait()
    run = "d" * 32
    cp1, w1 = applab.host("cp1"), applab.host("w1")
    stale = json.dumps({**holder(), "pid": gone.pid, "run": run})
    cp1.run_expect([0], f"mkdir -p /var/lib/hiddenplane && echo '{stale}' > /var/lib/hiddenplane/apply.lock")
    for host in (cp1, w1):
        host.run_expect([0], f"HIDDENPLANE_RUN={scope_of(run)}-7 setsid sleep 907 >/dev/null 2>&1 </dev/null &")
    for host in (cp1, w1):
        wait_until = time.monotonic() + 30
        while "sleep 907" not in host.check_output("ps -eo args") and time.monotonic() < wait_until:
            time.sleep(0.5)
        assert "sleep 907" in host.check_output("ps -eo args")
    proc = run_installer("apply", str(applab.inventory), "--state", str(applab.state), "--skip", "cluster-bootstrap",
                         "--wait-timeout", "60")
    out = proc.stdout + proc.stderr
    assert f"cp1: ended 1 command(s) of the dead run {run[:12]}" in out, out
    assert f"w1: ended 1 command(s) of the dead run {run[:12]}" in out, out
    for host in (cp1, w1):
        assert "sleep 907" not in host.check_output("ps -eo args")
    assert not cp1.file("/var/lib/hiddenplane/apply.lock").exists


KILL_AT = """
import os, signal, sys
from installer.core.cluster import resolve
from installer.engine import runner
from installer.engine.context import Options
target = sys.argv[3]
def on_event(ev):
    if ev.phase == target:
        os.kill(os.getpid(), signal.SIGKILL)
runner.run(resolve(sys.argv[1], sys.argv[2]), Options(skip=frozenset({"cluster-bootstrap"}), wait_timeout=60),
           log=lambda *_: None, on_event=on_event)
"""


@pytest.mark.parametrize("phase", ["pki", "artifacts", "etcd", "control-plane", "workers"])
def test_sigkill_in_a_phase_then_rerun_converges(applab, tmp_path, phase):
    # new leaf certificates: every phase has work to do; a removed binary gives the artifacts
    # phase some too
    state = tmp_path / "state"
    shutil.copytree(applab.state, state)
    # every leaf certificate re-issued (the CAs kept: no run replaces a CA the hosts trust)
    for p in (state / "pki").rglob("*"):
        if p.is_file() and p.name not in ("ca.crt", "ca.key", "front-proxy-ca.crt", "front-proxy-ca.key",
                                          "sa.key", "sa.pub"):
            p.unlink()
    applab.host("w1").run("rm -f /usr/local/bin/kube-proxy")
    proc = subprocess.run([sys.executable, "-c", KILL_AT, str(applab.inventory), str(state), phase],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr[-2000:]

    run_installer("apply", str(applab.inventory), "--state", str(state), "--skip", "cluster-bootstrap",
                  "--wait-timeout", "60")
    run_installer("plan", str(applab.inventory), "--state", str(state), "--skip", "cluster-bootstrap", "--check")
    for name, host in applab.hosts().items():
        leftovers = host.check_output("find /etc /usr/local/bin /var/lib/kubelet /opt -name '*.hp-new' 2>/dev/null "
                                      "|| true")
        assert leftovers == "", f"{name}: {leftovers}"
    # the restart that the killed run owed happened: the apiserver serves the new certificate
    served = served_certificate(applab.inventory, state, applab.spec.host("cp1").address, 6443)
    expected = issue.load_cert((state / "pki" / "apiserver.crt").read_bytes())
    assert served == expected.public_bytes(serialization_der())
    # leave the lab on this state, in the lab's own directory: this test's tmp_path goes once it
    # passes (tmp_path_retention_policy), and the next case starts from the lab's state
    shutil.rmtree(applab.state)
    shutil.copytree(state, applab.state)


def serialization_der():
    from cryptography.hazmat.primitives.serialization import Encoding
    return Encoding.DER


def test_three_control_hosts_form_one_etcd_cluster(tmp_path):
    with standin_lab("apply3", "10.213.203.0/24", tmp_path, controls=3, workers=1) as lab:
        report = apply_json(lab.inventory, lab.state)
        assert report["changes"] > 0
        cp1 = lab.host("cp1")
        members = etcdctl(cp1, "member", "list", "-w", "json")
        listed = json.loads(members)["members"]
        assert sorted(m["name"] for m in listed) == ["cp1", "cp2", "cp3"]
        health = cp1.check_output(
            "/usr/local/bin/etcdctl --endpoints=https://10.213.203.11:2379,https://10.213.203.12:2379,"
            f"https://10.213.203.13:2379 --cacert={PKI}/etcd/ca.crt --cert={PKI}/etcd/healthcheck-client.crt "
            f"--key={PKI}/etcd/healthcheck-client.key endpoint health 2>&1")
        assert health.count("is healthy") == 3, health
        for name in ("cp1", "cp2", "cp3"):
            assert lab.host(name).service("kube-apiserver").is_running
