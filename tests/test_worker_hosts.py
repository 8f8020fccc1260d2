"""spec.workerHosts: what the worker hosts are, for the ones that need it (the local lab's
systemd-nspawn workers on a cgroup v1 machine). Off by default, and then nothing renders
differently; on, exactly three worker files change, each restarting its own unit.

The real binaries read these renders too: kubelet and kube-proxy in tests/test_real_flags.py
(its ``container_workers`` cluster), containerd 2.x and Debian's 1.6 in tests/test_images.py.
"""

from __future__ import annotations

import copy
import difflib
import tomllib

import pytest
import yaml

from installer.core import components, inventory
from installer.core.diff import diff
from installer.core.errors import InventoryError
from installer.core.facts import FileFact
from installer.core.facts import HostFacts as Facts
from installer.core.render.plan import render_cluster
from installer.core.render.worker import CONNTRACK_IN_CONTAINER
from installer.engine.parts import worker_part

from .reference import REFDATA
from .standins.runtime import flatten

KUBELET = "/var/lib/kubelet/config.yaml"
PROXY = "/var/lib/kube-proxy/config.yaml"
CONTAINERD = "/etc/containerd/config.toml"
# the lines each field adds, and to which file (none when false)
ADDED = {
    "cgroupV1": {KUBELET: ["failCgroupV1: false"]},
    "evictionHard": {KUBELET: ["evictionHard:"]},
    "inContainer": {PROXY: ["conntrack:", "  maxPerCore: 0", "  tcpEstablishedTimeout: 0s",
                            "  tcpCloseWaitTimeout: 0s"],
                    CONTAINERD: ["restrict_oom_score_adj = true"]},
}
CONTAINERD_1X = {"versions": {"containerd": "1.6.20"}}


def plans_for(prepared, example_doc, tmp_path, workers: dict | None, artifacts: dict | None = None):
    doc = copy.deepcopy(example_doc)
    if workers is not None:
        doc["spec"]["workerHosts"] = workers
    if artifacts is not None:
        doc["spec"]["artifacts"] = artifacts
    inv = inventory.parse(doc, "test", base_dir=tmp_path)
    return render_cluster(inv, prepared.material)


def content(plans, host: str, path: str) -> str:
    return plans[host].files[path].content.decode()


def every_file(plans) -> dict[tuple[str, str], tuple[bytes, int, tuple]]:
    return {(h, p): (f.content, f.mode, f.restarts) for h, plan in plans.items() for p, f in plan.files.items()}


# --- the inventory ---------------------------------------------------------------------------

def test_the_defaults_are_false_and_described_as_not_defaults(prepared):
    assert prepared.inventory.spec.workerHosts.model_dump() == {"cgroupV1": False, "inContainer": False,
                                                                "evictionHard": {}}
    schema = inventory.json_schema()
    spec = schema["$defs"]["WorkerHostsSpec"]
    assert spec["additionalProperties"] is False
    for name in ("cgroupV1", "inContainer"):
        field = spec["properties"][name]
        assert (field["type"], field["default"]) == ("boolean", False)
        assert "not a default" in field["description"] and "nspawn" in field["description"]
    assert "deprecated upstream" in spec["properties"]["cgroupV1"]["description"]
    assert "workerHosts" in schema["$defs"]["ClusterSpec"]["properties"]


@pytest.mark.parametrize("workers,expected", [
    ({"cgroupv1": True}, "spec.workerHosts.cgroupv1: unknown field"),
    ({"inContainer": True, "oomScoreAdj": 0}, "spec.workerHosts.oomScoreAdj: unknown field"),
    ({"cgroupV1": 1}, "spec.workerHosts.cgroupV1: 1 is not true or false"),
    ({"inContainer": 0}, "spec.workerHosts.inContainer: 0 is not true or false"),
    ({"cgroupV1": "yes"}, "spec.workerHosts.cgroupV1: 'yes': Input should be a valid boolean"),
    ({"inContainer": "true"}, "spec.workerHosts.inContainer: 'true': Input should be a valid boolean"),
    ({"inContainer": None}, "spec.workerHosts.inContainer: None: Input should be a valid boolean"),
    ("nspawn", "spec.workerHosts: 'nspawn': Input should be a valid dictionary…"),
    # what the kubelet refuses at start (k8s.io/kubernetes pkg/kubelet/eviction), or would read
    # otherwise than written ("5%%": it trims every %), is refused here before any kubelet reads it
    ({"evictionHard": {"nodefs.available": "0Gi"}}, "spec.workerHosts.evictionHard.'nodefs.available': '0Gi': …"),
    ({"evictionHard": {"nodefs.available": "101%"}}, "spec.workerHosts.evictionHard.'nodefs.available': '101%': …"),
    ({"evictionHard": {"imagefs.available": "5%%"}}, "spec.workerHosts.evictionHard.'imagefs.available': '5%%': …"),
    ({"evictionHard": {"memory.available": "-1Gi"}}, "spec.workerHosts.evictionHard.'memory.available': '-1Gi': …"),
    ({"evictionHard": {"memory.available": "1e9"}}, "spec.workerHosts.evictionHard.'memory.available': '1e9': …"),
    ({"evictionHard": {"nodefs.available": 2}}, "spec.workerHosts.evictionHard.'nodefs.available': 2: …"),
    ({"evictionHard": {"disk.available": "1Gi"}}, "spec.workerHosts.evictionHard.'disk.available'.'[key]': …"),
])
def test_a_wrong_value_is_refused_with_its_path(example_doc, workers, expected):
    doc = copy.deepcopy(example_doc)
    doc["spec"]["workerHosts"] = workers
    with pytest.raises(InventoryError) as err:
        inventory.parse(doc, "test")
    problems = err.value.problems
    if expected.endswith("…"):
        assert any(p.startswith(expected[:-1]) for p in problems), problems
    else:
        assert expected in problems, problems


