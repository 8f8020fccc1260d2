"""The addons phase: CoreDNS and the konnectivity agents through the real ``kubernetes`` client
(transport faked with tests/test_kube.py's FakeApiServer, extended to the add-on kinds), Cilium
through the Helm CLI (a fake ``helm`` on PATH records what it was given), the phase order and
its skip rule, and konnectivity-server among the control binaries."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from installer import api
from installer.core.artifacts import ArtifactError, add_files
from installer.core.cluster import resolve as resolve_cluster
from installer.core.errors import InstallerError
from installer.core.render.addons import CILIUM_CHART, addon_objects, cilium_values_yaml, coredns_objects
from installer.engine import runner
from installer.engine.context import Context, Options
from installer.engine.phases import PHASE_CLASSES, PHASE_NAMES, build
from installer.engine.phases.apply_addons import ApplyAddons
from installer.host import apireach, kube, kube_objects
from installer.host.fetch import ALL_BINARIES, ResolvedArtifact, binary_files, resolve, role_binaries

from .conftest import write_inventory
from .test_kube import CRB, FakeApiServer

API = "https://192.168.56.230:6443"
TUNNEL = "https://127.0.0.1:40123"        # what a faked api_access yields: not the inventory's URL
NS = "/api/v1/namespaces/kube-system"
APPS = "/apis/apps/v1/namespaces/kube-system"
PATHS = {
    "ServiceAccount": f"{NS}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": CRB,
    "ConfigMap": f"{NS}/configmaps",
    "Deployment": f"{APPS}/deployments",
    "DaemonSet": f"{APPS}/daemonsets",
    "Service": f"{NS}/services",
}


class AddonApiServer(FakeApiServer):
    """FakeApiServer seeded by the add-on kinds' collections too."""

    def put(self, obj: dict) -> None:
        self.add(post_path(obj), obj)


def post_path(obj: dict) -> str:
    return PATHS[obj["kind"]]


def item_path(obj: dict) -> str:
    return f"{post_path(obj)}/{obj['metadata']['name']}"


def created(objs: list[dict]) -> list[tuple]:
    """The requests creating ``objs`` on an empty cluster: every object read (404), then the POSTs."""
    return [("GET", item_path(o), None) for o in objs] + [("POST", post_path(o), o) for o in objs]


def _client(material, fake):
    a = kube.api_client(API, material)
    a.pool = fake
    return a


@pytest.fixture
def fake():
    return AddonApiServer()


@pytest.fixture
def client(prepared, fake):
    a = _client(prepared.material, fake)
    yield a
    a.close()


@pytest.fixture(scope="module")
def cilium(tmp_path_factory, example_doc):
    """cni: cilium (egress: konnectivity by default), artifacts from a directory."""
    d = copy.deepcopy(example_doc)
    d["spec"]["network"]["cni"] = "cilium"
    d["spec"]["artifacts"] = {"source": "dir", "path": "artifacts"}
    tmp = tmp_path_factory.mktemp("cilium-apply")
    (tmp / "artifacts").mkdir()
    return api.prepare(write_inventory(tmp, d), tmp / "state")


def version(p) -> str:
    return p.inventory.spec.kubernetes.version


# --- apply_objects with the add-on kinds ---------------------------------------------------------

def test_first_run_sends_exactly_the_coredns_objects_in_order(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    assert objs == coredns_objects(prepared.inventory)          # egress: routes: no agents
    assert [o["kind"] for o in objs] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
                                         "Deployment", "Service"]
    done = kube_objects.apply_objects(client, addon_objects(prepared.inventory), version(prepared))
    assert done == [(o["kind"], o["metadata"]["name"], "created") for o in objs]
    assert fake.requests == created(objs)
    assert all(h.get("Content-Type") == "application/json" for (m, _, _), h in zip(fake.requests, fake.headers)
               if m == "POST")
    assert fake.store[f"{PATHS['Service']}/kube-dns"]["spec"]["clusterIP"] == "10.96.0.10"


