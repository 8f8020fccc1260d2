"""HA without a load balancer, on the shared real lab (3 control hosts, 2 workers: the local
API balancer is on, spec.apiServer.balancer auto): every worker's balancer lists every
apiserver; the kubernetes Service's endpoints are the balancer address; and with cp1 cut off
the network (its bridge port down: packets dropped, as a pulled cable) while an `installer
apply` is under way: the apply fails naming cp1 within the SSH bound, the Nodes stay Ready, a
Deployment scaled during the outage gets its pods Running, the day-2 commands that need only the
API or one control host work through cp2 and those that need every host stop naming cp1 before
any change, and once cp1 is back the balancers use it again and `installer apply` converges.

Figures printed (docs/ha.md quotes runs): per worker, requests (its own Node, read as its
kubelet) that failed through its balancer (127.0.0.1) and through the kubernetes Service (the pod
path, DNAT-ed to the balancer address), the longest request, how long after the cut and after
the restore each balancer marked cp1 down and up, and each day-2 command's exit. Runs before
tests/test_real_day2.py, which expects the cluster whole.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from installer.core.facts import LOCK
from installer.core.render.balancer import ADMIN_SOCKET, CTL, FALLBACK, SOCAT
from installer.host.liveness import DEAD_AFTER
from installer.host.ssh import Remote
from installer.lab import net

from . import hostprobes
from .realcluster import BUSYBOX, INSTALLER, run_installer, wait_for
from .realcluster import NAME as LAB

pytestmark = [pytest.mark.lab, pytest.mark.real]

UNIT = hostprobes.BALANCER
SOCKET, CTL, SOCAT = ADMIN_SOCKET, CTL, SOCAT
OUTAGE = 150.0        # seconds cp1 stays cut (the bound)
# a run that loses a host fails within: the keepalive watchdog's DEAD_AFTER, then a new
# channel's or connection's connect_timeout (host/ssh.py), and some slack for the machine
SSH_BOUND = DEAD_AFTER + Remote.connect_timeout + 15


@pytest.fixture(scope="module")
def rc(real_cluster):
    return real_cluster


def _servers_state(rc, worker: str) -> list[list[str]]:
    """The worker's balancer's ``show servers state`` rows for the apiservers' checked entries
    (not their unchecked backups), asked on its runtime API (root only) with the socat the
    installer ships for it."""
    out = rc.ssh(worker, f"echo 'show servers state apiservers' | {SOCAT} -t 5 - UNIX-CONNECT:{SOCKET}").stdout
    return [f for f in (line.split() for line in out.splitlines())
            if len(f) > 13 and f[1] == "apiservers" and not f[3].endswith(FALLBACK)]


def balancer_view(rc, worker: str) -> dict[str, str]:
    """server -> UP/DOWN/... as the worker's balancer sees it."""
    states = {"0": "DOWN", "1": "STARTING", "2": "UP", "3": "STOPPING"}
    return {f[3]: states.get(f[5], f[5]) for f in _servers_state(rc, worker)}


# srv_check_state is HAProxy's check->state bit field; its bit 0x1 (CHK_ST_INPROGRESS) is set
# only while one health check is running (every CHECK_INTERVAL), so two looks at an unchanged
# balancer could read 6 and 7. The admin view drops that bit: what is compared is configured
# (0x2), enabled (0x4) and paused (0x8), which only an admin action changes.
CHECK_IN_PROGRESS = 0x1


def balancer_admin(rc, worker: str) -> dict[str, tuple[str, str]]:
    """server -> (admin state: 0 in service, 8 drained; check state without the in-progress bit:
    6 checking, 2 paused)."""
    return {f[3]: (f[6], str(int(f[13]) & ~CHECK_IN_PROGRESS)) for f in _servers_state(rc, worker)}


