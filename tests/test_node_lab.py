"""`installer node add|remove|list` and the host side of `node revoke` on a real lab (1 control,
2 nspawn workers; the Kubernetes components are contract stand-ins, so the Kubernetes API part
is skipped with --skip-cluster / --skip cluster-bootstrap, or, for revoke, driven through the
real client over the fake transport while the host part runs for real).

- node add: only the new worker is changed, plus the pod route to it on the other worker;
  other pending inventory edits make it refuse, changing nothing.
- node remove: the worker is wiped, the other worker's route to its pods is gone, the ledger
  says removed, apply refuses the inventory that still lists it; node add brings it back.
- node revoke: the ledger says revoked with the time, the host is wiped, the name can never be
  added again."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml

from installer import api, kube, node_ops
from installer.ledger import Ledger, NodeRetiredError

from .fakeapi import FakeCluster
from .labfixtures import standin_lab
from .test_apply_lab import apply_json, run_installer

pytestmark = pytest.mark.lab

NAME, SUBNET = "nodes", "10.213.246.0/24"
WORKER_UNITS = ("kubelet", "kube-proxy", "containerd", "hiddenplane-routes")


def inventory_without(lab, name: str, path):
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] != name]
    path.write_text(yaml.safe_dump(doc))
    return path


def pod_routes(host) -> str:
    return host.check_output("ip route show proto 199")


def pod_cidr(lab, node: str) -> str:
    doc = yaml.safe_load((lab.state / "network.yaml").read_text())
    return doc["podCIDRs"][node]


def managed_sums(host) -> str:
    return host.check_output("find /etc/kubernetes /etc/systemd/system -maxdepth 3 -type f "
                             "! -name hiddenplane-routes.service -exec sha256sum {} + 2>/dev/null | sort")


@pytest.fixture(scope="module")
def nodelab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodelab")
    with standin_lab(NAME, SUBNET, tmp, controls=1, workers=2) as lab:
        lab.tmp = tmp
        lab.without_w2 = inventory_without(lab, "w2", tmp / "without-w2.yaml")
        apply_json(lab.without_w2, lab.state)
        yield lab


def test_node_add_changes_only_the_new_worker_and_the_routes(nodelab, tmp_path):
    w1, w2, cp1 = nodelab.host("w1"), nodelab.host("w2"), nodelab.host("cp1")
    assert not w2.file("/etc/systemd/system/kubelet.service").exists
    before = {n: managed_sums(nodelab.host(n)) for n in ("cp1", "w1")}

    # another pending edit in the inventory: refused, nothing changed anywhere
    doc = yaml.safe_load(nodelab.inventory.read_text())
    # changes kube-controller-manager's --cluster-signing-duration on cp1
    doc["spec"].setdefault("pki", {})["kubeletClientCertHours"] = 7
    other = tmp_path / "other-edit.yaml"
    other.write_text(yaml.safe_dump(doc))
    proc = run_installer("node", "add", str(other), "w2", "--state", str(nodelab.state), "--skip",
                         "cluster-bootstrap", check_rc=None)
    assert proc.returncode != 0 and "other pending changes" in proc.stderr, proc.stderr[-2000:]
    assert not w2.file("/etc/systemd/system/kubelet.service").exists
    assert managed_sums(w1) == before["w1"]

    proc = run_installer("node", "add", str(nodelab.inventory), "w2", "--state", str(nodelab.state),
                         "--skip", "cluster-bootstrap", "--output", "json", "--wait-timeout", "90")
    report = json.loads(proc.stdout)
    changed = {e["host"] for e in report["events"] if e["action"] == "changed" and not e["host"].startswith("(")}
    assert "w2" in changed
    for unit in WORKER_UNITS:
        assert w2.service(unit).is_running, unit
    assert f"{pod_cidr(nodelab, 'w2')} via {nodelab.spec.host('w2').address}" in pod_routes(w1)
    assert managed_sums(w1) == before["w1"] and managed_sums(cp1) == before["cp1"]
    for e in report["events"]:            # elsewhere only the routes unit changed and restarted
        if e["host"] in ("cp1", "w1") and e["action"] == "changed":
            assert all("hiddenplane-routes.service" in line for line in e["detail"]), e
    # a second add is a no-op
    proc = run_installer("node", "add", str(nodelab.inventory), "w2", "--state", str(nodelab.state),
                         "--skip", "cluster-bootstrap")
    assert "nothing to change" in proc.stdout


def test_node_list_shows_the_hosts(nodelab):
    rows = {r["name"]: r for r in json.loads(run_installer(
        "node", "list", str(nodelab.inventory), "--state", str(nodelab.state), "--output", "json").stdout)}
    assert {n: r["state"] for n, r in rows.items()} == {"cp1": "active", "w1": "active", "w2": "active"}


def test_node_remove_wipes_the_worker_and_drops_its_routes(nodelab):
    w1, w2 = nodelab.host("w1"), nodelab.host("w2")
    cidr = pod_cidr(nodelab, "w2")
    proc = run_installer("node", "remove", str(nodelab.inventory), "w2", "--state", str(nodelab.state),
                         "--skip-cluster", "--yes")
    assert "w2: removed" in proc.stdout
    for unit in WORKER_UNITS:
        assert not w2.service(unit).is_running, unit
        assert not w2.file(f"/etc/systemd/system/{unit}.service").exists, unit
    assert not w2.file("/etc/kubernetes").exists and not w2.file("/var/lib/kubelet").exists
    assert pod_routes(w2) == ""
    assert cidr not in pod_routes(w1)
    assert Ledger.load(api.state_for(api.validate(nodelab.inventory), nodelab.state)).entries["w2"].state == "removed"
    # apply refuses the inventory that still lists it; without it, all is converged
    proc = run_installer("apply", str(nodelab.inventory), "--state", str(nodelab.state), "--skip",
                         "cluster-bootstrap", check_rc=2)
    assert "w2 was removed" in proc.stderr and "node add" in proc.stderr
    run_installer("plan", str(nodelab.without_w2), "--state", str(nodelab.state), "--check",
                  "--skip", "cluster-bootstrap")

    # and node add brings it back
    run_installer("node", "add", str(nodelab.inventory), "w2", "--state", str(nodelab.state),
                  "--skip", "cluster-bootstrap", "--wait-timeout", "90")
    assert w2.service("kubelet").is_running and cidr in pod_routes(w1)


def test_node_revoke_records_it_and_wipes_the_host(nodelab):
    """The API part runs through the real client over the fake transport (no real apiserver
    here); the host part (wipe, routes on the others) is real."""
    inv = api.validate(nodelab.inventory)
    state = api.state_for(inv, nodelab.state)
    cluster = FakeCluster()
    material = state.load(inv)

    @contextlib.contextmanager
    def fake_api():
        a = kube.api_client("https://127.0.0.1:6443", material)
        a.rest_client.pool_manager = cluster
        try:
            yield a
        finally:
            a.close()

    w1, w2 = nodelab.host("w1"), nodelab.host("w2")
    cidr = pod_cidr(nodelab, "w2")
    out = node_ops.revoke(nodelab.inventory, "w2", nodelab.state, api_factory=fake_api,
                          refresh_skip=frozenset({"cluster-bootstrap"}), log=lambda m: None)
    assert out.entry.state == "revoked" and out.entry.since
    assert any(p.endswith("/validatingadmissionpolicies") for p in cluster.calls("POST"))
    e = Ledger.load(state).entries["w2"]
    assert e.state == "revoked" and e.address == nodelab.spec.host("w2").address
    assert not w2.file("/etc/kubernetes").exists and not w2.service("kubelet").is_running
    assert cidr not in pod_routes(w1)
    with pytest.raises(NodeRetiredError, match="w2 was revoked"):
        node_ops.add(nodelab.inventory, "w2", nodelab.state, skip=frozenset({"cluster-bootstrap"}))
    proc = run_installer("node", "add", str(nodelab.inventory), "w2", "--state", str(nodelab.state),
                         "--skip", "cluster-bootstrap", check_rc=2)
    assert "can never join again" in proc.stderr
