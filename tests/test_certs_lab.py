"""`installer certs check` against a real lab: deployed certificates read over SSH, and a
certificate made to expire soon flagged in the state and on the host it was pushed to."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from installer.api import prepare
from installer.core.pki import issue
from installer.core.pki.specs import cert_specs
from installer.core.safefs import write_atomic

from .labfixtures import standin_lab
from .test_apply_lab import apply_json, run_installer

pytestmark = pytest.mark.lab

NAME = "certs"
APISERVER = "/etc/kubernetes/pki/apiserver.crt"


@pytest.fixture(scope="module")
def certlab(tmp_path_factory):
    with standin_lab(NAME, "10.213.241.0/24", tmp_path_factory.mktemp("certlab"), controls=1, workers=1) as lab:
        yield lab


def check(lab, *extra, rc):
    proc = run_installer("certs", "check", str(lab.inventory), "--state", str(lab.state), "--output", "json",
                         *extra, check_rc=rc)
    return json.loads(proc.stdout)


def test_certs_check_reads_hosts_and_flags_a_soon_expiring_certificate(certlab):
    apply_json(certlab.inventory, certlab.state)
    worker = next(h.name for h in certlab.spec.hosts if h.role == "worker")

    doc = check(certlab, rc=0)
    rows = doc["certificates"]
    by_where = {}
    for r in rows:
        by_where.setdefault(r["where"], set()).add(r["name"])
    assert {"state", "cp1", worker} <= set(by_where)
    assert {APISERVER, "/etc/kubernetes/pki/ca.crt", "/etc/etcd/pki/server.crt"} <= by_where["cp1"]
    assert {"/etc/kubernetes/pki/ca.crt", "/var/lib/kubelet/pki/kubelet.crt"} <= by_where[worker]
    assert not [r for r in rows if r["notes"]], [r for r in rows if r["notes"]]
    assert [r["notAfter"] for r in rows] == sorted(r["notAfter"] for r in rows)

    # the state's apiserver certificate re-issued (same key, same SANs) to expire in 5 days
    p = prepare(certlab.inventory, certlab.state)
    spec = next(s for s in cert_specs(p.inventory) if s.name == "apiserver")
    pair = p.material.certs["apiserver"]
    soon = issue.issue(spec, pair.key, p.material.cas[spec.ca], 5, dt.datetime.now(dt.timezone.utc))
    write_atomic(certlab.state / "pki" / "apiserver.crt", issue.cert_pem(soon), 0o644)

    doc = check(certlab, rc=1)
    cp1_api = next(r for r in doc["certificates"] if r["where"] == "cp1" and r["name"] == APISERVER)
    assert cp1_api["notes"] == ["differs from state"] and not cp1_api["expiring"]

    apply_json(certlab.inventory, certlab.state)            # pushes it
    proc = run_installer("certs", "check", str(certlab.inventory), "--state", str(certlab.state),
                         "--within", "30", check_rc=1)
    assert "2 certificate(s) expire within 30 days" in proc.stdout, proc.stdout
    assert f"cp1: {APISERVER}" in proc.stdout and "state: apiserver" in proc.stdout
    doc = check(certlab, rc=1)
    expiring = {(r["where"], r["name"]) for r in doc["certificates"] if r["expiring"]}
    assert expiring == {("state", "apiserver"), ("cp1", APISERVER)}
    assert not [r for r in doc["certificates"] if r["notes"]]
    check(certlab, "--within", "1", rc=0)