def test_an_apiserver_leaves_a_balancer_and_comes_back_by_itself_when_no_run_brings_it_back(rc):
    """The ctl every planned apiserver stop uses (host/handover.py), on a real worker: ``leave``
    drains the server and pauses its checks; when nothing says ``back`` (the run died), the
    systemd timer it left does, after the seconds given. A name that is not a server's is
    refused before anything changes."""
    w = rc.workers[0]
    assert balancer_admin(rc, w)["cp2"] == ("0", "6")
    bad = rc.ssh(w, f"{CTL} leave 'cp2;id' 3")
    assert bad.returncode == 2 and "usage" in bad.stderr and balancer_admin(rc, w)["cp2"] == ("0", "6")
    # timed from before the ssh: the timer cannot fire earlier than SECONDS after this. SECONDS
    # leaves room for the ssh round trips that look at the drained state under CI's load (with
    # 4 s, a leave's ssh and the next look could outlast the timer, and the look found cp2 back)
    seconds = 12
    asked = time.monotonic()
    proc = rc.ssh(w, f"{CTL} leave cp2 {seconds}")
    assert proc.returncode == 0, proc.stderr
    admin = balancer_admin(rc, w)
    looked = time.monotonic() - asked
    assert looked < seconds, f"the leave and one look took {looked:.1f} s: the test cannot see the drained state"
    assert admin["cp2"] == ("8", "2") and admin["cp3"] == ("0", "6"), admin   # the others untouched
    wait_for("cp2 back in service by the timer", lambda: balancer_admin(rc, w)["cp2"] == ("0", "6"), 40, 0.5)
    took = time.monotonic() - asked
    print(f"{w}: cp2 back by its timer {took:.1f} s after a leave of {seconds} s "
          f"(the leave and one look: {looked:.1f} s)")
    assert seconds <= took <= seconds + 15
    assert balancer_view(rc, w)["cp2"] == "UP"


def test_no_one_but_root_on_a_worker_reaches_its_balancers_admin_socket(rc):
    """An attacker with an unprivileged shell on a worker (a compromised service's user) must
    not be able to drain an apiserver out of the balancer or point it elsewhere: the runtime API
    is the admin socket in a root-only directory, and the ctl refuses anyone but root."""
    w = rc.workers[0]
    before = balancer_admin(rc, w)
    nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups"
    direct = rc.ssh(w, f"echo 'set server apiservers/cp2 state maint' | {nobody} {SOCAT} -t 5 - UNIX-CONNECT:{SOCKET}")
    assert direct.returncode != 0 and "Permission denied" in direct.stderr, direct
    ctl = rc.ssh(w, f"{nobody} {CTL} leave cp2 5")
    assert ctl.returncode == 1 and "root only" in ctl.stderr, ctl
    modes = rc.ssh(w, f"stat -c '%a %U %G' {shlex.quote(str(Path(SOCKET).parent))} {SOCKET}").stdout.split("\n")
    assert modes[:2] == ["700 root root", "600 root root"], modes
    assert balancer_admin(rc, w) == before                  # nothing changed


def ready_nodes(rc, kubeconfig: Path | None = None) -> dict[str, bool]:
    args = ("--kubeconfig", str(kubeconfig)) if kubeconfig else ()
    proc = rc.kubectl(*args, "get", "nodes", "-o", "json", check=False, timeout=30)
    if proc.returncode != 0:
        return {}
    return {n["metadata"]["name"]: any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in n["status"].get("conditions") or [])
            for n in json.loads(proc.stdout)["items"]}


def test_every_worker_balances_over_every_apiserver(rc):
    inv = yaml.safe_load(rc.inventory.read_text())
    assert inv["spec"].get("apiServer", {}).get("balancer", "auto") == "auto" and len(rc.controls) == 3
    for w in rc.workers:
        assert rc.ssh(w, f"systemctl is-active {UNIT}").stdout.strip() == "active"
        assert balancer_view(rc, w) == {c: "UP" for c in rc.controls}, w
        server = rc.ssh(w, "grep server: /etc/kubernetes/kubelet.conf /etc/kubernetes/kube-proxy.conf").stdout
        assert server.count("https://127.0.0.1:6443") == 2, server
    # the kubernetes Service's endpoints are the balancer address, written once by the installer
    ep = rc.get("endpoints", "kubernetes")
    assert [(a["ip"], p["port"]) for s in ep["subsets"] for a in s["addresses"] for p in s["ports"]] == [
        ("172.20.0.1", 6443)]
    sl = rc.get("endpointslice", "kubernetes")
    assert [a for e in sl["endpoints"] for a in e["addresses"]] == ["172.20.0.1"]
    # a pod reaches the API through its own node's balancer (the Service's ClusterIP, DNAT-ed)
    for w in rc.workers:
        rc.run_pod(f"ha-svc-{w}", w, "sleep 100000")
        got = rc.kubectl("exec", f"ha-svc-{w}", "--", "sh", "-c",
                         "nc -w 5 10.96.0.1 443 </dev/null >/dev/null && echo reached", check=False, timeout=60)
        assert "reached" in got.stdout, (w, got.stdout, got.stderr)
        rc.kubectl("delete", "pod", f"ha-svc-{w}", "--wait=false")
    # the health endpoints answer anonymously, nothing else does
    cp1 = rc.address("cp1")
    for path, want in (("/readyz", 200), ("/livez", 200), ("/api", 401), ("/api/v1/nodes", 401)):
        assert http_status(rc, "w1", f"https://{cp1}:6443{path}") == want, path


