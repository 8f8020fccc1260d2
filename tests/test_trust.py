"""The CA guard (installer/core/trust.py): pure, with plans rendered from two PKIs and facts made
of the files a host would hold."""

from __future__ import annotations

import datetime as dt

import pytest

from installer.core import trust
from installer.core.facts import HostFacts
from installer.core.pki import issue
from installer.core.pki.material import Material, ensure
from installer.core.render.plan import render_cluster

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


@pytest.fixture(scope="module")
def two_pkis(prepared):
    other, _ = ensure(prepared.inventory, Material(), NOW)
    return prepared.plans, render_cluster(prepared.inventory, other)


def holding(plans, pick=lambda host, path: True) -> dict[str, HostFacts]:
    """Facts of hosts holding ``plans``' CA files (those ``pick`` keeps)."""
    out = {}
    for host, plan in plans.items():
        f = HostFacts()
        f.certs = {p: hf.content for p, hf in plan.files.items() if hf.trust and pick(host, p)}
        out[host] = f
    return out


def test_every_ca_file_is_marked_and_probed(prepared):
    cp1 = {p for p, f in prepared.plans["cp1"].files.items() if f.trust}
    assert cp1 == {"/etc/kubernetes/pki/ca.crt", "/etc/kubernetes/pki/front-proxy-ca.crt",
                   "/etc/kubernetes/pki/etcd/ca.crt", "/etc/etcd/pki/ca.crt"}
    node2 = {p for p, f in prepared.plans["node2"].files.items() if f.trust}
    assert node2 == {"/etc/kubernetes/pki/ca.crt"}


def test_the_same_ca_passes_and_another_is_refused(two_pkis, prepared):
    ours, theirs = two_pkis
    assert trust.mismatches(ours, holding(ours)) == []
    found = trust.mismatches(theirs, holding(ours))
    assert {(m.host, m.path) for m in found} == {(h, p) for h, plan in ours.items()
                                                  for p, f in plan.files.items() if f.trust}
    with pytest.raises(trust.TrustMismatch) as e:
        trust.check(theirs, holding(ours), "/s", new_ca=True)
    text = str(e.value)
    ca_on_host = trust.certificates(ours["cp1"].files["/etc/kubernetes/pki/ca.crt"].content)[0]
    ca_in_state = trust.certificates(theirs["cp1"].files["/etc/kubernetes/pki/ca.crt"].content)[0]
    assert ca_on_host.short in text and ca_in_state.short in text and ca_on_host.short != ca_in_state.short
    assert "/s: nothing was changed" in text and "would have made a new one" in text
    for advice in ("--state DIR", "installer reset INVENTORY --yes", "installer ca rotate INVENTORY"):
        assert advice in text
    assert e.value.exit_code == 2
    assert text.count("\n  cp1 ") + text.count("\n  node") <= trust.SHOWN + 1


def test_a_bundle_sharing_one_ca_passes_and_a_host_without_the_file_is_not_compared(two_pkis):
    ours, theirs = two_pkis
    facts = holding(ours)
    for f in facts.values():        # mid-rotation: old + new
        f.certs = {p: pem + theirs_pem for p, pem in f.certs.items()
                     for theirs_pem in [next(hf.content for hp in theirs.values() for q, hf in hp.files.items()
                                             if q == p)]}
    assert trust.mismatches(theirs, facts) == [] and trust.mismatches(ours, facts) == []
    assert trust.mismatches(theirs, holding(ours, pick=lambda host, path: False)) == []


def test_unreadable_content_on_the_host_is_a_mismatch(prepared):
    facts = holding(prepared.plans)
    facts["node2"].certs["/etc/kubernetes/pki/ca.crt"] = b"garbage"
    (m,) = trust.mismatches(prepared.plans, facts)
    assert (m.host, m.on_host) == ("node2", ())
    assert "no readable certificate" in trust.message([m], "/s", new_ca=False)


def test_the_probe_returns_the_ca_files(tmp_path):
    """The probe script itself, run locally on a file tree: C lines carry the content."""
    import base64
    import subprocess

    from installer.core.facts import PROBE, parse, probe_input
    pem = issue.cert_pem(issue.make_ca("probe-ca", issue.new_key("ecdsa-p256"), 1, NOW))
    (tmp_path / "ca.crt").write_bytes(pem)
    out = subprocess.run(["/bin/sh", "-c", PROBE],
                         input=probe_input([], [], [], [str(tmp_path / "ca.crt"), str(tmp_path / "absent.crt")]),
                         capture_output=True, check=True)
    facts = parse(out.stdout.decode())
    assert facts.certs == {str(tmp_path / "ca.crt"): pem}
    assert base64.b64encode(pem).decode() in out.stdout.decode()


def holding_leaves(plans) -> dict[str, HostFacts]:
    """Facts of hosts holding every certificate file of ``plans`` (CAs and leaves), as probed."""
    out = {}
    for host, plan in plans.items():
        f = HostFacts()
        f.certs = {p: plan.files[p].content for p in trust.certificate_paths(plan)}
        out[host] = f
    return out


def test_a_state_older_than_the_hosts_leaves_is_refused_and_a_newer_one_pushes(prepared):
    """A copy of the state from before a renewal (same CAs, older leaves) would push the old
    certificates and keys back, undoing a renewal made because a key leaked: refused, naming the
    host, the file and both issue times. The other way round is a renewal to push."""
    import copy
    newer = copy.copy(prepared.material)
    newer.certs = {n: p for n, p in prepared.material.certs.items() if n != "apiserver"}
    renewed, changes = ensure(prepared.inventory, newer, dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=2))
    assert {n for n in changes.reasons if not n.startswith("token/")} == {"apiserver"}, changes.reasons
    old_plans, new_plans = prepared.plans, render_cluster(prepared.inventory, renewed)
    trust.check(new_plans, holding_leaves(old_plans), "/s", new_ca=False)        # the renewal: pushed
    with pytest.raises(trust.TrustMismatch) as e:
        trust.check(old_plans, holding_leaves(new_plans), "/s", new_ca=False)
    text = str(e.value)
    assert "newer certificates than the state directory /s (a copy from before a renewal?): nothing was changed" \
        in text
    controls = [h for h in old_plans if "/etc/kubernetes/pki/apiserver.crt" in old_plans[h].files]
    assert controls and all(f"  {h} /etc/kubernetes/pki/apiserver.crt: issued " in text for h in controls), text
    assert "--state DIR" in text and e.value.exit_code == 2
    # only that leaf differs: nothing else is named, and the CA files are no leaves
    older = [o for h in old_plans for o in trust.older_leaves(h, old_plans[h], holding_leaves(new_plans)[h].certs)]
    assert {o.path for o in older} == {"/etc/kubernetes/pki/apiserver.crt"}
    assert all(o.on_host > o.in_state for o in older)
