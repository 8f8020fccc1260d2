"""etcd membership changes without hosts: the safety rules of `installer etcd member add|remove`,
the apply guard, the rendering of a joining member's unit and the restart key that keeps a
membership change from restarting every member at once. The real thing runs in
tests/test_etcd_members_lab.py."""

from __future__ import annotations

import copy
import json

import pytest

from installer.actions.etcd_members import MembershipRefused, apply_guard, check_add, check_remove, quorum
from installer.core import inventory
from installer.core.components import ETCD_UNIT
from installer.core.diff import diff
from installer.core.errors import InventoryError
from installer.core.facts import PROBE, DirFact, FileFact, HostFacts, parse
from installer.core.render.control import ETCD_RESTART_KEY, etcd_unit_files
from installer.core.render.plan import render_cluster
from installer.engine.context import Context, EtcdMembership, Options
from installer.engine.parts import etcd_part
from installer.engine.phases.read_etcd_membership import ReadEtcdMembership
from installer.engine.phases.start_etcd import StartEtcd
from installer.engine.planes.etcd_hosts import Member, parse_members
from installer.host.ssh import Result

from . import reference as ref
from .conftest import write_inventory

UNIT = f"/etc/systemd/system/{ETCD_UNIT}"
ADDR = {"cp1": "192.168.56.230", "cp2": "192.168.56.233", "cp3": "192.168.56.234", "cp4": "192.168.56.235",
        "cp5": "192.168.56.236"}


def member(name: str, learner: bool = False, started: bool = True, id_: str | None = None) -> Member:
    a = ADDR[name]
    return Member(name if started else "", id_ or f"{int(a.rsplit('.', 1)[1]) << 40:x}", [f"https://{a}:2380"],
                  [f"https://{a}:2379"] if started else [], learner)


def cluster(*names: str) -> list[Member]:
    return [member(n) for n in names]


def healthy(*names: str, down: tuple[str, ...] = ()) -> dict[str, bool]:
    return {n: n not in down for n in names}


# --- the rules -----------------------------------------------------------------------------------

def test_quorum():
    assert [quorum(n) for n in range(1, 7)] == [1, 2, 2, 3, 3, 4]


def test_remove_from_three_to_two_needs_allow_even():
    ms = cluster("cp1", "cp2", "cp3")
    reason = check_remove(ms, healthy("cp1", "cp2", "cp3"), "cp3")
    assert "2 members, an even count" in reason and "--allow-even" in reason and "replacing a host" in reason
    assert check_remove(ms, healthy("cp1", "cp2", "cp3"), "cp3", allow_even=True) is None


def test_remove_from_two_members_is_refused_even_with_allow_even():
    reason = check_remove(cluster("cp1", "cp2"), healthy("cp1", "cp2"), "cp2", allow_even=True)
    assert reason.startswith("etcd has only 2 members: removing cp2 would leave a single member")


def test_remove_the_last_member_is_refused():
    assert "no cluster at all" in check_remove(cluster("cp1"), healthy("cp1"), "cp1", allow_even=True)


def test_remove_a_healthy_member_while_another_is_down_is_refused():
    ms = cluster("cp1", "cp2", "cp3")
    reason = check_remove(ms, healthy("cp1", "cp2", "cp3", down=("cp2",)), "cp3", allow_even=True)
    assert "only 1 of them are healthy (down: cp2)" in reason and "2 are needed" in reason


def test_remove_the_dead_member_while_replacing_it_is_allowed():
    ms = cluster("cp1", "cp2", "cp3")
    assert check_remove(ms, healthy("cp1", "cp2", "cp3", down=("cp3",)), "cp3", allow_even=True) is None


def test_five_to_four_with_two_down_is_refused():
    ms = cluster("cp1", "cp2", "cp3", "cp4", "cp5")
    h = healthy("cp1", "cp2", "cp3", "cp4", "cp5", down=("cp4", "cp5"))
    assert "only 2 of them are healthy" in check_remove(ms, h, "cp1", allow_even=True)
    # removing one of the dead ones leaves 3 healthy of 4: a quorum
    assert check_remove(ms, h, "cp5", allow_even=True) is None


def test_no_quorum_refuses_every_change():
    ms = cluster("cp1", "cp2", "cp3")
    h = healthy("cp1", "cp2", "cp3", down=("cp2", "cp3"))
    for reason in (check_remove(ms, h, "cp3", allow_even=True), check_add(ms[:2], h, "cp3"),
                   check_add(ms, h, "cp4", allow_even=True)):
        assert reason.startswith("etcd has no quorum: only 1 of"), reason


