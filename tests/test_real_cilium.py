"""``cni: cilium`` on the real lab, as the seed runs it (docs/hosts.md "Cilium"): on demand.

``HIDDENPLANE_CILIUM_LAB=1 scripts/test tests/test_real_cilium.py``. Its own lab (``installer
lab up --cni cilium``: 1 control host, 2 nspawn workers that may load BPF programs), Cilium's
images, chart and helm built from their modules (``scripts/build-kubernetes default DIR --only
cilium``, tools/kubebuild/cilium.py), the seed's values; ``installer apply`` runs whole. Then, in
order: Cilium Ready on both workers; pod to pod across workers, a Service through kube-proxy,
DNS through CoreDNS (and past it, to the lab's upstream); the hidden control plane reaching pods
only through konnectivity (the control host has no route to them); upstream's CI conformance
selection; a deny NetworkPolicy enforced by Cilium; a second apply with nothing changed (no new
Helm revision); native routing; a revoked node's agent token refused; reset leaving nothing of
Cilium on the hosts.

Not in CI: the Cilium build alone is about 20 minutes cold on 2 cores (docs/testing.md has the
last run's date, commit and figures).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from installer.core.artifacts import read_sums
from installer.lab import lab as lab_mod

from .builtfixtures import ROOT, UPGRADE_TO, _linked_dir, build, default_dir, e2e_dir, upgrade_artifacts_dir
from .labfixtures import Lab, require_lab_tools, wait_for, write_ssh_config
from .realcluster import OUTSIDE, WAIT, RealCluster, converge, run_installer, start_upstream_dns

ON_DEMAND = "HIDDENPLANE_CILIUM_LAB"
pytestmark = [pytest.mark.lab, pytest.mark.real,
              pytest.mark.skipif(os.environ.get(ON_DEMAND) != "1",
                                 reason=f"on demand: {ON_DEMAND}=1 (builds Cilium, boots its own lab)")]

NAME, SUBNET = "cil", "10.213.245.0/24"
sys.path.insert(0, str(ROOT / "tools"))


def cilium_artifacts() -> Path:
    """The default artifacts plus Cilium's images, chart and helm (from the cache once built)."""
    dest = default_dir().with_name(f"artifacts-cilium-{default_dir().name.removeprefix('artifacts-')}")
    build(dest)
    build(dest, "default", "--only", "cilium")
    return dest


def with_e2e(artifacts: Path, inventory: Path) -> None:
    """The lab's artifacts plus image-e2e.tar (the conformance tests' images), imported by apply."""
    e2e = e2e_dir()
    sums = {**read_sums(artifacts), "image-e2e.tar": read_sums(e2e)["image-e2e.tar"]}
    files = {n: (e2e if n == "image-e2e.tar" else artifacts) / n for n in sums}
    dest = _linked_dir(artifacts.with_name(artifacts.name + "-e2e"), files, sums)
    doc = yaml.safe_load(inventory.read_text())
    doc["spec"]["artifacts"]["path"] = str(dest)
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))


REUSE = "HIDDENPLANE_CILIUM_REUSE"     # debugging: the directory of a run kept up (HIDDENPLANE_KEEP_CILIUM_LAB)


def _reuse(tmp: Path, kubectl: str) -> RealCluster:
    paths = lab_mod.LabPaths.of(NAME)
    spec = lab_mod.load_spec(paths)
    lab = Lab(spec, paths, tmp / "cil.inventory.yaml", write_ssh_config(paths, spec, tmp / "ssh_config"))
    return RealCluster(lab, lab.inventory, tmp / "state", tmp / "admin.kubeconfig", kubectl, {}, 0.0)


@pytest.fixture(scope="module")
def cil(tmp_path_factory, kubectl):
    require_lab_tools()
    if os.environ.get(REUSE):
        yield _reuse(Path(os.environ[REUSE]), kubectl)
        return
    tmp = tmp_path_factory.mktemp("cilium")
    arts = cilium_artifacts()
    lab_mod.down(NAME, log=lambda *_: None)
    inventory = lab_mod.up(NAME, 1, 2, 0, SUBNET, tmp / "cil.inventory.yaml", log=lambda *_: None, artifacts=arts,
                           cni="cilium")
    try:
        paths = lab_mod.LabPaths.of(NAME)
        spec = lab_mod.load_spec(paths)
        lab = Lab(spec, paths, inventory, write_ssh_config(paths, spec, tmp / "ssh_config"))
        cp1 = spec.host("cp1").address
        doc = yaml.safe_load(inventory.read_text())
        assert doc["spec"]["network"]["cni"] == "cilium"
        doc["spec"]["network"]["upstreamDNS"] = [cp1]      # the lab has no resolver: ours on cp1
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        with_e2e(paths.artifacts, inventory)
        start_upstream_dns(lab, cp1)
        yield converge(lab, inventory, tmp / "state", tmp / "admin.kubeconfig", kubectl, "cilium cluster")
    finally:
        if not os.environ.get("HIDDENPLANE_KEEP_CILIUM_LAB"):
            lab_mod.down(NAME, log=lambda *_: None)