# --- rendering -------------------------------------------------------------------------------

@pytest.mark.parametrize("artifacts", [None, CONTAINERD_1X], ids=["containerd-2", "containerd-1"])
def test_false_renders_exactly_what_no_section_renders(prepared, example_doc, tmp_path, artifacts):
    absent = plans_for(prepared, example_doc, tmp_path, None, artifacts)
    false = plans_for(prepared, example_doc, tmp_path, {"cgroupV1": False, "inContainer": False}, artifacts)
    assert every_file(false) == every_file(absent)
    if artifacts is None:        # the example itself, as the session renders it everywhere else
        assert every_file(absent) == every_file(prepared.plans)
    for plan in absent.values():
        for f in plan.files.values():
            text = f.content.decode(errors="replace")
            assert not any(w in text for w in ("failCgroupV1", "conntrack:", "restrict_oom_score_adj")), f.path


@pytest.mark.parametrize("artifacts", [None, CONTAINERD_1X], ids=["containerd-2", "containerd-1"])
@pytest.mark.parametrize("field", ["cgroupV1", "inContainer"])
def test_true_adds_only_its_lines_to_its_files_on_every_worker(prepared, example_doc, tmp_path, field, artifacts):
    off = plans_for(prepared, example_doc, tmp_path, None, artifacts)
    on = plans_for(prepared, example_doc, tmp_path, {field: True}, artifacts)
    before, after = every_file(off), every_file(on)
    changed = {key for key in before if before[key] != after[key]}
    workers = [h for h, p in on.items() if p.role == "worker"]
    assert len(workers) == 2
    assert changed == {(h, path) for h in workers for path in ADDED[field]}       # cluster-wide, workers only
    for host, path in changed:
        old, new = before[(host, path)][0].decode().splitlines(), after[(host, path)][0].decode().splitlines()
        ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        # false == true without the inserted lines: nothing else moved or changed
        assert {op for op, *_ in ops} == {"equal", "insert"}, (path, ops)
        added = [ln.strip() for op, _, _, j1, j2 in ops if op == "insert" for ln in new[j1:j2]]
        for line in ADDED[field][path]:
            assert line.strip() in added, (path, line, added)
        assert before[(host, path)][1:] == after[(host, path)][1:]      # mode and restarts unchanged


def test_eviction_hard_renders_every_kubelet_default_with_the_inventorys_over_them(prepared, example_doc, tmp_path):
    """A KubeletConfiguration naming some signals turns the others off (the kubelet's
    mergeDefaultEvictionSettings is false by default): memory pressure would then evict nothing.
    The rendered map is every default with the inventory's over them, on every worker only."""
    lab = {"nodefs.available": "2Gi", "imagefs.available": "2Gi"}
    plans = plans_for(prepared, example_doc, tmp_path, {"evictionHard": lab})
    for host in ("node2", "node3"):
        on, off = (yaml.safe_load(content(p, host, KUBELET)) for p in (plans, prepared.plans))
        assert on.pop("evictionHard") == {"memory.available": "100Mi", "nodefs.available": "2Gi",
                                          "nodefs.inodesFree": "5%", "imagefs.available": "2Gi",
                                          "imagefs.inodesFree": "5%"}
        assert on == off
    assert every_file(plans_for(prepared, example_doc, tmp_path, {"evictionHard": {}})) == every_file(prepared.plans)
    for value in ("0%", "100%", "12.5%", "512Mi", "100000"):          # what the kubelet reads as written
        inventory.parse({**example_doc, "spec": {**example_doc["spec"],
                                                 "workerHosts": {"evictionHard": {"nodefs.inodesFree": value}}}}, "t")


