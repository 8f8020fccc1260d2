"""A hosted tenant on the real lab (docs/hosted.md): its etcd, kube-apiserver (with its
konnectivity server), controller-manager and scheduler run as pods of the real-cluster lab (the
hosting cluster, volumes from a real dynamic provisioner: local-path-provisioner built from its
Go module), its two workers (w3, w4: nspawn hosts of the same lab network) join over SSH as
any cluster's do.

Real: the hosting cluster and every tenant component (the images built from their Go modules by
scripts/build-kubernetes, imported on the hosting workers), etcd's membership-aware start, TLS,
kubectl. Nothing stands in for anything.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from installer.core import versions
from installer.core.artifacts import read_sums
from installer.core.inventory_hosted import hosted_images
from installer.core.pki import issue
from installer.core.render.addons import netpol
from installer.lab import net
from installer.lab import tenant as lab_tenant

from . import hostprobes, probeloop
from .builtfixtures import ETCD_FROM, UPGRADE_TO, e2e_dir, hosted_etcd_image, upgrade_artifacts_dir
from .labfixtures import wait_for
from .realcluster import BUSYBOX, ECHO_TIMEOUT, INSTALLER, RealCluster, echo_workload, run_installer
from .realcluster import NAME as LAB
from .test_real_cluster import _csr_for

pytestmark = [pytest.mark.lab, pytest.mark.real]

ROOT = Path(__file__).resolve().parent.parent
STORAGE = ROOT / "installer" / "lab" / "manifests" / "local-path-storage.yaml"
TENANT, NS = "tenant", "hp-tenant"
API_PORT, KONNECTIVITY_PORT = 30443, 30132
A_WORKERS, B_WORKERS, C_WORKERS = ("w3", "w4"), ("w5",), ("w6",)      # tests/realcluster.py TENANT_WORKERS
AGNHOST_ARCHIVE, AGNHOST = "image-agnhost.tar", "registry.k8s.io/e2e-test-images/agnhost:2.66.1"


class Tenant:
    def __init__(self, rc: RealCluster, inventory: Path, state: Path, kubeconfig: Path, report: dict,
                 seconds: float):
        self.rc, self.inventory, self.state, self.kubeconfig = rc, inventory, state, kubeconfig
        self.report, self.seconds = report, seconds

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
                ) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.rc.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, timeout=timeout, input=stdin)
        if check:
            assert proc.returncode == 0, f"tenant kubectl {' '.join(args)}: rc={proc.returncode}\n{proc.stderr[-2000:]}"
        return proc

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


def tenant_inventory(rc: RealCluster, tmp: Path, name: str = "tenant", workers: tuple[str, ...] = A_WORKERS,
                     ports: tuple[int, int] = (API_PORT, KONNECTIVITY_PORT), etcd: int = 3,
                     etcd_version: str | None = None, spread: str = "preferred") -> Path:
    """A tenant: ``workers`` (w3 and w4), its control plane in the real cluster, exposed on the
    hosting workers' addresses (NodePort ``ports``); its etcd at ``etcd_version`` (else the default).
    Written as `installer lab up --hosting --tenant-workers` writes it (lab/tenant.py). ``spread``
    preferred: the lab's hosting cluster has two workers, too few to give three etcd members a
    node each (what lab up chooses there too; the product's default is required)."""
    hosting = yaml.safe_load(rc.inventory.read_text())
    hosts = [{"name": w, "address": rc.address(w), "role": "worker"} for w in workers]
    artifacts = worker_artifacts(Path(hosting["spec"]["artifacts"]["path"]), tmp.parent)
    doc = lab_tenant.tenant_doc(hosting, hosts, str(rc.kubeconfig), artifacts, name, ports, etcd, spread,
                                upstream_dns=[rc.address("cp1")])    # the tests' resolver
    if etcd_version:
        doc["spec"]["artifacts"]["versions"] = {**doc["spec"]["artifacts"].get("versions", {}), "etcd": etcd_version}
    path = tmp / f"{name}.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def worker_artifacts(src: Path, tmp: Path, name: str = "tenant-artifacts") -> Path:
    """The hosting lab's artifacts as a tenant's workers get them (lab/tenant.py), and agnhost
    (upstream's test image, built with the conformance suite) for the admission webhook a
    tenant pod serves."""
    e2e = e2e_dir()
    return lab_tenant.tenant_artifacts(src, tmp / name, {
        AGNHOST_ARCHIVE: (e2e / AGNHOST_ARCHIVE, read_sums(e2e)[AGNHOST_ARCHIVE])})


def import_pinned(rc: RealCluster, archives: list[Path], refs: list[str]) -> None:
    """Image archives imported on every hosting worker (lab tooling: with a registry, the
    kubelets pull them), pinned as the installer pins what it imports: the lab's disk is near
    the kubelet's image GC threshold, and nothing could pull them back."""
    for w in rc.workers:
        for archive in archives:
            with open(archive, "rb") as f:
                subprocess.run(["ssh", "-F", str(rc.lab.ssh_config), w, "/usr/local/bin/ctr -n k8s.io images import -"],
                               stdin=f, check=True, capture_output=True, timeout=300)
        pin = rc.ssh(w, f"for r in {' '.join(refs)}; do /usr/local/bin/ctr -n k8s.io images label $r "
                        "io.cri-containerd.pinned=pinned >/dev/null || exit 1; done")
        assert pin.returncode == 0, pin.stderr


def install_storage(rc: RealCluster) -> None:
    """The hosting cluster's provisioner (lab tooling): applied once, ready before any tenant."""
    rc.kubectl("apply", "-f", str(STORAGE))
    rc.kubectl("-n", "local-path-storage", "rollout", "status", "deployment/local-path-provisioner",
               "--timeout=300s", timeout=330)


def remove_namespace(rc: RealCluster, ns: str) -> None:
    """A tenant's namespace going (test teardown), no pod or budget of it left in the API when
    this returns: the next tests drain the hosting workers, which a tenant's budget or a pod
    still terminating there holds (deleting the budgets before the pods: CI of 23b311f). The
    pods are deleted at once (their graceful stops took most of a minute); the namespace, in
    terminating, lets no controller make new ones, and its volumes go on being deleted while
    the next tests run."""
    rc.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    rc.kubectl("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0", "--wait=false", check=False)
    wait_for(f"{ns}'s pods and PodDisruptionBudgets gone", lambda: not rc.get("pods", "-n", ns)["items"]
             and not rc.get("poddisruptionbudgets", "-n", ns)["items"], timeout=120)


@pytest.fixture(scope="module")
def tenant(real_cluster: RealCluster, tmp_path_factory) -> Tenant:
    rc = real_cluster
    # debugging: a tenant of an earlier run kept (its state there), with HIDDENPLANE_REAL_REUSE
    kept = os.environ.get("HIDDENPLANE_TENANT_DIR")
    tmp = Path(kept) if kept else tmp_path_factory.mktemp("tenant")
    install_storage(rc)
    # its etcd one patch behind the default: the upgrade test rolls it first (the hosting
    # cluster's archives hold the default's image only)
    import_pinned(rc, [hosted_etcd_image(ETCD_FROM)],
                  [hosted_images("registry.k8s.io", versions.DEFAULT_KUBERNETES_VERSION, ETCD_FROM)["etcd"]])
    inventory, state = tenant_inventory(rc, tmp, etcd_version=ETCD_FROM), tmp / "state"
    started = time.monotonic()
    proc = run_installer("apply", str(inventory), "--state", str(state), "--output", "json", "--wait-timeout", "900")
    seconds = time.monotonic() - started
    kubeconfig = tmp / "tenant.kubeconfig"
    run_installer("kubeconfig", str(inventory), "--state", str(state), "-o", str(kubeconfig))
    print(f"\nhosted tenant: apply {seconds:.0f} s")
    yield Tenant(rc, inventory, state, kubeconfig, json.loads(proc.stdout), seconds)
    if not kept:
        # the hosting cluster as the tests after these found it: no PodDisruptionBudget of the
        # tenant holding a drain of its workers, its pods going. Not a whole `reset` (the second
        # tenant's test proves that): its workers are not the hosting cluster's, and the
        # namespace's volumes go on being deleted while the next tests run (a reset waits ~55 s).
        remove_namespace(rc, NS)


def test_the_tenant_shows_its_own_workers_only(tenant: Tenant, tenant_b):
    nodes = tenant.get("nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(A_WORKERS)
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
               for n in nodes)
    # and the hosting cluster runs its control plane, in its namespace only
    pods = tenant.rc.get("pods", "-n", NS)["items"]
    names = sorted(p["metadata"]["name"].rsplit("-", 2)[0] if not p["metadata"]["name"].startswith("etcd-")
                   else "etcd" for p in pods)
    assert names.count("etcd") == 3 and names.count("kube-apiserver") == 2, names
    # admitted by a namespace enforcing Pod Security "restricted": not one of them runs as root
    labels = tenant.rc.get("namespace", NS)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
    assert all(p["spec"]["securityContext"].get("runAsNonRoot") and p["spec"]["securityContext"]["runAsUser"] != 0
               for p in pods), [p["spec"].get("securityContext") for p in pods]
    hosting_nodes = {n["metadata"]["name"] for n in tenant.rc.get("nodes")["items"]}
    assert not hosting_nodes & {n["metadata"]["name"] for n in nodes}
    # sized (Burstable: requests on every container, not BestEffort), ahead of ordinary workloads,
    # within the namespace's quota
    assert {p["status"]["qosClass"] for p in pods} == {"Burstable"}, [p["status"]["qosClass"] for p in pods]
    assert {p["spec"]["priorityClassName"] for p in pods} == {f"hiddenplane-tenant-{NS}"}
    assert {p["spec"]["priority"] for p in pods} == {1_000_000}
    quota = tenant.rc.get("resourcequota", "tenant", "-n", NS)["status"]
    assert int(quota["used"]["pods"]) == len(pods) <= int(quota["hard"]["pods"]), quota


def test_a_second_apply_changes_and_restarts_nothing(tenant: Tenant):
    proc = run_installer("apply", str(tenant.inventory), "--state", str(tenant.state), "--output", "json")
    report = json.loads(proc.stdout)
    assert report["changes"] == 0 and report["restarts"] == [], [e for e in report["events"]
                                                                 if e["action"] == "changed"]
    # and plan --check, reading the hosting cluster's objects and the tenant's, finds nothing to do
    plan = run_installer("plan", str(tenant.inventory), "--state", str(tenant.state), "--check", "--output", "json")
    assert json.loads(plan.stdout)["changes"] == 0


def test_a_wrong_state_directory_is_refused_before_anything_changes(tenant: Tenant, tmp_path):
    """An apply from another state directory stops before the lock and any change, naming the
    namespace: a new one by the ownership guard (the namespace records the state that applied it,
    core/tenancy.py); a copy of the tenant's state whose CA is another (as a copy from before a
    rotation) by the CA guard, which reads the tenant's CA files in the hosting cluster."""
    before = tenant.rc.get("secret", "kube-apiserver-files", "-n", NS)["metadata"]["resourceVersion"]
    proc = run_installer("apply", str(tenant.inventory), "--state", str(tmp_path / "other"), check_rc=2)
    assert f"namespace {NS} in the hosting cluster holds another tenant named tenant" in proc.stderr, proc.stderr
    assert "this state's none" in proc.stderr and "nothing was changed" in proc.stderr, proc.stderr
    copy = tmp_path / "copy"
    shutil.copytree(tenant.state, copy)
    for ext in ("crt", "key"):
        (copy / "pki" / f"ca.{ext}").unlink()
    proc = run_installer("apply", str(tenant.inventory), "--state", str(copy), check_rc=2)
    assert f"hosting namespace {NS} /etc/kubernetes/pki/ca.crt: the host trusts kubernetes-ca" in proc.stderr, \
        proc.stderr
    assert tenant.rc.get("secret", "kube-apiserver-files", "-n", NS)["metadata"]["resourceVersion"] == before
    owner = tenant.rc.get("configmap", "hiddenplane-owner", "-n", NS)["data"]
    assert owner == {"tenant": "tenant", "state": (tenant.state / "tenant-id").read_text().strip()}, owner


def test_the_tenants_apply_lock_refuses_another_holder(tenant: Tenant):
    """The tenant's apply lock is a Lease in its namespace: held by another run, an apply stops
    before any change (exit 3, naming the holder); given back, the next apply runs."""
    import datetime as dt
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "hiddenplane-apply", "namespace": NS},
             "spec": {"holderIdentity": "another-run", "leaseDurationSeconds": 3600, "renewTime": now}}
    tenant.rc.kubectl("create", "-f", "-", stdin=json.dumps(lease))
    try:
        proc = run_installer("apply", str(tenant.inventory), "--state", str(tenant.state), check_rc=3)
        assert "held by run another-run" in proc.stderr and "nothing was changed" in proc.stderr, proc.stderr
    finally:
        tenant.rc.kubectl("delete", "lease", "hiddenplane-apply", "-n", NS)
    run_installer("apply", str(tenant.inventory), "--state", str(tenant.state))
    # and it was given back
    assert tenant.rc.kubectl("get", "lease", "hiddenplane-apply", "-n", NS, check=False).returncode != 0