def agent_pods(c: RealCluster) -> dict[str, dict]:
    pods = c.get("pods", "-n", "kube-system", "-l", "k8s-app=cilium")["items"]
    return {p["spec"]["nodeName"]: p for p in pods}


def agents_ready(c: RealCluster) -> bool:
    ds = c.get("daemonset", "-n", "kube-system", "cilium")
    st = ds["status"]
    return (st.get("numberReady") == len(c.workers) and st.get("updatedNumberScheduled") == len(c.workers)
            and st.get("observedGeneration") == ds["metadata"]["generation"])


def cilium_status(c: RealCluster, node: str) -> str:
    pod = agent_pods(c)[node]["metadata"]["name"]
    out = c.kubectl("exec", "-n", "kube-system", pod, "-c", "cilium-agent", "--", "cilium-dbg", "status",
                    timeout=60).stdout
    return "\n".join(" ".join(line.split()) for line in out.splitlines())       # one space between words


def fetch(c: RealCluster, pod: str, ip: str, port: int = 8080, timeout: int = 5) -> str:
    """GET / from inside ``pod`` with nc (busybox's static wget crashes resolving through glibc's
    NSS, tests/test_real_cluster.py): the body, or "" when nothing answered."""
    got = c.kubectl("exec", pod, "--", "sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w {timeout} {ip} {port}",
                    check=False, timeout=timeout + 30)
    return got.stdout


def resolve(c: RealCluster, pod: str, name: str) -> list[str]:
    """The addresses busybox's nslookup gets for ``name`` from the pod's resolver (CoreDNS)."""
    out = c.kubectl("exec", pod, "--", "nslookup", name, check=False).stdout
    answers = out.split("Name:", 1)[1] if "Name:" in out else ""
    return [w for line in answers.splitlines() if line.strip().startswith("Address") for w in line.split()[1:]
            if w.count(".") == 3]


# --- Cilium up, the pod network ------------------------------------------------------------------

