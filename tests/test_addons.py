"""Cluster add-ons, rendered offline: CoreDNS, konnectivity (server unit, apiserver egress,
agents) and Cilium's Helm values and command line.

Every API object passes kubernetes-validate (strict) for the inventory's target version; the
apiserver's egress flags are checked by the real kube-apiserver's ``--help``, and the real
kube-apiserver decodes (strictly) and validates the EgressSelectorConfiguration in the sandbox of
tests/test_real_flags.py; the konnectivity-server unit passes systemd-analyze verify.
konnectivity's own flags have no built binary here: they are checked against the flag names of
the upstream sources, written out below.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from installer import api
from installer.core import versions
from installer.core.pki import issue
from installer.core.pki.specs import CLUSTER_CA, cert_specs
from installer.core.render import control
from installer.core.render.addons import (
    AGENT_IMAGE,
    CILIUM_CHART,
    COREDNS_IMAGE,
    addon_objects,
    agent_objects,
    apiserver_egress_flags,
    cilium_chart,
    cilium_values,
    cilium_values_yaml,
    coredns_objects,
    corefile,
    egress_mode,
    egress_selector_config,
    helm_argv,
    render_konnectivity_server,
)
from installer.core.render.addons import konnectivity as konn
from installer.core.render.control import render_control
from installer.host import kube_objects

from . import reference as ref
from .conftest import write_inventory
from .rendered import write
from .test_real_flags import (  # noqa: F401
    _append,
    _edit,
    _replace,
    apiserver_problems,
    apiserver_results,
    flag_problems,
    real,  # (real: a fixture)
)
from .test_units import make_root, problems_of, system_units  # noqa: F401 (a fixture)

UNIT_PATH = f"/etc/systemd/system/{konn.UNIT}"

# Flag names of kubernetes-sigs/apiserver-network-proxy, cmd/server/app/options/options.go
# (ProxyRunOptions.Flags) and cmd/agent/app/options/options.go (GrpcProxyAgentOptions.Flags),
# read from the upstream source; klog's flags are left out (we pass none).
UPSTREAM_SERVER_FLAGS = frozenset(f"--{n}" for n in """
    server-cert server-key server-ca-cert cluster-cert cluster-key cluster-ca-cert mode uds-name
    delete-existing-uds-file server-port server-bind-address agent-port agent-bind-address admin-port
    admin-bind-address health-port health-bind-address keepalive-time frontend-keepalive-time
    enable-profiling enable-contention-profiling server-id server-count agent-namespace
    agent-service-account kubeconfig kubeconfig-qps kubeconfig-burst kube-api-content-type
    authentication-audience proxy-strategies cipher-suites tls-min-version xfr-channel-size
    frontend-write-channel-size enable-lease-controller lease-namespace lease-label
    graceful-shutdown-timeout backend-dial-timeout""".split())
UPSTREAM_AGENT_FLAGS = frozenset(f"--{n}" for n in """
    agent-cert agent-key ca-cert proxy-server-host proxy-server-port alpn-proto health-server-port
    admin-server-port enable-profiling enable-contention-profiling agent-id sync-interval
    probe-interval sync-interval-cap service-account-token-path agent-identifiers
    enable-push-service-account-token""".split())


# --- fixtures -------------------------------------------------------------------------------

def _prepare(tmp_path_factory, example_doc, name: str, network: dict, hosts: list | None = None):
    d = copy.deepcopy(example_doc)
    d["spec"]["network"].update(network)
    if hosts:
        d["spec"]["hosts"] = hosts
    tmp = tmp_path_factory.mktemp(name)
    return api.prepare(write_inventory(tmp, d), tmp / "state")


@pytest.fixture(scope="module")
def cilium(tmp_path_factory, example_doc):
    """cni: cilium (so egress: konnectivity by default), upstream resolvers named."""
    return _prepare(tmp_path_factory, example_doc, "cilium",
                    {"cni": "cilium", "upstreamDNS": ["192.0.2.53", "198.51.100.53"], "clusterDNS": "10.96.0.53",
                     "clusterDomain": "k8s.example"})


@pytest.fixture(scope="module")
def cilium3(tmp_path_factory, example_doc):
    """Three control hosts, cni: cilium."""
    return _prepare(tmp_path_factory, example_doc, "cilium3", {"cni": "cilium"}, hosts=[
        {"name": "cp1", "address": "192.168.56.230", "role": "control"},
        {"name": "cp2", "address": "192.168.56.233", "role": "control"},
        {"name": "cp3", "address": "192.168.56.234", "role": "control"},
        {"name": "node2", "address": "192.168.56.231", "role": "worker"},
        {"name": "node3", "address": "192.168.56.232", "role": "worker"},
    ])


@pytest.fixture(scope="module")
def routes_konnectivity(tmp_path_factory, example_doc):
    """cni: routes with egress: konnectivity chosen explicitly."""
    return _prepare(tmp_path_factory, example_doc, "routesk", {"egress": "konnectivity"})


@pytest.fixture(params=["prepared", "cilium", "cilium3", "routes_konnectivity"])
def any_cluster(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["cilium", "cilium3", "routes_konnectivity"])
def konnectivity_cluster(request):
    return request.getfixturevalue(request.param)


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str) -> dict:
    found = _by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _control_plans(p) -> dict:
    """Control plans as render_control makes them (the konnectivity server included)."""
    return {h.name: render_control(p.inventory, h, p.material) for h in p.inventory.controls}


def _forward_targets(text: str) -> list[str]:
    lines = [line.split() for line in text.splitlines() if line.strip().startswith("forward ")]
    assert len(lines) == 1, text
    words = lines[0]
    assert words[:2] == ["forward", "."]
    return [w for w in words[2:] if w != "{"]


# --- every object against the schemas -------------------------------------------------------

def test_every_addon_object_validates_strictly_for_the_target_version(any_cluster):
    inv = any_cluster.inventory
    objects = addon_objects(inv)
    assert objects
    version = kube_objects.target_version(inv.spec.kubernetes.version)
    failures = []
    for o in objects:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{o['kind']}/{o['metadata']['name']}: {'/'.join(map(str, e.path))}: {e.message}")
    assert not failures, f"against Kubernetes {version}:\n" + "\n".join(failures)
    kube_objects.validate_objects(objects, inv.spec.kubernetes.version)    # the check apply runs


@pytest.mark.parametrize("minor", range(versions.MIN_SUPPORTED[1], versions.MAX_SUPPORTED[1] + 1))
def test_addon_objects_validate_for_every_supported_minor(cilium3, minor):
    kube_objects.validate_objects(addon_objects(cilium3.inventory), f"v1.{minor}.0")


def test_strict_validation_sees_inside_the_pod_templates(cilium):
    """A typo deep in a pod template is caught: the schema check is not a vacuous pass."""
    version = kube_objects.target_version(cilium.inventory.spec.kubernetes.version)
    for kind in ("Deployment", "DaemonSet"):
        obj = copy.deepcopy(_one(addon_objects(cilium.inventory), kind))
        obj["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesytem"] = True
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(obj, version, strict=True)


def test_objects_are_labelled_and_namespaced(any_cluster):
    for o in addon_objects(any_cluster.inventory):
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "hiddenplane", o["metadata"]["name"]
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == "kube-system", o["metadata"]["name"]


# --- CoreDNS -------------------------------------------------------------------------------

def test_coredns_service_takes_the_cluster_dns_address(any_cluster):
    inv = any_cluster.inventory
    svc = _one(coredns_objects(inv), "Service")
    assert svc["metadata"]["name"] == "kube-dns" and svc["metadata"]["namespace"] == "kube-system"
    assert svc["spec"]["clusterIP"] == inv.spec.network.clusterDNS
    assert ipaddress.ip_address(svc["spec"]["clusterIP"]) in ipaddress.ip_network(inv.spec.network.serviceCIDR)
    ports = {(p["port"], p["protocol"]) for p in svc["spec"]["ports"]}
    assert ports == {(53, "UDP"), (53, "TCP"), (9153, "TCP")}
    deploy = _one(coredns_objects(inv), "Deployment")
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_cluster_dns_in_the_kubelet_config_is_the_service(any_cluster):
    inv = any_cluster.inventory
    svc = _one(coredns_objects(inv), "Service")
    for plan in any_cluster.plans.values():
        if plan.role == "worker":
            cfg = yaml.safe_load(plan.files["/var/lib/kubelet/config.yaml"].content)
            assert cfg["clusterDNS"] == [svc["spec"]["clusterIP"]]
            assert cfg["clusterDomain"] == inv.spec.network.clusterDomain


def test_corefile_forwards_to_upstream_dns_when_set(cilium):
    text = corefile(cilium.inventory)
    assert _forward_targets(text) == ["192.0.2.53", "198.51.100.53"]
    assert "/etc/resolv.conf" not in text
    cm = _one(coredns_objects(cilium.inventory), "ConfigMap")
    assert cm["data"]["Corefile"] == text


def test_corefile_forwards_to_the_pods_resolv_conf_otherwise(prepared):
    assert prepared.inventory.spec.network.upstreamDNS == []
    assert _forward_targets(corefile(prepared.inventory)) == ["/etc/resolv.conf"]
    # ... which is the kubelet's resolvConf, because CoreDNS runs with dnsPolicy Default
    pod = _one(coredns_objects(prepared.inventory), "Deployment")["spec"]["template"]["spec"]
    assert pod["dnsPolicy"] == "Default"


def test_corefile_plugins(any_cluster):
    inv = any_cluster.inventory
    text = corefile(inv)
    words = [line.split()[0] for line in text.splitlines() if line.strip() and line.strip() != "}"]
    for plugin in ("errors", "health", "ready", "kubernetes", "prometheus", "forward", "cache", "loop",
                   "reload", "loadbalance"):
        assert plugin in words, plugin
    assert re.search(r"^\s*loop\s*$", text, re.M), "the loop plugin must stay: it stops a forwarding loop"
    assert f"kubernetes {inv.spec.network.clusterDomain} in-addr.arpa ip6.arpa {{" in text
    assert "lameduck 5s" in text and "pods insecure" in text and "ttl 30" in text
    assert "fallthrough in-addr.arpa ip6.arpa" in text
    assert "prometheus :9153" in text and "cache 30" in text
    assert text.count("{") == text.count("}")


def test_coredns_deployment(prepared):
    pod_spec = _one(coredns_objects(prepared.inventory), "Deployment")
    assert pod_spec["spec"]["replicas"] == 2
    pod = pod_spec["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["dnsPolicy"] == "Default"
    assert pod["serviceAccountName"] == "coredns"
    (c,) = pod["containers"]
    assert c["image"] == COREDNS_IMAGE and c["imagePullPolicy"] == "IfNotPresent"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["port"] == 8080
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["readinessProbe"]["httpGet"]["port"] == 8181
    assert c["args"] == ["-conf", "/etc/coredns/Corefile"]
    (vol,) = pod["volumes"]
    assert vol["configMap"]["name"] == _one(coredns_objects(prepared.inventory), "ConfigMap")["metadata"]["name"]


def test_coredns_rbac(prepared):
    objs = coredns_objects(prepared.inventory)
    role, binding, sa = _one(objs, "ClusterRole"), _one(objs, "ClusterRoleBinding"), _one(objs, "ServiceAccount")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    for group, resource in (("", "endpoints"), ("", "services"), ("", "pods"), ("", "namespaces"),
                            ("discovery.k8s.io", "endpointslices")):
        assert {(group, resource, "list"), (group, resource, "watch")} <= granted, resource
    assert {v for _, _, v in granted} == {"list", "watch"}, "CoreDNS only reads"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    kinds = [o["kind"] for o in objs]
    assert kinds.index("ServiceAccount") < kinds.index("Deployment")
    assert kinds.index("ConfigMap") < kinds.index("Deployment")


def test_image_constants():
    assert re.fullmatch(r"registry\.k8s\.io/coredns/coredns:v1\.14\.\d+", COREDNS_IMAGE)
    assert re.fullmatch(r"registry\.k8s\.io/kas-network-proxy/proxy-agent:v0\.\d+\.\d+", AGENT_IMAGE)
    assert AGENT_IMAGE.endswith(konn.KONNECTIVITY_VERSION)
    assert re.fullmatch(r"cilium-\d+\.\d+\.\d+\.tgz", CILIUM_CHART)


# --- konnectivity: which inventories get it ------------------------------------------------

def test_egress_defaults_follow_the_cni(prepared, cilium, routes_konnectivity, example_doc):
    assert egress_mode(prepared.inventory) == "routes"
    assert egress_mode(cilium.inventory) == "konnectivity"
    assert egress_mode(routes_konnectivity.inventory) == "konnectivity"
    from installer.core import inventory
    from installer.core.errors import InventoryError
    d = copy.deepcopy(example_doc)
    d["spec"]["network"].update(cni="cilium", egress="routes")
    with pytest.raises(InventoryError, match="egress: 'routes' needs cni: routes"):
        inventory.parse(d)


def test_routes_egress_adds_nothing(prepared):
    inv = prepared.inventory
    assert apiserver_egress_flags(inv) == {}
    assert agent_objects(inv) == []
    assert "konnectivity-server" not in prepared.material.certs
    assert "konnectivity-server" not in {s.name for s in cert_specs(inv)}
    for h in inv.controls:
        plan = render_control(inv, h, prepared.material)
        before = (dict(plan.files), dict(plan.dirs), list(plan.units))
        render_konnectivity_server(plan, inv, h, prepared.material)
        assert (plan.files, plan.dirs, plan.units) == before


# --- konnectivity: the apiserver side ------------------------------------------------------

def test_egress_selector_config_sends_cluster_traffic_to_the_socket():
    doc = egress_selector_config()
    assert (doc["apiVersion"], doc["kind"]) == ("apiserver.k8s.io/v1beta1", "EgressSelectorConfiguration")
    (sel,) = doc["egressSelections"]
    assert sel["name"] == "cluster"
    assert sel["connection"] == {"proxyProtocol": "GRPC", "transport": {"uds": {"udsName": konn.SOCKET}}}


@pytest.fixture(scope="module")
def konnectivity_tree(routes_konnectivity, tmp_path_factory):
    """The rendered tree of the 1-control konnectivity cluster, for the real kube-apiserver."""
    return write("routes-konnectivity", routes_konnectivity, tmp_path_factory)


EGRESS_WRONG = {
    # name: (how the first control host's egress config is spoiled, what kube-apiserver says)
    "egress-unknown-field": (_append("hiddenplaneBogus: 1"), 'strict decoding error: unknown field "hiddenplaneBogus"'),
    "egress-protocol": (_replace("proxyProtocol: GRPC", "proxyProtocol: Bogus"), 'Unsupported value: "Bogus"'),
    "egress-name": (_replace("name: cluster", "name: clusters"), 'Unsupported value: "clusters"'),
}


def test_the_real_apiserver_decodes_and_validates_the_egress_selector_config(konnectivity_tree, built_artifacts,
                                                                              tmp_path):
    """The rendered kube-apiserver, --egress-selector-config-file included, runs to the point
    where the aggregator loads its proxy client certificate (tests/test_real_flags.py): past
    the strict decoding and the validation of the EgressSelectorConfiguration. Each spoiled copy
    of that file stops it there instead, so the file is really read."""
    variants = {n: _edit(konn.EGRESS_CONFIG, spoil) for n, (spoil, _) in EGRESS_WRONG.items()}
    results = apiserver_results(konnectivity_tree, built_artifacts, tmp_path, variants)
    problems = []
    for plan in konnectivity_tree.hosts("control"):
        unit = plan.files["/etc/systemd/system/kube-apiserver.service"]
        assert ref.unit_flags(unit.content)["--egress-selector-config-file"] == konn.EGRESS_CONFIG
        problems += apiserver_problems(plan.name, plan, results[plan.name])
    assert not problems, "\n".join(problems)
    first = konnectivity_tree.hosts("control")[0]
    for name, (_, says) in EGRESS_WRONG.items():
        spoiled = apiserver_problems(name, first, results[name])
        assert any(says in p or says.replace('"', '\\"') in p for p in spoiled), (name, results[name].output[-2000:])


def test_apiserver_egress_flags_are_real_and_merge_cleanly(konnectivity_cluster, real):  # noqa: F811 (a fixture)
    inv = konnectivity_cluster.inventory
    extra = apiserver_egress_flags(inv)
    assert set(extra) == {"--egress-selector-config-file", "--api-audiences"}
    for h in inv.controls:
        merged = ref.parse_flags(control.apiserver_flags(inv, h))   # a flag given twice would raise
        issuer = merged["--service-account-issuer"]
        audiences = merged["--api-audiences"].split(",")
        assert audiences == [issuer, "system:konnectivity-server"]
        assert merged["--egress-selector-config-file"] == konn.EGRESS_CONFIG
        # listed by the real binary's --help, not deprecated, and the values parse as its types
        assert flag_problems(real["kube-apiserver"], {n: merged[n] for n in extra}) == []


# --- konnectivity: the server unit on each control host -------------------------------------

def test_control_hosts_get_the_server_and_its_files(konnectivity_cluster):
    inv = konnectivity_cluster.inventory
    for name, plan in _control_plans(konnectivity_cluster).items():
        assert plan.units.index(konn.UNIT) < plan.units.index("kube-apiserver.service")
        unit = plan.files[UNIT_PATH]
        assert unit.mode == 0o600 and unit.restarts == (konn.UNIT,)
        argv = ref.exec_start(unit.content)
        assert argv[0] == "/usr/local/bin/konnectivity-server"
        fl = ref.parse_flags(argv[1:])
        want = {
            "--uds-name": "/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
            "--delete-existing-uds-file": "true",
            "--cluster-cert": "/etc/kubernetes/pki/apiserver.crt",
            "--cluster-key": "/etc/kubernetes/pki/apiserver.key",
            "--mode": "grpc", "--server-port": "0", "--agent-port": "8132", "--admin-port": "8133",
            "--health-port": "8134", "--agent-namespace": "kube-system",
            "--agent-service-account": "konnectivity-agent",
            "--kubeconfig": "/etc/kubernetes/konnectivity-server.conf",
            "--authentication-audience": "system:konnectivity-server",
            "--agent-bind-address": inv.host(name).address,
        }
        assert {k: fl.get(k) for k in want} == want
        unknown = set(fl) - UPSTREAM_SERVER_FLAGS
        assert not unknown, f"not proxy-server flags upstream: {sorted(unknown)}"
        assert set(fl["--cipher-suites"].split(",")) == ref.CIS_CIPHER_SUITES

        # the socket is where the apiserver's egress config looks for it
        egress = yaml.safe_load(plan.files[konn.EGRESS_CONFIG].content)
        assert egress["egressSelections"][0]["connection"]["transport"]["uds"]["udsName"] == fl["--uds-name"]
        assert Path(fl["--uds-name"]).parent.as_posix() in plan.dirs
        assert plan.dirs[konn.SOCKET_DIR].mode == 0o700
        assert plan.files[konn.EGRESS_CONFIG].restarts == ("kube-apiserver.service",)
        # the serving pair it borrows restarts it too
        for path in (fl["--cluster-cert"], fl["--cluster-key"]):
            assert set(plan.files[path].restarts) == {"kube-apiserver.service", konn.UNIT}


def test_server_kubeconfig_identity(konnectivity_cluster):
    p = konnectivity_cluster
    ca = p.material.pair(CLUSTER_CA).cert
    binding = next(o for o in agent_objects(p.inventory) if o["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    for plan in _control_plans(p).values():
        f = plan.files[konn.KUBECONFIG]
        assert f.mode == 0o600 and f.secret and f.restarts == (konn.UNIT,)
        kc = yaml.safe_load(f.content)
        assert kc["clusters"][0]["cluster"]["server"] == f"https://127.0.0.1:{p.inventory.spec.apiServer.port}"
        (user,) = kc["users"]
        cert = x509.load_pem_x509_certificate(base64.b64decode(user["user"]["client-certificate-data"]))
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert cn == user["name"] == "system:konnectivity-server"
        assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": cn}]
        cert.verify_directly_issued_by(ca)
        ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert ekus == {ExtendedKeyUsageOID.CLIENT_AUTH}
        assert issue.cert_pem(cert) == issue.cert_pem(p.material.pair(konn.CERT_NAME).cert)


def test_konnectivity_server_unit_passes_systemd_analyze_verify(konnectivity_cluster, system_units, tmp_path):  # noqa: F811 (a fixture)
    checked = 0
    for plan in _control_plans(konnectivity_cluster).values():
        root = make_root(tmp_path, plan, system_units)
        for unit in plan.units:            # the unit, and the others beside it (Before=)
            assert problems_of(root, unit) == [], f"{plan.name} {unit}"
            checked += 1
        assert konn.UNIT in plan.units
    assert checked >= 5


def test_verify_harness_sees_a_broken_konnectivity_unit(cilium, system_units, tmp_path):  # noqa: F811 (a fixture)
    plan = next(iter(_control_plans(cilium).values()))
    broken = plan.files[UNIT_PATH].content.replace(b"ProtectHome=true", b"ProtectHome=true\nProtectHomes=true")
    root = make_root(tmp_path, plan, system_units, {konn.UNIT: broken})
    assert any("ProtectHomes" in line for line in problems_of(root, konn.UNIT))


# --- konnectivity: the agents --------------------------------------------------------------

def test_agents_dial_every_control_host(konnectivity_cluster):
    p = konnectivity_cluster
    inv = p.inventory
    objs = agent_objects(inv)
    ds, sa = _one(objs, "DaemonSet"), _one(objs, "ServiceAccount")
    pod = ds["spec"]["template"]["spec"]
    server = ref.parse_flags(konn.server_flags(inv, inv.controls[0]))
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == server["--agent-service-account"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"] == server["--agent-namespace"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["hostNetwork"] is True and pod["automountServiceAccountToken"] is False

    containers = pod["containers"]
    assert len(containers) == len(inv.controls)
    dialed = []
    ports = []
    (vol,) = pod["volumes"]
    token_source = next(s["serviceAccountToken"] for s in vol["projected"]["sources"] if "serviceAccountToken" in s)
    assert token_source["audience"] == server["--authentication-audience"]
    apiserver_cert = p.material.pair("apiserver").cert
    san_ips = {str(ip) for ip in apiserver_cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)}
    for c in containers:
        assert c["image"] == AGENT_IMAGE and c["imagePullPolicy"] == "IfNotPresent"
        assert c["command"] == ["/proxy-agent"]
        fl = ref.parse_flags(c["args"])
        assert not set(fl) - UPSTREAM_AGENT_FLAGS, sorted(set(fl) - UPSTREAM_AGENT_FLAGS)
        assert fl["--proxy-server-port"] == server["--agent-port"]
        assert fl["--service-account-token-path"] == f"{konn.TOKEN_DIR}/{token_source['path']}"
        assert fl["--ca-cert"].startswith(konn.TOKEN_DIR + "/")
        dialed.append(fl["--proxy-server-host"])
        ports += [int(fl["--health-server-port"]), int(fl["--admin-server-port"])]
        assert c["livenessProbe"]["httpGet"]["port"] == int(fl["--health-server-port"])
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert dialed == [h.address for h in inv.controls]
    # the agent verifies the server (the apiserver's pair) by the address it dials
    assert set(dialed) <= san_ips
    # one network namespace: no two containers share a port
    assert len(ports) == len(set(ports))
    # the server side: every agent pod reaches each server directly
    assert server["--server-count"] == "1"


# --- Cilium --------------------------------------------------------------------------------

def test_cilium_values_are_exactly_the_seed_settings(cilium):
    inv = cilium.inventory
    assert cilium_values(inv) == {
        "ipam": {"mode": "kubernetes"},
        "kubeProxyReplacement": "false",
        "hubble": {"enabled": False},
        "envoy": {"enabled": False},
        "l7Proxy": False,
        "rollOutCiliumPods": True,
        "operator": {"rollOutPods": True},
        "routingMode": "tunnel",
        "tunnelProtocol": "vxlan",
        "bpf": {"preallocateMaps": False},
        "k8sServiceHost": inv.endpoint,
        "k8sServicePort": inv.spec.apiServer.port,
    }
    assert yaml.safe_load(cilium_values_yaml(inv)) == cilium_values(inv)


def test_cilium_native_routing_and_the_users_values_merged_over_ours(example_doc, tmp_path):
    doc = copy.deepcopy(example_doc)
    doc["spec"]["network"].update(cni="cilium", cilium={
        "routingMode": "native",
        "values": {"bpf": {"mapDynamicSizeRatio": 0.01}, "operator": {"replicas": 1}, "l7Proxy": True}})
    inv = api.validate(write_inventory(tmp_path, doc))
    got = cilium_values(inv)
    assert got["routingMode"] == "native" and got["autoDirectNodeRoutes"] is True
    assert got["ipv4NativeRoutingCIDR"] == inv.spec.network.podCIDR and "tunnelProtocol" not in got
    # a map into a map, key by key; anything else replaced
    assert got["bpf"] == {"preallocateMaps": False, "mapDynamicSizeRatio": 0.01}
    assert got["operator"] == {"rollOutPods": True, "replicas": 1} and got["l7Proxy"] is True


def test_cilium_settings_without_cni_cilium_are_refused(example_doc, tmp_path):
    doc = copy.deepcopy(example_doc)
    doc["spec"]["network"]["cilium"] = {"routingMode": "native"}
    with pytest.raises(Exception, match=r"spec.network.cilium: set, but spec.network.cni is not cilium"):
        api.validate(write_inventory(tmp_path, doc))


def test_helm_argv_is_local(cilium, tmp_path):
    chart = cilium_chart(tmp_path / "artifacts")
    values = tmp_path / "cilium-values.yaml"
    argv = helm_argv(chart, values)
    assert argv == ["helm", "upgrade", "--install", "cilium", str(tmp_path / "artifacts" / CILIUM_CHART),
                    "--namespace", "kube-system", "--values", str(values)]
    assert not any("://" in a or a.startswith(("oci:", "--repo")) for a in argv)
    kc = tmp_path / "admin.conf"
    assert helm_argv(chart, values, kubeconfig=kc)[-2:] == ["--kubeconfig", str(kc)]
    for bad in ("oci://quay.io/cilium/cilium", "https://helm.cilium.io/cilium-1.18.3.tgz", "cilium/cilium"):
        with pytest.raises(ValueError):
            helm_argv(Path(bad), values)