# --- the tenant's pods, and its apiservers reaching them ------------------------------------------



def run_pod(t: Tenant, name: str, node: str, command: str, timeout: float = 300) -> dict:
    spec = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", command]}]}}
    t.kubectl("apply", "-f", "-", stdin=json.dumps(spec))
    return wait_for(f"tenant pod {name} Running", lambda: (p := t.get("pod", name))["status"].get("phase") == "Running"
                    and p, timeout=timeout)


def test_logs_exec_and_port_forward_go_through_konnectivity_and_pods_reach_the_api(tenant: Tenant):
    """The tenant's apiservers are pods of another cluster: they reach the tenant's kubelets only
    through the konnectivity agents' tunnels (exec, logs, port-forward); the tenant's pods reach
    them at kubernetes.default through their own node's balancer."""
    run_pod(tenant, "web", "w3", "echo hello-tenant > /tmp/index.html; exec httpd -f -v -p 8080 -h /tmp")
    assert tenant.kubectl("exec", "web", "--", "cat", "/tmp/index.html").stdout.strip() == "hello-tenant"
    forward = subprocess.Popen([tenant.rc.kubectl_bin, "--kubeconfig", str(tenant.kubeconfig), "port-forward",
                                "pod/web", "18089:8080"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = wait_for("port-forward answers", lambda: _get("http://127.0.0.1:18089/"), timeout=60, interval=1)
        assert body.strip() == "hello-tenant"
    finally:
        forward.terminate()
        forward.wait(timeout=30)
    logs = wait_for("web logs the request", lambda: tenant.kubectl("logs", "web").stdout.strip(), timeout=60)
    assert "GET /" in logs or logs, logs
    out = tenant.kubectl("exec", "web", "--", "nslookup", "kubernetes.default.svc.cluster.local", "10.97.0.10").stdout
    assert "10.97.0.1" in out, out
    reach = tenant.kubectl("exec", "web", "--", "sh", "-c", "nc -w 5 10.97.0.1 443 </dev/null && echo reached").stdout
    assert "reached" in reach
    # the same Service address from the node, TLS verified against the tenant's CA (busybox's
    # TLS has none of the apiserver's cipher suites): a tenant apiserver answers it
    r = tenant.rc.ssh("w3", "python3 -c \"import ssl, urllib.request as u; "
                            "c = ssl.create_default_context(cafile='/etc/kubernetes/pki/ca.crt'); "
                            "print(u.urlopen('https://10.97.0.1/readyz', context=c, timeout=10).read().decode())\"")
    assert r.stdout.strip() == "ok", r.stderr


def _get(url: str) -> str:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


# --- etcd: a member lost, with and without its volume ----------------------------------------------

ETCDCTL = ("/usr/local/bin/etcdctl --endpoints=https://127.0.0.1:2379 --cacert=/etc/etcd/pki/ca.crt "
           "--cert=/etc/etcd/pki/peer.crt --key=/etc/etcd/pki/peer.key")


def members(t: Tenant, via: str) -> list[list[str]]:
    out = t.rc.kubectl("-n", NS, "exec", via, "--", "/bin/sh", "-c", f"{ETCDCTL} member list -w simple").stdout
    return [line.split(", ") for line in out.strip().splitlines()]


def etcd_ready(t: Tenant) -> None:
    wait_for("etcd 3/3 ready", lambda: (s := t.rc.get("statefulset", "etcd", "-n", NS))["status"].get(
        "readyReplicas") == 3 and s["status"].get("updatedReplicas") == 3, timeout=600)


def test_an_etcd_member_comes_back_with_its_volume_and_without_it(tenant: Tenant):
    tenant.kubectl("delete", "configmap", "before-loss", "after-loss", "--ignore-not-found")
    tenant.kubectl("create", "configmap", "before-loss", "--from-literal=k=v1")
    tenant.rc.kubectl("-n", NS, "delete", "pod", "etcd-1", "--wait=true", timeout=180)
    etcd_ready(tenant)
    assert tenant.get("configmap", "before-loss")["data"] == {"k": "v1"}
    ids = {m[2]: m[0] for m in members(tenant, "etcd-2")}
    # its volume gone: a new claim, an empty directory; the member removes its old self and joins
    tenant.rc.kubectl("-n", NS, "delete", "pvc", "data-etcd-0", "--wait=false")
    tenant.rc.kubectl("-n", NS, "delete", "pod", "etcd-0", "--wait=true", timeout=180)
    etcd_ready(tenant)
    after = members(tenant, "etcd-2")
    assert sorted(m[2] for m in after) == ["etcd-0", "etcd-1", "etcd-2"] and all(m[1] == "started" for m in after)
    new_ids = {m[2]: m[0] for m in after}
    assert new_ids["etcd-0"] != ids["etcd-0"] and new_ids["etcd-1"] == ids["etcd-1"], (ids, new_ids)
    # (its start may take a restart or two: the other members check a peer's address against
    # its certificate's names in DNS, which the hosting cluster's DNS caches for 30 s)
    restarts = tenant.rc.get("pod", "etcd-0", "-n", NS)["status"]["containerStatuses"][0]["restartCount"]
    print(f"\netcd-0 with a new volume: member {ids['etcd-0']} removed, {new_ids['etcd-0']} added; "
          f"{restarts} restart(s) of its start")
    # nothing lost, and the cluster writes again
    assert tenant.get("configmap", "before-loss")["data"] == {"k": "v1"}
    tenant.kubectl("create", "configmap", "after-loss", "--from-literal=k=v2")
    # the rejoined member serves it too
    out = tenant.rc.kubectl("-n", NS, "exec", "etcd-0", "--", "/bin/sh", "-c",
                            f"{ETCDCTL} get /registry/configmaps/default/after-loss --keys-only").stdout
    assert "after-loss" in out


def test_a_snapshot_is_restored_into_the_running_tenant(tenant: Tenant, tmp_path):
    """`etcd members`, `etcd snapshot save` and `etcd snapshot restore` on a tenant (through the
    hosting API's pods/exec): after the restore the objects of the snapshot are back, one written
    after it is gone, the members form a new cluster, the workers are Ready, writes work."""
    listed = json.loads(run_installer("etcd", "members", str(tenant.inventory), "--state", str(tenant.state),
                                     "--output", "json").stdout)
    assert sorted(m["name"] for m in listed) == ["etcd-0", "etcd-1", "etcd-2"], listed
    tenant.kubectl("delete", "configmap", "snap-before", "snap-after", "after-restore", "--ignore-not-found")
    tenant.kubectl("create", "configmap", "snap-before", "--from-literal=k=kept")
    snap = tmp_path / "tenant.db"
    saved = json.loads(run_installer("etcd", "snapshot", "save", str(tenant.inventory), str(snap),
                                     "--state", str(tenant.state), "--output", "json").stdout)
    assert snap.stat().st_mode & 0o777 == 0o600 and saved["size"] == snap.stat().st_size > 0, saved
    assert saved["revision"] > 1 and saved["total_keys"] > 100, saved
    # nothing of it stays in the member's volume
    left = tenant.rc.kubectl("-n", NS, "exec", saved["host"], "--", "/bin/sh", "-c", "echo /var/lib/etcd/*").stdout
    assert left.split() == ["/var/lib/etcd/data"], left
    tenant.kubectl("create", "configmap", "snap-after", "--from-literal=k=gone")
    plan = run_installer("etcd", "snapshot", "restore", str(tenant.inventory), str(snap), "--state",
                         str(tenant.state), "--dry-run").stdout
    assert "nothing is stopped yet" in plan and "delete every etcd member's pod" in plan, plan

    started = time.monotonic()
    proc = run_installer("etcd", "snapshot", "restore", str(tenant.inventory), str(snap), "--state",
                         str(tenant.state), "--yes", "--wait-timeout", "300", timeout=900)
    seconds = time.monotonic() - started
    assert "restored" in proc.stdout and "[5/5]" in proc.stderr, proc.stderr
    assert tenant.get("configmap", "snap-before")["data"] == {"k": "kept"}
    gone = tenant.kubectl("get", "configmap", "snap-after", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stdout
    after = members(tenant, "etcd-1")
    assert sorted(m[2] for m in after) == ["etcd-0", "etcd-1", "etcd-2"] and all(m[1] == "started" for m in after)
    assert not {m["id"] for m in listed} & {m[0] for m in after}, "the restored members are a new cluster"

    def workers_ready() -> bool:
        nodes = tenant.get("nodes")["items"]
        return len(nodes) == len(A_WORKERS) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]) for n in nodes)
    wait_for("the tenant's workers Ready after the restore", workers_ready, timeout=300)
    back = time.monotonic() - started
    tenant.kubectl("create", "configmap", "after-restore", "--from-literal=k=v")
    # a pod made now starts on each tenant worker: their kubelets' watches, resumed from revisions
    # the restored cluster is below, are refused as compacted and list again (etcd_rules,
    # RESTORE_FLAGS; without, a pod bound to w4 stayed Pending with no status for 5 min)
    for w in A_WORKERS:
        run_pod(tenant, f"after-restore-{w}", w, "sleep 3600", timeout=120)
    tenant.kubectl("delete", "pod", *(f"after-restore-{w}" for w in A_WORKERS), "--wait=false")
    print(f"\netcd snapshot restore into the running tenant: {seconds:.0f} s (workers Ready {back:.0f} s after "
          f"its start); snapshot {saved['size']} bytes, {saved['total_keys']} keys")


# --- an admission webhook served by a tenant pod -----------------------------------------------------

def _webhook_tls(tmp: Path) -> tuple[bytes, bytes, bytes]:
    """A CA of the test's own and a serving pair for the webhook's Service name."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "webhook-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "webhook")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("webhook.default.svc")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def test_a_validating_webhook_served_by_a_tenant_pod_is_called(tenant: Tenant, tmp_path, neighbour):
    """The tenant's apiservers call a webhook whose server is a pod on a tenant worker (upstream's
    agnhost, its configmaps handler): through konnectivity, as no route leads from the hosting
    cluster's pods to the tenant's Service addresses. Then by URL (``url_webhooks``). (The
    neighbour's control plane comes up beside this and the next tests: ``neighbour``.)"""
    import base64
    ca, cert, key = _webhook_tls(tmp_path)
    objects = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "webhook-tls"}, "type": "kubernetes.io/tls",
         "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "webhook", "labels": {"app": "webhook"}},
         "spec": {"nodeName": "w4", "terminationGracePeriodSeconds": 1,
                  "containers": [{"name": "agnhost", "image": AGNHOST, "imagePullPolicy": "Never",
                                  "args": ["webhook", "--tls-cert-file=/tls/tls.crt",
                                           "--tls-private-key-file=/tls/tls.key", "--port=8443"],
                                  "volumeMounts": [{"name": "tls", "mountPath": "/tls", "readOnly": True}]}],
                  "volumes": [{"name": "tls", "secret": {"secretName": "webhook-tls"}}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "webhook"},
         "spec": {"selector": {"app": "webhook"}, "ports": [{"port": 443, "targetPort": 8443}]}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "guarded", "labels": {"webhook": "on"}}},
    ]
    for o in objects:
        tenant.kubectl("apply", "-f", "-", stdin=json.dumps(o))
    try:
        wait_for("the webhook pod ready", lambda: any(c.get("ready") for c in tenant.get("pod", "webhook")[
            "status"].get("containerStatuses", [])), timeout=300)
    except BaseException:
        # a local run of a667e16 met it once, cause unknown: what the pod and w4's images say
        print(tenant.kubectl("describe", "pod", "webhook", check=False).stdout[-4000:])
        print(tenant.rc.ssh("w4", "crictl images; journalctl -u kubelet --no-pager -n 40").stdout[-4000:])
        raise
    config = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
              "metadata": {"name": "tenant-test"},
              "webhooks": [{"name": "configmaps.tenant-test.example", "admissionReviewVersions": ["v1"],
                            "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10,
                            "namespaceSelector": {"matchLabels": {"webhook": "on"}},
                            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                       "resources": ["configmaps"]}],
                            "clientConfig": {"caBundle": base64.b64encode(ca).decode(), "service": {
                                "namespace": "default", "name": "webhook", "path": "/configmaps", "port": 443}}}]}
    tenant.kubectl("apply", "-f", "-", stdin=json.dumps(config))
    try:
        denied = wait_for("the webhook denies", lambda: (r := tenant.kubectl(
            "-n", "guarded", "create", "configmap", "bad", "--from-literal=webhook-e2e-test=webhook-disallow",
            check=False)).returncode != 0 and "unwanted key and value" in r.stderr and r.stderr, timeout=60)
        print(f"\nwebhook: {denied.strip()[-200:]}")
        tenant.kubectl("-n", "guarded", "create", "configmap", "good", "--from-literal=k=v")
        url_webhooks(tenant, config)
    finally:
        tenant.kubectl("delete", "validatingwebhookconfiguration", "tenant-test", "--ignore-not-found")
        tenant.rc.kubectl("delete", "namespace", "webhook-target", "--ignore-not-found", "--wait=false")