def test_cilium_runs_on_every_worker_and_only_workers_are_nodes(cil):
    nodes = cil.get("nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["w1", "w2"]
    wait_for("cilium Ready on both workers", lambda: agents_ready(cil), timeout=600)
    wait_for("the operator available", lambda: cil.get("deployment", "-n", "kube-system", "cilium-operator")
             ["status"].get("availableReplicas", 0) >= 1, timeout=300)
    for n in nodes:
        ready = next(x for x in n["status"]["conditions"] if x["type"] == "Ready")
        assert ready["status"] == "True", n["metadata"]["name"]
    for node in cil.workers:
        # through konnectivity: cp1 runs no Cilium and has no route into the pod network
        status = cilium_status(cil, node)
        print(f"\n{node}:\n{status}")
        assert "KubeProxyReplacement: False" in status and "Cilium: Ok 1.20.2" in status
        assert "Routing: Network: Tunnel [vxlan]" in status
        assert "Masquerading: IPTables" in status
    # the control host runs none of it
    assert cil.ssh("cp1", "ls /sys/class/net").stdout.split().count("cilium_host") == 0


def web_and_client(c: RealCluster, text: str) -> str:
    """A web server pod on w1 serving ``text`` and a client pod on w2 (new ones); the server's IP."""
    c.kubectl("delete", "pod", "web", "client", "--ignore-not-found", "--wait=true", timeout=180)
    server = c.run_pod("web", "w1", f"echo {text} > /tmp/index.html; httpd -f -p 8080 -h /tmp")
    c.run_pod("client", "w2", "sleep 3600")
    return server["status"]["podIP"]


def test_pods_services_and_dns_across_workers(cil):
    ip = web_and_client(cil, "hello-from-w1")
    assert "hello-from-w1" in fetch(cil, "client", ip)
    cil.kubectl("expose", "pod", "web", "--port", "80", "--target-port", "8080", "--name", "web")
    svc = cil.get("service", "web")["spec"]["clusterIP"]
    # through kube-proxy's rules (Cilium replaces none of them here)
    assert "hello-from-w1" in wait_for("the Service from w2", lambda: fetch(cil, "client", svc, 80), timeout=60)
    # DNS through CoreDNS: the Service by its names, and a name outside the cluster from the
    # lab's upstream (no loop)
    for name in ("web.default.svc.cluster.local", "web"):
        assert resolve(cil, "client", name) == [svc], name
    outside, address = next(iter(OUTSIDE.items()))
    assert resolve(cil, "client", outside.rstrip(".")) == [address]


def test_the_control_plane_reaches_pods_only_through_konnectivity(cil):
    ip = cil.get("pod", "web")["status"]["podIP"]
    # no route from the control host: its own connection times out
    direct = cil.ssh("cp1", f"timeout 5 bash -c 'exec 3<>/dev/tcp/{ip}/8080' && echo open || echo closed")
    assert direct.stdout.strip() == "closed", direct
    # yet logs, exec, port-forward and the apiserver's proxy work (the apiserver dials through
    # the konnectivity server on cp1 and the agents on the workers)
    assert "hello-from-w1" in cil.kubectl("get", "--raw", "/api/v1/namespaces/default/pods/web:8080/proxy/").stdout
    assert cil.kubectl("exec", "web", "--", "cat", "/tmp/index.html").stdout.strip() == "hello-from-w1"
    cil.kubectl("logs", "-n", "kube-system", "ds/cilium", "-c", "cilium-agent", "--tail", "1")
    pf = subprocess.Popen([cil.kubectl_bin, "--kubeconfig", str(cil.kubeconfig), "port-forward", "pod/web",
                           "18080:8080"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = wait_for("port-forward", lambda: _get("http://127.0.0.1:18080/"), timeout=60)
        assert "hello-from-w1" in body
    finally:
        pf.terminate()
        pf.wait(10)
    server = cil.ssh("cp1", "systemctl is-active konnectivity-server").stdout.strip()
    assert server == "active"


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except (OSError, urllib.error.URLError):
        return None


def test_the_ci_conformance_selection_passes_on_cilium(cil, tmp_path):
    import conformance  # tools/conformance.py
    images = [line.split()[0] for line in cil.ssh("w1", "ctr -n k8s.io images ls -q").stdout.splitlines()]
    assert any("/e2e-test-images/agnhost:" in i for i in images), images
    report = tmp_path / "conformance"
    code = conformance.main(["--kubeconfig", str(cil.kubeconfig), "--selection", "ci", "--e2e", str(e2e_dir()),
                             "--report-dir", str(report), "--kubectl", cil.kubectl_bin, "--nodes", "2"])
    summary = conformance.read_junit(report / "junit.xml")
    print(summary.line("ci") + "\n" + "\n".join(f"FAILED {n}: {w}" for n, w in summary.failed))
    assert code == 0 and not summary.failed, summary.failed
    assert not summary.skipped, summary.skipped


def test_a_deny_policy_is_enforced_by_cilium(cil):
    ip = cil.get("pod", "web")["status"]["podIP"]
    assert "hello-from-w1" in fetch(cil, "client", ip)
    deny = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-web", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"], "ingress": []}}
    cil.kubectl("apply", "-f", "-", stdin=json.dumps(deny))
    try:
        wait_for("the policy denies", lambda: fetch(cil, "client", ip, timeout=3) == "", timeout=60)
        # and keeps denying (not a blip), by ClusterIP too
        svc = cil.get("service", "web")["spec"]["clusterIP"]
        for _ in range(3):
            assert fetch(cil, "client", ip, timeout=3) == ""
            assert fetch(cil, "client", svc, 80, timeout=3) == ""
        # what Cilium says it did: the drops, by the policy
        metrics = cil.kubectl("exec", "-n", "kube-system", agent_pods(cil)["w1"]["metadata"]["name"], "-c",
                              "cilium-agent", "--", "cilium-dbg", "metrics", "list").stdout
        drops = [line for line in metrics.splitlines() if line.startswith("cilium_drop_count_total")]
        assert any("reason=Policy denied" in line for line in drops), drops
    finally:
        cil.kubectl("delete", "networkpolicy", "deny-web")
    wait_for("allowed again", lambda: "hello-from-w1" in fetch(cil, "client", ip), timeout=60)


def helm_revisions(c: RealCluster) -> int:
    secrets = c.get("secrets", "-n", "kube-system", "-l", "owner=helm,name=cilium")["items"]
    return len(secrets)


