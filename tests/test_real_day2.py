"""Day 2 on the real cluster (tests/realcluster.py, after tests/test_real_cluster.py): each
command against the real apiservers, kubelets and etcd, in the order an operator might run them.

- ``node drain``: a PodDisruptionBudget blocks it, and it stops after its timeout naming the pod.
- ``node remove w2``: pods evicted, the Node deleted, the host wiped (no container, shim, runc,
  kubelet or kube-proxy process left: listed), the other hosts' routes to its pods gone.
- ``node add w2``: it joins again with a new token the installer approves, and is Ready; no other
  host restarts anything but the routes unit.
- ``node revoke w2``, proven as an attacker would try it: w2's kubelet client certificate and
  key are copied off the host first; afterwards every write with them is refused by every
  apiserver (create its Node, its status, its Lease, a CSR, a mirror pod), a Secret its pod used
  cannot be read, its kubelet restarted with its old credentials does not bring the Node back,
  and its old bootstrap token authenticates nobody. The time from `revoke` returning to the first
  refused write on each of the three apiservers is printed. The ledger says revoked; `node add`
  and `apply` refuse the name.
- ``certs renew``: a pod answers throughout, each apiserver and kubelet presents the state's new
  leaf, the kubelet keeps its client certificate and renews it through the API (selfnodeclient).
- ``etcd member remove/add cp3`` with the API answering throughout; ``etcd snapshot save`` and
  ``restore`` (etcdutl): a ConfigMap from before the snapshot is back, one from after is gone.
- ``ca rotate``: w1 Ready with a certificate of the new CA, the old CA trusted by no apiserver or
  kubelet, a pod's service-account token still good, etcd's data kept.
- ``reset`` (w1's containerd stopped first: its shims outlive it), then ``apply`` again.

These replace the stand-in labs that proved the same commands before the real binaries ran.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shutil
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from . import hostprobes
from .realcluster import BUSYBOX, INSTALLER, run_installer, wait_for
from .realcluster import NAME as LAB

pytestmark = [pytest.mark.lab, pytest.mark.real]

KUBELET_CLIENT = "/var/lib/kubelet/pki/kubelet-client-current.pem"
PROCESSES = ("containerd", "containerd-shim-runc-v2", "runc", "kubelet", "kube-proxy")


@pytest.fixture(scope="module")
def rc(real_cluster):
    return real_cluster


def ready_nodes(rc) -> dict[str, bool]:
    return {n["metadata"]["name"]: any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in n["status"].get("conditions") or [])
            for n in rc.get("nodes")["items"]}


def pinned(name: str, node: str, replicas: int = 1) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                                           "terminationGracePeriodSeconds": 1,
                                           "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                                           "command": ["sleep", "100000"]}]}}}}


def running_pods(rc, label: str) -> list[dict]:
    return [p for p in rc.get("pods", "-l", f"app={label}")["items"] if p["status"].get("phase") == "Running"]


def processes(rc, host: str) -> list[str]:
    out = rc.ssh(host, "ps -eo comm=").stdout.split()
    return sorted({p for p in out if p in PROCESSES or p.startswith("containerd-shim")})


def gone(rc, host: str, path: str) -> bool:
    """``path`` is gone from ``host``, or it is a mount point left empty: teardown empties a
    mount point (a disk of its own on a real host; on the lab's nspawn workers
    /var/lib/containerd is a directory of the machine bound in) and keeps it."""
    return rc.ssh(host, f'test ! -e {path} || {{ mountpoint -q {path} && [ -z "$(ls -A {path})" ]; }}').returncode == 0


def proto199(rc, host: str) -> str:
    return rc.ssh(host, "ip route show proto 199").stdout


# --- drain, remove, add ---------------------------------------------------------------------------

def test_drain_blocked_by_a_pdb_stops_after_its_timeout_naming_the_pod(rc):
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(pinned("guarded", "w2")))
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "guarded"},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(pdb))
    [pod] = wait_for("guarded pod running", lambda: running_pods(rc, "guarded"), timeout=300)
    try:
        dry = json.loads(run_installer("node", "drain", str(rc.inventory), "w2", "--state", str(rc.state),
                                       "--dry-run", "--output", "json").stdout)
        assert dry["dryRun"] is True and f"default/{pod['metadata']['name']}" in dry["evicted"], dry
        assert not rc.get("node", "w2")["spec"].get("unschedulable"), "a dry run cordons nothing"
        proc = run_installer("node", "drain", str(rc.inventory), "w2", "--state", str(rc.state), "--timeout", "20",
                             check_rc=None, timeout=300)
        print("\n" + proc.stderr.strip().splitlines()[-1])
        assert proc.returncode != 0
        assert pod["metadata"]["name"] in proc.stderr and "disruption budget" in proc.stderr.lower(), proc.stderr
        assert rc.get("node", "w2")["spec"].get("unschedulable") is True        # left cordoned, as it says
        assert running_pods(rc, "guarded"), "the PDB kept the pod"
    finally:
        rc.kubectl("delete", "pdb", "guarded")
        rc.kubectl("delete", "deployment", "guarded")
        rc.kubectl("uncordon", "w2")


def test_node_remove_evicts_deletes_wipes_and_drops_the_routes(rc):
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(pinned("leaving", "w2")))
    wait_for("a pod on w2", lambda: running_pods(rc, "leaving"), timeout=300)
    cidr = rc.get("node", "w2")["spec"]["podCIDR"]
    assert all(cidr in proto199(rc, h) for h in ("cp1", "w1")), "routes to w2's pods before"
    assert processes(rc, "w2")
    dry = json.loads(run_installer("node", "remove", str(rc.inventory), "w2", "--state", str(rc.state), "--dry-run",
                                   "--output", "json").stdout)
    assert dry["dryRun"] is True and dry["steps"][0].startswith("cordon and drain Node w2"), dry
    assert ready_nodes(rc).get("w2") is True and running_pods(rc, "leaving")       # a dry run changes nothing
    proc = run_installer("node", "remove", str(rc.inventory), "w2", "--state", str(rc.state), "--yes",
                         "--timeout", "300", "--output", "json", timeout=1800)
    print("\n" + proc.stdout)
    done = json.loads(proc.stdout)
    # it ran what the dry run listed, in that order (the plan's last line is the operator's part)
    assert done["steps"] == dry["steps"][:-1] and done["state"] == "removed", (done, dry)
    assert "w2" not in ready_nodes(rc)
    left = processes(rc, "w2")
    print(f"w2 processes of the node after remove: {left or 'none'}")
    assert left == []
    for unit in ("kubelet", "kube-proxy", "containerd"):
        assert rc.ssh("w2", f"systemctl cat {unit}.service").returncode != 0, unit
    for path in ("/var/lib/kubelet", "/etc/kubernetes", "/var/lib/containerd",
                 "/etc/cni/net.d/10-hiddenplane.conflist"):
        assert gone(rc, "w2", path), path
    for h in ("cp1", "cp2", "cp3", "w1"):
        assert cidr not in proto199(rc, h), h
    # its deployment's pod moved nowhere (pinned to w2): pending, not lost silently
    assert not running_pods(rc, "leaving")
    rc.kubectl("delete", "deployment", "leaving")
    rows = {r["name"]: r for r in json.loads(run_installer(
        "node", "list", str(rc.inventory), "--state", str(rc.state), "--output", "json").stdout)}
    assert rows["w2"]["state"] == "removed" and rows["w1"]["state"] == "active"
    # apply refuses the inventory that still lists it, and says how to bring it back
    proc = run_installer("apply", str(rc.inventory), "--state", str(rc.state), check_rc=2)
    assert "w2 was removed" in proc.stderr and "node add" in proc.stderr, proc.stderr


def test_node_add_brings_it_back_and_restarts_nothing_elsewhere(rc, tmp_path):
    # with another pending edit in the inventory it refuses, changing nothing on w2
    doc = yaml.safe_load(rc.inventory.read_text())
    doc["spec"].setdefault("pki", {})["kubeletClientCertHours"] = 7     # a controller-manager flag
    other = tmp_path / "other-edit.yaml"
    other.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run_installer("node", "add", str(other), "w2", "--state", str(rc.state), check_rc=None)
    assert proc.returncode != 0 and "other pending changes" in proc.stderr, proc.stderr[-2000:]
    assert rc.ssh("w2", "test -e /etc/systemd/system/kubelet.service").returncode != 0
    # --dry-run: w2's changes planned (the ledger still says removed), nothing done
    dry = json.loads(run_installer("node", "add", str(rc.inventory), "w2", "--state", str(rc.state), "--dry-run",
                                   "--output", "json", timeout=600).stdout)
    assert dry["dryRun"] is True and any(e["host"] == "w2" and e["action"] == "changed" for e in dry["events"]), dry
    assert rc.ssh("w2", "test -e /etc/systemd/system/kubelet.service").returncode != 0

    # a thief who got w2's new token races w2's kubelet with a request of its own key
    proc = subprocess.Popen([INSTALLER, "node", "add", str(rc.inventory), "w2",
                             "--state", str(rc.state), "--wait-timeout", "900", "--output", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        thief_csr = race_with_stolen_token(rc, "w2", proc)
        out, err = proc.communicate(timeout=2400)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out)
    elsewhere = [r for r in report["restarts"] if not r.startswith("w2:")]
    assert all(r.endswith(":hiddenplane-routes.service") for r in elsewhere), elsewhere
    api_detail = [d for e in report["events"] if e["host"] == "(api)" for d in e["detail"]]
    approved = [d for d in api_detail if d.startswith("approved CSR")]
    assert len(approved) == 1 and "node w2" in approved[0], approved
    [denied] = [d for d in api_detail if f"CSR {thief_csr}:" in d]
    print(f"\nthe thief's request: {denied}")
    # which refusal depends on whether the kubelet's request came first: both hold the line
    assert denied.startswith("denied") and ("not the key w2's kubelet holds" in denied
                                          or "one certificate per token" in denied), denied
    thief = rc.get("csr", thief_csr)["status"]
    assert [c["type"] for c in thief["conditions"]] == ["Denied"] and not thief.get("certificate")
    # the one certificate issued with the token is for the key w2's kubelet uses now
    mine = rc.get("csr", approved[0].split()[2].rstrip(":"))
    issued = x509.load_pem_x509_certificate(base64.b64decode(mine["status"]["certificate"]))
    current = serialization.load_pem_private_key(
        rc.lab.host("w2").file("/var/lib/kubelet/pki/kubelet-client-current.pem").content, password=None)
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert issued.public_key().public_bytes(*der) == current.public_key().public_bytes(*der)
    assert ready_nodes(rc).get("w2") is True
    cidr = rc.get("node", "w2")["spec"]["podCIDR"]
    assert all(cidr in proto199(rc, h) for h in ("cp1", "w1"))
    again = run_installer("node", "add", str(rc.inventory), "w2", "--state", str(rc.state)).stdout
    assert "nothing to change" in again, again


def race_with_stolen_token(rc, node: str, proc: subprocess.Popen, timeout: float = 600) -> str:
    """As soon as ``node``'s bootstrap token Secret exists (the installer made it), send a client
    CSR for ``node`` with that token and a key of the thief's own; returns the CSR's name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        items = rc.get("secrets", "-n", "kube-system", "-l", f"hiddenplane.io/node={node}")["items"]
        if items:
            data = {k: base64.b64decode(v).decode() for k, v in items[0]["data"].items()}
            token = f"{data['token-id']}.{data['token-secret']}"
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no bootstrap token Secret of {node} appeared while the installer ran")
    body = _csr_body(f"system:node:{node}", "kubernetes.io/kube-apiserver-client-kubelet",
                     ["digital signature", "client auth"], prefix=f"thief-{node}-")
    ctx = ssl.create_default_context(cafile=str(rc.state / "pki" / "ca.crt"))
    req = urllib.request.Request(f"https://{rc.address('cp1')}:6443/apis/certificates.k8s.io/v1/certificatesigningrequests",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        name = json.loads(r.read())["metadata"]["name"]
    assert proc.poll() is None, "the installer ended before the thief's request was made"
    return name


# --- revoke, the way an attacker would try it -----------------------------------------------------

class Thief:
    """HTTPS requests with a stolen kubelet client certificate (cert and key in one PEM)."""

    def __init__(self, pem: Path, ca: Path):
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.ctx.load_cert_chain(str(pem))

    def request(self, url: str, method: str = "GET", body: dict | None = None,
                content_type: str = "application/json") -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


KUBE_PROXY_CONF = "/etc/kubernetes/kube-proxy.conf"
KUBE_PROXY_READS = {"Services": "/api/v1/services",
                    "EndpointSlices": "/apis/discovery.k8s.io/v1/endpointslices",
                    "Nodes": "/api/v1/nodes"}


def kube_proxy_thief(rc, host: str, tmp_path: Path) -> Thief:
    """A copy of ``host``'s kube-proxy client certificate and key, taken from its kubeconfig on
    the host (cert and key in one PEM, as Thief loads them)."""
    conf = yaml.safe_load(rc.lab.host(host).file(KUBE_PROXY_CONF).content_string)
    user = conf["users"][0]
    cert = base64.b64decode(user["user"]["client-certificate-data"])
    cn = x509.load_pem_x509_certificate(cert).subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    assert user["name"] == cn == f"hiddenplane:kube-proxy:{host}", (user["name"], cn)
    pem = tmp_path / f"kube-proxy-{host}.pem"
    pem.write_bytes(cert + base64.b64decode(user["user"]["client-key-data"]))
    pem.chmod(0o600)
    return Thief(pem, rc.state / "pki" / "ca.crt")


def shared_kube_proxy_thief(rc, tmp_path: Path) -> Thief:
    """What an earlier release put on every worker: a system:kube-proxy client certificate signed
    by the cluster CA (made here with the state's CA, as a copy kept from then would be)."""
    import datetime as dt

    from installer.core.pki import issue
    from installer.core.pki.issue import Pair
    from installer.core.pki.specs import CertSpec
    ca_pem = (rc.state / "pki" / "ca.crt").read_bytes()
    ca_key = (rc.state / "pki" / "ca.key").read_bytes()
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    ca = Pair(x509.load_pem_x509_certificate(ca_pem), load_pem_private_key(ca_key, None))
    key = issue.new_key("ecdsa-p256")
    cert = issue.issue(CertSpec("kube-proxy", "ca", "system:kube-proxy", client=True), key, ca, 30,
                       dt.datetime.now(dt.timezone.utc))
    pem = tmp_path / "kube-proxy-shared.pem"
    pem.write_bytes(issue.cert_pem(cert) + issue.key_pem(key))
    pem.chmod(0o600)
    return Thief(pem, rc.state / "pki" / "ca.crt")


def kube_proxy_reads(thief: Thief, url: str) -> dict[str, int]:
    """What kube-proxy lists, as ``thief``: resource -> HTTP status."""
    return {what: thief.request(f"{url}{path}?limit=1")[0] for what, path in KUBE_PROXY_READS.items()}


def _csr_body(cn: str, signer: str, usages: list[str], san_ip: str | None = None, prefix: str = "stolen-") -> dict:
    key = ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "system:nodes"),
        x509.NameAttribute(x509.NameOID.COMMON_NAME, cn)]))
    if san_ip:
        import ipaddress
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(san_ip))]),
                            critical=False)
    pem = b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"generateName": prefix},
            "spec": {"request": base64.b64encode(pem).decode(), "signerName": signer, "usages": usages}}