def http_status(rc, host: str, url: str) -> int:
    """The status of an anonymous GET of ``url`` from ``host`` (the cluster CA verifies it)."""
    script = ("import ssl, urllib.request, urllib.error\n"
              "c = ssl.create_default_context(cafile='/etc/kubernetes/pki/ca.crt')\n"
              f"try: print(urllib.request.urlopen({url!r}, context=c, timeout=10).status)\n"
              "except urllib.error.HTTPError as e: print(e.code)\n")
    out = rc.ssh(host, f"python3 -c {shlex.quote(script)}")
    return int(out.stdout.strip() or -1)


def _start_probes(rc) -> None:
    for w in rc.workers:
        for name, url in hostprobes.api(w):
            hostprobes.start(rc.lab.ssh_config, w, f"hp-probe-{name}", url)


class RunningApply:
    """``installer apply`` started in the background; returns once it has reported a step on
    cp1 (past connecting and its facts: the run is under way). Its exit and when it came are
    recorded by a thread."""

    def __init__(self, rc):
        self.lines: list[str] = []
        self.exited_at: float | None = None
        self.started = threading.Event()
        self.proc = subprocess.Popen([INSTALLER, "apply", str(rc.inventory), "--state", str(rc.state),
                                      "--wait-timeout", "900"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.started.wait(120), "apply reported no step on cp1:\n" + "".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.match(r"^\s+\S+\s+cp1\s", line):
                self.started.set()
        self.proc.wait()
        self.exited_at = time.time()
        self.started.set()

    def result(self, timeout: float) -> tuple[int | None, str, float]:
        self.thread.join(timeout)
        return self.proc.poll(), "".join(self.lines), self.exited_at or float("inf")


def day2_with_cp1_down(rc, tmp: Path) -> list[tuple[tuple[str, ...], int, str]]:
    """(installer arguments, exit code, words the output must hold) with cp1 cut off."""
    inv, state = str(rc.inventory), ("--state", str(rc.state))
    unreachable = "cp1: cannot reach"
    return [
        (("node", "list", inv, *state), 0, "cp1"),
        (("etcd", "snapshot", "save", inv, str(tmp / "etcd.db")), 0, "snapshot from cp2"),
        (("plan", inv, *state, "--check"), 3, unreachable),
        (("verify", inv, *state), 3, unreachable),
        (("certs", "renew", inv, *state), 3, unreachable),
        (("etcd", "member", "remove", inv, "cp3", *state, "--yes"), 3, unreachable),
        (("node", "revoke", inv, "w2", *state, "--yes"), 3, unreachable),
        (("ca", "rotate", inv, *state, "--yes"), 3, unreachable),
        (("upgrade", inv, *state, "--plan"), 4, unreachable),
        (("reset", inv, *state, "--yes"), 2, "nothing was done on any host (--ignore-unreachable resets the others)"),
    ]


@pytest.mark.quiet(LAB)
def test_losing_a_control_host_keeps_nodes_ready_and_workloads_scheduling(rc, tmp_path):
    cp1 = rc.lab.spec.host("cp1")
    web = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "ha-web"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "ha-web"}},
                    "template": {"metadata": {"labels": {"app": "ha-web"}},
                                 "spec": {"terminationGracePeriodSeconds": 1,
                                          "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                                          "command": ["sleep", "100000"]}]}}}}
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(web))
    _start_probes(rc)
    time.sleep(3)
    kubeconfig = tmp_path / "ha.kubeconfig"
    # an apply is under way when cp1 goes (cut once its facts are read): it has work left on
    # cp1 (a helper binary to put back, which restarts nothing), so it must reach cp1 again
    rc.ssh("cp1", "rm /usr/local/bin/etcdctl")
    running = RunningApply(rc)
    cut_at = time.time()
    net.cut_link(cp1)
    figures: dict = {}
    try:
        # kubectl pointed at another control host (the admin kubeconfig, its server cp2) while
        # the apply still holds the state. An apiserver's etcd client may still hold its
        # connection to cp1's member: a request it sends there fails until gRPC gives that
        # connection up; a user tries again
        to_cp2 = tmp_path / "cp2.kubeconfig"
        to_cp2.write_text(rc.kubeconfig.read_text().replace(f"https://{rc.address('cp1')}:6443",
                                                            f"https://{rc.address('cp2')}:6443"))
        scaled = wait_for("the scale through cp2", lambda: rc.kubectl(
            "--kubeconfig", str(to_cp2), "scale", "deployment", "ha-web", "--replicas=4", check=False,
            timeout=60).returncode == 0 and time.time(), timeout=90, interval=1)
        figures["the scale answered after the cut (s)"] = round(scaled - cut_at, 1)
        # the apply under way fails naming cp1, within the SSH bound
        code, out, failed_at = running.result(timeout=120)
        figures["apply under way: exit, failed after the cut (s)"] = (code, round(failed_at - cut_at, 1))
        assert code not in (0, None) and "cp1" in out, out[-2000:]
        assert failed_at - cut_at <= SSH_BOUND, (failed_at - cut_at, out[-2000:])
        print("\nthe apply under way at the cut ended with:\n" + "".join(out.splitlines(True)[-6:]))
        # the user's kubeconfig, written while cp1 is lost, names an apiserver that answers
        out = run_installer("kubeconfig", str(rc.inventory), "--state", str(rc.state), "-o", str(kubeconfig),
                            "--force").stdout
        assert f"server https://{rc.address('cp2')}:6443; cp1: no answer from the apiserver" in out, out
        not_ready, running_at = [], None
        while time.time() < cut_at + OUTAGE:
            ready = ready_nodes(rc, kubeconfig)
            if ready and not all(ready.values()):
                not_ready.append((round(time.time() - cut_at), ready))
            if running_at is None:
                pods = json.loads(rc.kubectl("--kubeconfig", str(kubeconfig), "get", "pods", "-l", "app=ha-web",
                                             "-o", "json", timeout=30).stdout)["items"]
                if sum(p["status"].get("phase") == "Running" for p in pods) == 4:
                    running_at = time.time() - cut_at
            time.sleep(5)
        assert not not_ready, f"Nodes NotReady while cp1 was cut: {not_ready}"
        assert running_at is not None, "the 4 replicas scaled during the outage were not Running"
        figures["4 replicas Running after the cut (s)"] = round(running_at, 1)
        # day 2 with cp1 down: what works through the other control hosts works; what needs every
        # host stops before any change, naming cp1 (the state's PKI untouched)
        pki = sorted((p.name, p.read_bytes()) for p in (rc.state / "pki").rglob("*") if p.is_file())
        for args, code, said in day2_with_cp1_down(rc, tmp_path):
            got = run_installer(*args, check_rc=None, timeout=300)
            figures[f"{' '.join(args[:3])}: exit"] = got.returncode
            assert got.returncode == code and said in got.stdout + got.stderr, (args, got.stdout[-800:],
                                                                                got.stderr[-800:])
        assert sorted((p.name, p.read_bytes()) for p in (rc.state / "pki").rglob("*") if p.is_file()) == pki
        for w in rc.workers:
            figures[f"{w}: cp1 marked DOWN after the cut (s)"] = hostprobes.marked(rc.lab.ssh_config, w, "cp1", cut_at,
                                                                                   "DOWN")
            assert balancer_view(rc, w)["cp1"] == "DOWN"
    finally:
        net.restore_link(cp1)
    back_at = time.time()
    for w in rc.workers:
        wait_for(f"{w}'s balancer uses cp1 again", lambda: balancer_view(rc, w).get("cp1") == "UP", timeout=60,
                 interval=0.5)
        figures[f"{w}: cp1 marked UP after the restore (s)"] = hostprobes.marked(rc.lab.ssh_config, w, "cp1",
                                                                                  back_at, "UP")
    for w in rc.workers:
        for name, _ in hostprobes.api(w):
            rows = hostprobes.rows(rc.lab.ssh_config, w, f"hp-probe-{name}", cut_at)
            fails = [r for r in rows if not r.ok]
            figures[f"{w} {name}: requests / failed / longest (s)"] = hostprobes.summary(rows)
            # a request caught on a connection to cp1 at the cut may fail once; never more
            assert len(fails) <= 1, (w, name, fails[:5])
    print("\nlosing cp1:\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))
    # the next run converges (etcdctl back on cp1) and leaves no lock behind
    out = run_installer("apply", str(rc.inventory), "--state", str(rc.state), "--wait-timeout", "900").stdout
    print(out[-300:])
    assert rc.ssh("cp1", "test -x /usr/local/bin/etcdctl").returncode == 0
    for c in rc.controls:
        assert rc.ssh(c, f"test -e {LOCK}").returncode == 1, c
    rc.kubectl("delete", "deployment", "ha-web")
