"""`installer certs check` on the state directory (offline) and its pieces."""

from __future__ import annotations

import datetime as dt
import json
import shutil

from click.testing import CliRunner
from cryptography import x509

from installer.actions import certs as certs_mod
from installer.cli.main import cli
from installer.core.cluster import resolve
from installer.core.pki import issue
from installer.core.pki.specs import CAS, cert_specs
from installer.core.safefs import write_atomic

from .conftest import EXAMPLE


def run(*args):
    return CliRunner().invoke(cli, ["certs", "check", *args], catch_exceptions=False)


def test_every_state_certificate_listed_sorted(prepared):
    rows = certs_mod.check(resolve(EXAMPLE, prepared.state.root), offline=True)
    names = [r.name for r in rows]
    want = {ca.name for ca in CAS} | {s.name for s in cert_specs(prepared.inventory)}
    assert sorted(names) == sorted(want)
    assert all(r.where == "state" for r in rows)
    afters = [r.not_after for r in rows]
    assert afters == sorted(afters)
    ca = next(r for r in rows if r.name == "ca")
    assert ca.subject == ca.issuer == "kubernetes-ca"
    api = next(r for r in rows if r.name == "apiserver")
    assert (api.subject, api.issuer) == ("kube-apiserver", "kubernetes-ca")

    result = run(str(EXAMPLE), "--state", str(prepared.state.root), "--offline", "--output", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["expiring"] == 0 and len(doc["certificates"]) == len(want)


def test_a_certificate_made_to_expire_soon_is_flagged(prepared, tmp_path):
    state = tmp_path / "state"
    shutil.copytree(prepared.state.root, state)
    spec = next(s for s in cert_specs(prepared.inventory) if s.name == "scheduler")
    pair = prepared.material.certs["scheduler"]
    now = dt.datetime.now(dt.timezone.utc)
    soon = issue.issue(spec, pair.key, prepared.material.cas[spec.ca], 5, now)
    write_atomic(state / "pki" / "scheduler.crt", issue.cert_pem(soon), 0o644)

    result = run(str(EXAMPLE), "--state", str(state), "--offline", "--within", "30")
    assert result.exit_code == 1, result.output
    assert "1 certificate(s) expire within 30 days" in result.output
    assert "state: scheduler" in result.output
    first = result.output.splitlines()[1]
    assert first.split()[:2] == ["state", "scheduler"] and "EXPIRING" in first

    result = run(str(EXAMPLE), "--state", str(state), "--offline", "--within", "1")
    assert result.exit_code == 0, result.output
    assert "none expires within 1 days" in result.output


def test_missing_state_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(cli, ["certs", "check", str(EXAMPLE), "--state", str(tmp_path / "nope"),
                                      "--offline"])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_fetched_pems_parsed_and_compared(prepared):
    a = prepared.material.certs["apiserver"].cert
    b = prepared.material.certs["scheduler"].cert
    raw = (b"== /etc/kubernetes/pki/apiserver.crt\n" + issue.cert_pem(a)
           + b"== /etc/kubernetes/pki/scheduler.crt\n" + issue.cert_pem(b) + issue.cert_pem(a)
           + b"== /broken.crt\nnot a pem\n")
    parsed = certs_mod.parse_fetched(raw)
    assert [c.serial_number for c in parsed["/etc/kubernetes/pki/scheduler.crt"]] == [b.serial_number,
                                                                                     a.serial_number]
    assert parsed["/broken.crt"] is None
    rows = certs_mod.host_rows("cp1", {"/etc/kubernetes/pki/apiserver.crt": a.serial_number,
                                       "/etc/kubernetes/pki/scheduler.crt": a.serial_number}, raw)
    by = {r.name: r for r in rows}
    assert by["/etc/kubernetes/pki/apiserver.crt"].notes == []
    assert by["/etc/kubernetes/pki/scheduler.crt"].notes == ["differs from state"]
    assert by["/broken.crt"].notes == ["no readable certificate in the file"]


def test_fetch_script_sends_only_certificate_blocks(tmp_path):
    import subprocess

    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "t")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, issue.hashes.SHA256()))
    pem = tmp_path / "client 'current'.pem"
    pem.write_bytes(issue.cert_pem(cert) + issue.key_pem(key))
    out = subprocess.run(["sh", "-c", certs_mod.fetch_script([str(pem), str(tmp_path / "absent.crt")])],
                         capture_output=True, check=True).stdout
    assert b"PRIVATE KEY" not in out
    parsed = certs_mod.parse_fetched(out)
    assert list(parsed) == [str(pem)] and parsed[str(pem)][0].serial_number == 1


class _Stub:
    def __init__(self, host, fail=False):
        self.host, self.fail = host, fail

    def run(self, script, what=None, **_):
        from installer.host.ssh import HostError, Result
        if self.fail:
            raise HostError(self.host.name, "cannot reach 192.0.2.1:22: timed out")
        return Result("", "", 0, b"")

    def close(self):
        pass


def test_unreachable_host_is_named_with_exit_3(prepared):
    import pytest
    fail = prepared.inventory.spec.hosts[0].name
    with pytest.raises(certs_mod.CertsError) as e:
        certs_mod.check(resolve(EXAMPLE, prepared.state.root), remote_for=lambda h: _Stub(h, h.name == fail))
    assert e.value.exit_code == 3 and f"{fail}: cannot reach" in str(e.value) and "--offline" in str(e.value)
    rows = certs_mod.check(resolve(EXAMPLE, prepared.state.root), remote_for=lambda h: _Stub(h))
    assert {r.where for r in rows} == {"state"}


def _short_lived(not_before: dt.datetime, hours: float) -> bytes:
    """A kubelet client certificate as the cluster signs them: short-lived (made here, self-signed:
    only its dates matter to the check)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "system:node:node2")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(not_before)
            .not_valid_after(not_before + dt.timedelta(hours=hours)).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def test_the_kubelets_own_certificate_is_judged_by_its_rotation_not_by_days_left():
    """A healthy new cluster: the kubelet's client certificate lives a day and is renewed by the
    kubelet at 70-90 % of that; `certs check` must not flag it every day, only when its renewal
    is late (past 90 %) or it expired."""
    now = dt.datetime.now(dt.timezone.utc)
    path = certs_mod.KUBELET_CLIENT
    fresh = certs_mod.host_rows("node2", {path: None}, f"== {path}\n".encode()
                                + _short_lived(now - dt.timedelta(hours=2), 24))[0]
    assert fresh.self_rotated and not fresh.expiring(now, 30)
    assert fresh.notes and fresh.notes[0].startswith("renewed by its holder (due by ")
    late = certs_mod.host_rows("node2", {path: None}, f"== {path}\n".encode()
                               + _short_lived(now - dt.timedelta(hours=22), 24))[0]
    assert late.expiring(now, 30) and late.as_dict(now, 30)["selfRotated"] is True
    # any other short-lived certificate on a host is judged by its days left, as before
    other = certs_mod.host_rows("node2", {"/etc/x.crt": None}, b"== /etc/x.crt\n"
                                + _short_lived(now - dt.timedelta(hours=2), 24))[0]
    assert not other.self_rotated and other.expiring(now, 30)