def state_before(rc, dst: Path) -> Path:
    """A copy of the state directory as it is now (what an operator might still work from)."""
    shutil.copytree(rc.state, dst)              # copy2: modes kept (0700 directories, 0600 keys)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o700
    return dst


def revoke_from_a_state_copied_before(rc, older: Path, thief, apiservers: dict[str, str]) -> None:
    """``node revoke w3`` from ``older`` (copied before w2's revoke): the policy must keep w2, the
    command must say the state did not know it, and the older ledger must learn it."""
    # an apply from the older state, w2 still in the inventory: refused before it changes any host
    # (every host's routes would list w2's pod CIDR again) or sends anything through the API (it
    # would make w2's renewal binding and token Secret again)
    routes = {h: rc.ssh(h, "sha256sum /etc/systemd/system/hiddenplane-routes.service").stdout for h in rc.controls}
    proc = run_installer("apply", str(rc.inventory), "--state", str(older), "--wait-timeout", "600", check_rc=2,
                         timeout=900)
    assert "w2: revoked in this cluster" in proc.stderr and "no host was changed" in proc.stderr, proc.stderr[-3000:]
    assert {h: rc.ssh(h, "sha256sum /etc/systemd/system/hiddenplane-routes.service").stdout
            for h in rc.controls} == routes
    assert rc.kubectl("get", "clusterrolebinding", "hiddenplane:node-renewal:w2", check=False).returncode != 0
    doc = yaml.safe_load(rc.inventory.read_text())
    used = {ipaddress.ip_address(h["address"]) for h in doc["spec"]["hosts"]}
    net = ipaddress.ip_network(f"{rc.address('cp1')}/24", strict=False)
    free = next(a for a in reversed(list(net.hosts())) if a not in used and a != net.network_address + 1)
    w2 = next(h for h in doc["spec"]["hosts"] if h["name"] == "w2")
    doc["spec"]["hosts"].append({**w2, "name": "w3", "address": str(free)})
    inventory = rc.inventory.with_name("with-w3.inventory.yaml")     # next to it: relative paths hold
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))

    proc = run_installer("node", "revoke", str(inventory), "w3", "--state", str(older), "--yes",
                         "--host-unreachable", timeout=900)
    print("\n" + proc.stdout + proc.stderr)
    # said: the cluster denied w2, the older state did not know it
    assert ("warning: the cluster's policy hiddenplane-revoked-nodes already denied system:node:w2, which this "
            "state's node ledger did not mark revoked") in proc.stderr, proc.stderr
    assert "(denies system:node:w2, system:node:w3)" in proc.stdout, proc.stdout
    waited = re.findall(r"the apiserver on (cp\d) refuses system:node:w3", proc.stdout)
    assert sorted(waited) == sorted(rc.controls), proc.stdout
    # the apply of the other hosts from the older state is refused (w2 listed, now known revoked)
    assert "the other hosts' routes were not refreshed" in proc.stderr and "w2 was revoked" in proc.stderr, \
        proc.stderr

    # the policy in the cluster: both names, in the installer's exact form
    policy = rc.get("validatingadmissionpolicy", "hiddenplane-revoked-nodes")
    assert [v["expression"] for v in policy["spec"]["validations"]] == [
        '!(request.userInfo.username in ["system:node:w2", "system:node:w3"])']
    binding = rc.get("validatingadmissionpolicybinding", "hiddenplane-revoked-nodes")
    assert binding["spec"]["validationActions"] == ["Deny"]

    # w2's stolen certificate: still refused by the policy on every apiserver
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "w2"}}
    for c, url in apiservers.items():
        code, answer = thief.request(f"{url}/api/v1/nodes", "POST", node)
        print(f"{c}: create Node w2 with the stolen certificate after a revoke from an older state: {code} "
              f"{answer[:200]}")
        assert code == 403 and "this node identity was revoked" in answer, (c, code, answer)

    # the same names again: the live policy and binding, with what kube-apiserver filled in
    # (failurePolicy, matchPolicy, selectors, scope), compare equal to ours field by field
    again = run_installer("node", "revoke", str(inventory), "w3", "--state", str(older), "--yes",
                          "--host-unreachable", timeout=900)
    assert "unchanged ValidatingAdmissionPolicy hiddenplane-revoked-nodes (denies system:node:w2, " \
           "system:node:w3)" in again.stdout, again.stdout
    assert "unchanged ValidatingAdmissionPolicyBinding hiddenplane-revoked-nodes" in again.stdout, again.stdout
    assert "already denied" not in again.stderr and "did not deny" not in again.stderr, again.stderr

    # the older state learned w2 (a later run from it keeps it) and recorded w3
    rows = {r["name"]: r for r in json.loads(run_installer(
        "node", "list", str(inventory), "--state", str(older), "--output", "json").stdout)}
    assert rows["w2"]["state"] == "revoked" and rows["w3"]["state"] == "revoked", rows
    ledger = yaml.safe_load((older / "nodes.yaml").read_text())["nodes"]
    assert ledger["w2"]["history"][-1]["note"] == "found in the cluster's revoked-nodes policy", ledger["w2"]
    # the current state is left alone: it still knows w2 only (w3 is the cluster's, and stays)
    current = yaml.safe_load((rc.state / "nodes.yaml").read_text())["nodes"]
    assert current["w2"]["state"] == "revoked" and "w3" not in current
    inventory.unlink()