def url_webhooks(tenant: Tenant, config: dict) -> None:
    """The tenant's admin gives its webhook a URL (the hosted apiserver's ``controlplane``
    egress, render/tenant.py). Aimed at the tenant's own webhook pod by its address in the
    tenant's pod network, the call gets as far as its TLS (the serving certificate names the
    Service only): dialled from the tenant's network. Aimed at a pod of the hosting cluster
    (a listener in a namespace of the lab's), the call fails and the listener sees nothing: the
    apiserver pod, which sits in that network, never dials it."""
    rc = tenant.rc
    listener = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "listener", "namespace": "webhook-target"},
                "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                    "name": "nc", "image": BUSYBOX, "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "echo listening; while true; do nc -l -p 9443 </dev/null >/dev/null; "
                                "echo connection; done"]}]}}
    rc.kubectl("create", "namespace", "webhook-target")
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(listener))
    ip = wait_for("the hosting listener running", lambda: (p := rc.get("pod", "listener", "-n", "webhook-target"))[
        "status"].get("phase") == "Running" and p["status"].get("podIP"), timeout=120)
    wait_for("it listens", lambda: "listening" in rc.kubectl("logs", "listener", "-n", "webhook-target").stdout,
             timeout=60)
    # the listener answers from the hosting cluster's own network (the control: it would see a call)
    seen = rc.ssh(rc.workers[0], f"python3 -c 'import socket; socket.create_connection((\"{ip}\", 9443), 5).close()'")
    assert seen.returncode == 0, seen.stderr
    wait_for("the control connection seen", lambda: rc.kubectl("logs", "listener", "-n", "webhook-target")
             .stdout.count("connection") == 1, timeout=30)
    pod_ip = tenant.get("pod", "webhook")["status"]["podIP"]
    hook = config["webhooks"][0]
    for target, url, says in (("tenant", f"https://{pod_ip}:8443/configmaps", "x509"),
                              ("hosting", f"https://{ip}:9443/configmaps", None)):
        hook["clientConfig"] = {"caBundle": hook["clientConfig"]["caBundle"], "url": url}
        hook["timeoutSeconds"] = 5
        tenant.kubectl("apply", "-f", "-", stdin=json.dumps(config))
        proc = wait_for(f"the {target} URL called", lambda: (r := tenant.kubectl(
            "-n", "guarded", "create", "configmap", f"via-{target}", "--from-literal=k=v", check=False)).returncode != 0
            and url.split("/configmaps")[0] in r.stderr and r, timeout=60)
        print(f"\nURL webhook at the {target} pod: {proc.stderr.strip()[-300:]}")
        if says:
            assert says in proc.stderr, proc.stderr
    time.sleep(3)
    logs = rc.kubectl("logs", "listener", "-n", "webhook-target").stdout
    assert logs.count("connection") == 1, logs          # the control's only


# --- a tenant under attack: a leaked join token, a stolen kubelet certificate ------------------------

KUBELET_CLIENT = "/var/lib/kubelet/pki/kubelet-client-current.pem"


def _https(url: str, ca: Path, pem: Path | None = None, token: str | None = None, method: str = "GET",
           body: dict | None = None) -> tuple[int, str]:
    import ssl
    import urllib.error
    import urllib.request
    ctx = ssl.create_default_context(cafile=str(ca))
    if pem is not None:
        ctx.load_cert_chain(str(pem))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_tenant_workers_join_token_mints_no_other_node(tenant: Tenant):
    """w3's token, leaked: once w3 joined it authenticates nobody; made valid again (its Secret
    back, as if stolen before w3 joined) it asks for a certificate for w4, which nothing approves
    and the next apply denies, naming w3."""
    t = yaml.safe_load((tenant.state / "secrets" / "tokens.yaml").read_text())["w3"]
    token, ca = f"{t['id']}.{t['secret']}", tenant.state / "pki" / "ca.crt"
    url = f"https://{tenant.rc.address(tenant.rc.workers[0])}:{API_PORT}"
    wait_for("the used token refused", lambda: _https(f"{url}/api", ca, token=token)[0] == 401, timeout=30, interval=1)
    tenant.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
        "metadata": {"name": f"bootstrap-token-{t['id']}", "namespace": "kube-system"},
        "stringData": {"token-id": t["id"], "token-secret": t["secret"], "usage-bootstrap-authentication": "true",
                       "auth-extra-groups": "system:bootstrappers:hiddenplane"}}))
    code, answer = wait_for("the token authenticates again", lambda: (r := _https(
        f"{url}/apis/certificates.k8s.io/v1/certificatesigningrequests", ca, token=token, method="POST",
        body=_csr_for("w4")))[0] == 201 and r, timeout=30, interval=1)
    name = json.loads(answer)["metadata"]["name"]
    time.sleep(10)           # room for the controller-manager to approve, if anything let it
    assert not (tenant.get("csr", name).get("status") or {}).get("conditions")
    report = json.loads(run_installer("apply", str(tenant.inventory), "--state", str(tenant.state), "--output",
                                      "json").stdout)
    lines = [d for e in report["events"] if e["host"] == "(api)" for d in e["detail"]]
    [line] = [d for d in lines if f"CSR {name}:" in d]
    assert line.startswith("denied") and "belongs to node w3" in line, line
    assert [c["type"] for c in tenant.get("csr", name)["status"]["conditions"]] == ["Denied"]
    print(f"\n{line}")


# a TLS client on a hosting worker: a GET of etcd's peer API (/members) with each pair given
# (PEMs on stdin, loaded from memory: nothing written on the host); prints its status line or
# why the connection failed
PEER_PROBE = r"""
import json, os, socket, ssl, sys
d = json.load(sys.stdin)
out = {}
for name, pem in d["pairs"].items():
    fd = os.memfd_create(name)
    os.write(fd, pem.encode())
    ctx = ssl.create_default_context(cadata=d["ca"])
    ctx.check_hostname = False
    ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    try:
        with socket.create_connection((d["ip"], 2380), timeout=10) as raw, ctx.wrap_socket(raw) as t:
            t.sendall(b"GET /members HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n")
            # TLS 1.3: a refused client certificate shows at the first read, as an alert or EOF
            out[name] = t.recv(4096).split(b"\r\n")[0].decode() or "failed: closed without an answer"
    except (OSError, ssl.SSLError) as e:
        out[name] = f"failed: {e}"
print(json.dumps(out))
"""


