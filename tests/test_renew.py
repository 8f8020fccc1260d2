"""`certs renew` and `ca rotate` without hosts: which certificates are re-issued, what the CAs
become, where files would go, backups, and that a dry run or a rotation without --yes writes
nothing. (The lab test runs both for real.)"""

from __future__ import annotations

import shutil
import socket
import ssl
import stat
import threading
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from installer.actions import endpoints, renew, rotate
from installer.cli.main import cli
from installer.core.cluster import resolve
from installer.core.errors import InstallerError, StateError
from installer.core.pki import issue
from installer.core.pki.specs import CAS, CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA, cert_specs
from installer.core.state import state_for
from installer.core.tlsfiles import write_private

from .conftest import EXAMPLE

CA_NAMES = {c.name for c in CAS}


@pytest.fixture
def state(prepared, tmp_path):
    root = tmp_path / "state"
    shutil.copytree(prepared.state.root, root)
    return root


def snapshot(root):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns, stat.S_IMODE(p.stat().st_mode))
            for p in root.rglob("*") if p.is_file()}


def test_every_leaf_by_default_never_a_ca(prepared):
    inv, m = prepared.inventory, prepared.material
    names = renew.leaf_names(inv, m)
    assert names == [s.name for s in cert_specs(inv)]
    assert not set(names) & CA_NAMES and "sa" not in names
    assert renew.leaf_names(inv, m, ["etcd/*"]) == [n for n in names if n.startswith("etcd/")]
    assert renew.leaf_names(inv, m, ["scheduler", "apiserver"]) == ["apiserver", "scheduler"]
    for bad in ("ca", "etcd/ca", "front-proxy-ca"):
        with pytest.raises(InstallerError, match="ca rotate"):
            renew.leaf_names(inv, m, [bad])
    with pytest.raises(InstallerError, match="no certificate named nope"):
        renew.leaf_names(inv, m, ["nope"])


def test_reissue_new_keys_for_the_chosen_leaves_only(prepared):
    inv, old = prepared.inventory, prepared.material
    new = renew.reissue(inv, old, ["apiserver", "etcd/server-cp1"])
    specs = {s.name: s for s in cert_specs(inv)}
    for name in ("apiserver", "etcd/server-cp1"):
        a, b = old.certs[name], new.certs[name]
        assert b.cert.serial_number != a.cert.serial_number
        assert issue.public_pem(b.key) != issue.public_pem(a.key)          # a new key
        assert issue.why_reissue(specs[name], b, new.cas[specs[name].ca], inv.spec.pki.keyAlgorithm,
                                 b.cert.not_valid_before_utc) is None       # same subject, SANs, usages, CA
    for name in set(old.certs) - {"apiserver", "etcd/server-cp1"}:
        assert new.certs[name] is old.certs[name], name
    assert new.cas == old.cas and new.sa_key is old.sa_key and new.encryption_key == old.encryption_key
    assert new.tokens == old.tokens
    assert old.certs["apiserver"].cert.serial_number != new.certs["apiserver"].cert.serial_number  # old untouched


def test_rotate_every_leaf_chains_to_the_new_ca(prepared):
    inv, old = prepared.inventory, prepared.material
    new = rotate.rotated(inv, old, rotate.which_cas(["all"]))
    for ca in CA_NAMES:
        assert new.cas[ca].cert.serial_number != old.cas[ca].cert.serial_number
        assert new.cas[ca].cert.subject == old.cas[ca].cert.subject
    for spec in cert_specs(inv):
        cert = new.certs[spec.name].cert
        assert issue.signed_by(cert, new.cas[spec.ca].cert), spec.name
        assert not issue.signed_by(cert, old.cas[spec.ca].cert), spec.name
    assert new.sa_key is old.sa_key and new.encryption_key == old.encryption_key
    assert set(new.tokens) == {h.name for h in inv.workers}
    assert not {t.id for t in new.tokens.values()} & {t.id for t in old.tokens.values()}


def test_rotate_only_the_cluster_ca_still_reissues_every_leaf(prepared):
    inv, old = prepared.inventory, prepared.material
    assert rotate.which_cas(["ca"]) == [CLUSTER_CA]
    assert rotate.which_cas(["etcd-ca", "front-proxy-ca"]) == [ETCD_CA, FRONT_PROXY_CA]
    new = rotate.rotated(inv, old, [CLUSTER_CA])
    assert new.cas[ETCD_CA] is old.cas[ETCD_CA] and new.cas[FRONT_PROXY_CA] is old.cas[FRONT_PROXY_CA]
    for spec in cert_specs(inv):
        assert new.certs[spec.name].cert.serial_number != old.certs[spec.name].cert.serial_number
        assert issue.signed_by(new.certs[spec.name].cert, new.cas[spec.ca].cert)
    with pytest.raises(InstallerError, match="unknown CA"):
        rotate.which_cas(["root"])


def test_rollout_names_only_certificate_files_and_their_units(prepared):
    inv, old = prepared.inventory, prepared.material
    out = renew.rollout(inv, old, renew.reissue(inv, old, ["scheduler"]))
    controls = {h.name for h in inv.controls}
    assert set(out) == controls
    for r in out.values():
        assert r.files == ["/etc/kubernetes/scheduler.conf"] and r.units == ["kube-scheduler.service"]
    everything = renew.rollout(inv, old, renew.reissue(inv, old, renew.leaf_names(inv, old)))
    cp = everything[inv.controls[0].name]
    assert "/etc/kubernetes/pki/ca.crt" not in cp.files and "/etc/kubernetes/pki/sa.key" not in cp.files
    assert cp.units[:2] == ["etcd.service", "kube-apiserver.service"]           # restart order
    for w in inv.workers:
        assert set(everything[w.name].files) == {"/var/lib/kubelet/pki/kubelet.crt", "/var/lib/kubelet/pki/kubelet.key",
                                                 "/etc/kubernetes/kube-proxy.conf"}
    rotated = renew.rollout(inv, old, rotate.rotated(inv, old, [CLUSTER_CA]))
    assert "/etc/kubernetes/pki/ca.crt" in rotated[inv.controls[0].name].files
    assert "/etc/kubernetes/bootstrap-kubelet.conf" in rotated[inv.workers[0].name].files