def test_a_second_apply_changes_nothing(cil):
    before = helm_revisions(cil)
    assert before >= 1
    proc = run_installer("apply", str(cil.inventory), "--state", str(cil.state), "--output", "json",
                         "--wait-timeout", WAIT)
    report = json.loads(proc.stdout)
    changed = [e for e in report["events"] if e["action"] == "changed"]
    assert changed == [], changed
    assert helm_revisions(cil) == before
    plan = run_installer("plan", str(cil.inventory), "--state", str(cil.state), "--check", check_rc=None)
    assert plan.returncode == 0, plan.stdout[-3000:]


# --- a worker removed and added back ------------------------------------------------------------

def test_a_worker_removed_and_added_back(cil):
    """`node remove` wipes Cilium's state off the host (the reset's teardown) and the operator
    forgets the node; `node add` brings it back with a working agent."""
    run_installer("node", "remove", str(cil.inventory), "w2", "--state", str(cil.state), "--yes")
    assert [n["metadata"]["name"] for n in cil.get("nodes")["items"]] == ["w1"]
    assert leftovers(cil, "w2") == {}
    wait_for("w2's CiliumNode collected", lambda: "w2" not in
             [n["metadata"]["name"] for n in cil.get("ciliumnodes")["items"]], timeout=300)
    run_installer("node", "add", str(cil.inventory), "w2", "--state", str(cil.state), "--wait-timeout", WAIT)
    wait_for("cilium Ready on both workers again", lambda: agents_ready(cil), timeout=600)
    ip = web_and_client(cil, "back")
    assert "back" in wait_for("pod to pod with w2 back", lambda: fetch(cil, "client", ip), timeout=120)


# --- an upgrade keeps Cilium ----------------------------------------------------------------------

def upgrade_inventory(c: RealCluster) -> Path:
    """The inventory at UPGRADE_TO: its artifacts the lab's, the binaries of UPGRADE_TO's build
    (the images stay those the workers hold: Cilium's do not depend on Kubernetes')."""
    doc = yaml.safe_load(c.inventory.read_text())
    here = Path(doc["spec"]["artifacts"]["path"])
    there = upgrade_artifacts_dir()
    ours, theirs = read_sums(here), read_sums(there)
    sums = {n: (theirs[n] if n in theirs and not n.endswith(".tar") else d) for n, d in ours.items()}
    files = {n: (there if n in theirs and not n.endswith(".tar") else here) / n for n in sums}
    doc["spec"]["artifacts"]["path"] = str(_linked_dir(here.with_name(here.name + "-" + UPGRADE_TO), files, sums))
    doc["spec"]["kubernetes"] = {"version": UPGRADE_TO}
    target = c.inventory.with_name("upgrade.inventory.yaml")
    target.write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


def test_an_upgrade_keeps_cilium(cil):
    before = helm_revisions(cil)
    target = upgrade_inventory(cil)
    start = time.monotonic()
    run_installer("upgrade", str(target), "--state", str(cil.state), "--wait-timeout", WAIT)
    print(f"\nupgrade to {UPGRADE_TO}: {time.monotonic() - start:.0f} s")
    nodes = cil.get("nodes")["items"]
    assert {n["status"]["nodeInfo"]["kubeletVersion"] for n in nodes} == {UPGRADE_TO}
    wait_for("cilium Ready after the upgrade", lambda: agents_ready(cil), timeout=600)
    assert helm_revisions(cil) == before            # Cilium itself untouched
    # the drains evicted the bare pods: new ones, on the upgraded kubelets
    ip = web_and_client(cil, "upgraded")
    svc = cil.get("service", "web")["spec"]["clusterIP"]
    assert "upgraded" in wait_for("pod to pod after the upgrade", lambda: fetch(cil, "client", ip), timeout=120)
    assert "upgraded" in fetch(cil, "client", svc, 80)
    assert "upgraded" in cil.kubectl("get", "--raw", "/api/v1/namespaces/default/pods/web:8080/proxy/").stdout
    cil.inventory.write_text(target.read_text())


# --- native routing -----------------------------------------------------------------------------