def test_a_holder_of_another_etcd_ca_certificate_is_no_peer_of_the_tenants_etcd(tenant: Tenant):
    """Root on the hosting worker running a member, holding what an apiserver pod holds (the etcd
    CA's client certificate) or a member's server certificate: the member's peer port refuses
    it, since its members check the peer certificate's CN (render/tenant.py). The members' own
    peer certificate, from the same place, is answered: the refusals are the check, not the
    network. From another hosting worker nothing gets there at all: a node reaches its own pods
    only, the tenant's NetworkPolicies drop the rest (render/tenant_network.py)."""
    rc, pki = tenant.rc, tenant.state / "pki"
    pod = rc.get("pod", "etcd-0", "-n", NS)
    ip, home = pod["status"]["podIP"], pod["spec"]["nodeName"]
    other = next(w for w in rc.workers if w != home)

    def pem(name: str) -> str:
        return (pki / f"{name}.crt").read_text() + (pki / f"{name}.key").read_text()
    data = {"ip": ip, "ca": (pki / "etcd" / "ca.crt").read_text(),
            "pairs": {"peer": pem("etcd/peer-hosted"), "apiserver": pem("apiserver-etcd-client"),
                      "server": pem("etcd/server-hosted"), "healthcheck": pem("etcd/healthcheck-client")}}
    seen = {}
    for w in (home, other):
        proc = subprocess.run(["ssh", "-F", str(rc.lab.ssh_config), w, "python3 -c " + shlex.quote(PEER_PROBE)],
                              input=json.dumps(data), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        seen[w] = json.loads(proc.stdout)
        print(f"\netcd-0's peer port ({ip}:2380) from {w}: {seen[w]}")
    assert seen[home]["peer"].startswith("HTTP/1.1 200"), seen
    for name in ("apiserver", "server", "healthcheck"):
        assert seen[home][name].startswith("failed:") and "timed out" not in seen[home][name], seen
    assert all(v == "failed: timed out" for v in seen[other].values()), seen


# --- a pod of another namespace: the tenant's NetworkPolicies, enforced ----------------------------

# tenant component -> (ports reached from elsewhere, ports that must not be)
EXPOSURE = {"etcd": ((), (2379, 2380)), "kube-apiserver": ((6443, 8132), (8133, 8134)),
            "kube-controller-manager": ((), (10257,)), "kube-scheduler": ((), (10259,))}


def test_a_pod_of_another_namespace_reaches_only_the_tenants_exposed_ports(tenant: Tenant):
    """An intruder pod on each hosting worker, in a namespace of its own, wearing the tenant's
    apiserver labels, dials every port of every pod of the tenant (and of each etcd member's
    Service) at once: only the apiservers'
    secure port and the konnectivity agents' port answer (what the Service exposes anyway, TLS
    in front); etcd's client and peer ports, konnectivity's admin and health ports and the
    controllers' are dropped (timed out, not refused: the packets never got there). The ports
    that answer are the control: the intruders reach the tenant's pods on their own node and the
    other, and only the policies stop the rest. And apply said it had checked: its probe's line."""
    rc = tenant.rc
    pods = [p for p in rc.get("pods", "-n", NS)["items"]
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp")]
    targets = []
    for p in pods:
        allowed, denied = EXPOSURE[p["metadata"]["labels"]["app.kubernetes.io/name"]]
        targets += [(p["metadata"]["name"], p["status"]["podIP"], port, port in allowed) for port in allowed + denied]
    assert {n.split("-")[0] for n, *_ in targets} == {"etcd", "kube"}, targets
    # and each etcd member's own Service (its ClusterIP: the address a roll never changes) and
    # the apiservers' etcd-near, where an intruder would look first: dropped as the pods' are
    services = {x["metadata"]["name"]: x for x in rc.get("services", "-n", NS)["items"]
                if x["metadata"]["name"].startswith("etcd-")}
    assert sorted(services) == ["etcd-0", "etcd-1", "etcd-2", "etcd-near"], sorted(services)
    targets += [(f"Service {name}", x["spec"]["clusterIP"], port, False)
                for name, x in services.items() for port in ((2379,) if name == "etcd-near" else (2379, 2380))]
    print(f"\nthe tenant's pods by hosting worker: "
          f"{sorted((p['spec']['nodeName'], p['metadata']['name']) for p in pods)}")
    rc.kubectl("create", "namespace", "intruder")
    try:
        for w in rc.workers:
            intruder = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": f"intruder-{w}", "namespace": "intruder",
                "labels": {"hiddenplane.io/tenant": "tenant", "app.kubernetes.io/name": "kube-apiserver"}},
                "spec": {"nodeName": w, "terminationGracePeriodSeconds": 1, "containers": [{
                    "name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}}
            rc.kubectl("apply", "-f", "-", stdin=json.dumps(intruder))
        for w in rc.workers:
            wait_for(f"the intruder on {w} running", lambda: rc.get("pod", f"intruder-{w}", "-n", "intruder")[
                "status"].get("phase") == "Running", timeout=120)
        # (the busybox image has no /tmp: nc's message is taken in a variable, its status with it)
        script = " ".join(f'(r=$(nc -w 3 {ip} {port} </dev/null 2>&1 >/dev/null); echo "{i} $? $r") &'
                          for i, (_, ip, port, _) in enumerate(targets)) + " wait"
        for w in rc.workers:
            proc = rc.kubectl("exec", "-n", "intruder", f"intruder-{w}", "--", "sh", "-c", script, timeout=60)
            seen = {int(line.split()[0]): line.split(None, 2)[1:] for line in proc.stdout.splitlines()}
            for i, (name, ip, port, allowed) in enumerate(targets):
                code, *err = seen[i]
                print(f"  from {w}: {name} {ip}:{port}: exit {code} {' '.join(err)}")
                if allowed:
                    assert code == "0", (w, name, port, err)
                else:
                    assert code != "0" and "timed out" in " ".join(err), (w, name, port, err)
    finally:
        rc.kubectl("delete", "namespace", "intruder", "--wait=false")
    probe = [d for e in tenant.report["events"] if e.get("phase") == "hosted" for d in e.get("detail") or []
             if d.startswith("NetworkPolicy enforced: etcd-")]
    assert probe, [e for e in tenant.report["events"] if e.get("phase") == "hosted"]


# --- measured: one tenant's control plane ---------------------------------------------------------

def test_one_tenants_control_plane_measured(tenant: Tenant):
    """What one tenant costs its hosting cluster (the kubelets' summaries, as metrics-server
    reads them) and how long it took to come up; printed for docs/hosted.md."""
    memory = cpu = 0
    per: dict[str, int] = {}
    for node in tenant.rc.workers:
        summary = json.loads(tenant.rc.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/stats/summary").stdout)
        for pod in summary.get("pods", []):
            if pod["podRef"]["namespace"] != NS:
                continue
            m = (pod.get("memory") or {}).get("workingSetBytes", 0)
            memory += m
            cpu += (pod.get("cpu") or {}).get("usageNanoCores", 0)
            kind = pod["podRef"]["name"].split("-")[0] if pod["podRef"]["name"].startswith("etcd") else \
                "-".join(pod["podRef"]["name"].split("-")[:-2])
            per[kind] = per.get(kind, 0) + m
    hosted = [e for e in tenant.report["events"] if e["phase"] == "hosted"]
    api_ready = sum(e["seconds"] for e in hosted)
    # the lab's hosts are containers on this machine: what it has left is what more tenants get
    available = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))) * 1024
    print(f"\none tenant: apply {tenant.seconds:.0f} s (API ready after the hosted phase's {api_ready:.0f} s, "
          f"every worker Ready at the end); control plane {memory / 2**20:.0f} MiB "
          f"({', '.join(f'{k} {v / 2**20:.0f}' for k, v in sorted(per.items()))}), {cpu / 1e6:.0f} mCPU now; "
          f"this machine has {available / 2**30:.1f} GiB available: room for about {int(available * 0.8 // memory)} "
          "more at 80 %")
    assert memory > 0 and per.keys() >= {"etcd", "kube-apiserver"}


# --- a neighbour that fills its etcd ------------------------------------------------------------------

def _pods_as_they_run(rc: RealCluster, ns: str) -> dict[tuple[str, str], int]:
    """(pod name, UID) -> its containers' restarts (an evicted or restarted pod changes it)."""
    return {(p["metadata"]["name"], p["metadata"]["uid"]):
            sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or [])
            for p in rc.get("pods", "-n", ns)["items"]}


@pytest.fixture(scope="module")
def neighbour(tenant: Tenant, tmp_path_factory):
    """A third tenant's control plane alone (`apply --only hosted --only cluster-bootstrap`: its
    objects and its RBAC, the admin's binding among them; one etcd member on a 32Mi volume: a
    quota of 24 MiB), applied on a thread beside the tests that request this first;
    (inventory, state, the apply's thread). Its one worker, w6, is only connected to (its facts
    read: a worker of another tenant would be refused by the CA guard), never joined."""
    tmp = tmp_path_factory.mktemp("tenant-c")
    inventory, state = tenant_inventory(tenant.rc, tmp, "tenant-c", C_WORKERS, (30445, 30134), etcd=1), \
        tmp / "state"
    doc = yaml.safe_load(inventory.read_text())
    doc["spec"]["controlPlane"]["hosted"]["etcdStorage"] = "32Mi"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    bg = Background(lambda: run_installer("apply", str(inventory), "--state", str(state), "--only", "hosted",
                                          "--only", "cluster-bootstrap", "--wait-timeout", "600", timeout=900))
    yield inventory, state, bg
    bg.wait(900)
    _neighbour_gone(tenant.rc)


def _neighbour_gone(rc: RealCluster) -> None:
    """The neighbour removed as the first tenant goes (its fixture): no budget of it left to hold
    the next tests' drains. Done by its last test too: its control plane idle beside the cut, the
    drain and the tenant's upgrade took CPU from those tests' probes on 2 cores."""
    rc.kubectl("delete", "priorityclass", "hiddenplane-tenant-hp-tenant-c", "--ignore-not-found", check=False)
    remove_namespace(rc, "hp-tenant-c")


@pytest.mark.quiet(LAB)
def test_a_neighbour_that_fills_its_etcd_gets_its_own_nospace(tenant: Tenant, neighbour, tmp_path):
    """The neighbour's control plane (``neighbour``) written full through its own API: its writes
    fail with etcd's NOSPACE, `etcd members` says so and what to do, and the way out (deletes,
    `etcd defrag`) gets it writing again. The first tenant's API probe meanwhile: not one
    failure; none of its pods restarted or evicted."""
    rc = tenant.rc
    inventory, state, applied = neighbour
    applied.join(900)
    url, ca = f"https://{rc.address(rc.workers[0])}:30445", state / "pki" / "ca.crt"
    pem = _admin_pem(state, tmp_path)
    configmaps = f"{url}/api/v1/namespaces/default/configmaps"
    before = _pods_as_they_run(rc, NS)
    probe = api_probe(tenant)
    filler, written, refused = "x" * (960 * 1024), 0, ""
    try:
        for i in range(80):
            code, text = _https(configmaps, ca, pem, method="POST",
                                body={"metadata": {"name": f"fill-{i}"}, "data": {"x": filler}})
            if code != 201:
                refused = text
                break
            written += 1
        # its own error, from its own etcd
        assert "database space exceeded" in refused, (written, refused[:300])
        listed = run_installer("etcd", "members", str(inventory), "--state", str(state))
        assert "NOSPACE" in listed.stdout and "alarm NOSPACE on member etcd-0" in listed.stderr, listed.stderr
        assert "installer etcd defrag INVENTORY" in listed.stderr, listed.stderr
        time.sleep(5)
    finally:
        ok, failed = probe.end()
    after = _pods_as_they_run(rc, NS)
    print(f"\na neighbour's etcd full after {written} writes of 960 KiB; the first tenant's API: {ok} answered, "
          f"{len(failed)} failed; its pods: {len(before)} before, {len(after)} after, none restarted")
    assert ok > 0 and failed == [], failed[:5]
    assert after == before
    # the way out: delete what filled it, defragment, disarm
    for i in range(written):
        code, text = _https(f"{configmaps}/fill-{i}", ca, pem, method="DELETE")
        assert code == 200, (code, text[:200])
    out = run_installer("etcd", "defrag", str(inventory), "--state", str(state), timeout=600).stdout
    assert "etcd-0: defragmented, " in out and "disarmed NOSPACE: etcd takes writes again" in out, out
    code, text = _https(configmaps, ca, pem, method="POST", body={"metadata": {"name": "after"}, "data": {"x": "1"}})
    assert code == 201, text[:300]
    # its last test: gone now, without a reset (``neighbour``)
    _neighbour_gone(rc)


# --- a second tenant in the same hosting cluster; a tenant reset --------------------------------------

def _admin_pem(state: Path, tmp: Path) -> Path:
    pem = tmp / f"{state.parent.name}-admin.pem"
    pem.write_bytes((state / "pki" / "admin.crt").read_bytes() + (state / "pki" / "admin.key").read_bytes())
    pem.chmod(0o600)
    return pem


class Background:
    """A function run on a thread from now on; ``join`` waits for it and raises what it raised."""

    def __init__(self, fn):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by join, in the test that waits
            self.error = e

    def wait(self, timeout: float = 1800) -> None:
        """Until it ends (what it raised is its own test's to report)."""
        self.thread.join(timeout)

    def join(self, timeout: float = 1800) -> None:
        self.wait(timeout)
        assert not self.thread.is_alive(), "the work on its thread did not end"
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def tenant_b(tenant: Tenant, tmp_path_factory) -> Background:
    """The second tenant's whole scenario, run beside the first tenant's tests (it touches only
    its own namespace and w5): started by the first test, waited for by its own (and by any test
    that stops the first tenant's API for longer than it waits)."""
    tmp = tmp_path_factory.mktemp("tenant-b")

    def scenario() -> None:
        try:
            second_tenant(tenant, tmp)
        except BaseException:
            # its namespace goes even so, its reset not reached: its pods and budgets held the
            # next tests' drains (CI of 6d30dcb's parent: one failed probe of it, then `node
            # remove` of a hosting worker refused by its etcd's budget, and `node add` after it)
            tenant.rc.kubectl("delete", "priorityclass", "hiddenplane-tenant-hp-tenant-b", "--ignore-not-found",
                              check=False)
            remove_namespace(tenant.rc, "hp-tenant-b")
            raise
    bg = Background(scenario)
    yield bg
    bg.thread.join(1800)


def _answer(url: str, ca: Path, pem: Path) -> int | None:
    """The status the API at ``url`` answers; None while it does not answer (the first
    tenant's API is down during its etcd restore)."""
    try:
        return _https(url, ca, pem)[0]
    except ConnectionError:
        return None
    except OSError as e:
        if "CERTIFICATE_VERIFY_FAILED" in str(e) or "certificate verify failed" in str(e):
            raise
        return None


def operator_kubeconfig(rc: RealCluster, tmp: Path, user: str) -> Path:
    """A hosting kubeconfig for the user ``user``: a client certificate the hosting cluster's CA
    signs (what its admin hands a tenant's operator; here from the lab's state), no rights of its
    own: those are what ``installer hosting-access`` binds to it."""
    import datetime as dt

    from installer.core.pki.specs import CertSpec
    ca = issue.Pair(issue.load_cert((rc.state / "pki" / "ca.crt").read_bytes()),
                    issue.load_key((rc.state / "pki" / "ca.key").read_bytes()))
    key = issue.new_key("ecdsa-p256")
    cert = issue.issue(CertSpec("operator", "ca", user, client=True), key, ca, 1, dt.datetime.now(dt.timezone.utc))
    doc = yaml.safe_load(rc.kubeconfig.read_text())
    doc["users"] = [{"name": user, "user": {
        "client-certificate-data": base64.b64encode(issue.cert_pem(cert)).decode(),
        "client-key-data": base64.b64encode(issue.key_pem(key)).decode()}}]
    doc["contexts"] = [{"name": user, "context": {"cluster": doc["clusters"][0]["name"], "user": user}}]
    doc["current-context"] = user
    path = tmp / f"{user}.kubeconfig"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


def second_tenant(tenant: Tenant, tmp: Path) -> None:
    rc = tenant.rc
    # one etcd member (the other tenant has three), operated with the least-privilege hosting
    # identity `installer hosting-access` binds (core/render/tenant_access.py): every command
    # below runs with exactly those rights
    inventory, state = (tenant_inventory(rc, tmp / "b", "tenant-b", B_WORKERS, (30444, 30133), etcd=1,
                                         spread="required"), tmp / "state")
    operator = operator_kubeconfig(rc, tmp, "hp-operator-b")
    doc = yaml.safe_load(inventory.read_text())
    doc["spec"]["controlPlane"]["hosted"]["kubeconfig"] = str(operator)
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    # no rights yet: the apply's first request (the ownership guard's read of the namespace) is
    # refused, and it says who grants them; nothing is made
    proc = run_installer("apply", str(inventory), "--state", str(state), check_rc=None)
    assert proc.returncode != 0 and "/api/v1/namespaces/hp-tenant-b: 403" in proc.stderr, proc.stderr
    assert "installer hosting-access INVENTORY --user NAME" in proc.stderr, proc.stderr
    assert rc.kubectl("get", "namespace", "hp-tenant-b", check=False).returncode != 0
    # the hosting cluster's admin makes it, with the identity's rights
    access = run_installer("hosting-access", str(inventory), "--user", "hp-operator-b").stdout
    rc.kubectl("apply", "-f", "-", stdin=access)
    # spread required (the default) on a hosting cluster of two workers: three etcd members need
    # three nodes; and an exposed address that is no hosting node's serves nothing. Each refused
    # before anything is made there, naming the way out
    good = inventory.read_text()
    doc = yaml.safe_load(good)
    doc["spec"]["controlPlane"]["hosted"]["etcdReplicas"] = 3
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run_installer("apply", str(inventory), "--state", str(state), check_rc=2)
    assert "the hosting cluster has 2 schedulable node(s)" in proc.stderr and "needs 3" in proc.stderr, proc.stderr
    assert "spec.controlPlane.hosted.spread: preferred" in proc.stderr, proc.stderr
    doc = yaml.safe_load(good)
    doc["spec"]["controlPlane"]["hosted"]["expose"]["addresses"][1] = rc.address("cp1")
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run_installer("apply", str(inventory), "--state", str(state), check_rc=2)
    assert f"expose.addresses[1] ({rc.address('cp1')}) is no hosting node's address" in proc.stderr, proc.stderr
    made = rc.get("deployments,statefulsets,configmaps,secrets,leases", "-n", "hp-tenant-b")["items"]
    assert [o["metadata"]["name"] for o in made] == ["kube-root-ca.crt"], made       # the hosting cluster's own
    # preferred: it grows to three members below (the apiservers still take a worker each)
    doc = yaml.safe_load(good)
    doc["spec"]["controlPlane"]["hosted"]["spread"] = "preferred"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.monotonic()
    proc = run_installer("apply", str(inventory), "--state", str(state), "--wait-timeout", "900")
    print(f"\nsecond tenant: apply {time.monotonic() - started:.0f} s\n{proc.stdout}")
    # the admin made the namespace: this state's first apply recorded itself as its owner
    owner = rc.get("configmap", "hiddenplane-owner", "-n", "hp-tenant-b")["data"]
    assert owner == {"tenant": "tenant-b", "state": (state / "tenant-id").read_text().strip()}, owner
    least_privilege(rc, operator)
    kubeconfig = tmp / "b.kubeconfig"
    run_installer("kubeconfig", str(inventory), "--state", str(state), "-o", str(kubeconfig))
    b = Tenant(rc, inventory, state, kubeconfig, {}, 0.0)
    assert [n["metadata"]["name"] for n in b.get("nodes")["items"]] == list(B_WORKERS)
    a_url = f"https://{rc.address(rc.workers[0])}:{API_PORT}"
    b_url = f"https://{rc.address(rc.workers[0])}:30444"
    a_pem, b_pem = _admin_pem(tenant.state, tmp), _admin_pem(state, tmp)
    a_ca, b_ca = tenant.state / "pki" / "ca.crt", state / "pki" / "ca.crt"
    # (the first tenant's API may be down a while: its etcd restore runs beside this)
    for url, ca, pem, code in ((a_url, a_ca, a_pem, 200), (b_url, b_ca, b_pem, 200),
                               # each one's admin certificate is nobody to the other (their CAs
                               # differ: 401, not 403)
                               (b_url, b_ca, a_pem, 401), (a_url, a_ca, b_pem, 401)):
        wait_for(f"{url} answers", lambda u=url, c=ca, p=pem: _answer(f"{u}/api/v1/nodes", c, p) is not None,
                 timeout=300)
        assert _answer(f"{url}/api/v1/nodes", ca, pem) == code, (url, pem.name, code)
    # and each one's API serves a certificate the other's CA does not trust
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        _https(f"{b_url}/api", a_ca, a_pem)
    # each tenant's keys in its own namespace only
    for ns, st in ((NS, tenant.state), ("hp-tenant-b", state)):
        files = rc.get("secret", "kube-apiserver-files", "-n", ns)["data"]
        key = base64.b64decode(files["etc_kubernetes_pki_apiserver.key"])
        assert key == (st / "pki" / "apiserver.key").read_bytes(), ns

    ownership_attacks(tenant, b, tmp)
    member_count_changes(b, state)
    root_tenant_refused(b, state)
    namespace_made_again(b, state, access)

    proc = run_installer("reset", str(inventory), "--state", str(state), "--yes", timeout=900)
    print(proc.stdout[-800:])
    assert rc.kubectl("get", "namespace", "hp-tenant-b", check=False).returncode != 0
    # its PriorityClass is the admin's (the access objects): kept, and said so
    assert "kept PriorityClass hiddenplane-tenant-hp-tenant-b: this identity may not delete it" in proc.stderr, \
        proc.stderr[-1500:]
    # run again, it finds nothing to do (it never makes the namespace to delete it)
    again = run_installer("reset", str(inventory), "--state", str(state), "--yes", timeout=300)
    assert "no namespace hp-tenant-b" in again.stdout + again.stderr, again.stdout + again.stderr
    assert rc.kubectl("get", "namespace", "hp-tenant-b", check=False).returncode != 0
    # an apply now may read the namespace (its ClusterRole stays) but not make it again
    proc = run_installer("apply", str(inventory), "--state", str(state), check_rc=None, timeout=300)
    assert proc.returncode != 0 and "namespace hp-tenant-b does not exist in the hosting cluster, and this " \
        "hosting identity may not create it" in proc.stderr, proc.stderr
    # what the identity's rights leave behind, cluster-wide: the admin removes it (docs/hosted.md)
    rc.kubectl("delete", "--ignore-not-found", "-f", "-", stdin=access)
    assert rc.kubectl("get", "clusterrole", "hiddenplane-operator-hp-tenant-b", check=False).returncode != 0
    assert not [v for v in rc.get("pv")["items"] if (v["spec"].get("claimRef") or {}).get("namespace") == "hp-tenant-b"]
    r = rc.ssh("w5", "test -e /etc/kubernetes || test -e /var/lib/kubelet || echo clean; "
                     "systemctl is-active kubelet || true")
    assert "clean" in r.stdout and "inactive" in r.stdout, r.stdout


def namespace_made_again(b: Tenant, state: Path, access: str) -> None:
    """Someone with rights on namespaces (the admin's) deletes the tenant's and makes it again
    with everything the guard and the operator could read copied: its label and its operator's
    Role (the same `hosting-access` output), its owner ConfigMap. The state's next command (a
    reset, which would delete it) is refused, exit 2, naming both UIDs; the namespace stays.
    Its operator, having made it again on purpose, deletes the state's UID file and the reset
    that follows goes on."""
    rc = b.rc
    ns = rc.get("namespace", "hp-tenant-b")
    owner = rc.get("configmap", "hiddenplane-owner", "-n", "hp-tenant-b")
    assert (state / "tenant-namespace-uid").read_text() == f"hp-tenant-b {ns['metadata']['uid']}\n"
    rc.kubectl("delete", "namespace", "hp-tenant-b", "--timeout=300s", timeout=330)
    rc.kubectl("apply", "-f", "-", stdin=access)
    rc.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "data": owner["data"],
        "metadata": {"name": owner["metadata"]["name"], "namespace": "hp-tenant-b",
                     "labels": owner["metadata"]["labels"]}}))
    again = rc.get("namespace", "hp-tenant-b")["metadata"]
    assert again["labels"] == ns["metadata"]["labels"] and again["uid"] != ns["metadata"]["uid"]
    proc = run_installer("reset", str(b.inventory), "--state", str(state), "--yes", check_rc=2, timeout=300)
    assert f"its UID is {again['uid']}, this state's {ns['metadata']['uid']}" in proc.stderr, proc.stderr
    assert rc.get("namespace", "hp-tenant-b")["metadata"]["uid"] == again["uid"]
    (state / "tenant-namespace-uid").unlink()


