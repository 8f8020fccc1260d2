"""A host lost at any moment fails the run within the bound, on real hosts: a lab host's link
is cut (its bridge port goes down: packets vanish, no RST, no ICMP) while a command runs, while
data is uploaded, behind a bastion, and while `installer apply` runs; and Remote.scope's
run mark on real hosts, with stop_scopes ending a killed run's processes.

Boots one stand-in lab (``lost`` on 10.213.231.0/24: cp1 .11, w1 .21, w2 .22). The measured
times are printed (run with -s to see them); they are asserted only against a generous sanity
bound so that a regression fails instead of hanging for an hour.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from installer.core import inventory
from installer.core.facts import LOCK
from installer.host.applylock import break_stale, drop, take
from installer.host.liveness import DEAD_AFTER, KEEPALIVE_INTERVAL
from installer.host.runmark import stop_scopes
from installer.host.ssh import HostError, Remote
from installer.lab import net

from .labfixtures import standin_lab, wait_for

pytestmark = pytest.mark.lab

LAB, SUBNET = "lost", "10.213.231.0/24"
CP1 = "10.213.231.11"
INSTALLER = str(Path(sys.executable).with_name("installer"))
# detection takes at most KEEPALIVE_INTERVAL + DEAD_AFTER; anything past this is a hang
SANITY = 120.0


@pytest.fixture(scope="module")
def lostlab(tmp_path_factory):
    with standin_lab(LAB, SUBNET, tmp_path_factory.mktemp("lostlab")) as lab:
        yield lab


@pytest.fixture
def inv(lostlab):
    return inventory.load(lostlab.inventory)


@pytest.fixture
def cut(lostlab):
    """cut(name) takes a host off the network; every host cut is back on leaving the test."""
    done = []

    def do(name: str) -> float:
        host = lostlab.spec.host(name)
        net.cut_link(host)
        done.append(host)
        return time.monotonic()
    yield do
    for host in done:
        net.restore_link(host)


def in_thread(fn):
    """Run ``fn`` in a thread; the returned dict gets ``error``/``result`` and ``at`` (monotonic
    time it ended)."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except Exception as e:      # noqa: BLE001 - the test inspects it
            out["error"] = e
        out["at"] = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    out["thread"] = t
    return out


def ended(job: dict) -> dict:
    job["thread"].join(SANITY)
    assert not job["thread"].is_alive(), f"still blocked after {SANITY} s"
    return job


def report(label: str, seconds: float, since: str = "from the cut to the error") -> None:
    print(f"\n[lost host] {label}: {seconds:.1f} s {since} (bound {KEEPALIVE_INTERVAL:g} + {DEAD_AFTER:g} s)")


# --- run marks on real hosts ------------------------------------------------------------------

def test_scoped_commands_pass_everything_through(inv):
    data = bytes(range(256)) * 4096 + b"\x00\r\n"
    with Remote(inv.host("cp1"), inv, scope="hp-t1") as r:
        got = r.run("cat", stdin=data)
        assert got.raw == data
        bad = r.run("printf 'out\\n'; printf 'err\\n' >&2; exit 7", check=False)
        assert (bad.stdout, bad.stderr, bad.rc) == ("out\n", "err\n", 7)
        with pytest.raises(HostError, match=r"cp1: boom failed \(exit 3\): nope"):
            r.run("echo nope >&2; exit 3", what="boom")
        environ = "tr '\\0' '\\n' < /proc/$$/environ"
        assert "HIDDENPLANE_RUN=hp-t1-" in r.run(environ).stdout
        assert "HIDDENPLANE_RUN" not in r.run(environ, scoped=False).stdout


def test_stop_scopes_ends_a_dead_runs_processes(inv):
    host = inv.host("cp1")
    with Remote(host, inv, scope="hp-dead") as dead, Remote(host, inv, scope="hp-alive") as other:
        dead.run("setsid sleep 3001 </dev/null >/dev/null 2>&1 &")      # outlives its command
        waiting = in_thread(lambda: dead.run("sleep 3002; echo finished"))
        other.run("setsid sleep 3003 </dev/null >/dev/null 2>&1 &")
        wait_for("sleep 3002", lambda: "3002" in other.run("pgrep -a sleep || true", scoped=False).stdout,
                 timeout=60, interval=0.05)
        with Remote(host, inv) as next_run:
            stopped = stop_scopes(next_run, "hp-dead")
            assert len(stopped) == 2 and all(s.startswith("hp-dead-") for s in stopped), stopped
            left = next_run.run("pgrep -a sleep || true").stdout
            assert "3001" not in left and "3002" not in left
            assert "3003" in left                                   # another prefix's scope stays
            assert stop_scopes(next_run, "hp-dead") == []
            assert len(stop_scopes(next_run, "hp-alive")) == 1
        # the killed command ends without an exit status: a failure, not "finished"
        err = ended(waiting).get("error")
        assert isinstance(err, HostError) and "finished" not in str(err), waiting


# --- a cut link under a single connection ----------------------------------------------------

def test_a_cut_during_a_long_command_fails_within_the_bound(inv, cut):
    with Remote(inv.host("w1"), inv) as r, Remote(inv.host("w1"), inv) as probe:
        job = in_thread(lambda: r.run("sleep 301", timeout=600, what="wait for etcd"))
        wait_for("sleep 301 on w1", lambda: "sleep 301" in probe.run("pgrep -a sleep || true").stdout,
                 timeout=60, interval=0.05)
        at = cut("w1")
        err = ended(job).get("error")
        seconds = job["at"] - at
        report("Remote.run('sleep 301', timeout=600)", seconds)
        assert isinstance(err, HostError) and err.host == "w1", job
        assert "wait for etcd: lost the connection (" in str(err)
        print(f"[lost host] the error: {err}")
        assert seconds < SANITY
        # reconnecting to the cut host is bounded too: one connect timeout
        t0 = time.monotonic()
        with pytest.raises(HostError, match="w1: cannot reach .*timed out"):
            r.run("true")
        report("reconnect to the cut host", time.monotonic() - t0, "to the error")


