"""`installer upgrade` on real clusters, the components built from their Go modules
(tests/builtfixtures.py) at the default version (v1.36.5) and at ``UPGRADE_TO`` (v1.37.2).

One lab, 3 control hosts and 2 workers (balanced), started one etcd patch behind the default
(``ETCD_FROM``), runs a Deployment of two replicas (one per worker) behind a NodePort Service,
guarded by a PodDisruptionBudget, probed from cp1 every 200 ms alternately through each worker's
NodePort; each worker probes the API through its balancer and the kubernetes Service every
250 ms. The tests run in order on it:

- an etcd patch rolled over the three members, an API probe from the test machine besides
  (each member's apiserver steps aside while the member restarts);
- then a Kubernetes minor upgrade: the plan and the refusals first, then the upgrade, killed
  (SIGKILL) during the worker step and run again to the end, then what must hold afterwards.

No probe may fail, the workload's included: its replicas stop as a drain-safe workload does
(realcluster.echo_workload's preStop). (The etcd roll had a 3+1 lab of its own until
2026-12-06: one lab boot and apply less in CI.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import yaml

from installer.core.upgrade_rules import RULES
from installer.lab import lab as lab_mod

from . import hostprobes, quiet
from .builtfixtures import UPGRADE_TO, upgrade_artifacts_dir
from .labfixtures import start_lab, wait_for
from .realcluster import ECHO_TIMEOUT, INSTALLER, WAIT, RealCluster, echo_workload, run_installer

pytestmark = [pytest.mark.lab, pytest.mark.real]

NAME, SUBNET = "upg", "10.213.233.0/24"
FROM = "v1.36.5"
NODE_PORT = 30080

PROBER = r'''
import json, sys, time, urllib.request
targets, out = sys.argv[2:], sys.argv[1]
ok = {t: 0 for t in targets}; bad = {t: 0 for t in targets}; fails = []
i = 0
while True:
    t = targets[i % len(targets)]; i += 1
    try:
        urllib.request.urlopen(f"http://{t}/", timeout=ECHO_TIMEOUT).read(); ok[t] += 1
    except Exception as e:
        bad[t] += 1; fails.append(f"{time.strftime('%H:%M:%S')} {t} {type(e).__name__}: {e}"[:200])
    with open(out + ".tmp", "w") as f:
        json.dump({"ok": ok, "failed": bad, "failures": fails[-50:]}, f)
    import os; os.replace(out + ".tmp", out)
    time.sleep(0.2)
'''.replace("ECHO_TIMEOUT", str(ECHO_TIMEOUT))


@pytest.fixture(scope="module")
def up(tmp_path_factory, built_artifacts, kubectl):
    from .builtfixtures import ETCD_FROM, with_etcd
    target_artifacts = upgrade_artifacts_dir()
    tmp = tmp_path_factory.mktemp("upg")
    lab = start_lab(NAME, SUBNET, tmp, controls=3, workers=2, images=True,
                    artifacts=with_etcd(built_artifacts, ETCD_FROM))
    try:
        inventory, state = tmp / "upg.inventory.yaml", tmp / "state"
        doc = yaml.safe_load(lab.inventory.read_text())
        assert doc["spec"]["kubernetes"]["version"] == FROM
        default_etcd = doc["spec"].get("artifacts", {}).get("versions", {}).get("etcd")
        doc["spec"]["artifacts"].setdefault("versions", {})["etcd"] = ETCD_FROM
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        # the operator's first edit (test_0): the default etcd, from the default build
        doc["spec"]["artifacts"]["versions"]["etcd"] = default_etcd or "v3.6.16"
        doc["spec"]["artifacts"]["path"] = str(built_artifacts)
        (tmp / "etcd.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        # and the second (test_1 on): the new version, and where its binaries are
        doc["spec"]["kubernetes"]["version"] = UPGRADE_TO
        doc["spec"]["artifacts"]["path"] = str(target_artifacts)
        (tmp / "target.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        proc = run_installer("apply", str(inventory), "--state", str(state), "--output", "json", "--wait-timeout", WAIT)
        kubeconfig = tmp / "admin.kubeconfig"
        run_installer("kubeconfig", str(inventory), "--state", str(state), "-o", str(kubeconfig))
        rc = RealCluster(lab, inventory, state, kubeconfig, kubectl, json.loads(proc.stdout), 0.0)
        for obj in echo_workload(NODE_PORT):
            rc.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
        wait_for("both echo replicas ready", lambda: rc.get("deployment", "echo")["status"].get("readyReplicas") == 2,
                 timeout=600)
        targets = [f"{rc.address(w)}:{NODE_PORT}" for w in rc.workers]
        subprocess.run(["ssh", "-F", str(lab.ssh_config), "cp1", "cat > /root/prober.py"], input=PROBER, text=True,
                       check=True, timeout=60)
        rc.ssh("cp1", "systemctl stop hp-prober 2>/dev/null; systemctl reset-failed hp-prober 2>/dev/null; "
                      f"systemd-run --unit=hp-prober /usr/bin/python3 /root/prober.py /root/probe.json "
                      f"{' '.join(targets)}")
        wait_for("the prober answered", lambda: sum(probes(rc)["ok"].values()) >= 10, timeout=120)
        # and on each worker what its kubelet and its pods see of the API (its balancer, the
        # kubernetes Service) while the apiservers restart
        for w in rc.workers:
            for name, url in hostprobes.api(w):
                hostprobes.start(lab.ssh_config, w, f"hp-probe-{name}", url)
        rc.etcd_target, rc.target = tmp / "etcd.yaml", tmp / "target.yaml"
        yield rc
    finally:
        lab_mod.down(NAME, log=lambda *_: None)


def probes(rc: RealCluster) -> dict:
    out = rc.ssh("cp1", "cat /root/probe.json 2>/dev/null").stdout
    return json.loads(out) if out.strip() else {"ok": {}, "failed": {}, "failures": []}


def versions_on_hosts(rc: RealCluster) -> dict[str, str]:
    out = {}
    for host, binary in (("cp1", "kube-apiserver"), *((w, "kubelet") for w in rc.workers)):
        out[host] = rc.ssh(host, f"/usr/local/bin/{binary} --version").stdout.strip()
    return out


# --- an etcd patch rolled on three members while the API keeps answering ---------------------------

class ApiProber:
    """From the test machine, every 200 ms: GET /readyz of the first apiserver that answers, in
    control-host order (admin client certificate from the state). Counts the ticks at which none
    answered, and each apiserver's refusals."""

    def __init__(self, addresses: list[str], state):
        import ssl
        import threading
        self.ctx = ssl.create_default_context(cafile=str(state / "pki" / "ca.crt"))
        self.ctx.load_cert_chain(str(state / "pki" / "admin.crt"), str(state / "pki" / "admin.key"))
        self.addresses, self.ticks, self.down, self.refused = addresses, 0, [], {a: 0 for a in addresses}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import urllib.request
        while not self.stop.wait(0.2):
            self.ticks += 1
            for a in self.addresses:
                try:
                    urllib.request.urlopen(f"https://{a}:6443/readyz", context=self.ctx, timeout=1).read()
                    break
                except Exception:          # noqa: BLE001 - any failure of one apiserver counts the same
                    self.refused[a] += 1
            else:
                self.down.append(time.strftime("%H:%M:%S"))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.quiet(NAME)