def root_tenant_refused(b: Tenant, state: Path) -> None:
    """A tenant an earlier release ran as root, made here by the admin taking the security
    context out of its etcd's template (OnDelete first: no pod rolls): apply stops with exit 2
    naming the StatefulSet and the way over, and the StatefulSet is as it was."""
    rc = b.rc
    rc.kubectl("-n", "hp-tenant-b", "patch", "statefulset", "etcd", "--type", "merge", "-p", json.dumps(
        {"spec": {"updateStrategy": {"type": "OnDelete", "rollingUpdate": None},
                  "template": {"spec": {"securityContext": None}}}}))
    before = rc.get("statefulset", "etcd", "-n", "hp-tenant-b")["metadata"]["generation"]
    proc = run_installer("apply", str(b.inventory), "--state", str(state), check_rc=2, timeout=300)
    assert "StatefulSet etcd run as root" in proc.stderr and "etcd snapshot save" in proc.stderr, proc.stderr
    assert rc.get("statefulset", "etcd", "-n", "hp-tenant-b")["metadata"]["generation"] == before


def least_privilege(rc: RealCluster, operator: Path) -> None:
    """The second tenant's hosting identity, which just applied it: the first tenant's Secrets,
    pods, StatefulSet and namespace are 403 to it, and so are listing namespaces and making one
    (kubectl, as anyone holding that kubeconfig would try)."""
    def as_operator(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([rc.kubectl_bin, "--kubeconfig", str(operator), *args], capture_output=True,
                              text=True, timeout=60)
    for args in (("get", "secrets", "-n", NS), ("get", "secret", "kube-apiserver-files", "-n", NS),
                 ("get", "pods", "-n", NS), ("get", "statefulset", "etcd", "-n", NS), ("get", "namespace", NS),
                 ("get", "namespaces"), ("create", "namespace", "hp-operator-b-made"),
                 ("get", "pods", "-n", "kube-system"), ("get", "node", rc.workers[0]),
                 ("cordon", rc.workers[0]),
                 # its quota, limits and priority are the admin's: not lifted by the operator
                 ("patch", "resourcequota", "tenant", "-n", "hp-tenant-b", "--type=merge", "-p",
                  '{"spec":{"hard":{"pods":"1000"}}}'),
                 ("delete", "limitrange", "tenant", "-n", "hp-tenant-b"),
                 ("patch", "priorityclass", "hiddenplane-tenant-hp-tenant-b", "--type=merge", "-p",
                  '{"description":"mine"}'),
                 ("get", "priorityclass", f"hiddenplane-tenant-{NS}")):
        proc = as_operator(*args)
        assert proc.returncode != 0 and "Forbidden" in proc.stderr, (args, proc.stdout, proc.stderr)
    # its own: allowed
    own = as_operator("get", "secrets", "-n", "hp-tenant-b", "-o", "name")
    assert own.returncode == 0 and "secret/kube-apiserver-files" in own.stdout, own.stderr
    # Pod Security "restricted" holds against it: it may not relabel its namespace, and a
    # Deployment it may create gets no privileged pod (the ReplicaSet's creates are refused)
    relabel = as_operator("label", "namespace", "hp-tenant-b", "pod-security.kubernetes.io/enforce=privileged",
                          "--overwrite")
    assert relabel.returncode != 0 and "Forbidden" in relabel.stderr, relabel.stderr
    escape = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "escape", "namespace": "hp-tenant-b"},
              "spec": {"selector": {"matchLabels": {"app": "escape"}}, "template": {
                  "metadata": {"labels": {"app": "escape"}},
                  "spec": {"hostPID": True, "containers": [{
                      "name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                      "securityContext": {"privileged": True},
                      "volumeMounts": [{"name": "root", "mountPath": "/host"}]}],
                      "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}}
    made = subprocess.run([rc.kubectl_bin, "--kubeconfig", str(operator), "apply", "-f", "-"], input=json.dumps(escape),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr            # the Deployment itself: PodSecurity only warns
    assert "violate PodSecurity" in made.stderr, made.stderr
    try:
        refused = wait_for("the escape's pods refused", lambda: [
            e for e in rc.get("events", "-n", "hp-tenant-b")["items"]
            if e.get("reason") == "FailedCreate" and "violates PodSecurity" in e.get("message", "")], timeout=60)
        print(f"\nthe operator's privileged Deployment: {refused[0]['message'][:300]}")
        assert not [p for p in rc.get("pods", "-n", "hp-tenant-b", "-l", "app=escape")["items"]]
    finally:
        as_operator("delete", "deployment", "escape", "-n", "hp-tenant-b")


def ownership_attacks(tenant: Tenant, b: Tenant, tmp: Path) -> None:
    """The second tenant's inventory aimed at a namespace that is not its own (the first
    tenant's; an application's), and the first tenant's inventory with the second's state (two
    clusters of one name): `reset --yes` and `etcd snapshot restore --yes` exit 2 before they
    change anything (core/tenancy.py), and every namespace stays as it was."""
    rc = tenant.rc
    rc.kubectl("create", "namespace", "app-shop")
    rc.kubectl("create", "configmap", "orders", "-n", "app-shop", "--from-literal=k=v")
    try:
        snap = tmp / "b.db"
        run_installer("etcd", "snapshot", "save", str(b.inventory), str(snap), "--state", str(b.state))
        uids = {ns: rc.get("namespace", ns)["metadata"]["uid"] for ns in (NS, "app-shop", "hp-tenant-b")}
        doc = yaml.safe_load(b.inventory.read_text())
        # the guard itself, with credentials that could read and delete any namespace (the
        # operator's own are refused before it: least_privilege)
        doc["spec"]["controlPlane"]["hosted"]["kubeconfig"] = str(rc.kubeconfig)
        for ns, why in ((NS, "its label hiddenplane.io/tenant is 'tenant'"),
                        ("app-shop", "its label hiddenplane.io/tenant is missing")):
            doc["spec"]["controlPlane"]["hosted"]["namespace"] = ns
            wrong = tmp / f"tenant-b-in-{ns}.yaml"
            wrong.write_text(yaml.safe_dump(doc, sort_keys=False))
            for args in (("reset", str(wrong), "--state", str(b.state), "--yes"),
                         ("etcd", "snapshot", "restore", str(wrong), str(snap), "--state", str(b.state), "--yes")):
                proc = run_installer(*args, check_rc=2, timeout=300)
                assert f"namespace {ns} in the hosting cluster is not tenant tenant-b's ({why})" in proc.stderr, \
                    (args[0], proc.stderr)
                assert "nothing was changed" in proc.stderr, proc.stderr
        proc = run_installer("reset", str(tenant.inventory), "--state", str(b.state), "--yes", check_rc=2, timeout=300)
        assert f"namespace {NS} in the hosting cluster holds another tenant named tenant" in proc.stderr, proc.stderr
        assert {ns: rc.get("namespace", ns)["metadata"]["uid"] for ns in uids} == uids
        assert rc.get("configmap", "orders", "-n", "app-shop")["data"] == {"k": "v"}
        assert not any(rc.get("namespace", ns)["metadata"].get("deletionTimestamp") for ns in uids)
        # the second tenant's workers were not touched either (reset stops before them)
        assert rc.ssh("w5", "systemctl is-active kubelet").stdout.strip() == "active"
    finally:
        rc.kubectl("delete", "namespace", "app-shop", "--wait=false")


def member_count_changes(b: Tenant, state: Path) -> None:
    """etcdReplicas 1 -> 3 on the running tenant by `apply` (each new member a learner first,
    promoted once in sync), its API read all along; then 3 -> 1. The data stays."""
    rc = b.rc
    b.kubectl("create", "configmap", "before-members", "--from-literal=k=1")

    def first_member() -> tuple[str, int]:
        pod = rc.get("pod", "etcd-0", "-n", "hp-tenant-b")
        return pod["metadata"]["uid"], pod["status"]["containerStatuses"][0]["restartCount"]
    member0 = first_member()
    doc = yaml.safe_load(b.inventory.read_text())
    doc["spec"]["controlPlane"]["hosted"]["etcdReplicas"] = 3
    three = b.inventory.with_name("tenant-b-3.yaml")
    three.write_text(yaml.safe_dump(doc, sort_keys=False))
    plan = json.loads(run_installer("apply", str(three), "--state", str(state), "--dry-run", "--output",
                                    "json").stdout)
    would = [d for e in plan["events"] if e["phase"] == "hosted" for d in e["detail"]]
    assert [d.split(" (")[0] for d in would[:2]] == ["would add etcd-1 as a learner",
                                                     "would add etcd-2 as a learner"], would
    assert rc.get("statefulset", "etcd", "-n", "hp-tenant-b")["spec"]["replicas"] == 1
    probe = api_probe(b)
    started = time.monotonic()
    try:
        out = run_installer("apply", str(three), "--state", str(state), "--output", "json", "--wait-timeout", "600",
                            timeout=1500).stdout
    finally:
        ok, failed = probe.end()
    grew = time.monotonic() - started
    detail = [d for e in json.loads(out)["events"] if e["phase"] == "hosted" for d in e["detail"]]
    print(f"\nsecond tenant: etcd 1 -> 3 in {grew:.0f} s; API reads {ok} ok, {len(failed)} failed {failed[:5]}\n"
          + "\n".join(detail[:4]))
    assert [d.split(":")[0] for d in detail[:2]] == ["added etcd member etcd-1", "added etcd member etcd-2"], detail
    assert not failed and ok > 0
    members = json.loads(run_installer("etcd", "members", str(three), "--state", str(state), "--output", "json").stdout)
    assert sorted(m["name"] for m in members) == ["etcd-0", "etcd-1", "etcd-2"], members
    assert not any(m["learner"] for m in members), members
    assert b.kubectl("get", "configmap", "before-members", check=False).returncode == 0
    again = json.loads(run_installer("apply", str(three), "--state", str(state), "--output", "json").stdout)
    assert again["changes"] == 0 and again["restarts"] == [], again["events"]

    started = time.monotonic()
    out = run_installer("apply", str(b.inventory), "--state", str(state), "--output", "json", "--wait-timeout", "600",
                        timeout=1500).stdout
    detail = [d for e in json.loads(out)["events"] if e["phase"] == "hosted" for d in e["detail"]]
    print(f"second tenant: etcd 3 -> 1 in {time.monotonic() - started:.0f} s\n" + "\n".join(detail[:2]))
    assert [d.split(" (")[0] for d in detail[:2]] == [
        "removed etcd member etcd-2, its pod, its Service and its volume claim data-etcd-2",
        "removed etcd member etcd-1, its pod, its Service and its volume claim data-etcd-1"], detail
    members = json.loads(run_installer("etcd", "members", str(b.inventory), "--state", str(state), "--output",
                                      "json").stdout)
    assert [m["name"] for m in members] == ["etcd-0"], members
    claims = sorted(c["metadata"]["name"] for c in rc.get("pvc", "-n", "hp-tenant-b")["items"])
    assert claims == ["data-etcd-0"], claims
    services = sorted(x["metadata"]["name"] for x in rc.get("services", "-n", "hp-tenant-b")["items"])
    # the members' own, and the apiservers' one
    assert [x for x in services if x.startswith("etcd-")] == ["etcd-0", "etcd-near"], services
    assert rc.kubectl("get", "pdb", "etcd", "-n", "hp-tenant-b", check=False).returncode != 0
    # etcd-0 never restarted for either change (the member list is a ConfigMap), and serves the data
    assert first_member() == member0
    assert b.kubectl("get", "configmap", "before-members", check=False).returncode == 0


def test_a_second_tenant_refuses_the_firsts_credentials_and_reset_removes_it(tenant: Tenant, tenant_b: Background):
    """A second tenant (w5) in the same hosting cluster, its scenario run beside the first's
    tests (second_tenant): isolation of the two, its member count fixed, reset."""
    tenant_b.join()
    # the first tenant, untouched
    assert sorted(n["metadata"]["name"] for n in tenant.get("nodes")["items"]) == sorted(A_WORKERS)


# --- a hosting worker lost (cut off, not drained) ----------------------------------------------

CUT = 120.0         # seconds the hosting worker's link stays down (the issue's two minutes)
AT_CUT = 15.0       # the cut's first seconds, reported apart: where a replica's request to the lost
                    # member waited out gRPC's 10 s TCP_USER_TIMEOUT before the etcd-near Service
SETTLED = 30.0      # seconds after the tenant's pods are all Ready again from which nothing fails


@pytest.mark.quiet(LAB)
def test_a_hosting_worker_cut_off_leaves_the_tenant_serving_through_the_other(tenant: Tenant, tenant_b):
    """The hosting worker holding one etcd member and an apiserver replica of the tenant loses its
    link for two minutes (its bridge port down: a pulled cable, no RST, no ICMP), while requests
    run every 0.5 s through both exposed addresses, writes through the other each second, and a
    read as its kubelet on a tenant worker through its balancer. Through what stays up: no
    failure from the cut until the return (each replica's etcd client uses its own node's member,
    so the one that stays has no request in flight to the lost member: before, 1-2 failures in
    the first 15 s, until gRPC's 10 s keepalive timeout gave that connection up) but for at most
    one through the balancer in the cut's first second (sent to the lost replica), a few after the
    return while the returning member cannot serve yet (when it was etcd's leader, its new
    leader's entries wait on a stale peer connection: docs/hosted.md, "A lost hosting node") or
    its replica settles in the balancers, none from 30 s after the tenant's pods are all Ready
    again; writes go on (quorum),
    the tenant's Nodes stay Ready, `installer kubeconfig` names the address that answers, and
    once the pods are back a second apply changes and restarts nothing. Figures:
    benchmarks/hosted_node_cut.py tells the same on 3 hosting workers."""
    # its control plane runs on the same hosting workers: it ends first (its failures are its
    # own test's: this one runs whatever it met)
    tenant_b.wait()
    rc = tenant.rc
    on = probeloop.by_node(rc.get("pods", "-n", NS)["items"])
    victim = next(n for n, names in sorted(on.items()) if any(x.startswith("kube-apiserver") for x in names)
                  and sum(x.startswith("etcd-") for x in names) == 1)
    # its member a follower: leadership moved off it first (CI of 6c035e9: the lost member led,
    # 4 failures at the cut through the balancer and more after the return, the leader's case of
    # hosted.md's "A lost hosting node", which benchmarks/hosted_node_cut.py --victim leader tells)
    mine = next(x for x in on[victim] if x.startswith("etcd-"))
    status = json.loads(rc.kubectl("-n", NS, "exec", mine, "--", "/bin/sh", "-c",
                                   f"{ETCDCTL} endpoint status --cluster -w json").stdout)
    ids = {e["Endpoint"].split("//")[1].split(".")[0]: e["Status"]["header"]["member_id"] for e in status}
    if ids[mine] == status[0]["Status"]["leader"]:
        to = next(i for n, i in sorted(ids.items()) if n != mine)
        rc.kubectl("-n", NS, "exec", mine, "--", "/bin/sh", "-c", f"{ETCDCTL} move-leader {to:x}")
    other = next(w for w in rc.workers if w != victim)
    lost, up = rc.address(victim), rc.address(other)
    # each replica's etcd client on its own node's member (the etcd-near Service): the one that
    # stays has nothing in flight to the lost member (render/tenant.py, near_service)
    pods = rc.get("pods", "-n", NS)["items"]
    ip = {x["metadata"]["name"]: x["status"].get("podIP") for x in pods}
    dump = 'for f in tcp tcp6; do while read -r l; do echo "$l"; done < /proc/net/$f; done'
    clients = {m: probeloop.tcp_clients(rc.kubectl("-n", NS, "exec", m, "--", "/bin/sh", "-c", dump).stdout, 2379)
               for m in ip if m.startswith("etcd-")}
    for node in (victim, other):
        for a in (x for x in on[node] if x.startswith("kube-apiserver")):
            serving = sorted(m for m, c in clients.items() if ip[a] in c)
            print(f"{a} on {node}: its etcd connections to {serving}")
            assert serving and all(m in on[node] for m in serving), (node, a, serving, on)
    addresses = yaml.safe_load(tenant.inventory.read_text())["spec"]["controlPlane"]["hosted"]["expose"]["addresses"]
    ctx = probeloop.admin_context(tenant.state / "pki")
    base = f"https://{up}:{API_PORT}/api/v1"

    def write(i: int) -> None:
        probeloop.api(ctx, f"{base}/namespaces/default/configmaps", "POST", {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cut-{i}"}})
        probeloop.api(ctx, f"{base}/namespaces/default/configmaps/cut-{i}", "DELETE")

    def nodes_ready(_i: int) -> None:
        for n in probeloop.api(ctx, f"{base}/nodes")["items"]:
            if not any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]):
                raise AssertionError(f"{n['metadata']['name']} not Ready")

    worker = A_WORKERS[0]
    hostprobes.start(rc.lab.ssh_config, worker, "hp-probe-cut", f"https://127.0.0.1:6443/api/v1/nodes/{worker}",
                     interval=0.5, timeout=5)
    loops = {f"read via {up}": probeloop.Loop(lambda _i: probeloop.api(ctx, f"{base}/namespaces/default"), 0.5),
             f"read via {lost} (the lost node's)": probeloop.Loop(lambda _i: probeloop.api(
                 ctx, f"https://{lost}:{API_PORT}/api/v1/namespaces/default"), 0.5),
             f"write via {up}": probeloop.Loop(write, 1.0),
             "the tenant's Nodes Ready": probeloop.Loop(nodes_ready, 2.0)}
    time.sleep(5)
    host = rc.lab.spec.host(victim)
    cut_at = time.time()
    net.cut_link(host)
    try:
        time.sleep(20)
        # a user's kubeconfig written while the node is lost names the address that answers
        kubeconfig = tenant.kubeconfig.with_name("cut.kubeconfig")
        said = run_installer("kubeconfig", str(tenant.inventory), "--state", str(tenant.state), "-o",
                             str(kubeconfig)).stdout
        assert f"https://{up}:{API_PORT}" in yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"][
            "server"], said
        if addresses[0] == lost:
            assert f"{lost}: no answer from the apiserver" in said, said
        assert subprocess.run([rc.kubectl_bin, "--kubeconfig", str(kubeconfig), "get", "nodes"],
                              capture_output=True, timeout=60).returncode == 0
        time.sleep(max(0.0, cut_at + CUT - time.time()))
    finally:
        net.restore_link(host)
    back_at = time.time()
    wait_for("the tenant's pods Ready again, etcd 3/3 and the apiservers 2/2", lambda: (
        rc.get("statefulset", "etcd", "-n", NS)["status"].get("readyReplicas") == 3
        and rc.get("deployment", "kube-apiserver", "-n", NS)["status"].get("readyReplicas") == 2), timeout=300)
    ready_at = time.time()
    converged = ready_at - back_at
    time.sleep(SETTLED + 5)
    rows = {label: loop.end() for label, loop in loops.items()}
    rows[f"read on {worker} via its balancer"] = [(r.start, r.ok, r.detail) for r in hostprobes.rows(
        rc.lab.ssh_config, worker, "hp-probe-cut")]
    server = f"api-{addresses.index(lost)}"      # the balancer's name for it (expose.addresses' order)
    down = hostprobes.marked(rc.lab.ssh_config, worker, server, cut_at, "DOWN")
    back = hostprobes.marked(rc.lab.ssh_config, worker, server, back_at, "UP")
    end_at = time.time()
    second = json.loads(run_installer("apply", str(tenant.inventory), "--state", str(tenant.state), "--output",
                                      "json").stdout)
    edges = (0.0, cut_at, cut_at + AT_CUT, back_at, end_at + 1)
    print(f"\n{victim} ({lost}: {', '.join(sorted(on[victim]))}) cut off {CUT:.0f} s; failed/requests "
          f"at the cut ({AT_CUT:.0f} s), in the rest of it, after the return:")
    for label, found in rows.items():
        print(f"  {label:44} {probeloop.columns(found, *edges[1:])}  {probeloop.when(found, cut_at, back_at)}")
    seconds = {k: "never" if v is None else f"{v:.1f} s" for k, v in (("down", down), ("up", back))}
    print(f"  {worker}'s balancer: {server} down {seconds['down']} after the cut, up {seconds['up']} after the "
          f"return; the pods Ready {converged:.0f} s after it; second apply: {second['changes']} change(s), "
          f"{len(second['restarts'])} restart(s)")
    # every server marked up or down, and when it ran on the unchecked backups (render/balancer.py)
    print("\n".join(f"  {worker}'s balancer {line}" for line in hostprobes.marks(rc.lab.ssh_config, worker, cut_at)))
    for label, found in rows.items():
        if "lost node" in label:
            continue
        at_cut = probeloop.within(found, cut_at, cut_at + AT_CUT)
        during = probeloop.within(found, cut_at + AT_CUT, back_at)
        after = probeloop.within(found, back_at, end_at + 1)
        # through a tenant worker's balancer, one request sent to the lost replica in the cut's
        # first second may be lost (new-machine run of 7c787ae: a read 0.5 s after the cut timed
        # out in its TLS handshake; its connect to the lost replica failed 1 s later and marked
        # that server down, and the session was not redispatched: not root-caused yet)
        bound = 1 if "balancer" in label else 0
        assert at_cut and sum(not ok for _, ok, _ in at_cut) <= bound, (label, [r for r in at_cut if not r[1]])
        # (CI of 4c772a4: two reads through the balancer closed unanswered 43 and 45 s into the
        # cut, when a balancer with its one server left down by its checks had none; now it still
        # tries its unchecked backups: render/balancer.py)
        assert during and all(ok for _, ok, _ in during), (label, [r for r in during if not r[1]])
        # the returning member's until it serves again, and while the returning replica settles
        # (a read through the balancer closed unanswered 9 s after the pods were Ready: CI of
        # 47aca86, not explained then, likely the same balancer without a server): not zero
        # (docs/hosted.md, "A lost hosting node"); none 30 s after every pod is Ready
        assert all(ok for t, ok, _ in after if t >= ready_at + SETTLED), (label, [r for r in after if not r[1]])
    assert down is not None and down < 10, down
    assert second["changes"] == 0 and not second["restarts"], [e for e in second["events"] if e["action"] == "changed"]




# --- a hosting worker drained -------------------------------------------------------------------

@pytest.mark.quiet(LAB)
def test_draining_a_hosting_worker_keeps_the_tenant_api_answering(tenant: Tenant, tenant_b):
    """A hosting node running an apiserver replica (and at most one etcd member) is drained of the
    tenant's pods and brought back while a probe reads the tenant's API through the other
    exposed address: every request answered (goal: 0 failed). The drained replica waits for its
    node (each exposed address serves its own node's replica: core/render/tenant_placement.py)
    and runs there again once uncordoned."""
    # after the second tenant's scenario, which runs beside the tests before this one: its applies
    # refuse to place its replicas while a hosting worker is cordoned (CI of ee6bbbf: its grow
    # to three members started inside this drain); its failures are its own test's
    tenant_b.wait()
    on = probeloop.by_node(tenant.rc.get("pods", "-n", NS)["items"])
    node = next(n for n, names in sorted(on.items()) if any(x.startswith("kube-apiserver") for x in names)
                and sum(x.startswith("etcd-") for x in names) <= 1)
    other = next(w for w in tenant.rc.workers if w != node)
    results: list[tuple[float, bool, str]] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            start = time.monotonic()
            r = tenant.kubectl("get", "--raw", "/api/v1/namespaces/default",
                               f"--server=https://{tenant.rc.address(other)}:{API_PORT}", check=False, timeout=30)
            results.append((start, r.returncode == 0, r.stderr.strip()[-200:]))
            time.sleep(0.2)
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        # the tenant's pods (the shared lab's other tests leave bare pods of their own on its
        # workers, which a whole drain refuses to delete without --force)
        tenant.rc.kubectl("drain", node, f"--pod-selector=hiddenplane.io/tenant={TENANT}", "--ignore-daemonsets",
                          "--delete-emptydir-data", "--timeout=300s", timeout=330)
        drained = time.monotonic() - started
        waiting = [p for p in tenant.rc.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=kube-apiserver")["items"]
                   if not p["spec"].get("nodeName")]
        assert len(waiting) == 1, [(p["metadata"]["name"], p["spec"].get("nodeName")) for p in waiting]
    finally:
        tenant.rc.kubectl("uncordon", node)
    wait_for(f"the tenant's apiservers 2/2 ready, one on {node} again",
             lambda: tenant.rc.get("deployment", "kube-apiserver", "-n", NS)["status"].get(
                 "readyReplicas") == 2 and sorted(p["spec"].get("nodeName") or "" for p in tenant.rc.get(
                     "pods", "-n", NS, "-l", "app.kubernetes.io/name=kube-apiserver")["items"]
                     if not p["metadata"].get("deletionTimestamp")) == sorted(tenant.rc.workers), timeout=300)
    etcd_ready(tenant)
    time.sleep(5)
    stop.set()
    thread.join(timeout=60)
    failed = [r for r in results if not r[1]]
    print(f"\ndrain of {node} ({', '.join(on[node])}): {drained:.0f} s; probe through {other}: {len(results)} "
          f"requests, {len(failed)} failed" + (f": {failed[:3]}" if failed else ""))
    assert len(results) > 20 and not failed, failed[:5]
    nodes = tenant.get("nodes")["items"]
    assert all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]) for n in nodes)


