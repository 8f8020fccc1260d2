"""The workers' API balancer (spec.apiServer.balancer): when it is on, what every worker and
control host gets, the kubernetes Service's endpoints, the artifacts it needs, and the
installer's own failover across control hosts. The balancer itself is proven on the real lab
(tests/test_real_day2.py: a control host lost); here its configuration is checked by the real
haproxy binary."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from installer import api
from installer.core import components
from installer.core.artifacts import ArtifactError, write_sums
from installer.core.diff import HostChanges
from installer.core.inventory import InventoryError, parse
from installer.core.render.balancer import BALANCER_CONFIG, haproxy_config
from installer.core.render.control import AUTHN_CONFIG
from installer.core.render.manifests import bootstrap_objects, kubernetes_endpoints
from installer.core.render.worker import BOOTSTRAP_KUBECONFIG, KUBELET_KUBECONFIG, HostFacts, render_worker
from installer.host import fetch, hostops, kube
from installer.host.kube_objects import validate_objects

from .conftest import write_inventory

UNIT = components.unit("api-balancer")
CONTROLS = [{"name": f"cp{i}", "address": f"192.168.56.24{i}", "role": "control"} for i in (1, 2, 3)]


def _ha(doc: dict, **api_server) -> dict:
    d = copy.deepcopy(doc)
    d["spec"]["hosts"] = copy.deepcopy(CONTROLS) + [h for h in d["spec"]["hosts"] if h["role"] == "worker"]
    d["spec"]["apiServer"].pop("endpoint", None)
    d["spec"]["apiServer"].update(api_server)
    return d


@pytest.fixture(scope="module")
def ha(tmp_path_factory, example_doc):
    tmp = tmp_path_factory.mktemp("ha")
    return api.prepare(write_inventory(tmp, _ha(example_doc)), tmp / "state")


@pytest.mark.parametrize("controls, endpoint, mode, on", [
    (1, None, "auto", False), (3, None, "auto", True), (3, "10.1.2.3", "auto", False),
    (1, None, "local", True), (3, None, "none", False), (3, "10.1.2.3", "local", True)])
def test_auto_means_more_than_one_control_host_and_no_endpoint(doc, controls, endpoint, mode, on):
    d = _ha(doc, balancer=mode)
    d["spec"]["hosts"] = d["spec"]["hosts"][:controls] + d["spec"]["hosts"][3:]
    if endpoint:
        d["spec"]["apiServer"]["endpoint"] = endpoint
    inv = parse(d)
    assert inv.local_balancer is on
    assert inv.worker_api_url == ("https://127.0.0.1:6443" if on else inv.api_url)


def test_a_worker_reaches_the_api_through_its_own_balancer(ha):
    inv, plan = ha.inventory, ha.plans["node2"]
    # started before the units that use it (and after the routes unit)
    assert plan.units == ["hiddenplane-routes.service", UNIT, "containerd.service", "kubelet.service",
                          "kube-proxy.service"]
    for path in (BOOTSTRAP_KUBECONFIG, "/etc/kubernetes/kube-proxy.conf"):
        assert yaml.safe_load(plan.files[path].content)["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    cfg = plan.files[BALANCER_CONFIG].content.decode()
    assert cfg == haproxy_config(inv) and plan.files[BALANCER_CONFIG].restarts == (UNIT,)
    servers = [line.split()[1:] for line in cfg.splitlines() if line.strip().startswith("server ")]
    assert servers == [[c["name"], f"{c['address']}:6443"] for c in CONTROLS]
    assert "bind 127.0.0.1:6443" in cfg and "bind 172.20.0.1:6443" in cfg
    assert "uri /readyz" in cfg and "verify required ca-file /etc/kubernetes/pki/ca.crt" in cfg
    assert "inter 1s fall 2 rise 1 on-marked-down shutdown-sessions" in cfg
    # a new cluster CA (ca rotate) reloads the balancer, whose checks verify with it
    assert plan.files["/etc/kubernetes/pki/ca.crt"].restarts == ("kubelet.service", UNIT)
    unit = plan.files[f"/etc/systemd/system/{UNIT}"].content.decode()
    assert "ExecStartPre=/sbin/ip address replace 172.20.0.1/32 dev lo" in unit
    assert "Before=containerd.service kubelet.service kube-proxy.service" in unit
    assert f"-Ws -f {BALANCER_CONFIG}" in unit and "ExecReload=/bin/kill -USR2 $MAINPID" in unit
    # a joined kubelet's kubeconfig is ours: it names the balancer, and the kubelet's own pair
    joined = render_worker(inv, inv.host("node2"), ha.material, HostFacts(kubelet_joined=True))
    kc = yaml.safe_load(joined.files[KUBELET_KUBECONFIG].content)
    assert kc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert kc["users"][0]["user"] == {"client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem",
                                      "client-key": "/var/lib/kubelet/pki/kubelet-client-current.pem"}
    assert BOOTSTRAP_KUBECONFIG in joined.absent


def test_without_the_balancer_workers_are_as_before(prepared):
    plan = prepared.plans["node2"]
    assert UNIT not in plan.units and BALANCER_CONFIG not in plan.files
    cp = prepared.plans["cp1"].files["/etc/systemd/system/kube-apiserver.service"].content.decode()
    assert "--anonymous-auth=false" in cp and "--endpoint-reconciler-type" not in cp
    assert kubernetes_endpoints(prepared.inventory) == []


def test_apiservers_leave_endpoints_to_the_installer_and_open_only_health_to_anonymous(ha):
    for c in CONTROLS:
        plan = ha.plans[c["name"]]
        unit = plan.files["/etc/systemd/system/kube-apiserver.service"].content.decode()
        assert "--endpoint-reconciler-type=none" in unit and f"--authentication-config={AUTHN_CONFIG}" in unit
        assert "--shutdown-delay-duration=5s" in unit
        # the flag and the config's anonymous section may not both be set (the apiserver refuses)
        assert "--anonymous-auth" not in unit
        authn = yaml.safe_load(plan.files[AUTHN_CONFIG].content)
        assert authn["anonymous"] == {"enabled": True, "conditions": [{"path": "/livez"}, {"path": "/readyz"},
                                                                      {"path": "/healthz"}]}


def test_the_kubernetes_service_endpoints_name_the_balancer_address(ha, doc):
    objs = kubernetes_endpoints(ha.inventory)
    assert [o["kind"] for o in objs] == ["Endpoints", "EndpointSlice"]
    assert objs[0]["subsets"] == [{"addresses": [{"ip": "172.20.0.1"}],
                                   "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}]
    assert objs[1]["endpoints"] == [{"addresses": ["172.20.0.1"], "conditions": {"ready": True}}]
    assert objs[1]["addressType"] == "IPv4"
    assert objs[0]["metadata"]["labels"] == {"endpointslice.kubernetes.io/skip-mirror": "true"}
    assert all(o in bootstrap_objects(ha.inventory, ha.material) for o in objs)
    validate_objects(objs, ha.inventory.spec.kubernetes.version)        # kubernetes-validate, strict
    # an IPv6 cluster gets the IPv6 default
    d = _ha(doc)
    d["spec"]["network"] = {"podCIDR": "fd10:244::/56", "serviceCIDR": "fd10:96::/108", "clusterDNS": "fd10:96::a"}
    for i, h in enumerate(d["spec"]["hosts"]):
        h["address"] = f"fd00::{i + 1}"
    v6 = parse(d)
    assert v6.balancer_address == "fd72:20::1" and kubernetes_endpoints(v6)[1]["addressType"] == "IPv6"


@pytest.mark.parametrize("address, message", [
    ("127.0.0.2", "is a loopback, link-local, multicast or unspecified address"),
    ("169.254.20.10", "is a loopback, link-local, multicast or unspecified address"),
    ("10.244.3.1", "lies inside spec.network.podCIDR 10.244.0.0/16"),
    ("10.96.0.7", "lies inside spec.network.serviceCIDR 10.96.0.0/12"),
    ("192.168.56.242", "is the address of spec.hosts[1]"),
    ("fd00::1", "is IPv6 but spec.network.serviceCIDR 10.96.0.0/12 is IPv4"),
])
def test_a_bad_balancer_address_is_named(doc, address, message):
    with pytest.raises(InventoryError) as e:
        parse(_ha(doc, balancerAddress=address))
    assert f"spec.apiServer.balancerAddress: '{address}' {message}" in str(e.value)


def test_a_change_reloads_the_balancer_and_restarts_the_rest():
    text = hostops.script(HostChanges("w1", restart=[UNIT, "kubelet.service"]))
    assert f"systemctl reload-or-restart {UNIT} ||" in text
    assert "systemctl restart kubelet.service ||" in text and f"systemctl restart {UNIT}" not in text


def test_haproxy_comes_from_the_artifacts_or_is_asked_for(ha, tmp_path):
    inv = ha.inventory
    assert "haproxy" in fetch.cluster_binaries(inv) and "haproxy" in fetch.role_binaries("worker", inv)
    assert "haproxy" not in fetch.role_binaries("control", inv)
    # source: download: HAProxy has no release binary; the cache directory may hold one
    d = yaml.safe_load(Path(inv.base_dir / "inventory.yaml").read_text())
    d["spec"]["artifacts"] = {"source": "download", "cacheDir": str(tmp_path / "cache")}
    dl = api.validate(write_inventory(tmp_path, d))
    (tmp_path / "cache").mkdir()
    with pytest.raises(ArtifactError) as e:
        fetch._balancer_from_cache(dl, None)
    assert "haproxy: the workers' API balancer" in str(e.value)
    assert "--only haproxy` (it lands in that directory's SHA256SUMS)" in str(e.value)
    (tmp_path / "cache" / "haproxy").write_bytes(b"\x7fELF")
    write_sums(tmp_path / "cache", {"haproxy": __import__("hashlib").sha256(b"\x7fELF").hexdigest()})
    assert fetch._balancer_from_cache(dl, None)["haproxy"].path == tmp_path / "cache" / "haproxy"


def test_the_real_haproxy_accepts_the_rendered_config(ha, tmp_path):
    """haproxy -c (the unit's ExecStartPre does the same) on the rendered config, its paths moved
    under tmp_path; with the binary scripts/build-kubernetes made (CI has it)."""
    artifacts = os.environ.get("HIDDENPLANE_TEST_ARTIFACTS")
    binary = Path(artifacts or "/nonexistent") / "haproxy"
    if not binary.is_file():
        pytest.skip("no haproxy in $HIDDENPLANE_TEST_ARTIFACTS (scripts/build-kubernetes builds it)")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(ha.plans["node2"].files["/etc/kubernetes/pki/ca.crt"].content)
    cfg = (haproxy_config(ha.inventory).replace("/etc/kubernetes/pki/ca.crt", str(ca))
           .replace("/run/hiddenplane-api-balancer/", f"{tmp_path}/").replace("172.20.0.1", "127.0.0.1")
           .replace("bind 127.0.0.1:6443\n", ""))
    (tmp_path / "haproxy.cfg").write_text(cfg)
    r = subprocess.run([str(binary), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "static" in subprocess.run(["file", str(binary)], capture_output=True, text=True).stdout


def test_the_installer_fails_over_to_the_first_apiserver_that_answers():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    try:
        # 127.0.0.2 refuses (nothing listens there): the next one in order answers
        assert kube.first_reachable(["127.0.0.2", "127.0.0.1"], port, 1.0) == "127.0.0.1"
        assert kube.first_reachable(["127.0.0.1", "127.0.0.3"], port, 1.0) == "127.0.0.1"
        assert kube.first_reachable(["127.0.0.2", "127.0.0.3"], port, 1.0) is None
        assert kube.first_reachable([], port, 1.0) is None
    finally:
        listening.close()