def test_a_cut_during_an_upload_fails_within_the_bound(lostlab, inv, cut):
    data = os.urandom(1 << 20) * 400                      # far more than any socket buffer holds
    with Remote(inv.host("w2"), inv) as r:
        job = in_thread(lambda: r.put("/var/tmp/big", data, what="upload big"))
        root = lostlab.paths.host_dir("w2") / "root"
        partial = root / "var/tmp/big.hp-new"
        wait_for("the upload under way", lambda: partial.exists() and partial.stat().st_size > (8 << 20),
                 timeout=60, interval=0.05)
        at = cut("w2")
        err = ended(job).get("error")
        report("Remote.put of 400 MiB", job["at"] - at)
        print(f"[lost host] the error: {err}")
        assert isinstance(err, HostError) and "w2: upload big: lost the connection" in str(err), job
        assert not (root / "var/tmp/big").exists()            # never renamed into place
        assert job["at"] - at < SANITY


def test_a_cut_behind_a_bastion_fails_within_the_bound(lostlab, cut, tmp_path):
    # TCP to the bastion stays healthy: only the SSH-level keepalive can see the target go
    doc = copy.deepcopy(yaml.safe_load(lostlab.inventory.read_text()))
    doc["spec"]["ssh"]["bastion"] = {"address": CP1}
    path = tmp_path / "bastion.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    binv = inventory.load(path)
    with Remote(binv.host("w1"), binv) as r, Remote(binv.host("w1"), binv) as probe:
        job = in_thread(lambda: r.run("sleep 302", timeout=600, what="long wait"))
        wait_for("sleep 302 on w1", lambda: "sleep 302" in probe.run("pgrep -a sleep || true").stdout,
                 timeout=60, interval=0.05)
        at = cut("w1")
        err = ended(job).get("error")
        report("through a bastion, Remote.run('sleep 302')", job["at"] - at)
        assert isinstance(err, HostError) and "w1: long wait: lost the connection" in str(err), job
        assert job["at"] - at < SANITY


def test_a_command_longer_than_the_bound_on_a_live_host_completes(inv):
    # the host answers its keepalives: a wait far past KEEPALIVE_INTERVAL + DEAD_AFTER is fine
    with Remote(inv.host("w1"), inv) as r:
        long = KEEPALIVE_INTERVAL + DEAD_AFTER + 5
        assert r.run(f"sleep {long:g}; echo done", timeout=long + 60).stdout == "done\n"


# --- the criterion: apply with a worker cut mid-way ----------------------------------

def installer(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)


def test_apply_with_a_worker_lost_mid_upload_fails_fast_and_the_next_run_converges(lostlab, inv, cut):
    common = ("--state", str(lostlab.state), "--skip", "cluster-bootstrap")
    root = lostlab.paths.host_dir("w1") / "root"
    proc = subprocess.Popen([INSTALLER, "apply", str(lostlab.inventory), *common, "--wait-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # mid-way: w1 is receiving its binaries (an upload's temporary file is there)
        wait_for("w1's artifacts upload",
                 lambda: proc.poll() is not None or any((root / "usr/local/bin").glob("*.hp-new")),
                 timeout=600, interval=0.02)
        assert proc.poll() is None, "apply ended before w1's upload was seen"
        at = cut("w1")
        out, err = proc.communicate(timeout=SANITY)
        seconds = time.monotonic() - at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report("installer apply, w1 cut during its artifacts upload", seconds, "from the cut to the exit")
    print(f"[lost host] apply said: {err.strip()}")
    assert proc.returncode == 3, f"rc={proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    assert "phase artifacts failed on w1: " in err and "lost the connection" in err, err
    assert seconds < SANITY
    # the lock was released on the control hosts
    with Remote(inv.host("cp1"), inv) as r:
        assert r.run(f"test -e {LOCK} && cat {LOCK} || echo none").stdout.strip() == "none"

    net.restore_link(lostlab.spec.host("w1"))
    again = installer("apply", str(lostlab.inventory), *common, "--wait-timeout", "60")
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-3000:]}"
    check = installer("plan", str(lostlab.inventory), *common, "--check")
    assert check.returncode == 0, f"{check.stdout[-3000:]}\n{check.stderr[-3000:]}"



def test_releasing_the_lock_on_a_lost_host_is_bounded(lostlab, inv, cut):
    # what the runner does on the way out of a failed run, here with the host already gone
    with Remote(inv.host("w2"), inv) as r:
        assert take(r, "run-lost-lock") is None
        at = cut("w2")
        job = ended(in_thread(lambda: drop(r, "run-lost-lock")))    # a HostError is swallowed: the lock goes stale
        assert "error" not in job, job
        seconds = job["at"] - at
        report("drop() of the apply lock on a cut host", seconds, "from the cut to its return")
        assert seconds < SANITY
    net.restore_link(lostlab.spec.host("w2"))
    with Remote(inv.host("w2"), inv) as r:
        assert "run-lost-lock" in r.run(f"cat {LOCK}").stdout      # unreachable then: still there
        break_stale(r)
