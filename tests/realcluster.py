"""One real cluster on the local lab, shared by every test that needs real Kubernetes.

The hosts: ``cp1``, ``cp2``, ``cp3`` (three, so that etcd membership and every apiserver's view
of a revocation are real), ``w1`` and ``w2``, all systemd-nspawn machines; the workers with what a
kubelet and runc need of nspawn (``installer.lab.nspawn.POD_HOST_ARGS``: writable cgroup
controllers of their own, /dev/kmsg, the keyring syscalls) and the lab inventory's
``spec.workerHosts`` (cgroup v1, in a container). The binaries: the
real Kubernetes components, etcd 3.6, containerd 2.x, runc and the CNI plugins, built from their
Go modules (tests/builtfixtures.py), and the image archives pause, CoreDNS and busybox, imported
from the artifacts (no registry). ``installer apply`` runs whole: no phase skipped.

What only the lab needs is in the lab's inventory, never a product default: AlwaysPullImages
off (``installer lab up``), and ``upstreamDNS`` pointing at a small DNS server the fixture runs
on cp1, because the lab has no resolver: it answers ``*.example.`` with TEST-NET addresses and
logs every question, so a test can see CoreDNS forward a name outside the cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from installer.lab import lab as lab_mod

from .labfixtures import Lab, start_lab, wait_for

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = str(ROOT / ".venv" / "bin" / "installer")
NAME, SUBNET = "real", "10.213.230.0/24"
BUSYBOX = "localhost/hiddenplane/busybox:lab"
OUTSIDE = {"outside.example.": "192.0.2.53"}
DNS_LOG = "/var/log/hp-test-dns.log"
# lab hosts that are not the cluster's: the workers of two hosted tenants whose control planes
# run in this cluster (tests/test_real_hosted.py); on the same lab network, as they must reach it
# the hosted tenants' workers (tests/test_real_hosted.py): w3 and w4 the first tenant's, w5 the
# second's, w6 the neighbour's, which only its control plane is applied for (never joined)
TENANT_WORKERS = ("w3", "w4", "w5", "w6")
WAIT = "900"          # seconds: a bound, not a wait (a loaded 2-core machine starts kubelets slowly)

# A DNS server for the lab's upstream (test scaffolding on cp1): A records for OUTSIDE,
# NXDOMAIN for everything else (CoreDNS's loop probe among them), each question logged.
DNS_SERVER = r'''
import socket, struct, sys
ANSWERS = %(answers)r
log = open(%(log)r, "a", buffering=1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((%(addr)r, 53))
while True:
    q, peer = s.recvfrom(512)
    i, labels = 12, []
    while q[i]:
        labels.append(q[i + 1:i + 1 + q[i]].decode()); i += 1 + q[i]
    name, qtype = ".".join(labels).lower() + ".", struct.unpack("!H", q[i + 1:i + 3])[0]
    log.write(f"{peer[0]} {name} {qtype}\n")
    head, question = q[:2], q[12:i + 5]
    ip = ANSWERS.get(name) if qtype == 1 else None
    if ip:
        answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(ip)
        s.sendto(head + struct.pack("!HHHHH", 0x8180, 1, 1, 0, 0) + question + answer, peer)
    else:
        s.sendto(head + struct.pack("!HHHHH", 0x8183, 1, 0, 0, 0) + question, peer)
'''


# A workload that survives drains: two replicas (one per worker), a NodePort, a PodDisruptionBudget.
# Its preStop sleep keeps a replica serving while its endpoint leaves every kube-proxy's rules (the
# EndpointSlice update and each kube-proxy's resync take about a second); without it, busybox's
# httpd exits on SIGTERM while some rules still send to it and a probe sees "connection refused"
# (0-2 per upgrade before; the upgrade tests now assert none). A workload's own duty, as for any
# rolling change of Kubernetes: https://kubernetes.io/docs/concepts/containers/container-lifecycle-hooks/
ECHO_STOP_DELAY = 5
# a request to it with no answer after this long fails (the upgrade tests' workload probes). 1 s
# before: CI of 26ac1d1 saw two answers slower than that (one per worker, a second apart) right
# after a tenant worker's kubelet and kube-proxy restarted, on a 2-core machine running both test
# processes; none was refused. The slowest answer is printed
ECHO_TIMEOUT = 5


def echo_workload(node_port: int, namespace: str = "default") -> list[dict]:
    labels = {"app": "echo"}
    meta = {"name": "echo", "namespace": namespace}
    pod = {"terminationGracePeriodSeconds": ECHO_STOP_DELAY + 10,
           "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
               {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}},
           "containers": [{"name": "httpd", "image": BUSYBOX, "imagePullPolicy": "Never",
                           "command": ["sh", "-c", "mkdir -p /www && hostname > /www/index.html && "
                                                   "exec httpd -f -p 8080 -h /www"],
                           "lifecycle": {"preStop": {"sleep": {"seconds": ECHO_STOP_DELAY}}},
                           "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}]}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
             "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta,
             "spec": {"type": "NodePort", "selector": labels,
                      "ports": [{"port": 80, "targetPort": 8080, "nodePort": node_port}]}},
            {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
             "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}}]


def run_installer(*args: str, check_rc: int | None = 0, timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)
    if check_rc is not None:
        assert proc.returncode == check_rc, \
            f"rc={proc.returncode}\nstdout:{proc.stdout[-4000:]}\nstderr:{proc.stderr[-4000:]}"
    return proc


@dataclass
class RealCluster:
    lab: Lab
    inventory: Path
    state: Path
    kubeconfig: Path
    kubectl_bin: str
    apply_report: dict
    apply_seconds: float

    def write_inventory(self, name: str, drop: tuple[str, ...] = ()) -> Path:
        """The cluster's inventory without the hosts ``drop`` (what an operator edits)."""
        doc = yaml.safe_load(self.inventory.read_text())
        doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] not in drop]
        path = self.inventory.with_name(name)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def write_kubeconfig(self) -> None:
        """The admin kubeconfig again, from the state (after a renewal or a CA rotation)."""
        run_installer("kubeconfig", str(self.inventory), "--state", str(self.state), "-o", str(self.kubeconfig),
                      "--force")

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
                ) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                              text=True, timeout=timeout, input=stdin)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: rc={proc.returncode}\n{proc.stderr[-2000:]}"
        return proc

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def ssh(self, host: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-F", str(self.lab.ssh_config), host, command], capture_output=True,
                              text=True, timeout=timeout)

    @property
    def controls(self) -> list[str]:
        return [h.name for h in self.lab.spec.hosts if h.role == "control"]

    @property
    def workers(self) -> list[str]:
        """The cluster's workers (the lab's but the hosted tenant's, TENANT_WORKERS)."""
        return [h.name for h in self.lab.spec.hosts if h.role == "worker" and h.name not in TENANT_WORKERS]

    def address(self, host: str) -> str:
        return self.lab.spec.host(host).address

    def run_pod(self, name: str, node: str, command: str) -> dict:
        """A busybox pod pinned to ``node`` running ``command``; returns it once Running."""
        spec = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
                "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                         "command": ["sh", "-c", command]}]}}
        self.kubectl("apply", "-f", "-", stdin=json.dumps(spec))
        return wait_for(f"pod {name} Running on {node}",
                        lambda: (p := self.get("pod", name))["status"].get("phase") == "Running"
                        and p["status"].get("podIP") and p, timeout=300)


