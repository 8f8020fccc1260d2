"""Whether a worker joined comes from the cluster, never from the hosts in the run
(installer/engine/phases/bootstrap_cluster.py, join_workers.py).

The phases on the real API client over the fake transport (tests/fakeapi.py); the real cluster
proves the same (tests/test_real_cluster.py::test_a_run_limited_to_some_hosts_brings_back_no_token).
"""

from __future__ import annotations

import contextlib

import pytest

from installer.engine.context import Bootstrapped, Context, Options
from installer.engine.phases.bootstrap_cluster import BootstrapCluster
from installer.engine.phases.join_workers import JoinWorkers
from installer.host import apireach, kube

from .fakeapi import FakeCluster

NODES = "/api/v1/nodes"
SECRETS = "/api/v1/namespaces/kube-system/secrets"


@pytest.fixture
def fake(monkeypatch):
    cluster = FakeCluster()

    @contextlib.contextmanager
    def access(inv, remotes, material=None, **kw):
        yield "https://127.0.0.1:40123"
    real = kube.api_client

    def client(url, material, *, credential="admin", **kw):
        a = real(url, material, credential=credential, **kw)
        a.pool = cluster
        return a
    monkeypatch.setattr(apireach, "api_access", access)
    monkeypatch.setattr(kube, "api_client", client)
    return cluster


def ctx_for(p, **options) -> Context:
    ctx = Context(p.inventory, p.state, Options(**options), p.material, p.changes, log=lambda _: None)
    ctx.produce(Bootstrapped())         # as cluster-bootstrap hands it on in a run
    return ctx


def node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def token_secret(p, name: str) -> dict:
    t = p.material.tokens[name]
    return {"apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
            "metadata": {"name": f"bootstrap-token-{t.id}", "namespace": "kube-system"},
            "stringData": {"token-id": t.id, "token-secret": t.secret}}


def secrets(fake) -> set[str]:
    return set(fake.objects(SECRETS))


def test_a_run_limited_to_one_worker_makes_no_token_of_a_worker_that_joined(prepared, fake):
    """node3 joined long ago (its Node is there) but is outside this run: its token stays gone
    (before: made again from the facts of the run's hosts, and honoured until its batch came)."""
    for n in ("node2", "node3"):
        fake.add(NODES, node(n))
    ev = BootstrapCluster().run_host(ctx_for(prepared, hosts=frozenset({"node2"})), "(api)")
    assert not [d for d in ev.detail if "bootstrap-token" in d], ev.detail
    assert secrets(fake) == set()


def test_a_token_secret_made_again_for_a_joined_worker_is_deleted(prepared, fake):
    fake.add(NODES, node("node2"))
    fake.add(SECRETS, token_secret(prepared, "node2"))
    ev = BootstrapCluster().run_host(ctx_for(prepared), "(api)")
    assert "deleted the bootstrap token Secret of node2 (it joined)" in ev.detail
    # node3 has not joined: its token is made
    assert secrets(fake) == {f"bootstrap-token-{prepared.material.tokens['node3'].id}"}


def test_a_worker_whose_certificate_was_issued_counts_as_joined(prepared, fake):
    """Its Node not registered yet (or deleted by hand): the issued certificate says its token
    did its job."""
    fake.add("/apis/certificates.k8s.io/v1/certificatesigningrequests", {
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": "c"},
        "spec": {"username": f"system:bootstrap:{prepared.material.tokens['node3'].id}"},
        "status": {"certificate": "eA=="}})
    BootstrapCluster().run_host(ctx_for(prepared), "(api)")
    assert secrets(fake) == {f"bootstrap-token-{prepared.material.tokens['node2'].id}"}


def test_a_worker_made_to_bootstrap_again_gets_its_token(prepared, fake):
    """`ca rotate`: the Node is there, but its kubelet forgot its certificate."""
    fake.add(NODES, node("node2"))
    ctx = ctx_for(prepared)
    ctx.rejoin.add("node2")
    BootstrapCluster().run_host(ctx, "(api)")
    assert f"bootstrap-token-{prepared.material.tokens['node2'].id}" in secrets(fake)


