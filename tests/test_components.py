"""The component table (installer/core/components.py) is the one place a component's identity
lives: the renderers, preflight, fetch, select and rollout agree with it."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from installer import api
from installer.actions import rollout, teardown
from installer.core import components
from installer.core.artifacts import CONTROL_BINARIES, WORKER_BINARIES
from installer.core.components import COMPONENTS, HELPER_BINARIES
from installer.engine.phases import run_preflight
from installer.host import fetch, waits
from tests.conftest import write_inventory


@pytest.fixture(scope="module")
def konnectivity(tmp_path_factory, example_doc):
    d = copy.deepcopy(example_doc)
    d["spec"]["network"].update({"egress": "konnectivity"})
    tmp = tmp_path_factory.mktemp("components-k")
    return api.prepare(write_inventory(tmp, d), tmp / "state")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory, example_doc):
    d = copy.deepcopy(example_doc)
    d["spec"].setdefault("apiServer", {}).update({"balancer": "local"})
    tmp = tmp_path_factory.mktemp("components-b")
    return api.prepare(write_inventory(tmp, d), tmp / "state")


def test_rows_are_unique():
    names = [c.name for c in COMPONENTS]
    units = [c.unit for c in COMPONENTS]
    binaries = [b for c in COMPONENTS for b in c.binaries]
    assert len(set(names)) == len(names) == 11
    assert len(set(units)) == len(units)
    assert len(set(binaries)) == len(binaries)
    assert all(c.unit.endswith(".service") and c.role in ("control", "worker", "any") for c in COMPONENTS
               if c.name != "hiddenplane-routes-repair")
    # the one timer: it runs the routes' repair (core/render/network.py), on both kinds of host
    assert components.unit("hiddenplane-routes-repair") == "hiddenplane-routes-repair.timer"
    assert components.by_name("hiddenplane-routes-repair").role == "any"
    assert not set(binaries) & set(HELPER_BINARIES)
    assert all(owner in names for owner in HELPER_BINARIES.values())


def test_every_planned_unit_belongs_to_exactly_one_row(prepared, konnectivity, balanced):
    seen = set()
    for p in (prepared, konnectivity, balanced):
        for plan in p.plans.values():
            for unit in plan.units:
                rows = [c for c in COMPONENTS if c.unit == unit]
                assert len(rows) == 1, unit
                assert rows[0].role in (plan.role, "any"), (plan.role, unit)
                seen.add(unit)
            for f in plan.files.values():
                for unit in f.restarts:
                    assert components.by_unit(unit) is not None, (f.path, unit)
    # and every row is planned by some cluster: the table has no dead rows
    assert seen == {c.unit for c in COMPONENTS}


def test_every_shipped_binary_is_a_component_or_a_declared_helper():
    for b in CONTROL_BINARIES + WORKER_BINARIES:
        owners = [c for c in COMPONENTS if b in c.binaries]
        assert len(owners) == 1 or b in HELPER_BINARIES, b
    role_of = {**{b: "control" for b in CONTROL_BINARIES}, **{b: "worker" for b in WORKER_BINARIES}}
    for c in COMPONENTS:
        for b in c.binaries:
            if b in role_of:
                assert role_of[b] == c.role, (c.name, b)


def test_ranks_are_the_order_rollout_needs():
    rank = {c.name: c.rank for c in COMPONENTS}
    # etcd first, then the apiserver, then what talks to it; workers last; routes/containerd unranked
    assert rank["etcd"] < rank["kube-apiserver"] < rank["konnectivity-server"] < rank["kube-controller-manager"]
    assert rank["kube-controller-manager"] == rank["kube-scheduler"] < rank["kubelet"] == rank["kube-proxy"]
    assert rank["containerd"] is None and rank["hiddenplane-routes"] is None
    assert rank["hiddenplane-routes-repair"] is None
    # a worker's balancer reloads (a new CA) before the kubelet and kube-proxy restart through it
    assert rank["api-balancer"] < rank["kubelet"]
    assert components.rank("no-such.service") == components.LAST_RANK > max(r for r in rank.values() if r is not None)
    assert rollout.RANK == components.ranks()
    assert rollout.restart_order(["kube-proxy.service", "etcd.service", "kube-scheduler.service",
                                  "kube-apiserver.service"]) == ["etcd.service", "kube-apiserver.service",
                                                                  "kube-scheduler.service", "kube-proxy.service"]


def test_preflight_ports_derive_from_the_rows():
    for role in ("control", "worker"):
        want = {p.number: c.unit for c in COMPONENTS if c.role == role for p in c.ports if p.preflight}
        assert run_preflight.PORTS[role] == want
    assert run_preflight.PORTS["control"] == {2379: "etcd.service", 2380: "etcd.service",
                                              6443: "kube-apiserver.service",
                                              10257: "kube-controller-manager.service",
                                              10259: "kube-scheduler.service"}
    assert run_preflight.PORTS["worker"] == {10248: "kubelet.service", 10250: "kubelet.service",
                                             10249: "kube-proxy.service", 10256: "kube-proxy.service"}
    # konnectivity is an addon: its ports are not refused before it is chosen
    assert not set(components.ports("konnectivity-server")) & set(run_preflight.PORTS["control"])
    assert components.LOCAL_CONTROL_PORTS == (10257, 10259)
    assert {u: waits.secure_ports(u) for u in ("kube-controller-manager.service", "kube-scheduler.service",
                                               "kubelet.service")} == {
        "kube-controller-manager.service": (10257,), "kube-scheduler.service": (10259,), "kubelet.service": (10250,)}


def test_every_row_names_a_wait_that_is_done(prepared):
    """Each component says what "started" means (components.WAITS), and host/waits.py does
    each kind: a shell wait, or the apiserver's TLS check."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(inv=prepared.inventory, options=SimpleNamespace(wait_timeout=60))
    for c in COMPONENTS:
        assert c.wait in components.WAITS, c.name
        if c.wait in waits._NOT_SHELL:
            assert waits.script(ctx, c.unit) is None
            continue
        script = waits.script(ctx, c.unit)
        assert script and script.startswith("(") or "etcdctl" in script, (c.name, script)
        if c.wait in ("active", "listening"):
            assert script.startswith(f"(set -- 60 {c.unit}\n# Until every unit given is active"), c.name
        if c.wait == "listening":
            ports = " ".join(str(p) for p in waits.secure_ports(c.unit))
            assert ports and f"(set -- 60 {ports} -- {c.unit}\n# Until something listens" in script, c.name
    assert {c.wait for c in COMPONENTS} == set(components.WAITS)      # no kind unused