def test_add_to_two_members_is_allowed_and_to_three_needs_allow_even():
    assert check_add(cluster("cp1", "cp2"), healthy("cp1", "cp2"), "cp3") is None
    ms = cluster("cp1", "cp2", "cp3")
    reason = check_add(ms, healthy("cp1", "cp2", "cp3"), "cp4")
    assert "4 members, an even count" in reason and "tolerate 1 failure" in reason
    assert check_add(ms, healthy("cp1", "cp2", "cp3"), "cp4", allow_even=True) is None


def test_add_an_existing_voting_member_is_refused():
    ms = cluster("cp1", "cp2", "cp3")
    assert "cp3 is already a voting member" in check_add(ms, healthy("cp1", "cp2", "cp3"), "cp3")


def test_one_change_at_a_time_another_learner():
    ms = cluster("cp1", "cp2", "cp3") + [member("cp4", learner=True)]
    h = healthy("cp1", "cp2", "cp3")
    for reason in (check_add(ms, h, "cp5", allow_even=True), check_remove(ms, h, "cp3", allow_even=True)):
        assert reason.startswith("another membership change is in progress: member cp4"), reason
        assert "is a learner" in reason


def test_one_change_at_a_time_an_unstarted_member():
    ms = cluster("cp1", "cp2") + [member("cp3", started=False, id_="abc")]
    reason = check_add(ms, healthy("cp1", "cp2"), "cp4", allow_even=True)
    assert "member abc (https://192.168.56.234:2380) is added but never started" in reason


def test_resuming_the_same_learner_and_undoing_it_are_allowed():
    ms = cluster("cp1", "cp2") + [member("cp3", learner=True)]
    h = healthy("cp1", "cp2")
    assert check_add(ms, h, "cp3") is None                       # resume: promote it
    assert check_remove(ms, h, "cp3") is None                    # undo: no vote changes


def test_one_change_at_a_time_against_the_inventory():
    ms = cluster("cp1", "cp2", "cp3")
    h = healthy("cp1", "cp2", "cp3")
    # the inventory lost cp2 *and* asks to remove cp3: two changes
    reason = check_remove(ms, h, "cp3", allow_even=True, controls=["cp1"])
    assert reason.startswith("one change at a time") and "also differ by cp2" in reason
    # only the host asked for differs: fine, whether still listed or already deleted
    assert check_remove(ms, h, "cp3", allow_even=True, controls=["cp1", "cp2", "cp3"]) is None
    assert check_remove(ms, h, "cp3", allow_even=True, controls=["cp1", "cp2"]) is None
    assert check_add(cluster("cp1", "cp2"), healthy("cp1", "cp2"), "cp3", controls=["cp1", "cp2", "cp3"]) is None
    assert "also differ by cp4" in check_add(cluster("cp1", "cp2"), healthy("cp1", "cp2"), "cp3",
                                            controls=["cp1", "cp2", "cp3", "cp4"])


def test_remove_an_unknown_member():
    assert check_remove(cluster("cp1", "cp2", "cp3"), {}, "cp9") == "cp9 is not an etcd member (members: cp1, cp2, cp3)"


def test_refusal_is_an_installer_error_with_its_own_exit_code():
    from installer.core.errors import InstallerError
    assert issubclass(MembershipRefused, InstallerError) and MembershipRefused.exit_code == 4


def test_parse_members_of_etcdctl_json():
    # as printed by etcdctl 3.4 right after `member add --learner` (the learner has no name yet)
    out = json.dumps({"header": {}, "members": [
        {"ID": 1047536054186327219, "name": "b", "peerURLs": ["https://10.0.0.2:2380"],
         "clientURLs": ["https://10.0.0.2:2379"]},
        {"ID": 4079093514649729670, "peerURLs": ["https://10.0.0.3:2380"], "isLearner": True}]})
    a, b = parse_members(out)
    assert (a.name, a.id, a.learner) == ("b", "e89987dbf30bcb3", False)
    assert (b.name, b.id, b.learner, b.client_urls) == ("", "389bd9f08a4bfa86", True, [])


# --- the apply guard -------------------------------------------------------------------------------

@pytest.fixture
def controls(three_controls):
    return three_controls.inventory.controls


def test_guard_refuses_a_new_control_host_next_to_a_running_cluster(controls):
    g = apply_guard(controls, {"cp1", "cp2"}, cluster("cp1", "cp2"))
    assert g.problems == ["cp3: has no etcd data while cp1, cp2 run an etcd cluster; apply would start it as a new, "
                          "separate cluster: run `installer etcd member add <inventory> cp3` to join it (as a "
                          "learner, then promoted)"]
    assert g.joining == {}


def test_guard_refuses_a_live_member_missing_from_the_inventory(controls):
    g = apply_guard(controls[:2], {"cp1", "cp2"}, cluster("cp1", "cp2", "cp3"))
    assert len(g.problems) == 1 and g.problems[0].startswith("cp3: a live etcd member (https://192.168.56.234:2380)")
    assert "`installer etcd member remove <inventory> cp3`" in g.problems[0]