def test_revoke_refuses_a_stolen_certificate_everywhere(rc, tmp_path):
    # before: a Secret a pod on w2 uses, and the thief's copy of w2's client certificate and key
    rc.kubectl("create", "secret", "generic", "w2-secret", "--from-literal=k=v")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "uses-secret"},
           "spec": {"nodeName": "w2", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                    "command": ["sleep", "100000"],
                                    "volumeMounts": [{"name": "s", "mountPath": "/s"}]}],
                    "volumes": [{"name": "s", "secret": {"secretName": "w2-secret"}}]}}
    rc.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    wait_for("uses-secret running", lambda: rc.get("pod", "uses-secret")["status"].get("phase") == "Running",
             timeout=300)
    stolen = tmp_path / "stolen.pem"
    stolen.write_text(rc.lab.host("w2").file(KUBELET_CLIENT).content_string)
    stolen.chmod(0o600)
    thief = Thief(stolen, rc.state / "pki" / "ca.crt")
    apiservers = {c: f"https://{rc.address(c)}:6443" for c in rc.controls}
    before, _ = thief.request(f"{apiservers['cp1']}/api/v1/namespaces/default/secrets/w2-secret")
    assert before == 200, "with its pod there, the Node authorizer lets w2 read the Secret"
    token = yaml.safe_load((rc.state / "secrets" / "tokens.yaml").read_text())["w2"]
    # w2's kube-proxy identity (its own: hiddenplane:kube-proxy:w2) reads what kube-proxy needs
    proxy_thief = kube_proxy_thief(rc, "w2", tmp_path)
    proxy_w1 = kube_proxy_thief(rc, "w1", tmp_path)
    for c, u in apiservers.items():
        assert kube_proxy_reads(proxy_thief, u) == dict.fromkeys(KUBE_PROXY_READS, 200), c
    # the shared identity of earlier releases is worth nothing: upstream's binding is empty and
    # protected from the apiserver's start-up reconciliation (which would add system:kube-proxy
    # back without autoupdate "false"): restart cp1's apiserver and look again
    assert rc.ssh("cp1", "systemctl restart kube-apiserver").returncode == 0
    wait_for("cp1's apiserver ready again",
             lambda: rc.kubectl("--server", apiservers["cp1"], "get", "--raw", "/readyz", check=False).returncode == 0,
             timeout=180)
    crb = rc.get("clusterrolebinding", "system:node-proxier")
    assert not crb.get("subjects"), crb
    assert crb["metadata"]["annotations"]["rbac.authorization.kubernetes.io/autoupdate"] == "false", crb
    shared = shared_kube_proxy_thief(rc, tmp_path)
    for c, u in apiservers.items():
        got = kube_proxy_reads(shared, u)
        print(f"{c}: a system:kube-proxy certificate (earlier releases' shared identity) lists {got}")
        assert got == dict.fromkeys(KUBE_PROXY_READS, 403), (c, got)

    # revoke; the host "unreachable" for the installer, so its kubelet keeps its credentials
    older = state_before(rc, tmp_path / "state-before-revoke")
    proc = run_installer("node", "revoke", str(rc.inventory), "w2", "--state", str(rc.state), "--yes",
                         "--host-unreachable", timeout=900)
    returned = time.monotonic()
    print("\n" + proc.stdout)
    waited = re.findall(r"the apiserver on (cp\d) refuses system:node:w2 \(([\d.]+) s after the policy\)",
                        proc.stdout + proc.stderr)
    assert sorted(h for h, _ in waited) == sorted(rc.controls), proc.stdout

    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "w2"}}
    for c, url in apiservers.items():
        code, answer = thief.request(f"{url}/api/v1/nodes", "POST", node)
        first = time.monotonic() - returned
        print(f"{c}: create Node w2 with the stolen certificate {first:.2f} s after revoke returned: "
              f"{code} {answer[:200]}")
        assert code == 403 and "this node identity was revoked" in answer, (c, code, answer)
    # an operator working from a copy of the state taken before this revoke revokes another
    # name: w2 stays revoked
    revoke_from_a_state_copied_before(rc, older, thief, apiservers)

    # its Lease went with its Node (garbage-collected); an admin puts one back, without an owner,
    # so that a renewal meets the policy rather than a missing object
    rc.kubectl("delete", "lease", "w2", "-n", "kube-node-lease", "--ignore-not-found")
    rc.kubectl("create", "-f", "-", stdin=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "w2", "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": "w2", "leaseDurationSeconds": 40}}))
    lease = rc.get("lease", "w2", "-n", "kube-node-lease")
    url = apiservers["cp2"]
    attempts = {
        "update its status": (f"{url}/api/v1/nodes/w2/status", "PATCH",
                              {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                              "application/merge-patch+json"),
        "create its Lease": (f"{url}/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", "POST",
                             {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                              "metadata": {"name": "w2", "namespace": "kube-node-lease"},
                              "spec": {"holderIdentity": "w2", "leaseDurationSeconds": 40}}, "application/json"),
        "renew its Lease": (f"{url}/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/w2", "PUT",
                            {**lease, "spec": {**lease["spec"], "renewTime": "2026-12-02T00:00:00.000000Z"}},
                            "application/json"),
        "create a client CSR": (f"{url}/apis/certificates.k8s.io/v1/certificatesigningrequests", "POST",
                                _csr_body("system:node:w2", "kubernetes.io/kube-apiserver-client-kubelet",
                                          ["digital signature", "client auth"]), "application/json"),
        "create a serving CSR": (f"{url}/apis/certificates.k8s.io/v1/certificatesigningrequests", "POST",
                                 _csr_body("system:node:w2", "kubernetes.io/kubelet-serving",
                                           ["digital signature", "server auth"], rc.address("w2")), "application/json"),
        "create a mirror pod": (f"{url}/api/v1/namespaces/default/pods", "POST",
                                {"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": "mirror-w2", "annotations": {"kubernetes.io/config.mirror": "x"}},
                                 "spec": {"nodeName": "w2", "containers": [{"name": "c", "image": BUSYBOX}]}},
                                "application/json"),
    }
    for what, (u, method, body, ctype) in attempts.items():
        code, answer = thief.request(u, method, body, ctype)
        print(f"{what}: {code} "
              f"{json.loads(answer).get('message', answer)[:220] if answer.startswith('{') else answer[:220]}")
        if what == "update its status":          # the Node is gone (and cannot be made again: above)
            assert code == 404, (what, code, answer)
        elif "Lease" in what or "client CSR" in what:
            assert code == 403 and "this node identity was revoked" in answer, (what, code, answer)
        else:                   # refused by the policy, or already by NodeRestriction before it
            assert code == 403, (what, code, answer)
    code, answer = thief.request(f"{url}/api/v1/namespaces/default/secrets/w2-secret")
    print(f"read the Secret its pod used: {code} {answer[:220]}")
    assert code == 403, answer
    # its kube-proxy certificate reads nothing any more, on every apiserver (RBAC: revoke deleted
    # hiddenplane:kube-proxy:w2; each apiserver's RBAC cache follows its own watch, hence the wait)
    for c, u in apiservers.items():
        start = time.monotonic()
        wait_for(f"{c} refuses w2's kube-proxy reads",
                 lambda: kube_proxy_reads(proxy_thief, u) == dict.fromkeys(KUBE_PROXY_READS, 403),
                 timeout=30, interval=0.2)
        code, answer = proxy_thief.request(f"{u}/api/v1/services")
        print(f"{c}: list Services with w2's kube-proxy certificate ({time.monotonic() - start:.2f} s): "
              f"{code} {json.loads(answer).get('message', answer)[:200]}")
        assert code == 403 and 'User "hiddenplane:kube-proxy:w2" cannot list resource "services"' in \
            json.loads(answer)["message"], answer
        # w1's kube-proxy is untouched
        assert kube_proxy_reads(proxy_w1, u) == dict.fromkeys(KUBE_PROXY_READS, 200), c
    assert rc.get("clusterrolebinding", "hiddenplane:kube-proxy:w1")["subjects"][0]["name"] == \
        "hiddenplane:kube-proxy:w1"
    assert rc.kubectl("get", "clusterrolebinding", "hiddenplane:kube-proxy:w2", check=False).returncode != 0

    # its kubelet, restarted with its old credentials, does not bring the Node back
    since = rc.ssh("w2", "date +%s").stdout.strip()
    assert rc.ssh("w2", "systemctl restart kubelet").returncode == 0

    def journal() -> str:
        return rc.ssh("w2", f"journalctl -u kubelet --since @{since} --no-pager -o cat").stdout
    # its first write (registering its Node again) is refused; the wait is that long, not a fixed one
    wait_for("w2's restarted kubelet refused", lambda: "this node identity was revoked" in journal(),
             timeout=120, interval=2)
    assert "w2" not in ready_nodes(rc)
    # its old bootstrap token authenticates nobody
    tok = subprocess.run(["curl", "-sk", "-o", "/dev/null", "-w", "%{http_code}", "-H", "@-", f"{url}/api"],
                         input=f"Authorization: Bearer {token['id']}.{token['secret']}\n", capture_output=True,
                         text=True, timeout=30)
    assert tok.stdout == "401", tok
    # the ledger says so; the name can never be added again, and apply refuses an inventory with it
    rows = {r["name"]: r for r in json.loads(run_installer(
        "node", "list", str(rc.inventory), "--state", str(rc.state), "--output", "json").stdout)}
    assert rows["w2"]["state"] == "revoked"
    proc = run_installer("node", "add", str(rc.inventory), "w2", "--state", str(rc.state), check_rc=2)
    assert "can never join again" in proc.stderr, proc.stderr
    proc = run_installer("apply", str(rc.inventory), "--state", str(rc.state), check_rc=2)
    assert "w2 was revoked" in proc.stderr, proc.stderr
    rc.kubectl("delete", "secret", "w2-secret")
    rc.kubectl("delete", "lease", "w2", "-n", "kube-node-lease")
    rc.kubectl("delete", "pod", "uses-secret", "--force", "--grace-period=0", check=False)
    rc.ssh("w2", "systemctl stop kubelet")       # the revoked host: nothing of it runs on