def test_the_consumers_read_the_table():
    assert fetch.RESTARTS == components.restarts()
    assert fetch.RESTARTS["etcd"] == "etcd.service" and "etcdctl" not in fetch.RESTARTS
    assert components.CONTROL_UNITS == tuple(c.unit for c in components.by_role("control")
                                         if c.name.startswith("kube-"))
    assert components.WORKER_UNITS == tuple(c.unit for c in COMPONENTS if c.role == "worker" and not c.addon)
    assert components.BALANCER_UNIT == components.unit("api-balancer")
    assert fetch.BALANCER_BINARIES == ("haproxy", "socat") and fetch.RESTARTS["haproxy"] == components.BALANCER_UNIT
    assert "socat" not in fetch.RESTARTS       # the runtime API's client: a new one restarts nothing


def test_only_the_balancer_reloads():
    # a new haproxy binary or config is a reload (haproxy -Ws re-executes itself, connections kept)
    assert [c.name for c in COMPONENTS if c.reload] == ["api-balancer"]
    assert components.reloads("hiddenplane-api-balancer.service")
    assert not components.reloads("kubelet.service") and not components.reloads("nope.service")
    assert (teardown.KUBELET_UNIT, teardown.KUBE_PROXY_UNIT, teardown.CONTAINERD_UNIT) == components.units(
        "kubelet", "kube-proxy", "containerd")