def start_upstream_dns(cluster_lab: Lab, address: str) -> None:
    script = DNS_SERVER % {"answers": OUTSIDE, "log": DNS_LOG, "addr": address}
    subprocess.run(["ssh", "-F", str(cluster_lab.ssh_config), "cp1",
                    "cat > /root/hp-test-dns.py && systemctl stop hp-test-dns 2>/dev/null; "
                    "systemd-run --unit=hp-test-dns /usr/bin/python3 /root/hp-test-dns.py"],
                   input=script, text=True, check=True, capture_output=True, timeout=60)


def converge(lab: Lab, inventory: Path, state: Path, kubeconfig: Path, kubectl: str, label: str) -> RealCluster:
    """The first ``installer apply`` of a lab's cluster, timed, and its admin kubeconfig."""
    start = time.monotonic()
    proc = run_installer("apply", str(inventory), "--state", str(state), "--output", "json", "--wait-timeout", WAIT)
    seconds = time.monotonic() - start
    run_installer("kubeconfig", str(inventory), "--state", str(state), "-o", str(kubeconfig))
    print(f"\n{label}: apply {seconds:.0f} s")
    return RealCluster(lab, inventory, state, kubeconfig, kubectl, json.loads(proc.stdout), seconds)


REUSE = "HIDDENPLANE_REAL_REUSE"       # debugging: a kept lab's directory (with HIDDENPLANE_KEEP_REAL_LAB)


def _reuse(tmp: Path, kubectl: str) -> RealCluster:
    """The cluster of an earlier run kept up (``HIDDENPLANE_KEEP_REAL_LAB``): its inventory,
    state and kubeconfig in ``tmp``; a no-op apply stands for the cold one."""
    from .labfixtures import write_ssh_config
    paths = lab_mod.LabPaths.of(NAME)
    spec = lab_mod.load_spec(paths)
    lab = Lab(spec, paths, tmp / f"{NAME}.inventory.yaml", write_ssh_config(paths, spec, tmp / "ssh_config"))
    inventory, state = tmp / "real.inventory.yaml", tmp / "state"
    proc = run_installer("apply", str(inventory), "--state", str(state), "--output", "json", "--wait-timeout", WAIT)
    return RealCluster(lab, inventory, state, tmp / "admin.kubeconfig", kubectl, json.loads(proc.stdout), 0.0)


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory, built_artifacts, kubectl) -> RealCluster:
    if os.environ.get(REUSE):
        yield _reuse(Path(os.environ[REUSE]), kubectl)
        return
    tmp = tmp_path_factory.mktemp("real")
    lab = start_lab(NAME, SUBNET, tmp, controls=3, workers=2 + len(TENANT_WORKERS), images=True,
                    hosting=True)
    try:
        assert [h.kind for h in lab.spec.hosts] == ["nspawn"] * (5 + len(TENANT_WORKERS))
        cp1 = lab.spec.host("cp1").address
        doc = yaml.safe_load(lab.inventory.read_text())
        doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] not in TENANT_WORKERS]
        doc["spec"]["network"] = {**doc["spec"].get("network", {}), "upstreamDNS": [cp1]}
        assert doc["spec"]["network"]["policy"] == "kube-network-policies"      # (lab up --hosting)
        # no endpoint (as `installer lab up` writes it): with 3 control hosts every worker
        # balances over the 3 apiservers (spec.apiServer.balancer auto; tests/test_real_ha.py)
        assert "endpoint" not in doc["spec"]["apiServer"]
        inventory = tmp / "real.inventory.yaml"
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        start_upstream_dns(lab, cp1)
        state = tmp / "state"
        yield converge(lab, inventory, state, tmp / "admin.kubeconfig", kubectl, "real cluster")
    finally:
        if not os.environ.get("HIDDENPLANE_KEEP_REAL_LAB"):
            lab_mod.down(NAME, log=lambda *_: None)