def test_backup_is_private_and_keeps_the_layout(prepared, state):
    st = state_for(prepared.inventory, state)
    paths = [st.pki("apiserver", "crt"), st.pki("apiserver", "key"), st.pki("etcd/server-cp1", "key"),
             st.admin_kubeconfig]
    root = renew.backup(st, "renew", paths)
    again = renew.backup(st, "renew", paths)
    assert root != again and root.parent == again.parent == state / "backups"
    for p in [root.parent, *root.rglob("*"), root]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    assert (root / "pki" / "apiserver.crt").read_bytes() == st.pki("apiserver", "crt").read_bytes()
    assert (root / "pki" / "etcd" / "server-cp1.key").is_file() and (root / "admin.conf").is_file()
    assert not (root / "pki" / "etcd" / "server-cp1.crt").exists()


def test_dry_run_and_rotate_without_yes_write_nothing(prepared, state):
    before = snapshot(state)
    # the example's hosts are not reachable: neither call may try
    report = renew.renew(resolve(EXAMPLE, state), dry_run=True, log=lambda m: pytest.fail(m))
    assert report.dry_run and not report.checks and report.backup is None
    assert [r.name for r in report.reissued] == renew.leaf_names(prepared.inventory, prepared.material)
    for r in report.reissued:
        assert r.old_serial == format(prepared.material.certs[r.name].cert.serial_number, "x") != r.new_serial
    plan = rotate.rotate_ca(resolve(EXAMPLE, state), log=lambda m: pytest.fail(m))
    assert plan.dry_run and any("stop etcd" in s for s in plan.steps)
    assert snapshot(state) == before and not (state / "backups").exists()

    runner = CliRunner()
    res = runner.invoke(cli, ["certs", "renew", str(EXAMPLE), "--state", str(state), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "apiserver: " in res.stdout and "would renew" in res.stdout and "kubelet client" in res.stdout
    res = runner.invoke(cli, ["ca", "rotate", str(EXAMPLE), "--state", str(state)])
    assert res.exit_code == 2 and "--yes" in res.stderr
    assert snapshot(state) == before


def test_refused_when_the_state_is_missing_or_behind(prepared, state, tmp_path):
    with pytest.raises(StateError, match="does not exist"):
        renew.renew(resolve(EXAMPLE, tmp_path / "none"), dry_run=True)
    (state / "pki" / "scheduler.key").unlink()
    with pytest.raises(StateError, match="scheduler: new.*installer apply"):
        renew.renew(resolve(EXAMPLE, state), dry_run=True)
    with pytest.raises(StateError, match="lacks scheduler"):
        rotate.rotate_ca(resolve(EXAMPLE, state))
    res = CliRunner().invoke(cli, ["certs", "renew", str(EXAMPLE), "--state", str(state), "--dry-run"])
    assert res.exit_code == 2 and "installer apply" in res.stderr and "Traceback" not in res.output


def test_handshake_reads_the_presented_certificate(prepared, tmp_path):
    """The handshake loop (memory BIOs over a channel) against a real TLS server; here the
    channel is a plain socket where the lab uses an SSH direct-tcpip channel."""
    m = prepared.material
    pair = m.certs["apiserver"]
    d = tmp_path / "srv"
    d.mkdir(mode=0o700)
    write_private(str(d / "tls.crt"), issue.cert_pem(pair.cert))
    write_private(str(d / "tls.key"), issue.key_pem(pair.key))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        try:
            with server.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError):
            pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()

    remote = SimpleNamespace(open=lambda: None,
                             open_channel=lambda address, port, timeout:
                             socket.create_connection((address, port), timeout=timeout))
    with endpoints.client_dir(m) as creds:
        der = endpoints.handshake(remote, "127.0.0.1", port, creds.context("admin"))
    listener.close()
    t.join(5)
    from cryptography import x509
    assert x509.load_der_x509_certificate(der).serial_number == pair.cert.serial_number


def test_judge_names_a_wrong_serial_and_an_old_ca(prepared):
    inv, old = prepared.inventory, prepared.material
    new = rotate.rotated(inv, old, rotate.which_cas(["all"]))
    ep = next(e for e in endpoints.endpoints(inv) if e.name == "kube-apiserver")
    assert endpoints.judge(ep, new.certs["apiserver"].cert, new, None, True, old.cas) == (
        True, "apiserver, signed by ca")
    ok, why = endpoints.judge(ep, old.certs["apiserver"].cert, new, None, True, old.cas)
    assert not ok and "the state's apiserver is" in why
    etcd = next(e for e in endpoints.endpoints(inv) if e.name == "etcd peer")
    assert etcd.ca == ETCD_CA and etcd.credential == "etcd/healthcheck-client"
    sched = next(e for e in endpoints.endpoints(inv) if e.name == "kube-scheduler")
    same = old.certs["admin"].cert
    assert endpoints.judge(sched, same, new, same, True, {})[0] is False      # restarted: must change
    assert endpoints.judge(sched, same, new, same, False, {})[0] is True
