"""The version-skew rules and the order of a rolling upgrade (core/upgrade_rules.py), and apply's
refusal of a version change on a running cluster, without hosts."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from installer import api
from installer.cli.main import cli
from installer.core.upgrade_rules import (
    RULES,
    HostState,
    SkewError,
    check_etcd,
    check_kubernetes,
    current_version,
    leases_waiting,
    upgrade_order,
)
from installer.engine import runner
from tests.conftest import write_inventory


@pytest.mark.parametrize("current,target,kind", [
    ("v1.36.5", "v1.36.5", "none"), ("v1.36.5", "v1.36.7", "patch"), ("v1.36.5", "v1.36.2", "patch-down"),
    ("v1.36.5", "v1.37.2", "minor"), ("v1.36.5", "v1.37.0", "minor"),
])
def test_moves_the_policy_allows(current, target, kind):
    assert check_kubernetes(current, target) == kind


@pytest.mark.parametrize("current,target,rule", [
    ("v1.35.4", "v1.37.2", "minor-skip"), ("v1.37.2", "v1.36.5", "minor-down"), ("v1.36.5", "v2.0.0", "major"),
])
def test_moves_the_policy_forbids_name_the_rule(current, target, rule):
    with pytest.raises(SkewError) as e:
        check_kubernetes(current, target)
    assert RULES[rule] in str(e.value) and current in str(e.value) and target in str(e.value)


def test_etcd_moves_by_patch_only():
    assert check_etcd("v3.6.16", "v3.6.16") is False and check_etcd("v3.6.15", "v3.6.16") is True
    with pytest.raises(SkewError, match="etcd v3.5.21 -> v3.6.16: upgrade rolls etcd patch releases only"):
        check_etcd("v3.5.21", "v3.6.16")


def hosts(cp: str = "v1.36.5", w1: str = "v1.36.5", w2: str = "v1.36.5", etcd: str = "v3.6.16") -> list[HostState]:
    return [HostState("cp1", "control", cp, etcd), HostState("w1", "worker", w1), HostState("w2", "worker", w2)]


def test_order_control_hosts_one_at_a_time_then_workers_in_batches():
    three = [HostState(f"cp{i}", "control", "v1.36.5", "v3.6.16") for i in (1, 2, 3)] + \
            [HostState(f"w{i}", "worker", "v1.36.5") for i in (1, 2, 3)]
    assert upgrade_order(three, "v1.37.2", "v3.6.16", 2) == [["cp1"], ["cp2"], ["cp3"], ["w1", "w2"], ["w3"]]
    # etcd first, one member at a time, when its version changes
    assert upgrade_order(three, "v1.37.2", "v3.6.17", 1)[:4] == [["cp1"], ["cp2"], ["cp3"], ["cp1"]]


def test_a_second_run_does_only_what_is_left():
    # cut short after w1: the control host and w1 report the target already
    assert upgrade_order(hosts(cp="v1.37.2", w1="v1.37.2"), "v1.37.2", "v3.6.16", 1) == [["w2"]]
    assert upgrade_order(hosts("v1.37.2", "v1.37.2", "v1.37.2"), "v1.37.2", "v3.6.16", 1) == []
    # the cluster's version is the oldest control host's
    assert current_version(hosts(cp="v1.37.2") + [HostState("cp2", "control", "v1.36.5")]) == "v1.36.5"


def test_apply_refuses_a_version_change_on_a_running_cluster(prepared, doc, tmp_path):
    st = tmp_path / "st"
    shutil.copytree(prepared.state.root, st)
    state = api.state_for(prepared.inventory, st)
    # an earlier apply recorded what the hosts run
    state.record_versions(runner.cluster_versions(prepared.inventory))
    before = state.versions_path.read_bytes()
    assert state.recorded_versions() == {"kubernetes": doc["spec"]["kubernetes"]["version"],
                                         "etcd": prepared.inventory.spec.artifacts.versions.etcd}
    runner.check_versions(prepared.inventory, state)            # the same versions: nothing to say
    doc["spec"]["kubernetes"]["version"] = "v1.37.2"
    inv = write_inventory(tmp_path, doc)
    res = CliRunner().invoke(cli, ["plan", str(inv), "--state", str(st)])
    assert res.exit_code == 2, res.output
    assert "kubernetes v1.36.5 -> v1.37.2" in res.output and "installer upgrade INVENTORY" in res.output
    assert state.versions_path.read_bytes() == before


def test_the_steps_of_an_upgrade_and_of_its_second_run(prepared, tmp_path):
    from installer.actions import upgrade as up_mod
    from installer.core.cluster import Cluster
    from installer.engine.run import open_run
    st = tmp_path / "st"
    shutil.copytree(prepared.state.root, st)
    state = api.state_for(prepared.inventory, st)
    inv = up_mod.with_versions(prepared.inventory, kubernetes="v1.37.2")
    with open_run(Cluster(inv, state), log=lambda m: None) as run:      # its plane says each control turn
        up = up_mod.Upgrade(inv, state, "v1.36.5", "v1.37.2", "minor", max_unavailable=2, run=run)
        etcd = inv.spec.artifacts.versions.etcd
        fresh = up_mod.Survey([HostState("cp1", "control", "v1.36.5", etcd), HostState("node2", "worker", "v1.36.5"),
                               HostState("node3", "worker", "v1.36.5")])
        words = [s.says for s in up_mod.upgrade_steps(up, fresh, etcd)]
        assert words[0].startswith("save an etcd snapshot")
        assert words[1].startswith("cp1: kube-apiserver, kube-controller-manager, kube-scheduler v1.36.5 -> v1.37.2")
        # the restarted controllers lead again before a worker is drained (a drain without them
        # leaves evicted pods' addresses in the Services)
        assert words[2].startswith("wait until a restarted kube-controller-manager and kube-scheduler lead")
        assert words[3].startswith("node2, node3: cordon, drain")           # --max-unavailable 2: one batch
        assert words[4].startswith("converge every host at v1.37.2") and len(words) == 5
        # each host's own version in its words: a run cut short after the control host
        later = up_mod.Survey([HostState("cp1", "control", "v1.37.2", etcd), HostState("node2", "worker", "v1.36.5"),
                               HostState("node3", "worker", "v1.36.5")])
        words = [s.says for s in up_mod.upgrade_steps(up, later, etcd)]
        assert words[1].startswith("node2, node3: cordon, drain (PodDisruptionBudgets respected")
        assert "kubelet and kube-proxy v1.36.5 -> v1.37.2" in words[1] and len(words) == 3
        # killed after node2 was upgraded, before its uncordon: a second run uncordons it, takes no
        # second snapshot (nothing is left to roll) and converges
        up_mod._mark(state, ["node2"])
        assert up_mod.cordoned_by_upgrade(state) == ["node2"]
        later = up_mod.Survey([HostState("cp1", "control", "v1.37.2", etcd), HostState("node2", "worker", "v1.37.2"),
                               HostState("node3", "worker", "v1.37.2")])
        words = [s.says for s in up_mod.upgrade_steps(up, later, etcd)]
        assert words == ["uncordon node2 (left cordoned by an interrupted upgrade, already at v1.37.2)",
                         "converge every host at v1.37.2 (add-ons; nothing else should change); record the versions"]
        up_mod._mark(state, [])
        assert not (st / "upgrade.yaml").exists()
        # Kubernetes and etcd both behind: each control host's etcd turn first, then its own turn
        # (the etcd turns were once counted twice, making every control turn an etcd one)
        both = up_mod.Survey([HostState("cp1", "control", "v1.36.5", "v3.6.14"), HostState("cp2", "control", "v1.36.5",
                                                                                          "v3.6.14"),
                              HostState("node2", "worker", "v1.36.5")])
        words = [s.says for s in up_mod.upgrade_steps(up, both, "v3.6.14")]
        assert [w.split(":")[0] for w in words[1:5]] == ["cp1", "cp2", "cp1", "cp2"], words
        assert all(f"etcd v3.6.14 -> {etcd}" in w for w in words[1:3]), words
        assert all("kube-apiserver, kube-controller-manager, kube-scheduler v1.36.5 -> v1.37.2" in w
                   for w in words[3:5]), words


CM, SCHED = "kube-controller-manager", "kube-scheduler"


def test_a_lease_counts_once_a_restarted_instance_holds_it():
    before = {CM: "cp1_aaa", SCHED: "cp2_bbb"}
    assert leases_waiting({CM: "cp1_aaa", SCHED: None}, before) == [CM, SCHED]
    # control hosts: any other holder is a restarted process (every host restarted by then)
    assert leases_waiting({CM: "cp1_ccc", SCHED: "cp3_ddd"}, before) == []


def test_a_tenants_old_standby_holding_the_lease_does_not_count():
    """Hosted: the old ReplicaSet's standby took the Lease when the old leader went; it is
    terminating once the roll is done, so a drain now would meet one more hand-over."""
    before = {CM: "kube-controller-manager-old-x_1", SCHED: "kube-scheduler-old-x_2"}
    now = {CM: "kube-controller-manager-old-y_3", SCHED: "kube-scheduler-new-a_4"}
    running = {"kube-controller-manager-new-a", "kube-controller-manager-new-b", "kube-scheduler-new-a",
               "kube-scheduler-new-b"}
    assert leases_waiting(now, before, running) == [CM]
    assert leases_waiting({**now, CM: "kube-controller-manager-new-b_5"}, before, running) == []
    # the same holders without the pods' view (control hosts): counted
    assert leases_waiting(now, before) == []