def test_native_routing(cil):
    doc = yaml.safe_load(cil.inventory.read_text())
    doc["spec"]["network"]["cilium"]["routingMode"] = "native"
    native = cil.inventory.with_name("native.inventory.yaml")
    native.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_installer("apply", str(native), "--state", str(cil.state), "--wait-timeout", WAIT)
    wait_for("cilium rolled out", lambda: agents_ready(cil), timeout=600)
    cil.kubectl("rollout", "status", "-n", "kube-system", "ds/cilium", "--timeout=600s", timeout=620)
    for node in cil.workers:
        assert "Routing: Network: Native" in cilium_status(cil, node)
    # a new pod on each side (the old ones' routes were the tunnel's)
    ip = web_and_client(cil, "native")
    assert "native" in wait_for("pod to pod, native", lambda: fetch(cil, "client", ip), timeout=60)
    # between workers, the pod's packets go as they are: w2 routes w1's pod range to w1
    w1 = cil.lab.spec.host("w1").address
    route = cil.ssh("w2", f"ip route get {ip}").stdout
    assert f"via {w1}" in route, route
    # the control host is no node: still no route in, konnectivity only
    direct = cil.ssh("cp1", f"timeout 5 bash -c 'exec 3<>/dev/tcp/{ip}/8080' && echo open || echo closed")
    assert direct.stdout.strip() == "closed"
    assert "native" in cil.kubectl("get", "--raw", "/api/v1/namespaces/default/pods/web:8080/proxy/").stdout
    cil.inventory.write_text(native.read_text())


# --- revocation, reset --------------------------------------------------------------------------

def _api_status(c: RealCluster, token: str, path: str) -> int:
    server = yaml.safe_load(c.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE        # the status code is what counts
    req = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_revoked_nodes_cilium_token_is_refused(cil):
    """Root on w2 takes the Cilium agent's ServiceAccount token from its pod's volume: it can
    write CiliumNodes and read every Secret Cilium may (cluster-wide rights). After `node
    revoke w2` the token is refused: it is bound to the agent's pod, which revoke deletes."""
    pod = agent_pods(cil)["w2"]
    uid = pod["metadata"]["uid"]
    found = cil.ssh("w2", f"cat /var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected/*/token")
    token = found.stdout.strip()
    assert token.count(".") == 2, found.stderr
    assert _api_status(cil, token, "/apis/cilium.io/v2/ciliumnodes") == 200
    run_installer("node", "revoke", str(cil.inventory), "w2", "--state", str(cil.state), "--yes")
    assert _api_status(cil, token, "/apis/cilium.io/v2/ciliumnodes") == 401
    # w1 keeps working
    wait_for("w1's agent Ready", lambda: agent_pods(cil)["w1"]["status"].get("phase") == "Running", timeout=60)


# what Cilium leaves on a host when nothing removes it
LEFTOVERS = {
    "links": "ip -o link show | grep -Eo ': (cilium_[a-z0-9_]+|lxc[0-9a-z_]+)' || true",
    "iptables": "for t in filter nat mangle raw; do iptables-save -t $t; ip6tables-save -t $t; done | "
                "grep -E '^:CILIUM|CILIUM_' || true",
    "files": "ls -d /etc/cni/net.d/*cilium* /opt/cni/bin/cilium-cni /etc/sysctl.d/*cilium* /run/cilium "
             "/var/run/cilium /sys/fs/bpf/cilium /sys/fs/bpf/tc 2>/dev/null || true",
    # (the BPF file system at /sys/fs/bpf is the host's: systemd's, here the lab's)
    "mounts": "grep ' /run/cilium' /proc/self/mountinfo || true",
    "routes": "for f in 4 6; do ip -$f route show proto kernel | grep ' via '; done || true",
    "ip rules": "ip rule show | grep -vE '^(0|32766|32767):' || true",
    "tc": "for d in $(ls /sys/class/net); do tc filter show dev $d ingress; tc filter show dev $d egress; "
          "done 2>/dev/null | grep -i bpf || true",
}


def leftovers(c: RealCluster, host: str) -> dict[str, str]:
    out = {}
    for what, cmd in LEFTOVERS.items():
        got = c.ssh(host, cmd).stdout.strip()
        if got:
            out[what] = got
    return out


def test_reset_leaves_no_cilium_state_on_the_hosts(cil):
    before = leftovers(cil, "w1")
    print(f"\nw1 before reset: {json.dumps(before, indent=1)}")
    assert "links" in before and "iptables" in before        # there was something to remove
    run_installer("reset", str(cil.inventory), "--state", str(cil.state), "--yes")
    # w2 was wiped by its revoke (the same teardown), w1 and cp1 by the reset
    for host in ("w1", "w2", "cp1"):
        assert leftovers(cil, host) == {}, host
