"""Hosted control planes, without a hosting cluster: spec.controlPlane in the inventory (every
mistake named by its field, nothing else changed) and the tenant's objects rendered from the
same plan a control host gets (installer/core/render/tenant.py, docs/hosted.md)."""

from __future__ import annotations

import base64
import copy
import json
import time

import pytest
import yaml
from cryptography import x509

from installer import api
from installer.core import inventory
from installer.core.egress import egress_mode
from installer.core.errors import InventoryError
from installer.core.pki.specs import ETCD_CA, cert_specs
from installer.core.render import control, pods, tenant
from installer.core.render.balancer import HOSTED_READYZ, haproxy_config, server_lines
from installer.host import kube_objects

NS = "hp-tenant-a"
TENANT = {
    "apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster", "metadata": {"name": "tenant-a"},
    "spec": {
        "controlPlane": {"mode": "hosted", "hosted": {
            "kubeconfig": "hosting.kubeconfig",
            "expose": {"type": "NodePort", "addresses": ["10.0.0.11", "10.0.0.12"], "port": 30443,
                       "konnectivityPort": 30132},
            "apiServerReplicas": 2, "etcdReplicas": 3, "storageClass": "local-path"}},
        "hosts": [{"name": "t1", "address": "10.0.1.21", "role": "worker"},
                  {"name": "t2", "address": "10.0.1.22", "role": "worker"}],
    },
}


@pytest.fixture
def doc():
    return copy.deepcopy(TENANT)


def parse(doc, tmp_path):
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    return inventory.parse(doc, base_dir=tmp_path)


def problems(doc, tmp_path) -> list[str]:
    with pytest.raises(InventoryError) as e:
        parse(doc, tmp_path)
    return e.value.problems


def test_a_hosted_inventory_lists_workers_only_and_reaches_the_api_where_it_is_exposed(doc, tmp_path):
    inv = parse(doc, tmp_path)
    assert inv.hosted is not None and inv.hosted_namespace == NS and inv.controls == []
    assert inv.api_url == "https://10.0.0.11:30443"
    assert inv.api_backends == [("api-0", "10.0.0.11", 30443), ("api-1", "10.0.0.12", 30443)]
    # the workers' balancer by default: the kubernetes Service's endpoint is its address
    assert inv.local_balancer and inv.worker_api_url == "https://127.0.0.1:6443"
    assert server_lines(inv.api_backends) == [
        "    server api-0 10.0.0.11:30443", "    server api-1 10.0.0.12:30443",
        "    server api-0-anyway 10.0.0.11:30443 backup no-check",
        "    server api-1-anyway 10.0.0.12:30443 backup no-check"]
    # its checks leave etcd's out (the replicas share every member: render/balancer.py)
    assert f"uri {HOSTED_READYZ} ver" in haproxy_config(inv) and HOSTED_READYZ.startswith("/readyz?exclude=etcd&")
    assert egress_mode(inv) == "konnectivity"


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["spec"]["hosts"].append({"name": "cp1", "address": "10.0.1.5", "role": "control"}),
     "spec.hosts[2].role: 'control' with spec.controlPlane.mode: hosted: the control plane runs in the hosting "
     "cluster; list workers only"),
    (lambda d: d["spec"]["controlPlane"].pop("hosted"),
     "spec.controlPlane.hosted: required field is missing with mode: hosted (the hosting cluster's kubeconfig "
     "and how the API is exposed)"),
    (lambda d: d["spec"]["controlPlane"].update(mode="systemd"),
     "spec.controlPlane.hosted: set only with mode: hosted (the control plane runs on the control hosts otherwise)"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(kubeconfig="missing.kubeconfig"),
     "spec.controlPlane.hosted.kubeconfig: 'missing.kubeconfig' is not a file"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(etcdReplicas=2),
     "spec.controlPlane.hosted.etcdReplicas: 2 is not allowed; expected 1 or 3"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(apiServerReplicas=1),
     "spec.controlPlane.hosted.apiServerReplicas: 1: Input should be greater than or equal to 2"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(etcdStorage="lots"),
     "spec.controlPlane.hosted.etcdStorage: 'lots' is not a Kubernetes quantity (for example 250m, 512Mi, 1Gi)"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(imageRegistry="Registry.Example/x:1"),
     "spec.controlPlane.hosted.imageRegistry: 'Registry.Example/x:1' is not an image registry (host[:port][/path], "
     "lower case)"),
    (lambda d: d["spec"]["controlPlane"]["hosted"]["expose"].update(konnectivityPort=30443),
     "spec.controlPlane.hosted.expose.konnectivityPort: 30443 is also the API's port"),
    (lambda d: d["spec"]["controlPlane"]["hosted"]["expose"].update(addresses=[]),
     "spec.controlPlane.hosted.expose.addresses: []: …"),
    # a tenant in the hosting cluster's own namespaces would share them, and its reset delete them
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(namespace="kube-system"),
     "spec.controlPlane.hosted.namespace: 'kube-system' is a namespace of the hosting cluster itself (default and "
     "kube-*): a tenant gets a namespace of its own, which its reset deletes"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(namespace="default"),
     "spec.controlPlane.hosted.namespace: 'default' is a namespace of the hosting cluster itself…"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(namespace="kube-tenants"),
     "spec.controlPlane.hosted.namespace: 'kube-tenants' is a namespace of the hosting cluster itself…"),
    # the workers would dial their own loopback, where any local process could take the API traffic
    (lambda d: d["spec"]["controlPlane"]["hosted"]["expose"].update(addresses=["10.0.0.11", "127.0.0.1"]),
     "spec.controlPlane.hosted.expose.addresses[1]: '127.0.0.1' is a loopback address: the tenant's workers would "
     "reach themselves, not the hosting cluster"),
    (lambda d: d["spec"]["controlPlane"]["hosted"]["expose"].update(addresses=["::1"]),
     "spec.controlPlane.hosted.expose.addresses[0]: '::1' is a loopback address…"),
    (lambda d: d["spec"]["controlPlane"]["hosted"]["expose"].update(addresses=["169.254.1.1"]),
     "spec.controlPlane.hosted.expose.addresses[0]: '169.254.1.1' is link-local…"),
    (lambda d: d["spec"]["controlPlane"]["hosted"].update(resources={"kubelet": {}}),
     "spec.controlPlane.hosted.resources.kubelet…"),
    (lambda d: d["spec"]["network"].update(egress="routes") if "network" in d["spec"] else
     d["spec"].update(network={"egress": "routes"}),
     "spec.network.egress: 'routes' cannot reach a hosted tenant's pods and kubelets from the hosting cluster: "
     "use egress: konnectivity (the default with mode: hosted)"),
    # a worker holding an address or a name of the tenant's API could pass as its apiserver
    (lambda d: d["spec"]["hosts"][0].update(address="10.0.0.12"),
     "spec.hosts[0].address: '10.0.0.12' is an address of the API (spec.controlPlane.hosted.expose.addresses "
     "'10.0.0.12')…"),
    (lambda d: d["spec"]["hosts"][1].update(name="kube-apiserver"),
     "spec.hosts[1].name: 'kube-apiserver' is a name of the API…"),
    (lambda d: d["spec"].update(hosts=[]), "spec.hosts: no hosts; a cluster needs at least one worker"),
])
def test_each_mistake_is_named_by_its_field(doc, tmp_path, mutate, expected):
    mutate(doc)
    found = problems(doc, tmp_path)
    if expected.endswith("…"):
        assert any(p.startswith(expected[:-1]) for p in found), found
    else:
        assert expected in found, found


