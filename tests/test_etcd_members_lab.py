"""`installer etcd member remove|add` on a real three-member etcd (mTLS, Debian etcd 3.4) in the
lab: cp3 leaves (3 -> 2, --allow-even), the inventory follows and apply restarts no member, cp3
comes back as a learner and is promoted (2 -> 3); every unsafe request on the way is refused with
its reason and changes nothing. Each step is checked with etcdctl on the hosts.

The tests run in file order on one lab: each starts from where the previous one left it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from .labfixtures import standin_lab
from .test_apply_lab import PKI, apply_json, etcdctl, run_installer

pytestmark = pytest.mark.lab

LAB, SUBNET = "etcdm", "10.213.242.0/24"
KEY, VALUE = "/hiddenplane-test/before-removal", "kept"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etcdm")
    with standin_lab(LAB, SUBNET, tmp, controls=3, workers=1) as the_lab:
        apply_json(the_lab.inventory, the_lab.state)
        doc = yaml.safe_load(the_lab.inventory.read_text())
        the_lab.without_cp3 = variant(tmp, "without-cp3", doc, drop="cp3", allow_even=True)
        the_lab.with_cp4 = variant(tmp, "with-cp4", doc, add="cp4", allow_even=True)
        the_lab.with_cp4_strict = variant(tmp, "with-cp4-strict", doc, add="cp4", allow_even=False)
        yield the_lab


def variant(tmp: Path, name: str, doc: dict, drop: str | None = None, add: str | None = None,
            allow_even: bool = False) -> Path:
    d = json.loads(json.dumps(doc))
    hosts = [h for h in d["spec"]["hosts"] if h["name"] != drop]
    if add:     # an address in the lab's subnet that no host has: it is never contacted
        hosts.append({"name": add, "address": SUBNET.replace("0/24", "14"), "role": "control"})
    d["spec"]["hosts"] = hosts
    if allow_even:
        d["spec"]["allowEvenControlHosts"] = True
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def members(lab, via: str = "cp1") -> list[dict]:
    return json.loads(etcdctl(lab.host(via), "member", "list", "-w", "json"))["members"]


def names(ms: list[dict]) -> list[str]:
    return sorted(m.get("name", "") for m in ms)


def healthy_endpoints(lab, hosts: list[str], via: str = "cp1") -> int:
    """How many of ``hosts`` answer `etcdctl endpoint health` (the health-check client, mTLS)."""
    endpoints = ",".join(f"https://{lab.spec.host(h).address}:2379" for h in hosts)
    out = lab.host(via).run(
        f"/usr/local/bin/etcdctl --endpoints={endpoints} --cacert={PKI}/etcd/ca.crt "
        f"--cert={PKI}/etcd/healthcheck-client.crt --key={PKI}/etcd/healthcheck-client.key endpoint health 2>&1")
    return out.stdout.count("is healthy")


def etcd_pid(lab, host: str) -> str:
    return lab.host(host).check_output("systemctl show -p MainPID --value etcd.service")


def test_day2_commands_respect_a_live_lock(lab, tmp_path):
    """A live apply elsewhere holds the lock on cp2: restore and membership changes stop before
    touching anything (restore used to stop the control plane on every member regardless)."""
    cp2 = lab.host("cp2")
    cp2.run_expect([0], "echo '{\"machine\": \"elsewhere\", \"pid\": 1, \"since\": %d, \"run\": \"r\"}' "
                   "> /var/lib/hiddenplane/apply.lock" % int(time.time()))
    pids = {h: etcd_pid(lab, h) for h in ("cp1", "cp2", "cp3")}
    snap = tmp_path / "any.db"
    snap.write_bytes(b"not even read")
    try:
        for args in (["etcd", "snapshot", "restore", str(lab.inventory), str(snap), "--yes"],
                     ["etcd", "member", "remove", str(lab.inventory), "cp3", "--allow-even", "--yes"],
                     ["node", "remove", str(lab.inventory), "w1", "--yes", "--state", str(lab.state)]):
            proc = run_installer(*args, check_rc=3)
            assert ("cp2: another command holds the apply lock" in proc.stderr
                    and "elsewhere" in proc.stderr), proc.stderr
        assert {h: etcd_pid(lab, h) for h in pids} == pids
        for h in ("cp1", "cp2", "cp3"):
            assert lab.host(h).service("kube-apiserver").is_running
        # the locks this command took on cp1 (before cp2 refused) are gone again
        for h in ("cp1", "cp3"):
            assert not lab.host(h).file("/var/lib/hiddenplane/apply.lock").exists
    finally:
        cp2.run("rm -f /var/lib/hiddenplane/apply.lock")


def unit_flag(lab, host: str, unit: str, flag: str) -> str:
    return lab.host(host).check_output(f"grep -o -- '{flag}=[^ ]*' /etc/systemd/system/{unit}")


def test_1_unsafe_requests_are_refused_and_change_nothing(lab):
    cp1, cp3 = lab.host("cp1"), lab.host("cp3")
    assert etcdctl(cp1, "put", KEY, VALUE) == "OK"
    assert names(members(lab)) == ["cp1", "cp2", "cp3"]

    # the inventory lost cp3 while it is still a member: apply names the command to run
    proc = run_installer("apply", str(lab.without_cp3), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         check_rc=4)
    assert "cp3: a live etcd member (https://10.213.242.13:2380)" in proc.stderr
    assert "installer etcd member remove <inventory> cp3" in proc.stderr

    # 3 -> 2 without --allow-even
    proc = run_installer("etcd", "member", "remove", str(lab.inventory), "cp3", "--yes", check_rc=4)
    assert "cp3: not removed: the cluster would have 2 members, an even count" in proc.stderr
    assert "nothing was changed" in proc.stderr

    # without --yes: the steps, exit 2
    proc = run_installer("etcd", "member", "remove", str(lab.inventory), "cp3", "--allow-even", check_rc=2)
    assert "etcdctl member remove" in proc.stderr and "pass --yes" in proc.stderr

    assert names(members(lab)) == ["cp1", "cp2", "cp3"]
    assert healthy_endpoints(lab, ["cp1", "cp2", "cp3"]) == 3
    assert cp3.service("etcd").is_running and cp3.file("/var/lib/etcd/member").is_directory


def test_2_remove_cp3_leaves_two_healthy_members(lab):
    proc = run_installer("etcd", "member", "remove", str(lab.inventory), "cp3", "--allow-even", "--yes")
    assert "cp3: etcd member" in proc.stdout and "removed; 2 members healthy: cp1, cp2" in proc.stdout
    assert "delete cp3 from the inventory" in proc.stdout

    ms = members(lab)
    assert names(ms) == ["cp1", "cp2"] and not any(m.get("isLearner") for m in ms)
    assert healthy_endpoints(lab, ["cp1", "cp2"]) == 2
    for h in ("cp1", "cp2"):
        assert lab.host(h).service("kube-apiserver").is_running, h
    cp3 = lab.host("cp3")
    for unit in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        assert not cp3.service(unit).is_running and not cp3.service(unit).is_enabled, unit
    assert not cp3.file("/var/lib/etcd").exists
    assert cp3.check_output("ls -d /var/lib/etcd.removed-*/member | wc -l") == "1"
    assert etcdctl(lab.host("cp2"), "get", KEY, "--print-value-only") == VALUE


def test_3_removing_from_a_two_member_cluster_is_refused(lab):
    pid = etcd_pid(lab, "cp2")
    for inv in (lab.inventory, lab.without_cp3):
        proc = run_installer("etcd", "member", "remove", str(inv), "cp2", "--allow-even", "--yes", check_rc=4)
        assert "cp2: not removed: etcd has only 2 members: removing cp2 would leave a single member" in proc.stderr
    assert names(members(lab)) == ["cp1", "cp2"]
    assert healthy_endpoints(lab, ["cp1", "cp2"]) == 2
    assert etcd_pid(lab, "cp2") == pid


def test_4_apply_without_cp3_restarts_no_etcd_member(lab):
    pids = {h: etcd_pid(lab, h) for h in ("cp1", "cp2")}
    report = apply_json(lab.without_cp3, lab.state)
    # the members' units now name two members, rewritten without a restart: the membership
    # change alone never restarts etcd, let alone both members at once
    assert not [r for r in report["restarts"] if r.endswith("etcd.service")], report["restarts"]
    etcd_events = {e["host"]: e for e in report["events"] if e["phase"] == "etcd" and e["action"] == "changed"}
    assert set(etcd_events) == {"cp1", "cp2"}
    assert {h: etcd_pid(lab, h) for h in ("cp1", "cp2")} == pids
    for h in ("cp1", "cp2"):
        assert "10.213.242.13" not in unit_flag(lab, h, "etcd.service", "--initial-cluster"), h
        # each apiserver uses its own host's member: the membership change is not its
        assert (unit_flag(lab, h, "kube-apiserver.service", "--etcd-servers")
                == "--etcd-servers=https://127.0.0.1:2379"), h
        assert lab.host(h).service("kube-apiserver").is_running, h
    assert names(members(lab)) == ["cp1", "cp2"]
    assert healthy_endpoints(lab, ["cp1", "cp2"]) == 2


def test_5_apply_refuses_a_control_host_without_etcd_data(lab):
    proc = run_installer("apply", str(lab.inventory), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         check_rc=4)
    assert "cp3: has no etcd data while cp1, cp2 run an etcd cluster" in proc.stderr
    assert "installer etcd member add <inventory> cp3" in proc.stderr
    cp3 = lab.host("cp3")
    assert not cp3.service("etcd").is_running and not cp3.file("/var/lib/etcd/member").exists
    assert names(members(lab)) == ["cp1", "cp2"]


def test_6_add_cp3_back_as_a_learner_then_promoted(lab):
    # --dry-run: the checks and the four steps, nothing registered
    proc = run_installer("etcd", "member", "add", str(lab.inventory), "cp3", "--state", str(lab.state),
                         "--dry-run", "--output", "json")
    doc = json.loads(proc.stdout)
    assert doc["dryRun"] is True and len(doc["steps"]) == 4, doc
    assert doc["steps"][0] == "etcdctl member add cp3 --learner --peer-urls=https://10.213.242.13:2380 (on cp1)"
    assert names(members(lab)) == ["cp1", "cp2"]

    proc = run_installer("etcd", "member", "add", str(lab.inventory), "cp3", "--state", str(lab.state),
                         "--wait-timeout", "120", timeout=900)
    assert "cp3: [1/4] etcdctl member add cp3 --learner --peer-urls=https://10.213.242.13:2380" in proc.stderr
    assert "added and promoted; 3 voting members, all healthy" in proc.stdout

    ms = members(lab)
    assert names(ms) == ["cp1", "cp2", "cp3"]
    assert [m.get("isLearner", False) for m in ms] == [False, False, False]
    cp3_id = next(m["ID"] for m in ms if m["name"] == "cp3")
    # etcd's own record: the member was a learner first, then promoted
    journal = lab.host("cp1").check_output("journalctl -u etcd --no-pager -o cat")
    entries = [json.loads(line) for line in journal.splitlines() if line.startswith("{")]
    hex_id = f"{cp3_id:x}"
    assert any(e.get("added-peer-id") == hex_id and e.get("added-peer-is-learner") is True for e in entries), journal
    assert any(e.get("promoted-member-id") == hex_id for e in entries), journal
    assert healthy_endpoints(lab, ["cp1", "cp2", "cp3"]) == 3
    assert healthy_endpoints(lab, ["cp1", "cp2", "cp3"], via="cp3") == 3

    cp3 = lab.host("cp3")
    assert etcdctl(cp3, "get", KEY, "--print-value-only") == VALUE       # written before the removal
    assert etcdctl(cp3, "put", "/hiddenplane-test/after-add", "3") == "OK"
    assert etcdctl(lab.host("cp1"), "get", "/hiddenplane-test/after-add", "--print-value-only") == "3"
    for h in ("cp1", "cp2", "cp3"):
        assert (unit_flag(lab, h, "kube-apiserver.service", "--etcd-servers")
                == "--etcd-servers=https://127.0.0.1:2379"), h
        for unit in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert lab.host(h).service(unit).is_running and lab.host(h).service(unit).is_enabled, f"{h}: {unit}"
    # the member runs as one that joined an existing cluster, not as a new cluster
    args = cp3.check_output("cat /proc/$(systemctl show -p MainPID --value etcd)/cmdline | tr '\\0' ' '")
    assert "--initial-cluster-state=existing" in args


def test_7_a_fourth_member_is_refused(lab):
    proc = run_installer("etcd", "member", "add", str(lab.with_cp4_strict), "cp4", "--state", str(lab.state),
                         check_rc=2)
    assert "4 control hosts" in proc.stderr
    proc = run_installer("etcd", "member", "add", str(lab.with_cp4), "cp4", "--state", str(lab.state), check_rc=4)
    assert "cp4: not added: the cluster would have 4 members, an even count" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert names(members(lab)) == ["cp1", "cp2", "cp3"]
    assert healthy_endpoints(lab, ["cp1", "cp2", "cp3"]) == 3


def test_8_apply_after_the_changes_restarts_nothing(lab):
    pids = {h: etcd_pid(lab, h) for h in ("cp1", "cp2", "cp3")}
    report = apply_json(lab.inventory, lab.state)
    assert report["restarts"] == [], report["restarts"]
    assert [(e["phase"], e["host"]) for e in report["events"]
            if e["action"] == "changed" and e["phase"] in ("etcd", "control-plane")] == []
    assert {h: etcd_pid(lab, h) for h in ("cp1", "cp2", "cp3")} == pids
    assert healthy_endpoints(lab, ["cp1", "cp2", "cp3"]) == 3