def test_guard_refuses_data_of_a_removed_member(controls):
    g = apply_guard(controls, {"cp1", "cp2", "cp3"}, cluster("cp1", "cp2"))
    assert g.problems[0].startswith("cp3: holds etcd data in /var/lib/etcd but is not a member")


def test_guard_lets_a_registered_learner_join(controls):
    ms = cluster("cp1", "cp2") + [member("cp3", learner=True, started=False)]
    g = apply_guard(controls, {"cp1", "cp2"}, ms)
    assert g.problems == [] and g.learners == {"cp3"}
    assert g.joining == {"cp3": "cp1=https://192.168.56.230:2380,cp2=https://192.168.56.233:2380,"
                                "cp3=https://192.168.56.234:2380"}


def test_guard_passes_a_matching_cluster(controls):
    g = apply_guard(controls, {"cp1", "cp2", "cp3"}, cluster("cp1", "cp2", "cp3"))
    assert (g.problems, g.joining, g.learners) == ([], {}, set())


# --- rendering: the joining member, the restart key ------------------------------------------------

def exec_flags(unit) -> dict[str, str]:
    return ref.parse_flags(ref.exec_start(unit.content)[1:])


def test_a_joining_member_starts_existing_with_the_live_members(three_controls):
    inv = three_controls.inventory
    cp3 = inv.host("cp3")
    normal, key = etcd_unit_files(inv, cp3)
    assert exec_flags(normal)["--initial-cluster-state"] == "new"
    assert exec_flags(normal)["--initial-cluster"] == ("cp1=https://192.168.56.230:2380,cp2=https://192.168.56.233:2380,"
                                                      "cp3=https://192.168.56.234:2380")
    live = "cp1=https://192.168.56.230:2380,cp3=https://192.168.56.234:2380"
    joining, join_key = etcd_unit_files(inv, cp3, join=live)
    flags = exec_flags(joining)
    assert flags["--initial-cluster-state"] == "existing" and flags["--initial-cluster"] == live
    assert flags["--initial-advertise-peer-urls"] == "https://192.168.56.234:2380"
    # everything else is the same unit: joining changes no restart input
    assert {k: v for k, v in flags.items() if not k.startswith("--initial-cluster")} == \
        {k: v for k, v in exec_flags(normal).items() if not k.startswith("--initial-cluster")}
    assert join_key == key


def test_the_unit_restarts_nothing_its_restart_key_restarts_etcd(three_controls):
    inv = three_controls.inventory
    plan = three_controls.plans["cp1"]
    assert plan.files[UNIT].restarts == ()
    assert plan.files[ETCD_RESTART_KEY].restarts == (ETCD_UNIT,)
    assert plan.files[ETCD_RESTART_KEY].mode == 0o600
    assert ETCD_RESTART_KEY in {f.path for f in etcd_part(plan).files}
    # another member's key differs (its own addresses are restart inputs)
    assert etcd_unit_files(inv, inv.host("cp2"))[1].content != plan.files[ETCD_RESTART_KEY].content


def facts_holding(plan, paths) -> HostFacts:
    return HostFacts(files={p: FileFact(plan.files[p].sha256, plan.files[p].mode, plan.files[p].owner,
                                        plan.files[p].group, True) for p in paths},
                     dirs={d.path: DirFact(d.mode, d.owner, d.group) for d in plan.dirs.values()},
                     users={"etcd"}, units={ETCD_UNIT: ("active", "enabled")}, etcd_data=True)


def test_dropping_a_control_host_rewrites_the_unit_without_restarting_etcd(three_controls, example_doc, tmp_path):
    before = three_controls.plans["cp1"]
    d = copy.deepcopy(example_doc)
    d["spec"]["hosts"] = [{"name": "cp1", "address": ADDR["cp1"], "role": "control"},
                          {"name": "cp2", "address": ADDR["cp2"], "role": "control"},
                          {"name": "node2", "address": "192.168.56.231", "role": "worker"}]
    d["spec"]["allowEvenControlHosts"] = True
    inv = inventory.load(write_inventory(tmp_path, d))
    after = render_cluster(inv, three_controls.material)["cp1"]
    facts = facts_holding(before, [f.path for f in etcd_part(before).files])
    ch = diff("cp1", etcd_part(after), facts)
    assert [f.path for f in ch.write] == [UNIT]
    assert "cp3=" not in exec_flags(after.files[UNIT])["--initial-cluster"]
    assert ch.restart == [] and ch.start == []
    # any other change of the unit (here: a key written from other flags) still restarts it
    stale = FileFact("0" * 64, 0o600, "root", "root", True)
    ch2 = diff("cp1", etcd_part(after), HostFacts(**{**vars(facts), "files": {**facts.files, ETCD_RESTART_KEY: stale}}))
    assert ch2.restart == [ETCD_UNIT]