def test_the_joined_workers_tokens_go_even_when_another_worker_never_registers(prepared, fake):
    fake.add(NODES, node("node2"))
    for n in ("node2", "node3"):
        fake.add(SECRETS, token_secret(prepared, n))
    ctx = ctx_for(prepared, wait_timeout=0.1)
    with pytest.raises(kube.KubeError, match="node3: not registered"):
        JoinWorkers().finish(ctx, [])
    assert secrets(fake) == {f"bootstrap-token-{prepared.material.tokens['node3'].id}"}
    assert "deleted the bootstrap token Secret of node2" in [d for e in ctx.events for d in e.detail]


def test_a_worker_the_cluster_revoked_stops_a_run_from_a_state_that_does_not_know_it(prepared, fake):
    """A state directory copied before `node revoke node3` (its ledger says nothing) with node3
    still in the inventory: cluster-bootstrap refuses before it sends anything, instead of making
    node3's renewal binding and token Secret again."""
    from installer.core.ledger import NodeRetiredError
    revoke_in(fake, ["node3"])
    with pytest.raises(NodeRetiredError, match="node3: revoked in this cluster .* nothing was sent"):
        BootstrapCluster().run_host(ctx_for(prepared), "(api)")
    assert [m for m, _, _ in fake.requests if m != "GET"] == []
    assert secrets(fake) == set()


def revoke_in(fake, names: list[str]) -> None:
    from installer.core.render.revocation import policy_objects
    for obj in policy_objects(names):
        plural = "validatingadmissionpolicies" if obj["kind"] == "ValidatingAdmissionPolicy" else \
            "validatingadmissionpolicybindings"
        fake.add(f"/apis/admissionregistration.k8s.io/v1/{plural}", obj)


def with_apiserver(ctx: Context, active: bool = True) -> Context:
    from installer.core import components
    from installer.core.facts import HostFacts
    state = ("active", "enabled") if active else ("inactive", "disabled")
    ctx.facts = {h.name: HostFacts(units={components.unit("kube-apiserver"): state}) for h in ctx.inv.controls}
    return ctx


def test_a_revoked_worker_in_the_inventory_stops_the_run_before_any_host_changes(prepared, fake):
    """The runner asks right after connect, before the lock: an apply from an older state
    copy would otherwise rewrite every host's routes (with the revoked worker's pod CIDR) before
    cluster-bootstrap refused; the real lab saw exactly that drift."""
    from installer.core.ledger import NodeRetiredError
    from installer.engine.bootstrap import refuse_revoked_before_changes
    revoke_in(fake, ["node3"])
    with pytest.raises(NodeRetiredError, match="node3: revoked in this cluster .* no host was changed"):
        refuse_revoked_before_changes(with_apiserver(ctx_for(prepared)))
    assert {m for m, _, _ in fake.requests} == {"GET"}


def test_a_revoked_name_the_inventory_no_longer_lists_lets_the_run_go_on(prepared, fake):
    from installer.engine.bootstrap import refuse_revoked_before_changes
    revoke_in(fake, ["node9"])
    refuse_revoked_before_changes(with_apiserver(ctx_for(prepared)))
    assert [p for m, p, _ in fake.requests if "validatingadmissionpolicies" in p] != []


def test_no_api_is_asked_before_any_apiserver_runs_or_when_the_run_skips_it(prepared, fake):
    from installer.engine.bootstrap import refuse_revoked_before_changes
    revoke_in(fake, ["node3"])
    refuse_revoked_before_changes(with_apiserver(ctx_for(prepared), active=False))
    refuse_revoked_before_changes(with_apiserver(ctx_for(prepared, skip=frozenset({"cluster-bootstrap"}))))
    assert fake.requests == []