def test_lookups():
    assert components.by_name("kubelet").unit == "kubelet.service"
    assert components.by_unit("etcd.service").name == "etcd"
    assert components.by_unit("crio.service") is None
    assert components.by_name("hiddenplane-routes") in components.by_role("worker")
    assert components.by_name("hiddenplane-routes") in components.by_role("control")
    with pytest.raises(StopIteration):
        components.by_name("nope")


def test_the_table_is_pure():
    # core/components imports nothing of the installer but itself
    out = subprocess.run([sys.executable, "-c", "import sys, installer.core.components; "
                          "print(sorted(m for m in sys.modules if m.startswith('installer')))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['installer', 'installer.core', 'installer.core.components']"


def test_each_row_names_the_inventory_field_its_version_comes_from(doc, tmp_path):
    doc["spec"]["kubernetes"]["version"] = "v1.36.2"
    doc["spec"].setdefault("artifacts", {}).setdefault("versions", {}).update(etcd="3.6.11", containerd="2.2.3")
    inv = api.validate(write_inventory(tmp_path, doc))
    released = fetch.component_versions(inv)
    got = {c.name: components.version_of(c.name, inv.spec) for c in COMPONENTS}
    assert got == {"etcd": "3.6.11", "kube-apiserver": "v1.36.2", "konnectivity-server": None,
                   "kube-controller-manager": "v1.36.2", "kube-scheduler": "v1.36.2", "api-balancer": None,
                   "hiddenplane-routes": None, "hiddenplane-routes-repair": None,
                   "containerd": "2.2.3", "kubelet": "v1.36.2", "kube-proxy": "v1.36.2"}
    # the same values fetch downloads (release URLs spell them with or without the v)
    assert released["kubernetes"].removeprefix("v") == got["kubelet"].removeprefix("v")
    assert released["etcd"].removeprefix("v") == got["etcd"]
    assert released["containerd"].removeprefix("v") == got["containerd"]


class _LocalSh:
    """A host that runs each script with this machine's sh (the waits' shell for real)."""

    def __init__(self):
        self.scripts: list[str] = []

    def run(self, script, check=True, what="", timeout=None):
        from installer.host.ssh import Result
        self.scripts.append(script)
        p = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=timeout)
        return Result(p.stdout, p.stderr, p.returncode)


def test_the_controller_manager_and_scheduler_are_waited_for_in_one_round_trip(prepared, monkeypatch):
    """A control host's shell waits go in one script; when one does not start, the error names
    that one, with what its wait said."""
    from types import SimpleNamespace

    from installer.host.ssh import HostError
    cm, sched = components.units("kube-controller-manager", "kube-scheduler")
    host = _LocalSh()
    ctx = SimpleNamespace(inv=prepared.inventory, options=SimpleNamespace(wait_timeout=1), remotes={"cp1": host})
    with pytest.raises(HostError, match=f"cp1: {cm} did not start .*(listens|active)"):
        waits.wait_all(ctx, "cp1", (cm, sched))           # neither runs on this machine
    assert len(host.scripts) == 1 and cm in host.scripts[0] and sched in host.scripts[0]
    # the first answers, the second does not: the second is named, with its own words
    monkeypatch.setattr(waits, "script", lambda ctx, unit: "true" if unit == cm else "echo 'no port 10259' >&2; false")
    with pytest.raises(HostError, match=f"cp1: {sched} did not start .*: no port 10259$"):
        waits.wait_all(ctx, "cp1", (cm, sched))
    monkeypatch.setattr(waits, "script", lambda ctx, unit: "true")
    waits.wait_all(ctx, "cp1", (cm, sched))
    assert len(host.scripts) == 3
