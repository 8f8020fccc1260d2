"""HA without a load balancer, on the shared real lab (3 control hosts, 2 workers: the local
API balancer is on, spec.apiServer.balancer auto): every worker's balancer lists every
apiserver; the kubernetes Service's endpoints are the balancer address; and with cp1 cut off
the network (its bridge port down: packets dropped, as a pulled cable) the Nodes stay Ready, a
Deployment scaled during the outage gets its pods Running, the installer works through cp2, and
once cp1 is back the balancers use it again and `installer apply` converges.

Figures printed (the README's HA section quotes a run): per worker, requests that failed through
its balancer (127.0.0.1) and through the kubernetes Service (the pod path, DNAT-ed to the balancer
address), the longest request, and how long after the cut and after the restore each balancer
marked cp1 down and up. Runs before tests/test_real_day2.py, which expects the cluster whole.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from installer.lab import net

from .realcluster import BUSYBOX, run_installer, wait_for

UNIT = "hiddenplane-api-balancer.service"
PROBE = Path(__file__).with_name("scripts") / "api_probe.py"
SOCKET = "/run/hiddenplane-api-balancer/admin.sock"
OUTAGE = 150.0        # seconds cp1 stays cut (the bound)


@pytest.fixture(scope="module")
def rc(real_cluster):
    return real_cluster


def balancer_view(rc, worker: str) -> dict[str, str]:
    """server -> UP/DOWN/... as the worker's balancer sees it (its runtime API, root only)."""
    script = ("import socket; s = socket.socket(socket.AF_UNIX); s.connect(%r); "
              "s.sendall(b'show servers state apiservers\\n'); print(s.makefile().read())" % SOCKET)
    out = rc.ssh(worker, f"python3 -c {shlex.quote(script)}").stdout
    states = {"0": "DOWN", "1": "STARTING", "2": "UP", "3": "STOPPING"}
    return {f[3]: states.get(f[5], f[5]) for f in (line.split() for line in out.splitlines())
            if len(f) > 5 and f[1] == "apiservers"}


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
        copied = subprocess.run(["ssh", "-F", str(rc.lab.ssh_config), w, "cat > /root/api_probe.py"],
                                input=PROBE.read_text(), text=True, capture_output=True, timeout=30)
        assert copied.returncode == 0, copied.stderr
        for name, url in (("lb", "https://127.0.0.1:6443"), ("svc", "https://10.96.0.1:443")):
            r = rc.ssh(w, f"systemctl stop hp-probe-{name} 2>/dev/null; systemctl reset-failed hp-probe-{name} "
                          f"2>/dev/null; systemd-run --unit=hp-probe-{name} /usr/bin/python3 /root/api_probe.py "
                          f"{url} /etc/kubernetes/pki/ca.crt 0.25 10")
            assert r.returncode == 0, r.stderr


def _probe_lines(rc, worker: str, name: str, since: float) -> list[tuple[float, bool, float, str]]:
    out = rc.ssh(worker, f"systemctl stop hp-probe-{name}; journalctl -u hp-probe-{name} -o cat --no-pager").stdout
    rows = []
    for line in out.splitlines():
        f = line.split(" ", 3)
        if len(f) >= 3 and f[1] in ("ok", "fail"):
            rows.append((float(f[0]), f[1] == "ok", float(f[2]), f[3] if len(f) > 3 else ""))
    return [r for r in rows if r[0] >= since]


def _marked(rc, worker: str, since: float, state: str) -> float | None:
    """Seconds from ``since`` (unix time) to the balancer's log line marking cp1 ``state``."""
    out = rc.ssh(worker, f"journalctl -u {UNIT} -o short-unix --no-pager --since=@{int(since) - 1}").stdout
    for line in out.splitlines():
        if f"apiservers/cp1 is {state}" in line:
            stamp = float(line.split()[0])
            if stamp >= since:
                return stamp - since
    return None


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
    cut_at = time.time()
    net.cut_link(cp1)
    figures: dict = {}
    try:
        # the user's kubeconfig, written while cp1 is lost, names an apiserver that answers
        out = run_installer("kubeconfig", str(rc.inventory), "--state", str(rc.state), "-o", str(kubeconfig),
                            "--force").stdout
        assert f"server https://{rc.address('cp2')}:6443; cp1: no answer from the apiserver" in out, out
        # an apiserver's etcd client may still hold its connection to cp1's member: a request
        # it sends there fails until gRPC gives that connection up; a user tries again
        scaled = wait_for("the scale through cp2 or cp3", lambda: rc.kubectl(
            "--kubeconfig", str(kubeconfig), "scale", "deployment", "ha-web", "--replicas=4", check=False,
            timeout=60).returncode == 0 and time.time(), timeout=90, interval=1)
        figures["the scale answered after the cut (s)"] = round(scaled - cut_at, 1)
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
        # day 2 through the other control hosts: node list reads the cluster; plan --check
        # needs every host and names the one it cannot reach
        listed = run_installer("node", "list", str(rc.inventory), "--state", str(rc.state), check_rc=None)
        figures["node list exit"] = listed.returncode
        assert listed.returncode == 0, listed.stderr
        check = run_installer("plan", str(rc.inventory), "--state", str(rc.state), "--check", check_rc=None,
                              timeout=300)
        figures["plan --check exit"] = check.returncode
        assert "cp1" in check.stdout + check.stderr
        for w in rc.workers:
            figures[f"{w}: cp1 marked DOWN after the cut (s)"] = _marked(rc, w, cut_at, "DOWN")
            assert balancer_view(rc, w)["cp1"] == "DOWN"
    finally:
        net.restore_link(cp1)
    back_at = time.time()
    for w in rc.workers:
        wait_for(f"{w}'s balancer uses cp1 again", lambda: balancer_view(rc, w).get("cp1") == "UP", timeout=60,
                 interval=0.5)
        figures[f"{w}: cp1 marked UP after the restore (s)"] = _marked(rc, w, back_at, "UP")
    for w in rc.workers:
        for name in ("lb", "svc"):
            rows = _probe_lines(rc, w, name, cut_at)
            fails = [r for r in rows if not r[1]]
            figures[f"{w} {name}: requests / failed / longest (s)"] = (len(rows), len(fails),
                                                                       max(r[2] for r in rows))
            # a request caught on a connection to cp1 at the cut may fail once; never more
            assert len(fails) <= 1, (w, name, fails[:5])
    print("\nlosing cp1:\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))
    run_installer("apply", str(rc.inventory), "--state", str(rc.state), "--wait-timeout", "900")
    rc.kubectl("delete", "deployment", "ha-web")