# --- the cluster keeps working through renewals, membership changes and restores -----------------

class Probe:
    """Calls ``fn`` every ``interval`` seconds in a thread while the block runs; counts failures."""

    def __init__(self, what: str, fn, interval: float = 0.5):
        import threading
        self.what, self.fn, self.interval = what, fn, interval
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                if self.fn():
                    self.ok += 1
                else:
                    self.failed += 1
            except Exception as e:          # noqa: BLE001 - a failed probe is data, not an error
                self.failed += 1
                self.errors.append(str(e)[:200])
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)
        print(f"\n{self.what}: {self.ok} answered, {self.failed} failed"
              + (f" ({self.errors[:3]})" if self.errors else ""))


def no_w2(rc) -> Path:
    """The inventory after w2's revocation: apply refuses one that still lists it."""
    return rc.write_inventory("no-w2.inventory.yaml", drop=("w2",))


def served_serial(address: str, port: int) -> int:
    """The serial of the certificate a TLS server presents (no client certificate, no verify)."""
    pem = ssl.get_server_certificate((address, port), timeout=10)
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


def https_status(url: str, client_pem: Path) -> int | str:
    """The HTTP status a server answers a client certificate with (the server not verified)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.load_cert_chain(str(client_pem))
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (ssl.SSLError, ConnectionResetError):
        return "handshake refused"


def verifies(address: str, port: int, cafile: Path) -> bool:
    """Whether the server's certificate verifies against ``cafile`` (and names ``address``)."""
    import socket
    ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with socket.create_connection((address, port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=address):
            return True
    except ssl.SSLCertVerificationError:
        return False


def api_answers(rc) -> bool:
    return rc.kubectl("get", "--raw", "/readyz", check=False, timeout=20).returncode == 0


def some_apiserver_answers(rc) -> bool:
    """The API as a client with every control host's address sees it: one /readyz answers."""
    return any(rc.kubectl("--server", f"https://{rc.address(c)}:6443", "get", "--raw", "/readyz",
                          check=False, timeout=20).returncode == 0 for c in rc.controls)


def pod_answers(rc, ip: str) -> bool:
    r = rc.ssh("cp1", f"exec 3<>/dev/tcp/{ip}/8080 && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3", timeout=20)
    return "hello-from" in r.stdout


@pytest.fixture(scope="module")
def web_w1(rc):
    """An HTTP server pod on w1 for the probes (the real-cluster module's, or a new one)."""
    if rc.kubectl("get", "pod", "web-w1", check=False).returncode != 0:
        rc.run_pod("web-w1", "w1", "echo hello-from-w1 > /tmp/index.html; exec httpd -f -v -p 8080 -h /tmp")
    return rc.get("pod", "web-w1")["status"]["podIP"]


@pytest.mark.quiet(LAB)
def test_certs_renew_keeps_the_cluster_working(rc, web_w1, tmp_path):
    inv = no_w2(rc)
    serial = x509.load_pem_x509_certificate(
        rc.lab.host("w1").file(KUBELET_CLIENT).content_string.encode()).serial_number
    endpoints = {f"{h}:{port}": (rc.address(h), port) for h, port in [(c, 6443) for c in rc.controls] + [("w1", 10250)]}
    before = {e: served_serial(*a) for e, a in endpoints.items()}
    # w1 asks the API through its balancer and through the kubernetes Service meanwhile: every
    # apiserver and etcd member restarts, one host at a time, and none of it may fail
    for name, url in hostprobes.api("w1"):
        hostprobes.start(rc.lab.ssh_config, "w1", f"hp-renew-{name}", url)
    began = time.time()
    with Probe("pod on w1 during certs renew", lambda: pod_answers(rc, web_w1)) as pod_probe:
        proc = run_installer("certs", "renew", str(inv), "--state", str(rc.state), "--wait-timeout", "600",
                             timeout=2400)
    print(proc.stdout[-1500:])
    assert pod_probe.failed == 0 and pod_probe.ok > 0
    # every apiserver left the balancers before it stopped (host/handover.py), once per host:
    # its stop for its etcd member's restart also did its own pending restart
    said = proc.stdout + proc.stderr
    assert [said.count(f"{c}: kube-apiserver left the API balancers of 1 worker(s)") for c in rc.controls] == [1] * 3
    # ... and stopped without being held to its deadline by the watches it served
    stops = {c: hostprobes.apiserver_stops(rc.lab.ssh_config, c, began) for c in rc.controls}
    print(f"kube-apiserver stops (seconds, held to the deadline): {stops}")
    assert all(s and not any(x.deadline for x in s) for s in stops.values()), stops
    for name, _ in hostprobes.api("w1"):
        rows = hostprobes.rows(rc.lab.ssh_config, "w1", f"hp-renew-{name}")
        print(f"w1 API probe {name} during certs renew: requests / failed / longest (s) {hostprobes.summary(rows)}")
        assert len(rows) > 100 and hostprobes.failed(rows) == [], hostprobes.failed(rows)[:5]
    # read here, apart from the installer's own checks: each server presents the state's new leaf
    pki = rc.state / "pki"
    for e, a in endpoints.items():
        now = served_serial(*a)
        leaf = pki / ("apiserver.crt" if e.endswith(":6443") else "kubelet/w1-serving.crt")
        assert now != before[e] and now == x509.load_pem_x509_certificate(leaf.read_bytes()).serial_number, e
    rc.write_kubeconfig()                      # the admin certificate was renewed too
    assert api_answers(rc)
    assert ready_nodes(rc) == {"w1": True}
    # the kubelet keeps its own client certificate (the cluster signs and renews those)
    after = x509.load_pem_x509_certificate(rc.lab.host("w1").file(KUBELET_CLIENT).content_string.encode()).serial_number
    assert after == serial
    # ... and renews it through the API as the kubelet does: a CSR for itself, made with its current
    # certificate, is approved by the controller-manager (selfnodeclient) and signed
    own = tmp_path / "w1.pem"
    own.write_text(rc.lab.host("w1").file(KUBELET_CLIENT).content_string)
    own.chmod(0o600)
    code, answer = Thief(own, rc.state / "pki" / "ca.crt").request(
        f"https://{rc.address('cp1')}:6443/apis/certificates.k8s.io/v1/certificatesigningrequests", "POST",
        _csr_body("system:node:w1", "kubernetes.io/kube-apiserver-client-kubelet", ["digital signature", "client auth"],
                  prefix="renewal-"))
    assert code == 201, answer
    name = json.loads(answer)["metadata"]["name"]
    status = wait_for("the renewal CSR signed", lambda: (s := rc.get("csr", name).get("status") or {}).get(
        "certificate") and s, timeout=120)
    assert [c["type"] for c in status["conditions"]] == ["Approved"], status["conditions"]
    print(f"renewal CSR {name} as system:node:w1: {status['conditions'][0].get('reason')} "
          f"({status['conditions'][0].get('message')})")
    rc.kubectl("delete", "csr", name)


@pytest.mark.quiet(LAB)
def test_etcd_member_remove_and_add_with_the_api_serving(rc):
    inv, without_cp3 = no_w2(rc), rc.write_inventory("no-w2-cp3.inventory.yaml", drop=("w2", "cp3"))
    doc = yaml.safe_load(without_cp3.read_text())
    doc["spec"]["allowEvenControlHosts"] = True
    without_cp3.write_text(yaml.safe_dump(doc, sort_keys=False))
    # each apiserver uses its own host's member: while cp3 leaves and comes back, one always answers
    with Probe("API (any apiserver) during etcd member remove/add", lambda: some_apiserver_answers(rc)) as api_probe:
        t0 = time.monotonic()
        out = run_installer("etcd", "member", "remove", str(inv), "cp3", "--state", str(rc.state), "--allow-even",
                            "--yes", timeout=900).stdout
        assert "removed; 2 members healthy: cp1, cp2" in out, out
        t1 = time.monotonic()
        out = run_installer("apply", str(without_cp3), "--state", str(rc.state), "--wait-timeout", "600",
                            timeout=1800).stdout
        print(f"\nmember remove {t1 - t0:.0f} s; apply without cp3 {time.monotonic() - t1:.0f} s:\n{out[-1500:]}")
        t1 = time.monotonic()
        out = run_installer("etcd", "member", "add", str(inv), "cp3", "--state", str(rc.state), "--wait-timeout",
                            "600", timeout=1800).stdout
        print(f"member add {time.monotonic() - t1:.0f} s:\n{out[-2500:]}")
        assert "added and promoted; 3 voting members, all healthy" in out, out
    assert api_probe.failed == 0 and api_probe.ok > 0
    assert ready_nodes(rc) == {"w1": True}


def test_etcd_snapshot_restore_brings_back_the_cluster_objects(rc, tmp_path):
    inv = no_w2(rc)
    rc.kubectl("create", "configmap", "before-snapshot", "--from-literal=k=1")
    snap = tmp_path / "etcd.snapshot"
    saved = json.loads(run_installer("etcd", "snapshot", "save", str(inv), str(snap), "--output", "json").stdout)
    print(f"\n{saved}")
    assert Path(saved["path"]).resolve() == snap.resolve() and saved["revision"] > 0 and saved["total_keys"] > 0
    assert snap.stat().st_mode & 0o777 == 0o600
    members = json.loads(run_installer("etcd", "members", str(inv), "--output", "json").stdout)
    assert sorted(m["name"] for m in members) == sorted(rc.controls) and not any(m["learner"] for m in members)
    assert all(m["alarms"] == [] for m in members), members
    rc.kubectl("create", "configmap", "after-snapshot", "--from-literal=k=2")
    data_dirs = rc.ssh("cp1", "ls -d /var/lib/etcd*").stdout
    proc = run_installer("etcd", "snapshot", "restore", str(inv), str(snap), check_rc=2)
    assert "--yes" in proc.stderr and "stop kube-apiserver" in proc.stderr, proc.stderr
    dry = json.loads(run_installer("etcd", "snapshot", "restore", str(inv), str(snap), "--dry-run",
                                   "--output", "json").stdout)
    assert dry["dryRun"] is True and any("stop kube-apiserver" in step for step in dry["steps"]), dry
    assert rc.ssh("cp1", "ls -d /var/lib/etcd*").stdout == data_dirs and api_answers(rc)
    out = run_installer("etcd", "snapshot", "restore", str(inv), str(snap), "--yes", "--wait-timeout", "600",
                        timeout=1800).stdout
    print(out[-1200:])
    wait_for("the API back", lambda: api_answers(rc), timeout=300)
    assert rc.kubectl("get", "configmap", "before-snapshot", check=False).returncode == 0
    assert rc.kubectl("get", "configmap", "after-snapshot", check=False).returncode != 0
    wait_for("w1 Ready again", lambda: ready_nodes(rc).get("w1"), timeout=600)
    rc.kubectl("delete", "configmap", "before-snapshot")
    # the same three members, each data dir moved aside once; writable again
    out = run_installer("etcd", "members", str(inv)).stdout
    print(out)
    assert sorted(line.split()[0] for line in out.strip().splitlines()[1:]) == sorted(rc.controls)
    for c in rc.controls:
        assert rc.ssh(c, "ls -d /var/lib/etcd.pre-restore-* | wc -l").stdout.strip() == "1", c
    # the way out of a NOSPACE alarm (none here): the history compacted, each member defragmented
    # in turn, the API serving throughout its three members' turns
    out = run_installer("etcd", "defrag", str(inv)).stdout
    print(out)
    assert all(f"{c}: defragmented, " in out for c in rc.controls) and "compact" in out, out
    assert api_answers(rc)


# --- the cure after a revocation, and starting over ------------------------------------------------

def test_ca_rotate_leaves_no_old_ca_trusted_and_the_cluster_working(rc, web_w1, tmp_path):
    inv = no_w2(rc)
    old_ca = tmp_path / "old-ca.crt"
    old_ca.write_bytes((rc.state / "pki" / "ca.crt").read_bytes())
    old_admin = tmp_path / "old-admin.pem"
    old_admin.write_bytes((rc.state / "pki" / "admin.crt").read_bytes() + (rc.state / "pki" / "admin.key").read_bytes())
    old_admin.chmod(0o600)
    pki = rc.state / "pki"
    old_kubelet_client = tmp_path / "old-apiserver-kubelet-client.pem"      # what the apiserver showed kubelets
    old_kubelet_client.write_bytes((pki / "apiserver-kubelet-client.crt").read_bytes()
                                   + (pki / "apiserver-kubelet-client.key").read_bytes())
    old_kubelet_client.chmod(0o600)
    rc.kubectl("create", "configmap", "before-rotate", "--from-literal=k=1")
    sa_token = rc.kubectl("exec", "web-w1", "--", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token").stdout
    proc = run_installer("ca", "rotate", str(inv), "--state", str(rc.state), "--yes", "--wait-timeout", "900",
                         "--output", "json", timeout=3600)
    report = json.loads(proc.stdout)
    print("\n" + "\n".join(report.get("steps", [])[-12:]))
    rc.write_kubeconfig()
    wait_for("w1 Ready with a certificate from the new CA", lambda: ready_nodes(rc).get("w1"), timeout=900)
    new_ca = x509.load_pem_x509_certificate((rc.state / "pki" / "ca.crt").read_bytes())
    kubelet_cert = x509.load_pem_x509_certificate(rc.lab.host("w1").file(KUBELET_CLIENT).content_string.encode())
    assert kubelet_cert.issuer == new_ca.subject
    assert rc.kubectl("get", "configmap", "before-rotate", check=False).returncode == 0, "etcd kept its data"
    # CoreDNS read the old CA at its start: restarted by the rotation, ready again (it synced with the API)
    assert any(s.startswith("restarted Deployment kube-system/coredns") for s in report["steps"]), report["steps"]
    wait_for("CoreDNS restarted and ready", lambda: (d := rc.get("deployment", "coredns", "-n", "kube-system"))[
        "status"].get("updatedReplicas") == d["spec"]["replicas"] == d["status"].get("readyReplicas")
        == d["status"].get("replicas"), timeout=600)
    # the old CA: trusted nowhere. Its admin certificate is refused by every apiserver...
    ctx = ssl.create_default_context(cafile=str(rc.state / "pki" / "ca.crt"))
    ctx.load_cert_chain(str(old_admin))
    for c in rc.controls:
        req = urllib.request.Request(f"https://{rc.address(c)}:6443/api")
        try:
            urllib.request.urlopen(req, context=ctx, timeout=20)
            code = 200
        except urllib.error.HTTPError as e:
            code = e.code
        assert code == 401, (c, code)
    # ... and by the kubelet; and no server presents a certificate of the old CA any more
    w1 = rc.address("w1")
    code = https_status(f"https://{w1}:10250/pods", old_kubelet_client)
    print(f"w1's kubelet to the old apiserver-kubelet-client certificate: {code}")
    assert code in (401, "handshake refused"), code
    new_ca_file = rc.state / "pki" / "ca.crt"
    for where in [(rc.address(c), 6443) for c in rc.controls] + [(w1, 10250)]:
        assert verifies(*where, old_ca) is False and verifies(*where, new_ca_file) is True, where
    # service-account tokens of running pods keep working (the SA key is kept)
    who = subprocess.run(["curl", "-s", "--cacert", str(rc.state / "pki" / "ca.crt"), "-H", "@-",
                          f"https://{rc.address('cp1')}:6443/apis/authentication.k8s.io/v1/selfsubjectreviews",
                          "-X", "POST", "-H", "Content-Type: application/json", "-d",
                          '{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}'],
                         input=f"Authorization: Bearer {sa_token.strip()}\n", capture_output=True, text=True,
                         timeout=30)
    assert "system:serviceaccount:default:default" in who.stdout, who.stdout[-500:]
    rc.kubectl("delete", "configmap", "before-rotate")


def test_reset_leaves_clean_hosts_and_apply_builds_the_cluster_again(rc):
    inv = no_w2(rc)
    # the hard case on w1: containerd already stopped (its unit kills only the daemon,
    # KillMode=process), so the shims and containers outlive it and must be found by their cgroups
    assert rc.ssh("w1", "systemctl stop containerd").returncode == 0
    left = processes(rc, "w1")
    print(f"\nw1 with containerd stopped: {left}")
    assert "containerd-shim" in left and "containerd" not in left      # ps: comm, 15 characters
    run_installer("reset", str(inv), "--state", str(rc.state), "--yes", timeout=1800)
    for h in (*rc.controls, "w1"):
        assert processes(rc, h) == [], h
        for x in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert not rc.lab.host(h).process.filter(comm=x), (h, x)
    w1 = rc.lab.host("w1")
    chains = w1.check_output("iptables-save | grep -E '^:(KUBE|CNI|HIDDENPLANE)' || true")
    assert chains == "", chains
    mounts = w1.check_output("grep -E '/run/containerd|/var/lib/kubelet|/var/lib/containerd/|netns' /proc/mounts "
                             "|| true")
    assert mounts == "", mounts
    assert gone(rc, "w1", "/var/lib/containerd")
    assert not w1.file("/var/lib/cni").exists and not w1.file("/etc/cni/net.d/10-hiddenplane.conflist").exists
    assert "proto 199" not in w1.check_output("ip route show proto 199 || true")
    run_installer("apply", str(inv), "--state", str(rc.state), "--wait-timeout", "900", timeout=2400)
    rc.write_kubeconfig()
    assert ready_nodes(rc) == {"w1": True}
    wait_for("CoreDNS ready again", lambda: (d := rc.get("deployment", "coredns", "-n", "kube-system"))["status"].get(
        "readyReplicas") == d["spec"]["replicas"], timeout=900)