def test_konnectivity_agents_follow_coredns(cilium, fake):
    objs = addon_objects(cilium.inventory)
    assert [o["kind"] for o in objs[6:]] == ["ServiceAccount", "ClusterRoleBinding", "DaemonSet"]
    with _client(cilium.material, fake) as a:
        done = kube_objects.apply_objects(a, objs, version(cilium))
    assert [x[2] for x in done] == ["created"] * len(objs)
    assert fake.requests == created(objs)


def _add_server_defaults(fake: AddonApiServer) -> None:
    """What a real apiserver adds to what we sent: defaults, allocations, status."""
    dep = fake.store[f"{PATHS['Deployment']}/coredns"]
    dep["spec"].update(revisionHistoryLimit=10, progressDeadlineSeconds=600)
    dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] = "25%"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c.update(terminationMessagePath="/dev/termination-log", terminationMessagePolicy="File")
    c["livenessProbe"]["periodSeconds"] = 10
    dep["spec"]["template"]["spec"].update(restartPolicy="Always", schedulerName="default-scheduler")
    dep["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "1"}
    dep["status"] = {"replicas": 2, "readyReplicas": 2}
    svc = fake.store[f"{PATHS['Service']}/kube-dns"]
    svc["spec"].update(type="ClusterIP", clusterIPs=["10.96.0.10"], sessionAffinity="None",
                       ipFamilies=["IPv4"], ipFamilyPolicy="SingleStack", internalTrafficPolicy="Cluster")
    fake.store[f"{PATHS['ConfigMap']}/coredns"]["metadata"]["labels"]["team"] = "dns"


def test_second_run_changes_nothing(prepared, client, fake):
    kube_objects.apply_objects(client, addon_objects(prepared.inventory), version(prepared))
    _add_server_defaults(fake)
    fake.requests.clear()
    done = kube_objects.apply_objects(client, addon_objects(prepared.inventory), version(prepared))
    objs = addon_objects(prepared.inventory)
    assert done == [(o["kind"], o["metadata"]["name"], "unchanged") for o in objs]
    # one GET per object; no create, no PUT, no DELETE
    assert [(m, p) for m, p, _ in fake.requests] == [("GET", item_path(o)) for o in objs]


def test_changed_configmap_is_replaced_with_the_live_resource_version(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    old = copy.deepcopy(next(o for o in objs if o["kind"] == "ConfigMap"))
    old["data"]["Corefile"] = ".:53 {\n    forward . 8.8.8.8\n}\n"
    old["metadata"]["labels"]["team"] = "dns"
    fake.put(old)
    rv = fake.store[item_path(old)]["metadata"]["resourceVersion"]
    done = kube_objects.apply_objects(client, objs, version(prepared))
    assert done[3] == ("ConfigMap", "coredns", "replaced")
    assert [a for _, _, a in done[:3] + done[4:]] == ["created"] * 5
    puts = [(p, b) for m, p, b in fake.requests if m == "PUT"]
    assert len(puts) == 1 and not any(m == "DELETE" for m, _, _ in fake.requests)
    path, body = puts[0]
    assert path == item_path(old)
    assert body["metadata"]["resourceVersion"] == rv
    assert body["data"] == objs[3]["data"]
    assert body["metadata"]["labels"] == {**objs[3]["metadata"]["labels"], "team": "dns"}
    assert fake.store[path]["data"]["Corefile"] == objs[3]["data"]["Corefile"]


def test_service_with_another_cluster_ip_is_deleted_and_created(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    svc = objs[5]
    old = copy.deepcopy(svc)
    old["spec"]["clusterIP"] = "10.96.0.99"
    fake.put(old)
    done = kube_objects.apply_objects(client, objs, version(prepared))
    assert done[5] == ("Service", "kube-dns", "replaced")
    assert [(m, p) for m, p, _ in fake.requests[-2:]] == [("DELETE", item_path(svc)), ("POST", post_path(svc))]
    assert fake.requests[-1][2] == svc
    assert not any(m == "PUT" for m, _, _ in fake.requests)
    assert fake.store[item_path(svc)]["spec"]["clusterIP"] == "10.96.0.10"


def test_service_port_change_is_a_replace_keeping_the_cluster_ip(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    old = copy.deepcopy(objs[5])
    old["spec"]["ports"] = old["spec"]["ports"][:2]
    fake.put(old)
    done = kube_objects.apply_objects(client, objs, version(prepared))
    assert done[5] == ("Service", "kube-dns", "replaced")
    [(path, body)] = [(p, b) for m, p, b in fake.requests if m == "PUT"]
    assert path == item_path(objs[5]) and body["spec"]["clusterIP"] == "10.96.0.10"
    assert not any(m == "DELETE" for m, _, _ in fake.requests)


def test_workload_with_another_selector_is_deleted_and_created(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    old = copy.deepcopy(objs[4])
    old["spec"]["selector"] = {"matchLabels": {"app": "old-dns"}}
    old["spec"]["template"]["metadata"]["labels"] = {"app": "old-dns"}
    fake.put(old)
    done = kube_objects.apply_objects(client, objs, version(prepared))
    assert done[4] == ("Deployment", "coredns", "replaced")
    methods = [(m, p) for m, p, _ in fake.requests if p.startswith(PATHS["Deployment"])]
    assert methods == [("GET", item_path(objs[4])), ("DELETE", item_path(objs[4])), ("POST", post_path(objs[4]))]


def test_changed_image_is_replaced_and_foreign_annotations_stay(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    old = copy.deepcopy(objs[4])
    old["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.k8s.io/coredns/coredns:v1.11.1"
    old["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "3"}
    fake.put(old)
    done = kube_objects.apply_objects(client, objs, version(prepared))
    assert done[4] == ("Deployment", "coredns", "replaced")
    [(_, body)] = [(p, b) for m, p, b in fake.requests if m == "PUT"]
    assert body["spec"] == objs[4]["spec"]
    assert body["metadata"]["annotations"] == {"deployment.kubernetes.io/revision": "3"}


def test_unknown_kind_and_missing_namespace_are_refused_before_any_request(prepared, client, fake):
    objs = addon_objects(prepared.inventory)
    no_ns = copy.deepcopy(objs[3])
    del no_ns["metadata"]["namespace"]
    with pytest.raises(ValueError, match="ConfigMap/coredns: a namespaced kind needs metadata.namespace"):
        kube_objects.apply_objects(client, objs[:3] + [no_ns], version(prepared))
    assert fake.requests == []


# --- the phase -----------------------------------------------------------------------------------

@pytest.fixture
def phase_api(monkeypatch):
    """Fake api_access (yields TUNNEL) and api_client (the real client on a FakeApiServer);
    returns (fake, the credentials and URLs the phase asked for)."""
    fake, asked = AddonApiServer(), []

    @contextlib.contextmanager
    def access(inv, remotes, material=None, **kw):
        yield TUNNEL

    real = kube.api_client

    def client(url, material, *, credential="admin", **kw):
        asked.append((url, credential))
        a = real(url, material, credential=credential, **kw)
        a.pool = fake
        return a
    monkeypatch.setattr(apireach, "api_access", access)
    monkeypatch.setattr(kube, "api_client", client)
    return fake, asked


def ctx_for(p, **options) -> Context:
    return Context(p.inventory, p.state, Options(**options), p.material, p.changes, log=lambda _: None)


FAKE_HELM = """#!/bin/sh
# records what the installer gave it, as it was at call time; no release is installed yet
rec="$HELM_RECORD"
if [ "$1" = history ]; then
  if [ -f "$rec/history" ]; then cat "$rec/history"; exit "${HELM_HISTORY_EXIT:-0}"; fi
  echo "Error: release: not found" >&2; exit 1
fi
if [ "$1" = get ]; then cat "$rec/deployed-values"; exit 0; fi
: > "$rec/argv"
for a in "$@"; do printf '%s\\n' "$a" >> "$rec/argv"; done
printf '%s' "$KUBECONFIG" > "$rec/env"
cp "$KUBECONFIG" "$rec/kubeconfig"
stat -L -c %a "$KUBECONFIG" > "$rec/mode"         # -L: the file, not /proc's link to it
readlink "$KUBECONFIG" > "$rec/target"
prev=""
for a in "$@"; do
  if [ "$prev" = "--values" ]; then cp "$a" "$rec/values"; fi
  prev="$a"
done
exit "${HELM_EXIT:-0}"
"""


@pytest.fixture
def fake_helm(tmp_path, monkeypatch):
    bindir, rec = tmp_path / "bin", tmp_path / "rec"
    bindir.mkdir()
    rec.mkdir()
    helm = bindir / "helm"
    helm.write_text(FAKE_HELM)
    helm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setenv("HELM_RECORD", str(rec))
    return rec


@pytest.fixture
def chart(cilium):
    d = cilium.inventory.artifacts_dir()
    (d / CILIUM_CHART).write_bytes(b"a chart, as far as these tests go\n")
    add_files(d, [CILIUM_CHART])
    yield d / CILIUM_CHART
    (d / CILIUM_CHART).unlink()
    (d / "SHA256SUMS").unlink()


def test_phase_applies_the_addon_objects_as_admin(prepared, phase_api):
    fake, asked = phase_api
    ev = ApplyAddons().run_host(ctx_for(prepared), "(api)")
    objs = addon_objects(prepared.inventory)
    assert asked == [(TUNNEL, "admin")]
    assert fake.requests == created(objs)
    assert ev.action == "changed" and ev.detail == [f"created {o['kind']} {o['metadata']['name']}" for o in objs]
    again = ApplyAddons().run_host(ctx_for(prepared), "(api)")
    assert again.action == "unchanged" and again.detail == []


def test_phase_runs_helm_with_the_chart_values_and_a_private_kubeconfig(cilium, phase_api, fake_helm, chart):
    fake, asked = phase_api
    ev = ApplyAddons().run_host(ctx_for(cilium), "(api)")
    objs = addon_objects(cilium.inventory)
    assert fake.requests == created(objs)
    argv = (fake_helm / "argv").read_text().splitlines()
    kc_path = (fake_helm / "env").read_text()
    assert argv[:7] == ["upgrade", "--install", "cilium", str(chart), "--namespace", "kube-system", "--values"]
    assert argv[8:] == ["--kubeconfig", kc_path, "--description",
                        f"hiddenplane {CILIUM_CHART} sha256:{hashlib.sha256(chart.read_bytes()).hexdigest()}"]
    assert (fake_helm / "values").read_bytes() == cilium_values_yaml(cilium.inventory)
    assert (fake_helm / "mode").read_text().strip() == "600"
    # on no filesystem: an anonymous in-memory file helm inherited, named by its descriptor
    assert re.fullmatch(r"/proc/self/fd/\d+", kc_path) and re.fullmatch(r"/proc/self/fd/\d+", argv[7])
    assert (fake_helm / "target").read_text().startswith("/memfd:")
    kc = yaml.safe_load((fake_helm / "kubeconfig").read_text())
    assert kc["clusters"][0]["cluster"]["server"] == TUNNEL
    assert kc["users"][0]["name"] == "kubernetes-admin"
    fd = Path(f"/proc/self/fd/{kc_path.rsplit('/', 1)[1]}")     # here, the installer's: closed afterwards
    assert not (fd.is_symlink() and os.readlink(fd).startswith("/memfd:"))
    assert ev.action == "changed" and ev.detail[-1] == f"helm upgrade --install cilium {CILIUM_CHART}"


def _deployed(rec: Path, chart: Path, values: object, status: str = "deployed") -> None:
    """What the fake helm answers for the release: its last revision and its values."""
    digest = hashlib.sha256(chart.read_bytes()).hexdigest()
    (rec / "history").write_text(json.dumps([{"revision": 3, "status": status, "chart": "cilium-1.20.2",
                                              "description": f"hiddenplane {chart.name} sha256:{digest}"}]))
    (rec / "deployed-values").write_text(json.dumps(values))


@pytest.fixture
def live_api(monkeypatch):
    """A dry run against a running apiserver (the plane says one runs): it reads what is there."""
    from installer.engine import api_objects
    from installer.engine.phases import apply_addons
    for mod in (api_objects, apply_addons):
        monkeypatch.setattr(mod, "api_live", lambda ctx: True)


def test_a_release_with_this_chart_and_these_values_is_left_alone(cilium, phase_api, fake_helm, chart, live_api):
    ApplyAddons().run_host(ctx_for(cilium), "(api)")          # the objects, and a first helm run
    (fake_helm / "argv").unlink()
    _deployed(fake_helm, chart, yaml.safe_load(cilium_values_yaml(cilium.inventory)))
    again = ApplyAddons().run_host(ctx_for(cilium), "(api)")
    assert again.action == "unchanged" and again.detail == [] and not (fake_helm / "argv").exists()
    dry = ApplyAddons().run_host(ctx_for(cilium, dry_run=True), "(api)")
    assert dry.action == "unchanged" and dry.detail == []


@pytest.mark.parametrize("why", ["values", "chart", "failed"])
def test_a_release_that_differs_is_upgraded(cilium, phase_api, fake_helm, chart, why, live_api):
    ApplyAddons().run_host(ctx_for(cilium), "(api)")
    (fake_helm / "argv").unlink()
    values = yaml.safe_load(cilium_values_yaml(cilium.inventory))
    if why == "values":
        values = {**values, "l7Proxy": True}            # someone ran helm by hand
    _deployed(fake_helm, chart, values, "failed" if why == "failed" else "deployed")
    if why == "chart":
        history = json.loads((fake_helm / "history").read_text())
        history[0]["description"] = "hiddenplane cilium-1.20.2.tgz sha256:" + "0" * 64
        (fake_helm / "history").write_text(json.dumps(history))
    dry = ApplyAddons().run_host(ctx_for(cilium, dry_run=True), "(api)")
    assert dry.detail == [f"would run helm upgrade --install cilium {CILIUM_CHART} --namespace kube-system"]
    assert not (fake_helm / "argv").exists()
    ev = ApplyAddons().run_host(ctx_for(cilium), "(api)")
    assert ev.action == "changed" and ev.detail == [f"helm upgrade --install cilium {CILIUM_CHART}"]
    assert (fake_helm / "argv").read_text().splitlines()[:2] == ["upgrade", "--install"]


def test_a_history_that_cannot_be_read_stops_the_phase(cilium, phase_api, fake_helm, chart, monkeypatch):
    _deployed(fake_helm, chart, {})
    monkeypatch.setenv("HELM_HISTORY_EXIT", "1")
    with pytest.raises(InstallerError, match=r"helm history cilium failed \(exit 1\)"):
        ApplyAddons().run_host(ctx_for(cilium), "(api)")
    assert not (fake_helm / "argv").exists()


def test_phase_reports_a_failing_helm(cilium, phase_api, fake_helm, chart, monkeypatch):
    monkeypatch.setenv("HELM_EXIT", "1")
    with pytest.raises(InstallerError, match=r"helm upgrade --install cilium failed \(exit 1\)"):
        ApplyAddons().run_host(ctx_for(cilium), "(api)")


def test_missing_helm_is_a_clear_error_before_any_request(cilium, phase_api, chart, tmp_path, monkeypatch):
    fake, _ = phase_api
    monkeypatch.setenv("PATH", str(tmp_path))                # no helm there
    with pytest.raises(InstallerError, match=r"neither the artifacts \(.*\) nor PATH has `helm`: install Helm 3"):
        ApplyAddons().run_host(ctx_for(cilium), "(api)")
    assert fake.requests == []


def test_missing_or_unlisted_chart_is_a_clear_error(cilium, phase_api, fake_helm):
    fake, _ = phase_api
    d = cilium.inventory.artifacts_dir()
    with pytest.raises(InstallerError) as e:
        ApplyAddons().run_host(ctx_for(cilium), "(api)")
    assert f"{d / CILIUM_CHART}" in str(e.value) and "helm pull cilium" in str(e.value)
    (d / CILIUM_CHART).write_bytes(b"not listed\n")
    try:
        with pytest.raises(InstallerError, match="no entry in"):
            ApplyAddons().run_host(ctx_for(cilium), "(api)")
    finally:
        (d / CILIUM_CHART).unlink()
    assert fake.requests == [] and not (fake_helm / "argv").exists()


def test_dry_run_lists_what_it_would_do(cilium, phase_api, fake_helm, chart):
    fake, asked = phase_api
    ev = ApplyAddons().run_host(ctx_for(cilium, dry_run=True), "(api)")
    assert fake.requests == [] and asked == [] and not (fake_helm / "argv").exists()
    objs = addon_objects(cilium.inventory)
    assert ev.detail[:len(objs)] == [
        f"would apply {o['kind']} {'kube-system/' if 'namespace' in o['metadata'] else ''}{o['metadata']['name']}"
        for o in objs]
    assert ev.detail[-1] == f"would run helm upgrade --install cilium {chart} --namespace kube-system"


# --- order and skipping --------------------------------------------------------------------------

def test_phase_order():
    assert PHASE_NAMES == ("connect", "preflight", "lock", "pki", "artifacts", "etcd-membership", "etcd",
                           "hosted", "control-plane", "cluster-bootstrap", "addons", "workers", "verify")
    # one name per phase, and one phase per module, named for its class (ReadEtcdMembership in
    # phases/read_etcd_membership.py)
    assert len(set(PHASE_CLASSES)) == len(PHASE_CLASSES) == len(set(PHASE_NAMES))
    # built anew for every run: nothing a phase keeps survives into the next run
    assert not set(map(id, build())) & set(map(id, build()))
    for p in build():
        snake = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", type(p).__name__).lower()
        assert type(p).__module__ == f"installer.engine.phases.{snake}", type(p)


def test_each_result_a_phase_reads_is_an_earlier_phases_declared_output(prepared):
    """What one phase hands another is a typed result it declares (Phase.produces), read with
    ctx.result: no Context field any phase may write. Every read is made earlier in the order,
    and a phase producing what it did not declare is stopped at the boundary."""
    from installer.engine.context import Bootstrapped, EtcdMembership
    from installer.engine.phases.bootstrap_cluster import BootstrapCluster
    from installer.engine.phases.join_workers import JoinWorkers
    made: set[type] = set()
    for cls in PHASE_CLASSES:
        assert set(cls.reads) <= made, f"{cls.name} reads {cls.reads} before any phase produces it"
        made |= set(cls.produces)
    assert made == {Bootstrapped, EtcdMembership}
    ctx = ctx_for(prepared)
    assert ctx.result(Bootstrapped) is None
    ctx.produce(Bootstrapped())
    assert ctx.result(Bootstrapped) == Bootstrapped() and ctx.result(EtcdMembership) is None
    runner._check_outputs(BootstrapCluster(), ctx)              # its own output: passes
    with pytest.raises(TypeError, match="phase workers produced Bootstrapped, which it does not declare"):
        runner._check_outputs(JoinWorkers(), ctx)


def test_the_etcd_members_never_change_without_the_membership_read():
    from installer.engine.context import Options
    assert runner.effective_options(Options(only=frozenset({"etcd"}))).only == {"etcd", "etcd-membership"}
    assert runner.effective_options(Options(skip=frozenset({"etcd-membership"}))).skip == {"etcd-membership", "etcd"}
    assert runner.effective_options(Options(skip=frozenset({"etcd"}))).skip == {"etcd"}   # a read alone harms nothing


def test_skipping_cluster_bootstrap_skips_addons(prepared, monkeypatch):
    o = runner.effective_options(Options(skip=frozenset({"cluster-bootstrap"})))
    assert o.skip == {"cluster-bootstrap", "addons"}
    ctx = ctx_for(prepared, skip=o.skip)
    assert not ctx.will_run("addons") and ctx.will_run("workers")
    plain = Options(skip=frozenset({"workers"}))
    assert runner.effective_options(plain) is plain
    assert ctx_for(prepared, only=frozenset({"addons"})).will_run("addons")

    seen = []

    def stop(cluster, options, log):
        seen.append(options)
        raise RuntimeError("stop here")
    monkeypatch.setattr(runner, "context", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        runner.run(resolve_cluster(prepared.inventory, prepared.state.root),
                   options=Options(skip=frozenset({"cluster-bootstrap"})))
    assert seen[0].skip == {"cluster-bootstrap", "addons"}


# --- konnectivity-server among the control binaries ----------------------------------------------

def _artifacts(d: Path, names) -> None:
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_bytes(f"#!/bin/sh\necho {n}\n".encode())
    add_files(d, list(names))


def test_konnectivity_server_is_a_control_binary_in_konnectivity_mode(prepared, cilium, tmp_path):
    assert "konnectivity-server" not in role_binaries("control")
    assert "konnectivity-server" not in role_binaries("control", prepared.inventory)
    assert role_binaries("control", cilium.inventory)[-1] == "konnectivity-server"
    assert role_binaries("worker", cilium.inventory) == role_binaries("worker")
    resolved = {n: ResolvedArtifact(n, tmp_path / n, "0" * 64) for n in ALL_BINARIES + ("konnectivity-server",)}
    for files in (binary_files(resolved, "control", cilium.inventory), binary_files(resolved, "control")):
        f = {g.path: g for g in files}["/usr/local/bin/konnectivity-server"]
        assert f.mode == 0o755 and f.restarts == ("konnectivity-server.service",)
    assert not any(g.path.endswith("konnectivity-server")
                   for g in binary_files(resolved, "control", prepared.inventory) + binary_files(resolved, "worker"))
    with pytest.raises(ArtifactError, match="not resolved: konnectivity-server"):
        binary_files({n: resolved[n] for n in ALL_BINARIES}, "control", cilium.inventory)


def test_source_dir_needs_konnectivity_server_listed(example_doc, tmp_path):
    d = copy.deepcopy(example_doc)
    d["spec"]["network"]["egress"] = "konnectivity"
    d["spec"]["artifacts"] = {"source": "dir", "path": "artifacts"}
    _artifacts(tmp_path / "artifacts", ALL_BINARIES)
    inv = api.validate(write_inventory(tmp_path, d))
    with pytest.raises(ArtifactError, match="konnectivity-server: no entry in"):
        resolve(inv, log=lambda _: None)
    _artifacts(tmp_path / "artifacts", ("konnectivity-server",))
    got = resolve(inv, log=lambda _: None)
    assert got["konnectivity-server"].path == tmp_path / "artifacts" / "konnectivity-server"


def test_source_download_with_konnectivity_says_to_use_source_dir(example_doc, tmp_path, monkeypatch):
    monkeypatch.setenv("HIDDENPLANE_DOWNLOAD_MIRROR", "http://127.0.0.1:9")      # must never be used
    d = copy.deepcopy(example_doc)
    d["spec"]["network"]["cni"] = "cilium"
    d["spec"]["artifacts"] = {"source": "download", "cacheDir": str(tmp_path / "cache")}
    inv = api.validate(write_inventory(tmp_path, d))
    with pytest.raises(ArtifactError, match=r"konnectivity-server: .*no release binary.*source: dir"):
        resolve(inv, log=lambda _: None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# --- after a CA rotation: the add-ons that call the API restart -----------------------------------

def test_ca_rotate_restarts_the_addons_whose_pods_call_the_api(prepared, cilium, client, fake):
    """Pods read the cluster CA once: after `ca rotate` CoreDNS refused the new apiserver
    certificate (x509: unknown authority) until restarted. kubectl rollout restart's way: a
    new pod-template annotation."""
    from installer.actions import rotate
    assert rotate.api_client_workloads(prepared.inventory) == [("Deployment", "kube-system", "coredns")]
    assert rotate.api_client_workloads(cilium.inventory) == [
        ("Deployment", "kube-system", "coredns"), ("DaemonSet", "kube-system", "konnectivity-agent"),
        ("DaemonSet", "kube-system", "cilium"), ("Deployment", "kube-system", "cilium-operator")]
    dep = next(o for o in coredns_objects(prepared.inventory) if o["kind"] == "Deployment")
    fake.put(copy.deepcopy(dep))
    assert kube.restart_workload(client, "Deployment", "kube-system", "coredns", "2026-12-02T02:30:00Z")
    method, path, body = fake.requests[-1]
    assert (method, path) == ("PATCH", item_path(dep))
    assert body == {"spec": {"template": {"metadata": {"annotations": {kube.RESTARTED_AT: "2026-12-02T02:30:00Z"}}}}}
    # absent (e.g. no konnectivity agents): nothing to restart, no error
    assert not kube.restart_workload(client, "DaemonSet", "kube-system", "konnectivity-agent", "x")
    steps = rotate.rotate_plan(prepared.inventory, ["ca"], use_api=True)
    assert any("restart the add-ons whose pods call the API (kube-system/coredns)" in s for s in steps)
    assert not any("restart the add-ons" in s for s in rotate.rotate_plan(prepared.inventory, ["etcd/ca"], True))