def test_cgroup_v1_sets_fail_cgroup_v1_false(prepared, example_doc, tmp_path):
    plans = plans_for(prepared, example_doc, tmp_path, {"cgroupV1": True})
    on, off = (yaml.safe_load(content(p, "node2", KUBELET)) for p in (plans, prepared.plans))
    assert on.pop("failCgroupV1") is False
    assert on == off


def test_in_container_sets_kube_proxy_conntrack_and_containerd_oom(prepared, example_doc, tmp_path):
    plans = plans_for(prepared, example_doc, tmp_path, {"inContainer": True})
    proxy = yaml.safe_load(content(plans, "node3", PROXY))
    assert proxy.pop("conntrack") == {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    assert proxy == yaml.safe_load(content(prepared.plans, "node3", PROXY))

    # config version 3 (containerd 2.x): the CRI runtime plugin's own table
    v3 = tomllib.loads(content(plans, "node3", CONTAINERD))
    assert v3["version"] == 3
    runtime = v3["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True      # still there
    assert v3 == merged(tomllib.loads(content(prepared.plans, "node3", CONTAINERD)),
                        {"plugins": {"io.containerd.cri.v1.runtime": {"restrict_oom_score_adj": True}}})

    # config version 2 (containerd 1.x): the one CRI plugin table, beside sandbox_image
    off1 = plans_for(prepared, example_doc, tmp_path, None, CONTAINERD_1X)
    on1 = plans_for(prepared, example_doc, tmp_path, {"inContainer": True}, CONTAINERD_1X)
    v2 = tomllib.loads(content(on1, "node3", CONTAINERD))
    assert v2["version"] == 2
    assert v2["plugins"]["io.containerd.grpc.v1.cri"]["restrict_oom_score_adj"] is True
    assert v2 == merged(tomllib.loads(content(off1, "node3", CONTAINERD)),
                        {"plugins": {"io.containerd.grpc.v1.cri": {"restrict_oom_score_adj": True}}})


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def test_the_rendered_field_names_are_the_go_types(prepared, example_doc, tmp_path):
    """Every key of the two configs with both fields on is a field of the Go types (tests/refdata,
    generated from the built binaries); the real binaries decode them in test_real_flags."""
    plans = plans_for(prepared, example_doc, tmp_path, {"cgroupV1": True, "inContainer": True,
                                                        "evictionHard": {"nodefs.available": "2Gi"}})
    for path, kind in ((KUBELET, "KubeletConfiguration"), (PROXY, "KubeProxyConfiguration")):
        listed = {ln.strip() for ln in (REFDATA / "config" / f"{kind}.txt").read_text().splitlines()
                  if ln.strip() and not ln.startswith("#")}
        # evictionHard is a Go map (signal -> threshold), not a struct: its keys are no fields
        rendered = flatten(yaml.safe_load(content(plans, "node2", path)), opaque={"evictionHard"})
        assert rendered <= listed, sorted(rendered - listed)
    assert {"failCgroupV1", "evictionHard", "conntrack.maxPerCore", "conntrack.tcpEstablishedTimeout",
            "conntrack.tcpCloseWaitTimeout"} <= set().union(
        *(flatten(yaml.safe_load(content(plans, "node2", p))) for p in (KUBELET, PROXY)))
    assert set(CONNTRACK_IN_CONTAINER) == {"maxPerCore", "tcpEstablishedTimeout", "tcpCloseWaitTimeout"}


# --- a running cluster -------------------------------------------------------------------------

def converged(plan) -> Facts:
    """A worker holding exactly ``plan``'s files (written by the installer), every unit active."""
    return Facts(files={p: FileFact(f.sha256, f.mode, f.owner, f.group, ours=True) for p, f in plan.files.items()},
                 units={u: ("active", "enabled") for u in plan.units})


@pytest.mark.parametrize("workers,restarted", [
    ({"cgroupV1": True}, ["kubelet"]),
    ({"inContainer": True}, ["containerd", "kube-proxy"]),
    ({"cgroupV1": True, "inContainer": True}, ["containerd", "kubelet", "kube-proxy"]),
    ({"evictionHard": {"nodefs.available": "2Gi"}}, ["kubelet"]),
])
def test_turning_a_field_on_or_off_restarts_what_reads_it(prepared, example_doc, tmp_path, workers, restarted):
    on = plans_for(prepared, example_doc, tmp_path, workers)
    units = list(components.units(*restarted))
    for old, new in ((prepared.plans, on), (on, prepared.plans)):
        for host in ("node2", "node3"):
            ch = diff(host, worker_part(new[host]), converged(old[host]))
            assert sorted(f.path for f in ch.write) == sorted(
                p for f in workers for p in ADDED[f]), host
            assert sorted(ch.restart) == sorted(units) and not ch.start and not ch.defer, host
    assert not diff("node2", worker_part(on["node2"]), converged(on["node2"])).restart