@pytest.mark.quiet(LAB)
def test_certs_check_reads_the_tenants_certificates_and_renew_rolls_them(tenant: Tenant):
    """`certs check` reads the tenant's control-plane certificates where its pods do (its Secrets
    and ConfigMaps); `certs renew` of the apiserver's and etcd's serving certificates rolls
    etcd's members and then the apiserver replicas while the tenant's API is probed, and the
    Service then presents the new certificate."""
    where = f"hosting {NS}"

    def rows() -> dict[str, dict]:
        proc = run_installer("certs", "check", str(tenant.inventory), "--state", str(tenant.state), "--output",
                             "json", check_rc=None)
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
        return {r["name"]: r for r in json.loads(proc.stdout)["certificates"] if r["where"] == where}
    before = rows()
    assert {"/etc/kubernetes/pki/apiserver.crt", "/etc/etcd/pki/server.crt", "/etc/etcd/pki/peer.crt",
            "/etc/kubernetes/controller-manager.conf"} <= before.keys(), sorted(before)
    assert not [n for n, r in before.items() if r["notes"]], before

    probe = api_probe(tenant)
    started = time.monotonic()
    try:
        proc = run_installer("certs", "renew", str(tenant.inventory), "--state", str(tenant.state), "--only",
                             "apiserver", "--only", "etcd/server-hosted", "--output", "json", timeout=900)
    finally:
        ok, failed = probe.end()
    seconds = time.monotonic() - started
    report = json.loads(proc.stdout)
    checks = {c["endpoint"]: c for c in report["checks"]}
    for w in tenant.rc.workers:             # each exposed address, its own node's replica
        address = tenant.rc.address(w)
        assert checks[f"kube-apiserver (hosted, {address})"]["ok"], checks
        assert checks[f"konnectivity-server (hosted, {address})"]["ok"], checks
    after = rows()
    for name in ("/etc/kubernetes/pki/apiserver.crt", "/etc/etcd/pki/server.crt"):
        assert after[name]["serial"] != before[name]["serial"], name
    assert after["/etc/etcd/pki/peer.crt"]["serial"] == before["/etc/etcd/pki/peer.crt"]["serial"]
    assert not [n for n, r in after.items() if r["notes"]], after
    print(f"\ncerts renew of the tenant's apiserver and etcd serving certificates: {seconds:.0f} s; API probe "
          f"{ok} ok, {len(failed)} failed" + "".join(f"\n  {f}" for f in failed[:5]))
    assert ok > 20 and not failed, failed[:5]