def test_the_schema_documents_spec_control_plane():
    schema = json.dumps(inventory.json_schema())
    for text in ("controlPlane", "apiServerReplicas", "etcdReplicas", "storageClass", "imageRegistry",
                 "konnectivityPort"):
        assert text in schema


# --- the tenant's objects ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenant")
    (d / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    (d / "tenant.yaml").write_text(yaml.safe_dump(TENANT))
    p = api.prepare(d / "tenant.yaml", d / "state")
    return p, tenant.render_tenant(p.inventory, p.material)


def _by(plan, kind, name):
    return next(o for o in plan.objects if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_tenants_objects_pass_the_kubernetes_schemas_and_stay_in_its_namespace(rendered):
    p, plan = rendered
    kube_objects.validate_objects(plan.objects, p.inventory.spec.kubernetes.version)
    assert plan.objects[0]["kind"] == "Namespace" and plan.objects[0]["metadata"]["name"] == NS
    # but for the PriorityClass every tenant shares (cluster-scoped, the pods name it)
    assert [o["kind"] for o in plan.objects if o["metadata"].get("namespace") != NS] == ["Namespace", "PriorityClass"]
    assert plan.workloads() == [("StatefulSet", "etcd"), ("Deployment", "kube-apiserver"),
                                ("Deployment", "kube-controller-manager"), ("Deployment", "kube-scheduler")]
    # no control host, no kubelet plan: only the workers are hosts
    assert sorted(p.plans) == ["t1", "t2"]


def test_every_path_a_containers_args_name_is_mounted_in_it(rendered):
    _, plan = rendered
    writable = {f"{control.AUDIT_DIR}/audit.log", tenant.SOCKET}
    for kind, name in plan.workloads():
        spec = _by(plan, kind, name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            mounted = set()
            for m in c["volumeMounts"]:
                v = volumes.get(m["name"], {})      # "data": the StatefulSet's claim
                if "projected" in v:
                    for src in v["projected"]["sources"]:
                        mounted |= {f"{m['mountPath']}/{i['path']}" for i in next(iter(src.values()))["items"]}
            missing = pods.flag_paths(c["args"]) - mounted - writable
            assert not missing, (name, c["name"], missing)


def test_each_pods_secrets_hold_only_its_own_keys(rendered):
    """The cluster CA key only in the controller-manager's Secret, etcd's keys only in etcd's,
    the service-account key in the apiserver's and the controller-manager's: a hosting user who
    can read one component's Secret gets that component's keys only."""
    _, plan = rendered
    secrets = {o["metadata"]["name"]: set(o["data"]) for o in plan.objects if o["kind"] == "Secret"}
    ca_key, sa_key = pods.key_for(control.P["ca.key"]), pods.key_for(control.P["sa.key"])
    assert [n for n, k in secrets.items() if ca_key in k] == ["kube-controller-manager-files"]
    assert sorted(n for n, k in secrets.items() if sa_key in k) == ["kube-apiserver-files",
                                                                    "kube-controller-manager-files"]
    assert [n for n, k in secrets.items() if any(x.startswith("etc_etcd_pki_") for x in k)] == ["etcd-files"]
    # nothing secret in a ConfigMap
    for o in plan.objects:
        if o["kind"] == "ConfigMap":
            assert not any(k.endswith(".key") or k.endswith(".conf") for k in o["data"]), o["metadata"]["name"]


def test_the_api_dials_its_nodes_etcd_member_first_and_leaders_dial_the_service(rendered):
    p, plan = rendered
    args = _by(plan, "Deployment", "kube-apiserver")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in args)
    # one address, not every member: a replica's requests never wait on a lost node's member
    assert flags["--etcd-servers"] == f"https://etcd-near.{NS}.svc:2379"
    near = _by(plan, "Service", "etcd-near")["spec"]
    assert near["trafficDistribution"] == "PreferSameNode" and near["type"] == "ClusterIP"
    # ready members only (a learner, a member catching up: no client), and no peer port
    assert not near.get("publishNotReadyAddresses") and [x["port"] for x in near["ports"]] == [2379]
    assert near["selector"] == _by(plan, "StatefulSet", "etcd")["spec"]["selector"]["matchLabels"]
    # the name the apiservers dial is in the one server certificate every member serves with
    names = p.material.pair("etcd/server-hosted").cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"etcd-near.{NS}.svc" in names
    assert flags["--advertise-address"] == p.inventory.balancer_address
    assert flags["--endpoint-reconciler-type"] == "none"
    assert flags["--egress-selector-config-file"]
    cm = _by(plan, "Secret", "kube-controller-manager-files")["data"]
    conf = yaml.safe_load(base64.b64decode(cm[pods.key_for(f"{control.K8S_DIR}/controller-manager.conf")]))
    assert conf["clusters"][0]["cluster"]["server"] == f"https://kube-apiserver.{NS}.svc:30443"


def test_the_certificates_name_the_exposed_addresses_and_every_etcd_member(rendered):
    p, _ = rendered
    specs = {s.name: s for s in cert_specs(p.inventory)}
    api_sans = specs["apiserver"].sans
    assert {"10.0.0.11", "10.0.0.12", "kube-apiserver", f"kube-apiserver.{NS}.svc", "127.0.0.1"} <= api_sans
    members = {f"etcd-{i}.{NS}.svc" for i in range(3)}      # each member's Service, for every count
    for name in ("etcd/server-hosted", "etcd/peer-hosted"):
        assert {f"*.etcd.{NS}.svc", f"etcd.{NS}.svc", "127.0.0.1", *members} <= specs[name].sans
    assert not any(n.startswith("etcd/server-") and n != "etcd/server-hosted" for n in specs)
    # and the certificate issued is the row's
    names = p.material.pair("etcd/server-hosted").cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert f"*.etcd.{NS}.svc" in names.get_values_for_type(x509.DNSName)


def test_each_etcd_member_is_reached_at_its_own_service_whose_address_never_changes(rendered):
    """A member's pod comes back from a roll with a new address the hosting cluster's DNS goes
    on answering stale for up to 30 s; its Service's address never changes: peers and the
    member's own advertised URLs name it. A member not ready yet is listed
    (its peers must reach it for it to become ready), and the Service selects that pod alone."""
    p, plan = rendered
    services = {o["metadata"]["name"]: o for o in plan.objects if o["kind"] == "Service"}
    sts = _by(plan, "StatefulSet", "etcd")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    for i in range(3):
        svc = services[f"etcd-{i}"]["spec"]
        assert svc["type"] == "ClusterIP" and svc["publishNotReadyAddresses"] is True
        assert "clusterIP" not in svc                        # the hosting cluster's to choose, once
        pod = {**pod_labels, "statefulset.kubernetes.io/pod-name": f"etcd-{i}"}
        assert svc["selector"].items() <= pod.items() and svc["selector"]["statefulset.kubernetes.io/pod-name"] == \
            f"etcd-{i}" and {"hiddenplane.io/tenant", "app.kubernetes.io/name"} <= svc["selector"].keys()
        assert {(q["name"], q["port"]) for q in svc["ports"]} == {("client", 2379), ("peer", 2380)}
    members = _by(plan, "ConfigMap", "etcd-members")["data"]
    assert members["cluster"] == ",".join(f"etcd-{i}=https://etcd-{i}.{NS}.svc:2380" for i in range(3))
    assert members["endpoints"] == ",".join(f"https://etcd-{i}.{NS}.svc:2379" for i in range(3))
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--advertise-client-urls=https://$(member).{NS}.svc:2379" in args
    # the headless Service stays: the StatefulSet names its pods under it
    assert services["etcd"]["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "etcd"


def test_the_tenants_apiserver_dials_urls_from_the_tenants_network(rendered):
    """A URL its admin chooses (a webhook's) is dialled through konnectivity, by an agent on the
    tenant's workers (``controlplane``), as what is in its cluster (``cluster``); etcd, in the
    hosting namespace, directly (no ``etcd`` selection)."""
    from installer.core.render.addons import konnectivity as konn
    p, plan = rendered
    doc = yaml.safe_load(_by(plan, "ConfigMap", "kube-apiserver-config")["data"][pods.key_for(konn.EGRESS_CONFIG)])
    via = {"proxyProtocol": "GRPC", "transport": {"uds": {"udsName": tenant.SOCKET}}}
    assert doc["egressSelections"] == [{"name": "cluster", "connection": via},
                                       {"name": "controlplane", "connection": via}]


def test_an_etcd_member_accepts_as_a_peer_only_the_members_certificate(rendered):
    """Peers' names are not matched against their pod addresses (they change; the flag says
    why), so the members check the peer certificate's CN instead: the etcd CA also signs the
    apiservers' client certificate and the members' server one, which a peer must not be."""
    p, plan = rendered
    args = _by(plan, "StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in args if "=" in a)
    assert flags["--peer-cert-allowed-cn"] == "etcd-peer"
    cn = lambda name: p.material.pair(name).cert.subject.get_attributes_for_oid(  # noqa: E731
        x509.NameOID.COMMON_NAME)[0].value
    assert cn("etcd/peer-hosted") == "etcd-peer"
    others = [s.name for s in cert_specs(p.inventory) if s.ca == ETCD_CA and s.name != "etcd/peer-hosted"]
    assert {"apiserver-etcd-client", "etcd/server-hosted", "etcd/healthcheck-client"} <= set(others)
    assert all(cn(n) != "etcd-peer" for n in others), [(n, cn(n)) for n in others]


def test_the_pods_roll_only_when_what_they_run_with_changes(rendered, tmp_path):
    """The same inputs render the same pod templates (a new installer release alone rolls
    nothing); another replica count changes the Deployment, not the pod template."""
    p, plan = rendered
    again = tenant.render_tenant(p.inventory, p.material)
    assert json.dumps(again.objects, sort_keys=True) == json.dumps(plan.objects, sort_keys=True)
    doc = copy.deepcopy(TENANT)
    doc["spec"]["controlPlane"]["hosted"]["apiServerReplicas"] = 3
    (tmp_path / "hosting.kubeconfig").write_text("x")
    inv3 = inventory.parse(doc, base_dir=tmp_path)
    three = tenant.render_tenant(inv3, p.material)
    def digest(plan, name):
        return _by(plan, "Deployment", name)["spec"]["template"]["metadata"]["annotations"][pods.INPUTS_ANNOTATION]
    assert digest(three, "kube-scheduler") == digest(plan, "kube-scheduler")
    assert digest(three, "kube-controller-manager") == digest(plan, "kube-controller-manager")


def test_another_etcd_member_count_restarts_no_member_and_is_planned_one_at_a_time(rendered, tmp_path):
    """etcdReplicas 3 -> 1 (or back): the member list is a ConfigMap each start reads, so the
    StatefulSet's pod template stays (no member restarts for it); the apiservers' flags change.
    The plan: one member at a time, a new one a learner first."""
    from installer.host import tenant_members
    p, plan = rendered
    doc = copy.deepcopy(TENANT)
    doc["spec"]["controlPlane"]["hosted"]["etcdReplicas"] = 1
    (tmp_path / "hosting.kubeconfig").write_text("x")
    inv1 = inventory.parse(doc, base_dir=tmp_path)
    one = tenant.render_tenant(inv1, p.material)
    sts3, sts1 = _by(plan, "StatefulSet", "etcd"), _by(one, "StatefulSet", "etcd")
    assert sts3["spec"]["template"] == sts1["spec"]["template"]
    assert (sts3["spec"]["replicas"], sts1["spec"]["replicas"]) == (3, 1)
    url = f"https://etcd-0.{NS}.svc:2380"
    assert _by(one, "ConfigMap", "etcd-members")["data"]["cluster"] == f"etcd-0={url}"
    assert _by(plan, "ConfigMap", "etcd-members")["data"]["endpoints"].count("https://etcd-") == 3
    env = {e["name"]: e for e in sts3["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["peer_url"]["value"] == "https://$(member)." + NS + ".svc:2380"
    assert env["legacy_peer_url"]["value"] == "https://$(member).etcd." + NS + ".svc:2380"
    assert [o["metadata"]["name"] for o in one.objects if o["kind"] == "Service" and o["metadata"]["name"] != "etcd"
            and o["metadata"]["name"].startswith("etcd")] == ["etcd-0", "etcd-near"]
    assert env["cluster"]["valueFrom"]["configMapKeyRef"] == {"name": "etcd-members", "key": "cluster"}

    def servers(objs):
        args = _by(objs, "Deployment", "kube-apiserver")["spec"]["template"]["spec"]["containers"][0]["args"]
        return next(a for a in args if a.startswith("--etcd-servers="))
    # the member count changes no apiserver flag: nothing of theirs restarts for it
    assert servers(one) == servers(plan) == f"--etcd-servers=https://etcd-near.{NS}.svc:2379"
    assert [s.split(" (")[0] for s in tenant_members.count_steps(p.inventory, 1)] == [
        "add etcd-1 as a learner", "add etcd-2 as a learner"]
    assert [s.split(",")[0] for s in tenant_members.count_steps(inv1, 3)] == [
        "remove member etcd-2 through a member that stays", "remove member etcd-1 through a member that stays"]
    assert not _by_kind(one, "PodDisruptionBudget", "etcd") and _by_kind(plan, "PodDisruptionBudget", "etcd")


def _by_kind(plan, kind, name):
    return [o for o in plan.objects if o["kind"] == kind and o["metadata"]["name"] == name]


@pytest.mark.parametrize("args", [["etcd", "member", "add"], ["etcd", "member", "remove"]])
def test_day2_commands_not_for_tenants_refuse_them_and_do_nothing(tmp_path, args):
    """A tenant's members are etcdReplicas: `etcd member add|remove` say so, exit 2, before they
    read a host or the state."""
    from click.testing import CliRunner

    from installer.cli.main import cli
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    inv = tmp_path / "tenant.yaml"
    inv.write_text(yaml.safe_dump(TENANT))
    snap = tmp_path / "snap.db"
    snap.write_bytes(b"x")
    extra = {("etcd", "member", "add"): ["t1"], ("etcd", "member", "remove"): ["t1"],
             ("etcd", "snapshot", "save"): [str(tmp_path / "out.db")],
             ("etcd", "snapshot", "restore"): [str(snap), "--yes"]}.get(tuple(args), [])
    state = ["--state", str(tmp_path / "state")] if args[0] not in ("etcd",) or args[1] == "member" else []
    result = CliRunner().invoke(cli, [*args, str(inv), *extra, *state])
    assert result.exit_code == 2, result.output
    assert "does not handle hosted control planes" in result.output, result.output
    assert "are spec.controlPlane.hosted.etcdReplicas" in result.output, result.output
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_the_ca_guard_compares_what_the_hosting_cluster_holds(rendered):
    """A tenant's CA files as its ConfigMaps hold them: the same CA passes, another one is a
    mismatch naming the namespace and the path (core/trust.py)."""
    from installer.core import trust
    p, _ = rendered
    plan = tenant.tenant_plan_files(p.inventory, p.material)
    ca = plan.files[control.P["ca.crt"]]
    assert trust.held_mismatches("hosting namespace x", plan, {ca.path: ca.content}) == []
    etcd_ca = plan.files[control.P["etcd-ca.crt"]].content
    found = trust.held_mismatches("hosting namespace x", plan, {ca.path: etcd_ca})
    assert [(m.host, m.path) for m in found] == [("hosting namespace x", ca.path)]


# --- the hosting cluster's kubeconfig ----------------------------------------------------------------

def _ca_data() -> str:
    import base64
    import datetime as dt

    from installer.core.pki import issue as pki_issue
    key = pki_issue.new_key("ecdsa-p256")
    cert = pki_issue.make_ca("hosting-ca", key, 1, dt.datetime.now(dt.timezone.utc))
    return base64.b64encode(pki_issue.cert_pem(cert)).decode()


CA_DATA = _ca_data()


def _kubeconfig(tmp_path, cluster: dict, user: dict, **extra) -> None:
    (tmp_path / "hosting.kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443",
                                               "certificate-authority-data": CA_DATA, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}], **extra}))


@pytest.mark.parametrize("cluster, user, message", [
    ({"insecure-skip-tls-verify": True}, {"token": "t"}, "insecure-skip-tls-verify is refused"),
    ({}, {"exec": {"command": "aws"}}, "a user with exec is not supported"),
    ({}, {"auth-provider": {"name": "gcp"}}, "a user with auth-provider is not supported"),
    ({}, {}, "its user has no client certificate and key, and no token"),
    ({"server": "http://10.0.0.1:8080"}, {"token": "t"}, "the cluster's server must be an https:// URL"),
    ({"certificate-authority": "missing-ca.crt", "certificate-authority-data": None}, {"token": "t"},
     "certificate-authority"),
    # the system's roots would let any public CA's certificate for that address pass
    ({"certificate-authority-data": None}, {"token": "t"}, "the cluster has no certificate-authority"),
    ({"certificate-authority-data": "bm90IGEgY2VydA=="}, {"token": "t"}, "certificate-authority is not a PEM"),
    # what kubectl acts on and this client would not: refused by name, never dropped
    ({"proxy-url": "http://proxy:3128"}, {"token": "t"}, "the cluster's proxy-url is not supported"),
    ({}, {"token": "t", "as": "system:admin"}, "the user's as is not supported"),
    ({}, {"token": "t", "as-groups": ["system:masters"]}, "the user's as-groups is not supported"),
    ({}, {"username": "admin", "password": "p"}, "the user's password, username is not supported"),
    ({}, {"tokenFile": "/run/token"}, "the user's tokenFile is not supported"),
])
def test_a_hosting_kubeconfig_that_would_skip_verification_or_run_a_program_is_refused(tmp_path, doc, cluster,
                                                                                         user, message):
    from installer.host import hosting
    inv = parse(doc, tmp_path)
    _kubeconfig(tmp_path, cluster, user)
    with pytest.raises(hosting.HostingError, match=message):
        hosting.hosting_client(inv)


@pytest.mark.parametrize("section", ["clusters", "users", "contexts"])
def test_a_hosting_kubeconfig_naming_an_entry_twice_is_refused(tmp_path, doc, section):
    """kubectl reads one entry per name: a second of the same name is refused, not chosen."""
    from installer.host import hosting
    inv = parse(doc, tmp_path)
    twice = {"clusters": {"name": "k", "cluster": {"server": "https://10.9.9.9:6443", "certificate-authority-data":
                                                   CA_DATA}},
             "users": {"name": "u", "user": {"token": "other"}},
             "contexts": {"name": "c", "context": {"cluster": "k", "user": "u"}}}[section]
    _kubeconfig(tmp_path, {}, {"token": "t"})
    path = tmp_path / "hosting.kubeconfig"
    kc = yaml.safe_load(path.read_text())
    kc[section].append(twice)
    path.write_text(yaml.safe_dump(kc))
    name = twice["name"]
    with pytest.raises(hosting.HostingError, match=f"2 {section} named '{name}': give each one name only once"):
        hosting.hosting_client(inv)


def test_a_hosting_token_is_sent_as_a_header_and_never_shown(tmp_path, doc):
    from installer.host import hosting
    inv = parse(doc, tmp_path)
    _kubeconfig(tmp_path, {}, {"token": "s3cr3t-token"})
    client = hosting.hosting_client(inv)
    assert client.headers == {"Authorization": "Bearer s3cr3t-token"} and client.host == "https://10.0.0.1:6443"
    assert "s3cr3t" not in repr(client)


# --- how a tenant's live objects compare (host/kube_objects.py) ------------------------------------

def test_a_tenants_live_objects_compare_by_what_decides_them(rendered):
    """A file Secret is equal only with exactly its keys (a key left over would still be
    projected); a ConfigMap likewise; a StatefulSet whose claims or Service name changed must be
    made again (the API refuses to change them); server defaults alone change nothing."""
    from installer.host import kube_objects as ko
    _, plan = rendered
    secret = _by(plan, "Secret", "etcd-files")
    live = {**secret, "data": dict(secret["data"]), "metadata": {**secret["metadata"], "uid": "x"}}
    assert ko._opaque_secret(secret, live) is None
    live["data"]["extra"] = "eA=="
    assert ko._opaque_secret(secret, live) == "replace"
    assert ko._opaque_secret(secret, {**live, "type": "kubernetes.io/tls"}) == "recreate"
    cm = _by(plan, "ConfigMap", "etcd-config")
    assert ko._as_subset(cm, {**cm, "data": {**cm["data"], "old-key": "x"}}) == "replace"
    sts = _by(plan, "StatefulSet", "etcd")
    live = json.loads(json.dumps(sts))
    live["spec"]["revisionHistoryLimit"] = 10                      # a server default
    live["spec"]["volumeClaimTemplates"][0]["spec"]["volumeMode"] = "Filesystem"
    assert ko._as_subset(sts, live) is None
    live["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "2Gi"
    assert ko._as_subset(sts, live) == "recreate"
    live = json.loads(json.dumps(sts))
    live["spec"]["template"]["metadata"]["annotations"][pods.INPUTS_ANNOTATION] = "0" * 64
    assert ko._as_subset(sts, live) == "replace"


# --- day 2 ------------------------------------------------------------------------------------------

def test_an_upgrade_of_a_tenant_rolls_its_control_plane_by_component(rendered, tmp_path):
    """The tenant's control plane is one turn of the upgrade's order (etcd first when its version
    changes, then the apiservers, then the controller-managers and schedulers), each applied
    alone: a component's objects are its files and its workload, nothing of another's."""
    from installer.actions import upgrade as up_mod
    from installer.core.upgrade_rules import HostState
    from installer.engine.planes import tenant_roll
    p, plan = rendered
    inv = up_mod.with_versions(p.inventory, kubernetes="v1.37.2")
    state = api.state_for(p.inventory, p.state.root)
    from installer.core.cluster import Cluster
    from installer.engine.run import open_run
    etcd = inv.spec.artifacts.versions.etcd
    survey = up_mod.Survey([HostState("hosted", "control", "v1.36.5", "v3.6.1"),
                            *[HostState(w.name, "worker", "v1.36.5") for w in inv.workers]])
    with open_run(Cluster(inv, state), log=lambda m: None) as run:
        up = up_mod.Upgrade(inv, state, "v1.36.5", "v1.37.2", "minor", run=run)
        words = [s.says for s in up_mod.upgrade_steps(up, survey, "v3.6.1")]
    assert words[0].startswith("save an etcd snapshot")
    assert words[1].startswith(f"etcd (StatefulSet etcd in hp-tenant-a) v3.6.1 -> {etcd}: one member at a time"), words
    assert words[2].startswith("kube-apiserver, kube-controller-manager, kube-scheduler in hp-tenant-a "
                               "v1.36.5 -> v1.37.2")
    assert words[3].startswith("wait until a restarted kube-controller-manager and kube-scheduler lead")
    assert all(": cordon, drain" in w for w in words[4:-1]) and words[-1].startswith("converge every host")

    def kinds(components):
        return sorted((o["kind"], o["metadata"]["name"]) for o in
                      tenant_roll.component_objects(inv, p.material, components))
    api_objects = kinds(tenant_roll.APISERVER)
    assert ("Deployment", "kube-apiserver") in api_objects and ("Namespace", "hp-tenant-a") in api_objects
    assert not any(n.startswith(("etcd", "kube-controller", "kube-scheduler")) for _, n in api_objects), api_objects
    assert [n for k, n in kinds(tenant_roll.ETCD) if k in ("StatefulSet", "Deployment")] == ["etcd"]
    controllers = [n for k, n in kinds(tenant_roll.CONTROLLERS) if k == "Deployment"]
    assert controllers == ["kube-controller-manager", "kube-scheduler"]
    # every object of the tenant is in exactly one component's (or holds for the whole namespace)
    every = kinds(tenant_roll.ETCD + tenant_roll.APISERVER + tenant_roll.CONTROLLERS)
    assert every == sorted((o["kind"], o["metadata"]["name"]) for o in
                           tenant.render_tenant(inv, p.material).objects)
    # the new version changes the three Kubernetes images, not etcd's nor konnectivity's
    new = {c["image"] for o in tenant.render_tenant(inv, p.material).objects if o["kind"] in ("Deployment",
           "StatefulSet") for c in o["spec"]["template"]["spec"]["containers"]}
    old = {c["image"] for o in plan.objects if o["kind"] in ("Deployment", "StatefulSet")
           for c in o["spec"]["template"]["spec"]["containers"]}
    assert sorted(new - old) == [f"registry.k8s.io/{c}:v1.37.2" for c in
                                 ("kube-apiserver", "kube-controller-manager", "kube-scheduler")]


def test_the_restore_of_a_tenant_copies_before_it_stops_anything(rendered, tmp_path):
    """`etcd snapshot restore --dry-run` of a tenant: its steps, in order, without reaching the
    hosting cluster; the exec stream's exit status read as the API sends it."""
    from click.testing import CliRunner

    from installer.cli.main import cli
    from installer.host import podexec
    p, plan = rendered
    snap = tmp_path / "snap.db"
    snap.write_bytes(b"x")
    inv = tmp_path / "t.yaml"
    (tmp_path / "hosting.kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    inv.write_text(yaml.safe_dump(TENANT))
    res = CliRunner().invoke(cli, ["etcd", "snapshot", "restore", str(inv), str(snap), "--dry-run"])
    assert res.exit_code == 0, res.output
    order = ["copy ", "stop kube-apiserver", "hand the snapshot", "delete every etcd member's pod",
             "start kube-apiserver"]
    at = [res.output.find(w) for w in order]
    assert -1 not in at and at == sorted(at), res.output
    assert "etcd-0, etcd-1, etcd-2" in res.output and "nothing is stopped yet" in res.output
    # each member's start restores with the revision raised past every client's (etcd_rules)
    from installer.core.etcd_rules import RESTORE_FLAGS
    env = {e["name"]: e.get("value") for e in _by(plan, "StatefulSet", "etcd")["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["restore_flags"] == "--bump-revision=1000000000 --mark-compacted" == " ".join(RESTORE_FLAGS)
    assert podexec.exit_code({"status": "Success"}) == 0
    assert podexec.exit_code({"status": "Failure", "reason": "NonZeroExitCode",
                              "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}) == 3
    with pytest.raises(podexec.ExecError, match="container not found"):
        podexec.exit_code({"status": "Failure", "message": "container not found (\"etcd\")"})


def test_a_renewal_of_a_tenant_rolls_its_control_plane_between_the_push_and_the_workers(rendered):
    """`certs renew --dry-run` of a tenant: the tenant's files that change (as its Secrets and
    ConfigMaps hold them) beside the workers', and its roll before the workers' restarts; the
    renewal checks the tenant's API and konnectivity certificates by handshake from a worker."""
    from click.testing import CliRunner

    from installer.actions.endpoints import endpoints
    from installer.cli.main import cli
    p, _ = rendered
    d = p.state.root.parent
    res = CliRunner().invoke(cli, ["certs", "renew", str(d / "tenant.yaml"), "--state", str(p.state.root),
                                   "--only", "apiserver", "--only", "etcd/server-hosted", "--dry-run",
                                   "--output", "json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    tenant_files = report["rollout"]["hosting hp-tenant-a"]["files"]
    assert {"/etc/kubernetes/pki/apiserver.crt", "/etc/etcd/pki/server.crt"} <= set(tenant_files), tenant_files
    assert not any(k != "hosting hp-tenant-a" for k in report["rollout"]), report["rollout"]
    steps = report["steps"]
    roll = next(i for i, s in enumerate(steps) if s.startswith("roll the tenant's control plane"))
    assert steps[roll - 1].startswith("push the new files") and steps[roll + 1].startswith("restart what uses them")
    from installer.engine.planes.hosted import HostedPlane
    names = [(e.host, e.name, e.port) for e in endpoints(p.inventory, HostedPlane(p.inventory, None))]
    for address in ("10.0.0.11", "10.0.0.12"):       # each exposed address serves its own node's replica
        assert ("t1", f"kube-apiserver (hosted, {address})", 30443) in names, names
        assert ("t1", f"konnectivity-server (hosted, {address})", 30132) in names, names



def test_a_ca_rotation_of_a_tenant_stops_and_starts_it_in_its_hosting_cluster(rendered):
    """`ca rotate --dry-run` of a tenant: its control plane stopped (etcd's members too when the
    etcd CA rotates: members of two CAs cannot talk), written with the new files and started,
    before the tokens and the workers' bootstrap, as on control hosts."""
    from click.testing import CliRunner

    from installer.cli.main import cli
    p, _ = rendered
    d = p.state.root.parent
    for which, etcd in (("ca", False), ("etcd-ca", True)):
        res = CliRunner().invoke(cli, ["ca", "rotate", str(d / "tenant.yaml"), "--state", str(p.state.root),
                                       "--which", which, "--dry-run"])
        assert res.exit_code == 0, res.output
        order = ["new CA(s)", "stop the tenant's kube-apiserver", "write the tenant's Secrets",
                 "bootstrap token Secrets", "each worker in turn", "check by TLS handshake"]
        at = [res.output.find(w) for w in order]
        assert -1 not in at and at == sorted(at), res.output
        assert ("and etcd's members (their volumes stay" in res.output) == etcd, res.output
        assert "on control hosts" not in res.output and "push the new files to" not in res.output


def test_a_tenant_run_gets_the_hosted_plane_which_names_its_namespace(rendered):
    """The Run's plane is chosen once, from spec.controlPlane.mode: a tenant's is the hosted one,
    whose one target (apply's hosted phase, its lock) is the tenant's namespace; opening it
    reaches no cluster (its client is made when first asked for)."""
    from installer.core.cluster import Cluster
    from installer.engine.planes.hosted import HostedPlane
    from installer.engine.run import open_run
    p, _ = rendered
    with open_run(Cluster(p.inventory, p.state), log=lambda m: None) as run:
        assert isinstance(run.plane, HostedPlane) and run.plane.name == "hosted"
        assert run.plane.targets() == [p.inventory.hosted_namespace]
        assert run.plane.lock_targets(None, pending=False) == [p.inventory.hosted_namespace]
        assert run.plane._api is None


def test_the_hosted_plane_restarts_a_tenant_workers_units_as_systemd():
    """A tenant's hosts are its workers: a rollout's restart of their units goes to systemd
    (the apply script), not to the hosting cluster (a full `certs renew` of a tenant restarts
    kubelets; `ca rotate` stops them)."""
    from installer.core.diff import HostChanges
    from installer.engine.planes.hosted import HostedPlane
    calls = []

    class Ctx:
        def execute(self, phase, host, changes: HostChanges, no_block=False):
            calls.append((phase, host, list(changes.restart)))
    HostedPlane(None, None).restart(Ctx(), "t1", "kubelet.service")
    assert calls == [("restart", "t1", ["kubelet.service"])]


def _ca_and_server(tmp_path, san: str):
    """A CA and a server pair for ``san`` (an IP address), PEM files in ``tmp_path``."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = dt.datetime.now(dt.timezone.utc)

    def cert(subject, key, issuer, issuer_key, ca, ext=None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
             .not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ext is not None:
            b = b.add_extension(ext, critical=False)
        return b.sign(issuer_key, hashes.SHA256())
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("test-ca", ca_key, "test-ca", ca_key, True)
    srv = cert("hosting", key, "test-ca", ca_key, False,
               x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(san))]))
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    (tmp_path / "ca.crt").write_bytes(pem(ca))
    (tmp_path / "srv.pem").write_bytes(pem(srv) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp_path / "ca.crt", tmp_path / "srv.pem"


def _listener(handle):
    """A server on loopback whose every connection goes to ``handle(conn, seen)``; what it
    received goes to the list it returns with the listening socket (closing it ends the server)."""
    import socket
    import threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    seen: list[bytes] = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            handle(conn, seen)
    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


def _tls_listener(tmp_path, answer: bytes):
    """A TLS server (a certificate for 127.0.0.1 of its own CA) answering each request with
    ``answer``."""
    import ssl
    ca, srv = _ca_and_server(tmp_path, "127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(srv))

    def handle(conn, seen):
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                seen.append(tls.recv(4096))
                tls.sendall(answer)
        except (ssl.SSLError, OSError):
            seen.append(b"")
    return (ca, *_listener(handle))


def _plain_listener():
    """A TCP server that records what each connection sends (or that one came)."""
    def handle(conn, seen):
        with conn:
            conn.settimeout(2)
            try:
                seen.append(conn.recv(4096) or b"(connected)")
            except OSError:
                seen.append(b"(connected)")
    return _listener(handle)


def test_the_exec_stream_follows_no_redirect_and_takes_no_proxy_from_the_environment(tmp_path, doc, monkeypatch):
    """An API (or someone who answers as it) redirecting the exec stream elsewhere, even to
    ws://, gets no second request and so never the bearer token; https_proxy in the environment
    is not used (the REST client ignores it too): the stream goes to the API server alone."""
    from installer.host import hosting, podexec
    elsewhere, went = _plain_listener()
    proxy, proxied = _plain_listener()
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    redirect = (f"HTTP/1.1 307 Temporary Redirect\r\nLocation: ws://127.0.0.1:{elsewhere.getsockname()[1]}/steal"
                "\r\nContent-Length: 0\r\n\r\n").encode()
    ca, api_server, seen = _tls_listener(tmp_path, redirect)
    inv = parse(doc, tmp_path)
    _kubeconfig(tmp_path, {"server": f"https://127.0.0.1:{api_server.getsockname()[1]}",
                           "certificate-authority": str(ca), "certificate-authority-data": None},
                {"token": "s3cr3t-token"})
    client = hosting.hosting_client(inv)
    try:
        with pytest.raises(podexec.ExecError, match="redirect, which is not followed"):
            podexec.pod_exec(client, "hp-t", "etcd-0", "etcd", ["/bin/true"], timeout=10)
        time.sleep(0.5)
    finally:
        for s in (elsewhere, proxy, api_server):
            s.close()
    assert len(seen) == 1 and b"GET /api/v1/namespaces/hp-t/pods/etcd-0/exec?" in seen[0], seen
    assert went == [] and proxied == [], (went, proxied)


@pytest.mark.parametrize("san, refused", [("127.0.0.2", True), ("127.0.0.1", False)])
def test_the_exec_stream_checks_the_hosting_servers_name(tmp_path, doc, san, refused):
    """Someone on the network between this machine and the hosting cluster, holding a certificate
    of the kubeconfig's CA for another name, is refused before anything is sent (the WebSocket
    library checks no name itself: the stream's TLS context does). A server with the right name
    gets the handshake (and then a request it does not answer as an API)."""
    import socket
    import ssl
    import threading

    from installer.host import hosting, podexec
    ca, srv = _ca_and_server(tmp_path, san)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(str(srv))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    seen = []

    def serve():
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                seen.append(tls.recv(4096))
                tls.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        except (ssl.SSLError, OSError):
            seen.append(b"")
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    inv = parse(doc, tmp_path)
    _kubeconfig(tmp_path, {"server": f"https://127.0.0.1:{port}", "certificate-authority": str(ca),
                           "certificate-authority-data": None},
                {"token": "s3cr3t-token"})
    client = hosting.hosting_client(inv)
    with pytest.raises(podexec.ExecError) as err:
        podexec.pod_exec(client, "hp-t", "etcd-0", "etcd", ["/bin/true"], timeout=10)
    t.join(10)
    listener.close()
    if refused:
        assert "certificate" in str(err.value).lower() and seen == [b""], (err.value, seen)
    else:
        assert b"GET /api/v1/namespaces/hp-t/pods/etcd-0/exec?" in seen[0] and b"403" in str(err.value).encode()
    assert "s3cr3t" not in str(err.value)


def test_the_kubeconfig_names_the_first_exposed_address_that_answers(rendered):
    """kubectl does not fail over: `installer kubeconfig` run while a hosting node is lost names
    an exposed address that answers, and says which did not (as for control hosts, docs/ha.md)."""
    from installer.host.apireach import chosen_server
    p, _ = rendered
    inv = p.inventory
    assert chosen_server(inv, "10.0.0.11") == ("https://10.0.0.11:30443", None)
    assert chosen_server(inv, "10.0.0.12") == ("https://10.0.0.12:30443", "10.0.0.11: no answer from the apiserver")
    assert chosen_server(inv, None) == ("https://10.0.0.11:30443", "no apiserver answered from here")


def test_the_kubeconfig_of_control_hosts_names_the_hosts_that_did_not_answer(three_controls):
    from installer.host.apireach import chosen_server
    inv = three_controls.inventory
    assert chosen_server(inv, "192.168.56.234") == ("https://192.168.56.234:6443",
                                                    "cp1, cp2: no answer from the apiserver")
    assert chosen_server(inv, "192.168.56.230") == (inv.api_url, None)
