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


def as_probed(facts: dict[str, HostFacts]) -> dict[str, HostFacts]:
    """What the facts probe sends of a kubeconfig: its client certificate alone."""
    for f in facts.values():
        f.certs = {p: trust.leaf(p, c) or b"" for p, c in f.certs.items()}
    return facts


@pytest.mark.parametrize("held_as", ["probed", "whole kubeconfig"])
def test_a_kubeconfigs_client_certificate_is_a_leaf_the_guard_keeps(prepared, held_as):
    """A renewal of a component's client certificate lands in its kubeconfig, not in a .crt: a
    state from before it would push the replaced key back inside controller-manager.conf. Held
    as the probe sends it (the certificate alone) or as a tenant's Secret holds it (the whole
    kubeconfig), it is refused the same way."""
    import copy
    newer = copy.copy(prepared.material)
    newer.certs = {n: p for n, p in prepared.material.certs.items() if n != "controller-manager"}
    renewed, _ = ensure(prepared.inventory, newer, dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=2))
    old_plans, new_plans = prepared.plans, render_cluster(prepared.inventory, renewed)
    conf = "/etc/kubernetes/controller-manager.conf"
    controls = [h for h in old_plans if conf in old_plans[h].files]
    assert controls and all(conf in trust.certificate_paths(old_plans[h]) for h in controls)
    held = holding_leaves(new_plans)
    if held_as == "probed":
        held = as_probed(held)
    trust.check(new_plans, held, "/s", new_ca=False)
    with pytest.raises(trust.TrustMismatch) as e:
        trust.check(old_plans, held, "/s", new_ca=False)
    assert all(f"  {h} {conf}: issued " in str(e.value) for h in controls), str(e.value)
    older = {o.path for h in old_plans for o in trust.older_leaves(h, old_plans[h], held[h].certs)}
    assert older == {conf}


def test_a_kubeconfig_without_a_client_certificate_is_not_compared(prepared):
    """The bootstrap kubeconfig holds a token; a host's kubeconfig that lost its certificate line
    (or holds garbage) gives no certificate: nothing to compare, never a crash."""
    plans = prepared.plans
    for plan in plans.values():
        for p in trust.certificate_paths(plan):
            if p.endswith(".conf"):
                assert b"client-certificate-data" in plan.files[p].content
    boot = [p for plan in plans.values() for p, f in plan.files.items()
            if p.endswith(".conf") and b"token:" in f.content]
    assert boot and not any(p in trust.certificate_paths(plan) for plan in plans.values() for p in boot)
    held = holding_leaves(plans)
    for f in held.values():
        f.certs = {p: (b"" if p.endswith(".conf") else c) for p, c in f.certs.items()}
    trust.check(plans, held, "/s", new_ca=False)
    assert trust.leaf("/x.conf", b"users: [{user: {client-certificate-data: '!!'}}]") is None


def test_the_probe_sends_a_kubeconfigs_certificate_and_never_its_key(prepared, tmp_path):
    """The facts probe itself, on a rendered controller-manager.conf: the C line carries the
    client certificate, decoded from the kubeconfig; not a byte of the key beside it."""
    import base64
    import subprocess

    from installer.core.facts import PROBE, parse, probe_input
    from installer.core.pki import issue as pki_issue
    plan = next(p for p in prepared.plans.values() if "/etc/kubernetes/controller-manager.conf" in p.files)
    content = plan.files["/etc/kubernetes/controller-manager.conf"].content
    (tmp_path / "cm.conf").write_bytes(content)
    (tmp_path / "bad.conf").write_bytes(b"users:\n- user:\n    client-certificate-data: !!notbase64\n")
    out = subprocess.run(["/bin/sh", "-c", PROBE],
                         input=probe_input([], [], [], [str(tmp_path / "cm.conf"), str(tmp_path / "bad.conf")]),
                         capture_output=True, check=True)
    facts = parse(out.stdout.decode())
    pair = prepared.material.certs["controller-manager"]
    assert facts.certs[str(tmp_path / "cm.conf")] == pki_issue.cert_pem(pair.cert)
    assert trust.leaf(str(tmp_path / "bad.conf"), facts.certs[str(tmp_path / "bad.conf")]) is None
    key = pki_issue.key_pem(pair.key)
    assert base64.b64encode(key).decode() not in out.stdout.decode() and key not in out.stdout
    assert b"PRIVATE KEY" not in b"".join(facts.certs.values())