def test_ca_rotate_moves_the_tenant_and_its_workers_to_new_cas(tenant: Tenant, tenant_b, tmp_path):
    """`ca rotate` of every CA of the tenant: its control plane stopped in the hosting cluster
    (etcd too: its CA changes), written with the new files and started; the workers bootstrap
    again; etcd's data kept; the old admin certificate refused; the Service presents a
    certificate of the new CA; the hosting cluster's copies of the CAs are the new ones."""
    tenant_b.wait()                     # its checks read this tenant's CA and API
    rc = tenant.rc
    old_admin = _admin_pem(tenant.state, tmp_path)
    old_ca = (tenant.state / "pki" / "ca.crt").read_bytes()
    tenant.kubectl("create", "configmap", "before-rotate", "--from-literal=k=1")
    started = time.monotonic()
    proc = run_installer("ca", "rotate", str(tenant.inventory), "--state", str(tenant.state), "--yes",
                         "--wait-timeout", "600", "--output", "json", timeout=1800)
    seconds = time.monotonic() - started
    report = json.loads(proc.stdout)
    assert all(c["ok"] for c in report["checks"]), [c for c in report["checks"] if not c["ok"]]
    new_ca = (tenant.state / "pki" / "ca.crt").read_bytes()
    assert new_ca != old_ca
    run_installer("kubeconfig", str(tenant.inventory), "--state", str(tenant.state), "-o", str(tenant.kubeconfig),
                  "--force")

    def workers_ready() -> bool:
        nodes = tenant.get("nodes")["items"]
        return len(nodes) == len(A_WORKERS) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"]) for n in nodes)
    wait_for("the tenant's workers Ready under the new CA", workers_ready, timeout=600)
    assert tenant.get("configmap", "before-rotate")["data"] == {"k": "1"}, "etcd kept its data"
    url = f"https://{rc.address(rc.workers[0])}:{API_PORT}/api"
    ca = tenant.state / "pki" / "ca.crt"
    assert _https(url, ca, old_admin)[0] == 401
    (tmp_path / "new").mkdir()
    assert _https(url, ca, _admin_pem(tenant.state, tmp_path / "new"))[0] == 200
    held = rc.get("configmap", "kube-apiserver-config", "-n", NS)["data"]
    assert held["etc_kubernetes_pki_ca.crt"].encode() == new_ca
    for w in A_WORKERS:
        pem = rc.ssh(w, "cat /var/lib/kubelet/pki/kubelet-client-current.pem").stdout
        cert = x509.load_pem_x509_certificate(pem[pem.index("-----BEGIN CERTIFICATE"):].encode())
        assert issue.signed_by(cert, x509.load_pem_x509_certificate(new_ca)), w
    print(f"\nca rotate of the tenant (every CA): {seconds:.0f} s")


# --- upgrade: the tenant a minor up, under probes (last: the tenants before run the default version) ---

ECHO_PORT = 30081
CONTROL_IMAGES = ("image-kube-apiserver.tar", "image-kube-controller-manager.tar", "image-kube-scheduler.tar")
ETCD_TO = versions.DEFAULT_COMPONENTS["etcd"]


class Probe:
    """Requests in a loop on a thread until stopped: (ok, what failed)."""

    def __init__(self, call):
        self.call, self.ok, self.failed = call, 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                self.call(i)
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                self.failed.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}"[:200])
            time.sleep(0.2)

    def end(self) -> tuple[int, list[str]]:
        self.stop.set()
        self.thread.join(timeout=60)
        return self.ok, self.failed


def enforcer_drops(rc: RealCluster) -> dict[str, str]:
    """Each hosting worker's NetworkPolicy enforcer: the packets its queue dropped (full, or
    refused by it) and its TCP verdicts, from its metrics on the node's loopback."""
    read = ("python3 -c \"import urllib.request; print(urllib.request.urlopen("
            f"'http://{netpol.METRICS}/metrics', timeout=5).read().decode())\"")
    out = {}
    for w in rc.workers:
        text = rc.ssh(w, read).stdout
        out[w] = " ".join(line.removeprefix("kube_network_policies_") for line in text.splitlines()
                          if line.startswith(("kube_network_policies_nfqueue_queue_dropped",
                                              "kube_network_policies_nfqueue_user_dropped",
                                              'kube_network_policies_packet_count{family="IPv4",protocol="TCP"')))
    return out