def test_two_control_hosts_need_the_inventory_opt_in(example_doc, tmp_path):
    d = copy.deepcopy(example_doc)
    d["spec"]["hosts"].append({"name": "cp2", "address": ADDR["cp2"], "role": "control"})
    with pytest.raises(InventoryError) as err:
        inventory.load(write_inventory(tmp_path, d))
    assert any("spec.allowEvenControlHosts: true" in p for p in err.value.problems)
    d["spec"]["allowEvenControlHosts"] = True
    assert len(inventory.load(write_inventory(tmp_path, d)).controls) == 2


def test_facts_say_whether_a_host_holds_etcd_data():
    assert "/var/lib/etcd/member" in PROBE
    assert parse("K\tetcd_data\t1\nEND\n").etcd_data is True
    assert parse("END\n").etcd_data is False


# --- the guard inside the etcd phase ---------------------------------------------------------------

class FakeRemote:
    """Answers etcdctl member list with ``members``; records every script."""

    def __init__(self, name, members=None):
        self.name, self.members, self.calls = name, members, []

    def run(self, script, stdin=None, check=True, what=None, timeout=600):
        self.calls.append(what)
        doc = {"members": [{"ID": int(m.id, 16), "name": m.name, "peerURLs": m.peer_urls,
                            "clientURLs": m.client_urls, "isLearner": m.learner} for m in self.members]}
        return Result(json.dumps(doc), "", 0)


def context(prepared, facts: dict[str, HostFacts], members) -> Context:
    ctx = Context(prepared.inventory, prepared.state, Options(), prepared.material, prepared.changes,
                  log=lambda m: None)
    ctx.plans = render_cluster(prepared.inventory, prepared.material)
    ctx.facts = facts
    ctx.remotes = {h.name: FakeRemote(h.name, members) for h in prepared.inventory.spec.hosts}
    return ctx


def read_membership(ctx: Context) -> list[str]:
    """The etcd phase's membership read as the runner drives it: prepare (facts only), run_host
    on the hosts it chose, finish. The hosts it asked."""
    phase = ReadEtcdMembership()
    hosts = phase.prepare(ctx)
    if hosts:                       # the runner skips a phase that chose no host
        phase.finish(ctx, [phase.run_host(ctx, h) for h in hosts])
    return hosts


def running(plan) -> HostFacts:
    return facts_holding(plan, [f.path for f in etcd_part(plan).files])


def test_phase_refuses_before_touching_a_host(three_controls):
    plans = three_controls.plans
    facts = {"cp1": running(plans["cp1"]), "cp2": running(plans["cp2"]), "cp3": HostFacts()}
    ctx = context(three_controls, facts, cluster("cp1", "cp2"))
    with pytest.raises(MembershipRefused) as err:
        read_membership(ctx)
    assert "cp3: has no etcd data while cp1, cp2 run an etcd cluster" in str(err.value)
    assert "installer etcd member add <inventory> cp3" in str(err.value)
    # only the running members were asked (a read: prepare itself reaches no host)
    assert [ctx.remotes[h].calls for h in ("cp1", "cp2", "cp3")] == [["etcd member list"]] * 2 + [[]]


def test_phase_renders_the_registered_learner_as_joining(three_controls):
    plans = three_controls.plans
    facts = {"cp1": running(plans["cp1"]), "cp2": running(plans["cp2"]), "cp3": HostFacts()}
    ctx = context(three_controls, facts, cluster("cp1", "cp2") + [member("cp3", learner=True, started=False)])
    assert read_membership(ctx) == ["cp1", "cp2"]
    assert StartEtcd().prepare(ctx) == ["cp1", "cp2", "cp3"]
    flags = exec_flags(ctx.plans["cp3"].files[UNIT])
    assert flags["--initial-cluster-state"] == "existing"
    assert flags["--initial-cluster"].endswith(",cp3=https://192.168.56.234:2380")
    assert ctx.result(EtcdMembership).guard.learners == {"cp3"}
    # the other members' units are untouched
    assert exec_flags(ctx.plans["cp1"].files[UNIT])["--initial-cluster-state"] == "new"


def test_a_no_op_apply_asks_etcd_nothing(three_controls):
    plans = three_controls.plans
    facts = {n: running(plans[n]) for n in ("cp1", "cp2", "cp3")}
    ctx = context(three_controls, facts, cluster("cp1"))       # would be refused if asked
    assert read_membership(ctx) == []
    assert all(r.calls == [] for r in ctx.remotes.values())


def test_a_new_cluster_bootstraps_without_asking(three_controls):
    ctx = context(three_controls, {n: HostFacts() for n in ("cp1", "cp2", "cp3")}, [])
    assert read_membership(ctx) == [] and ctx.result(EtcdMembership).guard.joining == {}
    assert all(r.calls == [] for r in ctx.remotes.values())
