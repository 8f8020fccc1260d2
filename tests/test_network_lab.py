"""The pod network of ``cni: routes`` on real lab hosts (1 control + 2 workers, nspawn).

After `installer apply` (stand-ins for the Kubernetes binaries, so no cluster-bootstrap): each
host's routing table holds the routes the installer computed (proto 199), and "pods" made by
hand the way a runtime would (a network namespace, then the INSTALLED CNI plugins run in the
order of the INSTALLED conflist, prevResult passed along) get addresses from their worker's
slice, reach each other across workers without NAT, are reached by the hidden control host,
and reach a machine that has no route to pods (masqueraded). DEL releases the address.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading

import pytest
import yaml

from installer.core.network import CONFLIST, ROUTE_PROTO
from installer.lab import lab as lab_mod

from .labfixtures import install_standins, start_lab
from .test_apply_lab import apply_json

pytestmark = pytest.mark.lab

SUBNET = "10.213.220.0/24"
GATEWAY = "10.213.220.1"          # the lab bridge: the machine itself, which has no route to pods
PORT = 7777
HOST_LOCAL_DIR = "/var/lib/cni/networks/hiddenplane"

# Runs ON a worker: what a container runtime does for one pod sandbox. ADD runs every plugin
# of the installed conflist in order, each getting the previous result; DEL runs them in
# reverse with the ADD result. loopback is invoked on its own, as runtimes do.
CNI_EXEC = r'''
import json, os, subprocess, sys
cmd, netns = sys.argv[1], sys.argv[2]
cache = f"/run/hp-cni-{netns}.json"
conf = json.load(open("CONFLIST"))

def run(plugin, ifname, net):
    env = dict(os.environ, CNI_COMMAND=cmd, CNI_CONTAINERID=f"ctr-{netns}", CNI_NETNS=f"/run/netns/{netns}",
               CNI_IFNAME=ifname, CNI_PATH="/opt/cni/bin")
    r = subprocess.run(["/opt/cni/bin/" + plugin], input=json.dumps(net).encode(), env=env, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"{plugin} {cmd}: rc={r.returncode} {r.stdout.decode()} {r.stderr.decode()}")
    return json.loads(r.stdout) if r.stdout.strip() else None

lo = {"cniVersion": conf["cniVersion"], "name": "lo", "type": "loopback"}
plugins, prev = conf["plugins"], None
if cmd == "DEL":
    plugins, prev = plugins[::-1], json.load(open(cache))
for p in plugins:
    net = dict(p, cniVersion=conf["cniVersion"], name=conf["name"])
    if prev is not None:
        net["prevResult"] = prev
    out = run(p["type"], "eth0", net)
    if cmd == "ADD":
        prev = out
run("loopback", "lo", lo)
if cmd == "ADD":
    json.dump(prev, open(cache, "w"))
    print(json.dumps(prev))
'''.replace("CONFLIST", CONFLIST)

# Answers every connection with the address it came from, so the caller sees any NAT.
ECHO_PEER = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             f"s.bind(('0.0.0.0', {PORT})); s.listen()\n"
             "while True:\n    c, a = s.accept(); c.sendall(a[0].encode()); c.close()\n")


@pytest.fixture(scope="module")
def netlab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("netlab")
    lab = start_lab("net", SUBNET, tmp, controls=1, workers=2)
    install_standins(lab.paths.artifacts)
    lab.state = tmp / "state"
    lab.tmp = tmp
    lab.report = apply_json(lab.inventory, lab.state)
    lab.alloc = yaml.safe_load((lab.state / "network.yaml").read_text())["podCIDRs"]
    lab.addr = {h.name: h.address for h in lab.spec.hosts}
    for name in ("w1", "w2"):
        h = lab.host(name)
        h.check_output(f"cat > /root/cni-exec.py <<'EOF'\n{CNI_EXEC}\nEOF")
        h.check_output(f"cat > /root/echo-peer.py <<'EOF'\n{ECHO_PEER}EOF")
    yield lab
    lab_mod.down("net", log=lambda *_: None)


def our_routes(host) -> dict[str, str]:
    """dst -> via of the routes carrying our marker."""
    out = {}
    for line in host.check_output(f"ip -4 route show proto {ROUTE_PROTO}").splitlines():
        words = line.split()
        out[words[0]] = words[words.index("via") + 1]
    return out


def add_pod(host, name: str) -> str:
    host.check_output(f"ip netns add {name}")
    result = json.loads(host.check_output(f"python3 /root/cni-exec.py ADD {name}"))
    return result["ips"][0]["address"].split("/")[0]


def from_pod(host, pod: str, address: str) -> str:
    """Connect from ``pod`` to ``address``:PORT; what the other end saw as our address."""
    return host.check_output(
        f"ip netns exec {pod} python3 -c \"import socket; s = socket.create_connection(('{address}', {PORT}), "
        f"timeout=5); print(s.recv(64).decode())\"")


def test_each_host_routes_the_other_workers_pod_cidrs(netlab):
    assert netlab.report["changes"] > 0
    a, alloc = netlab.addr, netlab.alloc
    assert set(alloc) == {"w1", "w2"} and alloc["w1"] != alloc["w2"]
    assert all(ipaddress.ip_network(c).subnet_of(ipaddress.ip_network("10.244.0.0/16")) for c in alloc.values())
    assert our_routes(netlab.host("w1")) == {alloc["w2"]: a["w2"]}
    assert our_routes(netlab.host("w2")) == {alloc["w1"]: a["w1"]}
    assert our_routes(netlab.host("cp1")) == {alloc["w1"]: a["w1"], alloc["w2"]: a["w2"]}
    for name in ("w1", "w2", "cp1"):
        assert netlab.host(name).service("hiddenplane-routes").is_enabled, name
    for name in ("w1", "w2"):
        h = netlab.host(name)
        # the sysctls took effect although systemd-sysctl.service is skipped in a container
        assert h.file("/proc/sys/net/ipv4/ip_forward").content_string.strip() == "1"
        assert json.loads(h.file(CONFLIST).content_string)["plugins"][0]["ipam"]["ranges"] == [
            [{"subnet": alloc[name]}]]


@pytest.fixture(scope="module")
def pods(netlab):
    """One pod per worker, made with the installed plugins and conflist; an echo server in each."""
    ips = {}
    for name in ("w1", "w2"):
        h = netlab.host(name)
        ips[name] = add_pod(h, "pod")
        h.check_output("setsid -f ip netns exec pod python3 /root/echo-peer.py >/dev/null 2>&1 </dev/null")
    for name in ("w1", "w2"):
        netlab.host(name).check_output(  # wait until the server listens
            f"for i in $(seq 50); do ip netns exec pod ss -Htln | grep -q ':{PORT}' && exit 0; sleep 0.1; done; exit 1")
    return ips


def test_pods_get_addresses_from_their_workers_slice(netlab, pods):
    for name, ip in pods.items():
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(netlab.alloc[name]), (name, ip)
        h = netlab.host(name)
        assert h.file(f"{HOST_LOCAL_DIR}/{ip}").exists
        # the gateway is the bridge on the worker, holding the slice's first address
        gw = str(ipaddress.ip_network(netlab.alloc[name])[1])
        assert f"default via {gw} dev eth0" in h.check_output("ip netns exec pod ip -4 route")
        assert f"inet {gw}/" in h.check_output("ip -4 addr show cni0")


def test_pods_reach_each_other_across_workers_without_nat(netlab, pods):
    assert from_pod(netlab.host("w1"), "pod", pods["w2"]) == pods["w1"]
    assert from_pod(netlab.host("w2"), "pod", pods["w1"]) == pods["w2"]


def test_the_hidden_control_host_reaches_a_pod_on_each_worker(netlab, pods):
    cp1 = netlab.host("cp1")
    for name, ip in pods.items():
        seen = cp1.check_output(f"python3 -c \"import socket; s = socket.create_connection(('{ip}', {PORT}), "
                                "timeout=5); print(s.recv(64).decode())\"")
        assert seen == netlab.addr["cp1"], name      # the pod saw the control host itself


def test_pod_traffic_leaving_the_pod_network_is_masqueraded(netlab, pods):
    """The machine (the lab bridge's address) has no route to pods: only a masqueraded
    connection can be answered."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((GATEWAY, PORT))
    srv.listen()
    srv.settimeout(10)
    seen = []

    def serve():
        try:
            c, peer = srv.accept()
            seen.append(peer[0])
            c.sendall(peer[0].encode())
            c.close()
        except OSError:
            pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert from_pod(netlab.host("w1"), "pod", GATEWAY) == netlab.addr["w1"]
    finally:
        t.join(10)
        srv.close()
    assert seen == [netlab.addr["w1"]]


def test_del_releases_the_address(netlab, pods):
    h = netlab.host("w2")
    ip = pods["w2"]
    h.check_output("python3 /root/cni-exec.py DEL pod")
    assert not h.file(f"{HOST_LOCAL_DIR}/{ip}").exists
    assert "eth0" not in h.check_output("ip netns exec pod ip -o link")
    h.check_output("ip netns del pod")


def test_reapply_changes_nothing_and_keeps_the_routes(netlab):
    before = {n: our_routes(netlab.host(n)) for n in ("cp1", "w1", "w2")}
    report = apply_json(netlab.inventory, netlab.state)
    assert report["changes"] == 0 and report["restarts"] == [], [e for e in report["events"]
                                                                 if e["action"] == "changed"]
    assert {n: our_routes(netlab.host(n)) for n in ("cp1", "w1", "w2")} == before


def test_a_worker_leaving_the_inventory_loses_its_routes_but_keeps_its_slice(netlab):
    doc = yaml.safe_load(netlab.inventory.read_text())
    alloc, a = dict(netlab.alloc), netlab.addr
    doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] != "w2"]
    smaller = netlab.tmp / "without-w2.inventory.yaml"
    smaller.write_text(yaml.safe_dump(doc))
    report = apply_json(smaller, netlab.state)
    assert sorted(report["restarts"]) == ["cp1:hiddenplane-routes.service", "w1:hiddenplane-routes.service"]
    assert our_routes(netlab.host("w1")) == {}                       # flushed by its marker
    assert our_routes(netlab.host("cp1")) == {alloc["w1"]: a["w1"]}
    assert yaml.safe_load((netlab.state / "network.yaml").read_text())["podCIDRs"] == alloc

    # back in the inventory: the same slice, the same routes
    apply_json(netlab.inventory, netlab.state)
    assert yaml.safe_load((netlab.state / "network.yaml").read_text())["podCIDRs"] == alloc
    assert our_routes(netlab.host("w1")) == {alloc["w2"]: a["w2"]}
    assert our_routes(netlab.host("cp1")) == {alloc["w1"]: a["w1"], alloc["w2"]: a["w2"]}