def api_probe(tenant: Tenant) -> Probe:
    """The tenant's API read from here through its Service every 0.2 s."""
    def get(_):
        r = tenant.kubectl("get", "--raw", "/api/v1/namespaces/default", check=False, timeout=30)
        if r.returncode:
            raise RuntimeError(r.stderr.strip()[-200:])
    return Probe(get)


@pytest.fixture(scope="module")
def target_artifacts() -> Path:
    """v1.37.2's artifacts, waited for (a new machine builds them beside the tests) before the
    upgrade's quiet window, not inside it: module fixtures come before a test's own."""
    return upgrade_artifacts_dir()


@pytest.mark.quiet(LAB)
def test_the_tenant_upgrades_a_minor_under_probes(tenant: Tenant, tmp_path, target_artifacts: Path):
    """`installer upgrade` of the tenant v1.36.5 -> v1.37.2 and its etcd ETCD_FROM -> the default:
    etcd's members roll one at a time, then the apiserver replicas, then the controller-manager
    and scheduler, then the workers one at a time; the tenant's API, probed
    from here through its Service, never fails, and a Deployment of two replicas behind a
    NodePort of the tenant's workers answers throughout: no probe fails."""
    import urllib.request

    rc = tenant.rc
    # the hosting workers get the new control-plane images
    import_pinned(rc, [target_artifacts / image for image in CONTROL_IMAGES],
                  [hosted_images("registry.k8s.io", UPGRADE_TO, ETCD_TO)[c] for c in
                   ("kube-apiserver", "kube-controller-manager", "kube-scheduler")])
    for obj in echo_workload(ECHO_PORT):
        tenant.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    try:
        wait_for("both echo replicas ready", lambda: tenant.get("deployment", "echo")["status"].get(
            "readyReplicas") == 2, timeout=300)
    except BaseException:
        # (CI of dda85fe: not ready after 300 s, once, after the CA rotation; not seen on a
        # dev lab: what the tenant says is the diagnosis)
        pods = tenant.kubectl("get", "pods", "-o", "wide", check=False).stdout
        events = tenant.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-3000:]
        nodes = tenant.kubectl("get", "nodes", "-o", "wide", check=False).stdout
        raise AssertionError(f"echo not ready:\n{pods}\n{nodes}\n{events}") from None
    doc = yaml.safe_load(tenant.inventory.read_text())
    doc["spec"]["kubernetes"]["version"] = UPGRADE_TO
    doc["spec"]["artifacts"]["versions"]["etcd"] = ETCD_TO        # the tenant ran ETCD_FROM
    doc["spec"]["artifacts"]["path"] = str(worker_artifacts(target_artifacts, tenant.inventory.parent.parent,
                                                            "tenant-artifacts-up"))
    target = tenant.inventory.parent / "tenant-up.yaml"
    target.write_text(yaml.safe_dump(doc, sort_keys=False))
    plan = json.loads(run_installer("upgrade", str(target), "--state", str(tenant.state), "--plan",
                                    "--output", "json").stdout)
    print("\n" + "\n".join(plan["steps"]))
    # etcd first (one member at a time), then the apiservers, the controllers, the workers
    roll = [i for i, s in enumerate(plan["steps"]) if s.startswith(f"etcd (StatefulSet etcd in {NS}) {ETCD_FROM} -> "
                                                                   f"{ETCD_TO}: one member at a time")]
    control = [i for i, s in enumerate(plan["steps"]) if s.startswith(
        f"kube-apiserver, kube-controller-manager, kube-scheduler in {NS} v1.36.5 -> {UPGRADE_TO}")]
    assert len(roll) == 1 and len(control) == 1 and roll[0] < control[0], plan["steps"]

    echo = [f"http://{rc.address(w)}:{ECHO_PORT}/" for w in A_WORKERS]

    slowest = [0.0]

    def get_echo(i: int) -> None:
        # failed: refused, reset, or no answer within ECHO_TIMEOUT; the slowest answer is printed
        t = time.monotonic()
        try:
            urllib.request.urlopen(echo[i % 2], timeout=ECHO_TIMEOUT).read()
        except OSError as e:                    # which worker's NodePort failed, and how
            raise OSError(f"{A_WORKERS[i % 2]}: {e}") from None
        slowest[0] = max(slowest[0], time.monotonic() - t)
    workload = Probe(get_echo)
    began = time.time()

    drops = enforcer_drops(rc)
    api = api_probe(tenant)
    started = time.monotonic()
    try:
        proc = subprocess.run([INSTALLER, "upgrade", str(target), "--state", str(tenant.state), "--output", "json",
                               "--wait-timeout", "600"], capture_output=True, text=True, timeout=1800)
    finally:
        time.sleep(3)
        ok, failed = workload.end()
        api_ok, api_failed = api.end()
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the tenant's inventory from here on, whatever the checks below find (the next tests
    # need the version the tenant now runs)
    tenant.inventory = target
    done = json.loads(proc.stdout)
    at = began
    for t in done["timings"]:
        # each step with the wall time it began: a failed probe (its time) is placed in a step
        print(f"{time.strftime('%H:%M:%S', time.localtime(at))} {t['seconds']:7.1f} s  {t['step']}")
        at += t["seconds"]
    print(f"tenant upgrade v1.36.5 -> {UPGRADE_TO}: {seconds:.0f} s; API probe {api_ok} ok, {len(api_failed)} "
          f"failed; workload probe {ok} ok, {len(failed)} failed, slowest answer {slowest[0]:.2f} s"
          + "".join(f"\n  {f}" for f in failed[:10]))
    # a connection the enforcer dropped (its queue full) waits for its SYN's retries
    print("the hosting workers' enforcers, before and after:" + "".join(
        f"\n  {w}: {drops[w]}\n  {w}: {now}" for w, now in enforcer_drops(rc).items()))
    if api_failed:
        # the hosting side of the tenant's API meanwhile: its pods' events, and each etcd member's
        # and apiserver's warnings since the roll began
        print(rc.kubectl("get", "events", "-n", NS, "--sort-by=.lastTimestamp", check=False).stdout[-5000:])
        since = f"--since-time={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(began))}"
        for p in rc.get("pods", "-n", NS)["items"]:
            name = p["metadata"]["name"]
            if name.startswith(("etcd-", "kube-apiserver-")):
                container = "etcd" if name.startswith("etcd") else "kube-apiserver"
                logs = rc.kubectl("logs", "-n", NS, name, "-c", container, since, check=False).stdout
                print(f"--- {name}\n" + "\n".join(x for x in logs.splitlines() if " W" in x[:30] or " E" in x[:30]
                                                 or '"level":"warn"' in x or '"level":"error"' in x)[-3000:])
    assert api_ok > 50 and not api_failed, api_failed[:5]
    if failed:
        # what each tenant worker's kube-proxy and kubelet said meanwhile, and the tenant's events
        for w in A_WORKERS:
            print(f"--- {w}\n" + rc.ssh(w, f"journalctl -u kube-proxy -u kubelet -o short-precise --no-pager "
                                          f"--since=@{int(began)} | grep -v ' I[0-9]' | tail -n 60").stdout)
        print(tenant.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-6000:])
    assert ok > 100 and not failed, failed
    server = json.loads(tenant.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert server == UPGRADE_TO
    images = {c["image"] for p in rc.get("pods", "-n", NS)["items"] for c in p["spec"]["containers"]
              if c["name"] in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")}
    assert images == {f"registry.k8s.io/{c}:{UPGRADE_TO}" for c in
                      ("kube-apiserver", "kube-controller-manager", "kube-scheduler")}, images
    nodes = tenant.get("nodes")["items"]
    assert {n["status"]["nodeInfo"]["kubeletVersion"] for n in nodes} == {UPGRADE_TO}
    # every etcd member runs the new patch, the same three members, each healthy
    etcd_image = hosted_images("registry.k8s.io", UPGRADE_TO, ETCD_TO)["etcd"]
    assert {c["image"] for p in rc.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=etcd")["items"]
            for c in p["spec"]["containers"]} == {etcd_image}
    status = json.loads(rc.kubectl("-n", NS, "exec", "etcd-0", "--", "/bin/sh", "-c",
                                   f"{ETCDCTL} endpoint status --cluster -w json").stdout)
    assert sorted(e["Status"]["version"] for e in status) == [ETCD_TO.lstrip("v")] * 3, status
    assert not any(n["spec"].get("unschedulable") for n in nodes)
    assert done["snapshot"] and Path(done["snapshot"]).is_file()
    # a second run finds nothing left to roll
    again = json.loads(run_installer("upgrade", str(target), "--state", str(tenant.state), "--plan",
                                     "--output", "json").stdout)
    assert len(again["steps"]) == 1 and again["steps"][0].startswith("converge every host"), again["steps"]


def test_node_drain_remove_and_add_of_a_tenant_worker(tenant: Tenant):
    """`node drain`, `node remove` and `node add` on a tenant's worker, as on any cluster's:
    cordoned, its pods evicted (the PodDisruptionBudget of the workload above holds: its other
    replica stays); removed with the inventory still listing it, then added back: it joins
    with a new bootstrap token (its first one was used: it must not come back, and did without a
    Secret, 401, before the state forgot it)."""
    inv, state = str(tenant.inventory), str(tenant.state)
    run_installer("node", "drain", inv, "w4", "--state", state)
    assert tenant.get("node", "w4")["spec"].get("unschedulable") is True
    left = [p["metadata"]["name"] for p in tenant.get("pods", "-A", "--field-selector", "spec.nodeName=w4")["items"]
            if not any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences") or [])]
    assert not left, left

    def token() -> str | None:
        t = yaml.safe_load((tenant.state / "secrets" / "tokens.yaml").read_text()).get("w4")
        return t and t["id"]
    first = token()
    old = yaml.safe_load((tenant.state / "secrets" / "tokens.yaml").read_text())["w4"]
    out = run_installer("node", "remove", inv, "w4", "--state", state, "--yes", timeout=900).stdout
    print("\n" + out[-800:])
    assert [n["metadata"]["name"] for n in tenant.get("nodes")["items"]] == ["w3"] and token() is None
    assert tenant.rc.ssh("w4", "test -e /etc/systemd/system/kubelet.service").returncode != 0
    started = time.monotonic()
    run_installer("node", "add", inv, "w4", "--state", state, "--wait-timeout", "600", timeout=1200)
    print(f"node add w4: {time.monotonic() - started:.0f} s")
    nodes = {n["metadata"]["name"]: n for n in tenant.get("nodes")["items"]}
    assert sorted(nodes) == ["w3", "w4"] and not nodes["w4"]["spec"].get("unschedulable")
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in nodes["w4"]["status"]["conditions"])
    assert token() not in (None, first)
    # a holder of w4's first token (stolen before the remove) is nobody to the tenant's API
    url = f"https://{tenant.rc.address(tenant.rc.workers[0])}:{API_PORT}"
    code, _ = _https(f"{url}/api", tenant.state / "pki" / "ca.crt", token=f"{old['id']}.{old['secret']}")
    assert code == 401, code
    rows = {r["name"]: r for r in json.loads(run_installer("node", "list", inv, "--state", state,
                                                            "--output", "json").stdout)}
    assert rows["w4"]["state"] == "active"


# --- last: a revoked worker stays out of the tenant -------------------------------------------------

def test_node_revoke_refuses_a_stolen_kubelet_certificate_of_a_tenant(tenant: Tenant, tmp_path):
    stolen = tmp_path / "stolen.pem"
    stolen.write_text(tenant.rc.ssh("w4", f"cat {KUBELET_CLIENT}").stdout)
    stolen.chmod(0o600)
    ca = tenant.state / "pki" / "ca.crt"
    url = f"https://{tenant.rc.address(tenant.rc.workers[0])}:{API_PORT}"
    assert _https(f"{url}/api/v1/nodes/w4", ca, stolen)[0] == 200
    proc = run_installer("node", "revoke", str(tenant.inventory), "w4", "--state", str(tenant.state), "--yes",
                         "--host-unreachable", timeout=900)
    print("\n" + proc.stdout[-1500:])
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "w4"}}
    # each exposed address reaches its own node's apiserver: every one refuses it
    for w in tenant.rc.workers:
        code, answer = _https(f"https://{tenant.rc.address(w)}:{API_PORT}/api/v1/nodes", ca, stolen, method="POST",
                              body=node)
        assert code == 403 and "this node identity was revoked" in answer, (w, code, answer[:300])
    assert [n["metadata"]["name"] for n in tenant.get("nodes")["items"]] == ["w3"]