def test_0_an_etcd_patch_is_rolled_one_member_at_a_time_and_the_api_keeps_answering(up):
    from .builtfixtures import ETCD_FROM
    target, state = up.etcd_target, up.state
    to_etcd = yaml.safe_load(target.read_text())["spec"]["artifacts"]["versions"]["etcd"]
    controls = [h for h in up.lab.spec.hosts if h.role == "control"]

    def etcd_versions() -> list[str]:
        return [up.ssh(h.name, "/usr/local/bin/etcd --version").stdout.split("\n")[0] for h in controls]
    assert etcd_versions() == [f"etcd Version: {ETCD_FROM.lstrip('v')}"] * 3

    plan = json.loads(run_installer("upgrade", str(target), "--state", str(state), "--plan", "--output",
                                    "json").stdout)
    print("\n" + "\n".join(plan["steps"]))
    assert plan["kind"] == "none" and [s.split(":")[0] for s in plan["steps"][1:4]] == ["cp1", "cp2", "cp3"]
    assert all(f"etcd {ETCD_FROM} -> {to_etcd}, this member alone" in s for s in plan["steps"][1:4])

    prober = ApiProber([h.address for h in controls], state)
    try:
        time.sleep(2)
        began = time.time()
        done = json.loads(run_installer("upgrade", str(target), "--state", str(state), "--output", "json",
                                        "--wait-timeout", WAIT).stdout)
        time.sleep(2)
    finally:
        prober.finish()
    for t in done["timings"]:
        print(f"{t['seconds']:7.1f} s  {t['step'][:100]}")
    print(f"API probes: {prober.ticks} ticks, none answering at {len(prober.down)} {prober.down[:10]}; "
          f"refusals per apiserver {prober.refused}")
    assert prober.ticks > 50 and prober.down == []
    # each member's own apiserver stepped aside while it restarted (host/handover.py): the
    # workers saw no failure through their balancers or the Service (the fixture's probes, read
    # from the roll's start and started again for the minor upgrade's tests)
    failed = {}
    for w in up.workers:
        for name, url in hostprobes.api(w):
            rows = hostprobes.rows(up.lab.ssh_config, w, f"hp-probe-{name}", since=began)
            print(f"{w} API probe {name}: requests / failed / longest (s) {hostprobes.summary(rows)}")
            assert len(rows) > 50, (w, name)
            failed[f"{w} {name}"] = hostprobes.failed(rows)[:5]
            hostprobes.start(up.lab.ssh_config, w, f"hp-probe-{name}", url)
    assert not any(failed.values()), failed
    # each apiserver stopped once for its member, its watches ended, not held to its deadline
    stops = {h.name: hostprobes.apiserver_stops(up.lab.ssh_config, h.name, began) for h in controls}
    print(f"kube-apiserver stops (seconds, held to the deadline): {stops}")
    assert all(len(s) == 1 and not s[0].deadline for s in stops.values()), stops
    assert etcd_versions() == [f"etcd Version: {to_etcd.lstrip('v')}"] * 3
    health = up.ssh("cp1", "ETCDCTL_API=3 /usr/local/bin/etcdctl --endpoints=" + ",".join(
        f"https://{h.address}:2379" for h in controls)
        + " --cacert=/etc/kubernetes/pki/etcd/ca.crt --cert=/etc/kubernetes/pki/etcd/healthcheck-client.crt"
        " --key=/etc/kubernetes/pki/etcd/healthcheck-client.key endpoint health -w json")
    assert [e["health"] for e in json.loads(health.stdout)] == [True] * 3, health.stdout + health.stderr
    again = json.loads(run_installer("upgrade", str(target), "--state", str(state), "--output", "json").stdout)
    assert len(again["steps"]) == 1, again["steps"]
    # the edit is the operator's inventory from now on
    up.inventory.write_text(target.read_text())


