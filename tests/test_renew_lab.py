"""`installer certs renew` and `installer ca rotate` on a real three-member lab (real etcd with mTLS,
the contract stand-ins serving their configured certificates): every endpoint presents the new
certificate (checked here with our own TLS handshakes), nothing else changes, etcd keeps its data."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import ssl
import stat

import pytest
import yaml
from cryptography import x509

from installer.core.pki import issue

from .labfixtures import standin_lab
from .test_apply_lab import apply_json, etcdctl, run_installer

pytestmark = pytest.mark.lab

NAME, SUBNET = "renew", "10.213.243.0/24"
CONTROLS = ("cp1", "cp2", "cp3")
CAS = ("ca", "etcd/ca", "front-proxy-ca")
MANIFEST = "/var/lib/hiddenplane/manifest"
CLIENT_KUBECONFIGS = {"/etc/kubernetes/admin.conf", "/etc/kubernetes/controller-manager.conf",
                      "/etc/kubernetes/scheduler.conf", "/etc/kubernetes/kube-proxy.conf"}
CA_FILES = {"/etc/kubernetes/pki/ca.crt", "/etc/kubernetes/pki/ca.key", "/etc/kubernetes/pki/front-proxy-ca.crt",
            "/etc/kubernetes/pki/etcd/ca.crt", "/etc/etcd/pki/ca.crt"}
SA_FILES = {"/etc/kubernetes/pki/sa.key", "/etc/kubernetes/pki/sa.pub"}


@pytest.fixture(scope="module")
def renewlab(tmp_path_factory):
    with standin_lab(NAME, SUBNET, tmp_path_factory.mktemp("renewlab"), controls=3, workers=1) as lab:
        apply_json(lab.inventory, lab.state)
        lab.worker = next(h.name for h in lab.spec.hosts if h.role == "worker")
        yield lab


# --- what the hosts present, read independently of the installer -------------------------------

def endpoints(lab) -> list[tuple[str, str, str, int, str | None, str | None]]:
    """(host, endpoint, address, port, state cert, client credential); cert None: self-signed
    on loopback (read on the host with openssl)."""
    out = []
    for h in CONTROLS:
        a = lab.spec.host(h).address
        out += [(h, "etcd-client", a, 2379, f"etcd/server-{h}", "etcd/healthcheck-client"),
                (h, "etcd-peer", a, 2380, f"etcd/peer-{h}", "etcd/healthcheck-client"),
                (h, "apiserver", a, 6443, "apiserver", "admin"),
                (h, "controller-manager", "127.0.0.1", 10257, None, None),
                (h, "scheduler", "127.0.0.1", 10259, None, None)]
    w = lab.worker
    out.append((w, "kubelet", lab.spec.host(w).address, 10250, f"kubelet/{w}-serving", "apiserver-kubelet-client"))
    return out


def state_cert(lab, name: str) -> x509.Certificate:
    return issue.load_cert((lab.state / "pki" / f"{name}.crt").read_bytes())


def presented(lab, address: str, port: int, credential: str, cafile=None) -> x509.Certificate:
    """A TLS handshake from this machine, presenting the state's ``credential``; with ``cafile``
    the server must verify against it (and its SANs name ``address``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cafile is None:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cafile=str(cafile))
    pki = lab.state / "pki"
    ctx.load_cert_chain(str(pki / f"{credential}.crt"), str(pki / f"{credential}.key"))
    with socket.create_connection((address, port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=address) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def loopback_serial(lab, host: str, port: int) -> int:
    out = lab.host(host).check_output(
        f"openssl s_client -connect 127.0.0.1:{port} </dev/null 2>/dev/null | openssl x509 -noout -serial")
    return int(out.strip().split("=", 1)[1], 16)


def serials(lab) -> dict[tuple[str, str], int]:
    out = {}
    for host, name, address, port, cert, cred in endpoints(lab):
        out[(host, name)] = (presented(lab, address, port, cred).serial_number if cert
                             else loopback_serial(lab, host, port))
    return out


def managed_files(lab) -> dict[str, dict[str, str]]:
    """host -> {path: sha256 of its content now} for every file the installer wrote there."""
    out = {}
    for h in lab.spec.hosts:
        lines = lab.host(h.name).check_output(
            f"cut -f1 {MANIFEST} | sort -u | xargs -d '\\n' sha256sum").splitlines()
        out[h.name] = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    return out


def state_files(lab) -> dict[str, bytes]:
    return {str(p.relative_to(lab.state)): p.read_bytes() for p in lab.state.rglob("*")
            if p.is_file() and "backups" not in p.parts}


def main_pid(lab, host: str, unit: str) -> str:
    return lab.host(host).check_output(f"systemctl show -p MainPID --value {unit}")


def check_rows(lab) -> dict[tuple[str, str], dict]:
    proc = run_installer("certs", "check", str(lab.inventory), "--state", str(lab.state), "--output", "json")
    return {(r["where"], r["name"]): r for r in json.loads(proc.stdout)["certificates"]}


def renewed_by_design(path: str) -> bool:
    """Files that carry a leaf certificate or its key (or embed a client certificate)."""
    if path in CA_FILES or path in SA_FILES:
        return False
    return path.endswith((".crt", ".key")) or path in CLIENT_KUBECONFIGS


# --- the tests -------------------------------------------------------------------------------

def test_certs_renew_presents_new_serials_and_changes_nothing_else(renewlab, tmp_path):
    lab = renewlab
    stale = tmp_path / "stale-state"            # a copy from before the renewal
    shutil.copytree(lab.state, stale)
    cp1 = lab.host("cp1")
    etcdctl(cp1, "put", "renew-a", "1")
    before = serials(lab)
    files_before = managed_files(lab)
    state_before = state_files(lab)
    checked_before = check_rows(lab)
    containerd_pid = main_pid(lab, lab.worker, "containerd")
    for (host, name), serial in before.items():
        cert = next(c for h, n, _, _, c, _ in endpoints(lab) if (h, n) == (host, name))
        if cert:
            assert serial == state_cert(lab, cert).serial_number, (host, name)

    # --dry-run: lists every leaf and where it goes; the state is untouched
    proc = run_installer("certs", "renew", str(lab.inventory), "--state", str(lab.state), "--dry-run",
                         "--output", "json")
    plan = json.loads(proc.stdout)
    assert plan["dry_run"] and not plan["checks"] and plan["backup"] is None
    names = {r["name"] for r in plan["reissued"]}
    assert {"apiserver", "etcd/server-cp2", "etcd/peer-cp3", f"kubelet/{lab.worker}-serving", "admin"} <= names
    assert not names & set(CAS)
    assert "kube-apiserver.service" in plan["rollout"]["cp1"]["units"]
    assert state_files(lab) == state_before

    proc = run_installer("certs", "renew", str(lab.inventory), "--state", str(lab.state), "--output", "json",
                         "--no-api", "--wait-timeout", "120", timeout=900)
    report = json.loads(proc.stdout)
    assert all(c["ok"] for c in report["checks"]) and len(report["checks"]) == len(before)
    assert "kubelet client certificates" in report["notes"][0]
    # safe order: one control host at a time, its etcd member with its own apiserver stepped aside
    # (whose start after the member is its restart: host/handover.py), apiservers before the
    # rest, workers last
    order = [r.split(":", 1)[1] for r in report["restarts"]]
    assert order[:6] == ["etcd.service", "kube-apiserver.service"] * 3, order
    assert [r.split(":", 1)[0] for r in report["restarts"][:6]] == ["cp1", "cp1", "cp2", "cp2", "cp3", "cp3"]
    assert "kube-apiserver.service" not in order[6:], order        # none restarted twice
    assert set(order[-2:]) == {"kubelet.service", "kube-proxy.service"}, order
    assert "containerd.service" not in order

    # every endpoint presents a new certificate; those from the state present the state's new one
    after = serials(lab)
    for host, name, _, _, cert, _ in endpoints(lab):
        assert after[(host, name)] != before[(host, name)], (host, name)
        if cert:
            assert after[(host, name)] == state_cert(lab, cert).serial_number, (host, name)

    # the CAs, the service-account key, the encryption key and tokens are untouched in the state
    state_after = state_files(lab)
    for rel in ("pki/ca.crt", "pki/ca.key", "pki/etcd/ca.crt", "pki/etcd/ca.key", "pki/front-proxy-ca.crt",
                "pki/front-proxy-ca.key", "pki/sa.key", "pki/sa.pub", "secrets/encryption.key", "secrets/tokens.yaml"):
        assert state_after[rel] == state_before[rel], rel
    # on the hosts: exactly the files carrying a renewed certificate changed, nothing else
    files_after = managed_files(lab)
    for host, before_files in files_before.items():
        assert set(files_after[host]) == set(before_files), host
        changed = {p for p, digest in before_files.items() if files_after[host][p] != digest}
        expected = {p for p in before_files if renewed_by_design(p)}
        assert changed == expected, (host, sorted(changed ^ expected))
    assert main_pid(lab, lab.worker, "containerd") == containerd_pid

    # the copy from before the renewal would push the replaced certificates and keys back: refused
    # before the lock, naming a host and file, and nothing on the hosts changes
    proc = run_installer("apply", str(lab.inventory), "--state", str(stale), check_rc=2)
    assert "the hosts hold newer certificates than the state directory" in proc.stderr, proc.stderr
    assert "cp1 /etc/kubernetes/pki/apiserver.crt: issued " in proc.stderr, proc.stderr
    # a kubeconfig's client certificate counts too (the probe sent that certificate, not the key)
    assert re.search(r"\n  cp1 /etc/kubernetes/[a-z-]+\.conf: issued ", proc.stderr), proc.stderr
    assert managed_files(lab) == files_after

    # the old files are kept: 0700 directories, 0600 files
    backup = lab.state / report["backup"].split(str(lab.state) + "/", 1)[1]
    assert backup.is_dir() and backup.parent.name == "backups"
    for p in [backup.parent, *backup.rglob("*"), backup]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    old_api = issue.load_cert((backup / "pki" / "apiserver.crt").read_bytes())
    assert old_api.serial_number == before[("cp1", "apiserver")]

    # etcd healthy, its data intact on every member
    for h in CONTROLS:
        host = lab.host(h)
        assert "is healthy" in etcdctl(host, "endpoint", "health"), h
        assert etcdctl(host, "get", "renew-a", "--print-value-only") == "1", h

    # certs check: the hosts hold what the state holds, with the new expiry
    checked = check_rows(lab)
    api = checked[("cp2", "/etc/kubernetes/pki/apiserver.crt")]
    assert not api["notes"]
    assert api["notAfter"] == state_cert(lab, "apiserver").not_valid_after_utc.isoformat()
    assert api["serial"] != checked_before[("cp2", "/etc/kubernetes/pki/apiserver.crt")]["serial"]
    assert checked[("state", "ca")] == checked_before[("state", "ca")]
    assert not [r for r in checked.values() if r["notes"]]


def test_ca_rotate_keeps_etcd_data_and_every_endpoint_chains_to_the_new_ca(renewlab, tmp_path):
    lab = renewlab
    cp1 = lab.host("cp1")
    state_before = state_files(lab)
    proc = run_installer("ca", "rotate", str(lab.inventory), "--state", str(lab.state), check_rc=2)
    assert "--yes" in proc.stderr and "stop etcd" in proc.stderr
    dry = json.loads(run_installer("ca", "rotate", str(lab.inventory), "--state", str(lab.state), "--no-api",
                                   "--dry-run", "--output", "json").stdout)
    assert dry["dryRun"] is True and dry["steps"][0].startswith("connect to every host"), dry
    assert any(s.startswith("stop etcd on cp1") for s in dry["steps"]), dry
    assert any("--no-api" in n for n in dry["notes"]), dry
    assert state_files(lab) == state_before

    etcdctl(cp1, "put", "rotate-b", "2")
    old_cas = {name: state_cert(lab, name) for name in CAS}
    old_ca_files = {}
    for name, cert in old_cas.items():
        old_ca_files[name] = tmp_path / f"old-{name.replace('/', '-')}.crt"
        old_ca_files[name].write_bytes(issue.cert_pem(cert))
    sa_key = (lab.state / "pki" / "sa.key").read_bytes()
    enc_key = (lab.state / "secrets" / "encryption.key").read_bytes()
    old_token = lab.host(lab.worker).check_output("grep -o 'token: .*' /etc/kubernetes/bootstrap-kubelet.conf")
    before = serials(lab)

    proc = run_installer("ca", "rotate", str(lab.inventory), "--state", str(lab.state), "--yes", "--no-api",
                         "--output", "json", "--wait-timeout", "120", timeout=1200)
    report = json.loads(proc.stdout)
    assert all(c["ok"] for c in report["checks"]), report["checks"]

    new_cas = {name: state_cert(lab, name) for name in CAS}
    for name in CAS:
        assert new_cas[name].serial_number != old_cas[name].serial_number, name
    new_ca_files = {}
    for name, cert in new_cas.items():
        new_ca_files[name] = tmp_path / f"new-{name.replace('/', '-')}.crt"
        new_ca_files[name].write_bytes(issue.cert_pem(cert))

    # etcd kept its data on every member (keys written before both operations)
    for h in CONTROLS:
        host = lab.host(h)
        assert etcdctl(host, "get", "renew-a", "--print-value-only") == "1", h
        assert etcdctl(host, "get", "rotate-b", "--print-value-only") == "2", h
        for unit in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert host.service(unit).is_running, f"{h}: {unit}"
    for unit in ("containerd", "kubelet", "kube-proxy"):
        assert lab.host(lab.worker).service(unit).is_running, unit

    # every endpoint: a verified handshake with the new CA succeeds, with the old CA it fails
    for host, name, address, port, cert, cred in endpoints(lab):
        if cert is None:
            assert loopback_serial(lab, host, port) != before[(host, name)], (host, name)
            continue
        ca = "etcd/ca" if name.startswith("etcd") else "ca"
        got = presented(lab, address, port, cred, cafile=new_ca_files[ca])
        assert got.serial_number == state_cert(lab, cert).serial_number, (host, name)
        assert issue.signed_by(got, new_cas[ca]) and not issue.signed_by(got, old_cas[ca]), (host, name)
        with pytest.raises(ssl.SSLCertVerificationError):
            presented(lab, address, port, cred, cafile=old_ca_files[ca])
    # the controller-manager's and scheduler's client certificates (in their kubeconfigs) too
    for h in CONTROLS:
        for conf in ("controller-manager.conf", "scheduler.conf"):
            doc = yaml.safe_load(lab.host(h).file(f"/etc/kubernetes/{conf}").content_string)
            client = issue.load_cert(base64.b64decode(doc["users"][0]["user"]["client-certificate-data"]))
            assert issue.signed_by(client, new_cas["ca"]) and not issue.signed_by(client, old_cas["ca"]), (h, conf)

    # the worker was given new bootstrap material; the service-account and encryption keys stay
    w = lab.host(lab.worker)
    assert w.check_output("grep -o 'token: .*' /etc/kubernetes/bootstrap-kubelet.conf") != old_token
    assert not w.file("/var/lib/kubelet/pki/kubelet-client-current.pem").exists
    assert (lab.state / "pki" / "sa.key").read_bytes() == sa_key
    assert (lab.state / "secrets" / "encryption.key").read_bytes() == enc_key

    # the old CA material is kept privately
    backup = lab.state / report["backup"].split(str(lab.state) + "/", 1)[1]
    assert stat.S_IMODE(backup.stat().st_mode) == 0o700
    assert stat.S_IMODE((backup / "pki" / "ca.key").stat().st_mode) == 0o600
    assert issue.load_cert((backup / "pki" / "ca.crt").read_bytes()).serial_number == old_cas["ca"].serial_number

    # a following apply has nothing to do; certs check sees the state's certificates everywhere
    assert apply_json(lab.inventory, lab.state)["changes"] == 0
    checked = check_rows(lab)
    assert not [r for r in checked.values() if r["notes"] and "kubelet-client" not in r["name"]]