# --- a Kubernetes minor upgrade on three control hosts and two workers ------------------------------

def test_1_plan_shows_the_order_and_apply_refuses_the_new_version(up):
    before = versions_on_hosts(up)
    assert set(before.values()) == {f"Kubernetes {FROM}"}, before
    doc = json.loads(run_installer("upgrade", str(up.target), "--state", str(up.state), "--plan",
                                   "--output", "json").stdout)
    print("\n" + "\n".join(doc["checks"] + doc["steps"]))
    assert (doc["from"], doc["to"], doc["kind"], doc["dryRun"]) == (FROM, UPGRADE_TO, "minor", True)
    steps = doc["steps"]
    assert steps[0].startswith("save an etcd snapshot")
    # the control hosts one at a time, then the workers
    assert [s.split(":")[0] for s in steps[1:7]] == ["cp1", "cp2", "cp3", steps[4].split(":")[0], "w1", "w2"], steps
    assert steps[4].startswith("wait until a restarted kube-controller-manager and kube-scheduler lead")
    assert "cordon, drain" in steps[5] and steps[-1].startswith(f"converge every host at {UPGRADE_TO}")
    assert any("Nodes: 2/2 Ready" in c for c in doc["checks"]), doc["checks"]
    # apply would restart everything at once: refused, pointing to upgrade
    proc = run_installer("apply", str(up.target), "--state", str(up.state), check_rc=2)
    assert f"kubernetes {FROM} -> {UPGRADE_TO}" in proc.stderr and "installer upgrade" in proc.stderr
    assert versions_on_hosts(up) == before


def test_2_a_not_ready_node_refuses_the_upgrade(up):
    up.ssh("w2", "systemctl stop kubelet")
    try:
        wait_for("w2 NotReady", lambda: not any(
            c["type"] == "Ready" and c["status"] == "True" for c in up.get("node", "w2")["status"]["conditions"]),
            timeout=300)
        proc = run_installer("upgrade", str(up.target), "--state", str(up.state), check_rc=4)
        assert "w2: NotReady" in proc.stderr and "--force" in proc.stderr and "nothing was changed" in proc.stderr
    finally:
        up.ssh("w2", "systemctl start kubelet")
    wait_for("w2 Ready again", lambda: any(
        c["type"] == "Ready" and c["status"] == "True" for c in up.get("node", "w2")["status"]["conditions"]),
        timeout=300)
    assert versions_on_hosts(up)["cp1"] == f"Kubernetes {FROM}"


@pytest.mark.quiet(NAME)
def test_3_killed_in_the_worker_step_then_run_again_it_finishes_and_the_workload_kept_answering(up):
    start = time.monotonic()
    proc = subprocess.Popen([INSTALLER, "upgrade", str(up.target), "--state", str(up.state), "--wait-timeout", WAIT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("upgrade: [") and "] w1: cordon, drain" in line:
            break
    time.sleep(8)                                       # in the middle of w1's turn
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print("\nkilled after:\n" + "".join(seen[-6:]))
    assert any("] w1: cordon, drain" in line for line in seen), "".join(seen)
    # the plan says where it stopped: w1 was cordoned by the upgrade, and is still to do or to uncordon
    plan = json.loads(run_installer("upgrade", str(up.target), "--state", str(up.state), "--plan",
                                    "--output", "json").stdout)
    print("\n".join(plan["steps"]))
    assert (up.state / "upgrade.yaml").is_file() and "w1" in (up.state / "upgrade.yaml").read_text()
    assert any(s.startswith("w1") or "uncordon w1" in s for s in plan["steps"]), plan["steps"]

    done = json.loads(run_installer("upgrade", str(up.target), "--state", str(up.state), "--output", "json",
                                    "--wait-timeout", WAIT, timeout=3600).stdout)
    seconds = time.monotonic() - start
    for t in done["timings"]:
        print(f"{t['seconds']:7.1f} s  {t['step']}")
    print(f"upgrade {FROM} -> {UPGRADE_TO}: {seconds:.0f} s in all (killed once)")
    time.sleep(3)
    seen = probes(up)
    up.ssh("cp1", "systemctl stop hp-prober")
    print(f"probes: ok {seen['ok']}, failed {seen['failed']}")
    print("\n".join(seen["failures"]))
    assert sum(seen["ok"].values()) > 100
    assert not sum(seen["failed"].values()), seen
    failed = {}
    for w in up.workers:
        for name, _ in hostprobes.api(w):
            rows = hostprobes.rows(up.lab.ssh_config, w, f"hp-probe-{name}")
            print(f"{w} API probe {name}: requests / failed / longest (s) {hostprobes.summary(rows)}")
            # judged inside this lab's quiet windows (the etcd roll's and this test's): between
            # them the other process's window may hold the CPU (tests/quiet.py; CI of 01c2172:
            # 3 reads failed while the real lab's upgrade held it, during test_2, which breaks
            # nothing that they read). Outside them, printed only
            outside = [r for r in hostprobes.failed(rows) if not quiet.within(NAME, r.start)]
            if outside:
                print(f"  outside the quiet windows, not judged: {outside[:5]}")
            failed[f"{w} {name}"] = [r for r in hostprobes.failed(rows) if quiet.within(NAME, r.start)][:5]
            assert len([r for r in rows if quiet.within(NAME, r.start)]) > 100, (w, name, quiet.HELD)
    assert not any(failed.values()), failed
    assert not (up.state / "upgrade.yaml").exists()
    assert done["snapshot"] is None or done["snapshot"].endswith("etcd.db")
    assert list(up.state.glob("backups/upgrade-*/etcd.db")), "the first run's snapshot is kept"


def test_4_every_component_reports_the_new_version(up):
    assert set(versions_on_hosts(up).values()) == {f"Kubernetes {UPGRADE_TO}"}
    server = json.loads(up.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert server == UPGRADE_TO
    nodes = up.get("nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == up.workers
    for n in nodes:
        assert n["status"]["nodeInfo"]["kubeletVersion"] == UPGRADE_TO
        assert n["status"]["nodeInfo"]["kubeProxyVersion"] in ("", UPGRADE_TO)
        assert not n["spec"].get("unschedulable"), n["metadata"]["name"]
    assert up.get("deployment", "echo")["status"].get("readyReplicas") == 2


def test_5_a_second_upgrade_and_apply_change_nothing(up):
    again = json.loads(run_installer("upgrade", str(up.target), "--state", str(up.state), "--output", "json",
                                     "--wait-timeout", WAIT).stdout)
    assert again["kind"] == "none" and len(again["steps"]) == 1, again
    report = json.loads(run_installer("apply", str(up.target), "--state", str(up.state), "--output", "json",
                                      "--wait-timeout", WAIT).stdout)
    assert report["changes"] == 0 and report["restarts"] == [], report


def test_6_going_down_a_minor_is_refused_with_the_rule(up):
    proc = run_installer("upgrade", str(up.target), "--state", str(up.state), "--to", FROM, check_rc=4)
    assert RULES["minor-down"] in proc.stderr and "nothing was changed" in proc.stderr
    # the old inventory is refused by apply as well
    proc = run_installer("apply", str(up.inventory), "--state", str(up.state), check_rc=2)
    assert f"kubernetes {UPGRADE_TO} -> {FROM}" in proc.stderr
