"""The pod network of ``cni: routes``, without hosts: pod CIDR allocation (stable, persisted),
routes per host, the CNI conflist, the routes unit and how the state and the plans carry them.
The lab proves the same files on real hosts (tests/test_network_lab.py)."""

from __future__ import annotations

import copy
import ipaddress
import json
import subprocess

import pytest
import yaml

from installer import api
from installer.core import network
from installer.core.errors import StateError
from installer.core.network import (
    REPAIR_SERVICE,
    REPAIR_TIMER,
    ROUTE_PROTO,
    ROUTES_UNIT,
    allocate,
    capacity,
    release,
    routes_for,
    slice_prefix,
)
from installer.core.render.network import REPAIR_SCRIPT
from installer.engine.parts import control_plane_part, worker_part

from . import reference as ref
from .conftest import write_inventory

P16 = "10.244.0.0/16"


# --- allocation -------------------------------------------------------------------------------

def test_allocation_is_deterministic_whatever_the_order():
    a, why = allocate(P16, 24, {}, ["w2", "w1", "w3"])
    b, _ = allocate(P16, 24, {}, ["w3", "w1", "w2"])
    assert a == b == {"w1": "10.244.0.0/24", "w2": "10.244.1.0/24", "w3": "10.244.2.0/24"}
    assert why == {"w1": "pod CIDR 10.244.0.0/24", "w2": "pod CIDR 10.244.1.0/24", "w3": "pod CIDR 10.244.2.0/24"}
    assert list(a) == sorted(a)


def test_rerun_changes_nothing():
    a, _ = allocate(P16, 24, {}, ["w1", "w2"])
    again, why = allocate(P16, 24, a, ["w1", "w2"])
    assert again == a and why == {}


def test_adding_a_worker_moves_no_other():
    a, _ = allocate(P16, 24, {}, ["w1", "w3"])
    # "w2" sorts between them but takes the next free slice: nothing shifts
    b, why = allocate(P16, 24, a, ["w1", "w2", "w3"])
    assert {n: b[n] for n in a} == a
    assert b["w2"] == "10.244.2.0/24" and set(why) == {"w2"}


def test_removing_a_worker_frees_nothing_until_released():
    a, _ = allocate(P16, 24, {}, ["w1", "w2", "w3"])
    b, why = allocate(P16, 24, a, ["w1", "w3"])
    assert b == a and why == {}               # w2 keeps its slice: its pods may still run
    c, _ = allocate(P16, 24, b, ["w1", "w3", "w4"])
    assert c["w4"] == "10.244.3.0/24" and c["w2"] == "10.244.1.0/24"
    # released explicitly: the lowest free slice is reused
    d, why = allocate(P16, 24, release(b, ["w2"]), ["w1", "w3", "w4"])
    assert d == {"w1": "10.244.0.0/24", "w3": "10.244.2.0/24", "w4": "10.244.1.0/24"}
    assert why == {"w4": "pod CIDR 10.244.1.0/24"}


def test_a_returning_worker_gets_its_old_slice():
    a, _ = allocate(P16, 24, {}, ["w1", "w2"])
    b, _ = allocate(P16, 24, a, ["w1"])
    c, why = allocate(P16, 24, b, ["w1", "w2"])
    assert c == a and why == {}


def test_exhaustion_is_a_clear_error_naming_what_holds_the_slices():
    a, _ = allocate("10.244.0.0/24", 25, {}, ["w1", "w2"])
    assert a == {"w1": "10.244.0.0/25", "w2": "10.244.0.128/25"}
    with pytest.raises(StateError) as e:
        allocate("10.244.0.0/24", 25, a, ["w1", "w3"])
    msg = str(e.value)
    assert msg.startswith("no free /25 left in podCIDR 10.244.0.0/24 for worker w3: 2 slice(s), 2 allocated; "
                          "1 held by nodes no longer in the inventory (w2): release them")
    assert "nodeCIDRMaskSize" in msg
    b, _ = allocate("10.244.0.0/24", 25, release(a, ["w2"]), ["w1", "w3"])
    assert b == {"w1": "10.244.0.0/25", "w3": "10.244.0.128/25"}


def test_entries_that_no_longer_fit_are_reallocated_with_a_reason():
    a, _ = allocate(P16, 24, {}, ["w1", "w2"])
    b, why = allocate("10.245.0.0/16", 24, {**a, "gone": "10.244.9.0/24"}, ["w1", "w2"])
    assert b == {"w1": "10.245.0.0/24", "w2": "10.245.1.0/24"}
    assert why["w1"] == "pod CIDR 10.245.0.0/24 (10.244.0.0/24 no longer fits podCIDR 10.245.0.0/16 at /24)"
    assert why["gone"].startswith("released")
    c, why = allocate(P16, 25, a, ["w1", "w2"])       # a new mask re-slices too
    assert c == {"w1": "10.244.0.0/25", "w2": "10.244.0.128/25"} and set(why) == {"w1", "w2"}
    # hand-edited garbage and overlaps are re-allocated, never trusted
    d, why = allocate(P16, 24, {"w1": "bogus", "w2": "10.244.0.0/24", "w3": "10.244.0.0/24"}, ["w1", "w2", "w3"])
    assert d == {"w1": "10.244.1.0/24", "w2": "10.244.0.0/24", "w3": "10.244.2.0/24"}
    assert "overlapped" in why["w3"] and "not a CIDR" in why["w1"]


def test_ipv6_slices_are_prefix_plus_16_but_never_smaller_than_a_64():
    assert slice_prefix("fd00:10:244::/48", 24) == 64 and capacity("fd00:10:244::/48", 24) == 65536
    assert slice_prefix("fd00:10:244::/56", 24) == 64 and capacity("fd00:10:244::/56", 24) == 256
    assert slice_prefix("fd00:10::/40", 24) == 56
    assert capacity("fd00:10:244::/64", 24) == 1
    a, _ = allocate("fd00:10:244::/56", 24, {}, ["w1", "w2"])
    assert a == {"w1": "fd00:10:244::/64", "w2": "fd00:10:244:1::/64"}
    assert network.conflist(a["w1"])["plugins"][0]["ipam"]["routes"] == [{"dst": "::/0"}]


def test_capacity():
    assert capacity(P16, 24) == 256 and capacity(P16, 16) == 1 and capacity("10.244.0.0/24", 20) == 0


# --- routes -------------------------------------------------------------------------------------

WORKERS = [("w1", "10.0.0.21"), ("w2", "10.0.0.22"), ("w3", "10.0.0.23")]
ALLOC = {"w1": "10.244.0.0/24", "w2": "10.244.1.0/24", "w3": "10.244.2.0/24", "gone": "10.244.3.0/24"}


def test_a_worker_routes_every_other_workers_slice_via_that_worker():
    got = [(r.dst, r.via) for r in routes_for("w2", "worker", WORKERS, ALLOC, "routes")]
    assert got == [("10.244.0.0/24", "10.0.0.21"), ("10.244.2.0/24", "10.0.0.23")]
    # egress does not matter to workers; departed nodes get no route
    assert routes_for("w2", "worker", WORKERS, ALLOC, "konnectivity") == routes_for("w2", "worker", WORKERS, ALLOC,
                                                                                    "routes")


def test_a_control_host_routes_every_worker_only_with_egress_routes():
    got = [(r.dst, r.via) for r in routes_for("cp1", "control", WORKERS, ALLOC, "routes")]
    assert got == [("10.244.0.0/24", "10.0.0.21"), ("10.244.1.0/24", "10.0.0.22"), ("10.244.2.0/24", "10.0.0.23")]
    assert routes_for("cp1", "control", WORKERS, ALLOC, "konnectivity") == []


# --- rendered files -----------------------------------------------------------------------------

def test_conflist_is_a_bridge_without_nat_then_portmap(prepared):
    for plan in (p for p in prepared.plans.values() if p.role == "worker"):
        f = plan.files[network.CONFLIST]
        assert f.mode == 0o644 and f.restarts == ()
        conf = json.loads(f.content)
        assert conf["cniVersion"] == "1.0.0" and conf["name"] == "hiddenplane"
        assert [p["type"] for p in conf["plugins"]] == ["bridge", "portmap"]
        bridge, portmap = conf["plugins"]
        assert bridge["bridge"] == "cni0" and bridge["isGateway"] is True and bridge["ipMasq"] is False
        assert bridge["ipam"] == {"type": "host-local",
                                  "ranges": [[{"subnet": prepared.material.pod_cidrs[plan.name]}]],
                                  "routes": [{"dst": "0.0.0.0/0"}]}
        assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}


def _exec(plan, key="ExecStart") -> list[str]:
    return ref.unit_values(plan.files[f"/etc/systemd/system/{ROUTES_UNIT}"].content, "Service", key)


def _routes(plan) -> list[tuple[str, str]]:
    out = []
    for line in _exec(plan):
        words = line.split()
        if words[1:3] == ["route", "replace"]:
            assert words[-2:] == ["proto", str(ROUTE_PROTO)], line
            out.append((words[3], words[words.index("via") + 1]))
    return out


def test_routes_unit_on_every_host(prepared):
    inv, alloc = prepared.inventory, prepared.material.pod_cidrs
    addr = {h.name: h.address for h in inv.spec.hosts}
    for plan in prepared.plans.values():
        want = [(alloc[w.name], addr[w.name]) for w in inv.workers if w.name != plan.name]
        assert _routes(plan) == want, plan.name
        ex = _exec(plan)
        flush = f"/sbin/ip -4 route flush proto {ROUTE_PROTO}"
        assert ex[ex.index(flush) + 1].startswith("/sbin/ip route replace")   # flush first, then add
        assert _exec(plan, "ExecStop")[0] == flush
        unit = plan.files[f"/etc/systemd/system/{ROUTES_UNIT}"]
        assert unit.restarts == (ROUTES_UNIT,) and unit.mode == 0o600
        assert ref.unit_values(unit.content, "Service", "Type") == ["oneshot"]
        assert ref.unit_values(unit.content, "Service", "RemainAfterExit") == ["yes"]
        if plan.role == "worker":
            assert plan.units[0] == ROUTES_UNIT
            assert ex[0] == "/lib/systemd/systemd-sysctl /etc/sysctl.d/90-hiddenplane.conf"
            # the sysctls take effect at once: their file restarts the unit that applies them
            assert plan.files["/etc/sysctl.d/90-hiddenplane.conf"].restarts == (ROUTES_UNIT,)
            assert "/usr/sbin/iptables -w -t nat -A HIDDENPLANE-MASQ -d 10.244.0.0/16 -j RETURN" in ex
            assert ex.index("/usr/sbin/iptables -w -t nat -A HIDDENPLANE-MASQ -j MASQUERADE") > ex.index(
                "/usr/sbin/iptables -w -t nat -A HIDDENPLANE-MASQ ! -s 10.244.0.0/16 -j RETURN")
            assert ROUTES_UNIT in worker_part(plan).units
        else:
            assert plan.units[-2:] == [ROUTES_UNIT, REPAIR_TIMER] and "systemd-sysctl" not in " ".join(ex)
            assert not [line for line in ex if "iptables" in line]
            assert ROUTES_UNIT in control_plane_part(plan).units


# --- the repair after a link flap ----------------------------------------------------------------

def _unit(plan, name: str) -> bytes:
    return plan.files[f"/etc/systemd/system/{name}"].content


def _repair_files(plan) -> list[str]:
    return [p for p in plan.files if "hiddenplane-routes-repair" in p]


def _repair_routes(plan) -> list[tuple[str, str]]:
    argv = ref.exec_start(_unit(plan, REPAIR_SERVICE))
    assert argv[:3] == [REPAIR_SCRIPT, "4", str(ROUTE_PROTO)], argv
    pairs = argv[3:]
    return list(zip(pairs[::2], pairs[1::2], strict=True))


def test_a_timer_puts_back_the_routes_on_every_host(prepared):
    """Every host that routes (cni: routes) runs the repair every 5 s over the same routes as its
    routes unit; the timer is part of that unit, its run is quiet and waits for it."""
    for plan in prepared.plans.values():
        assert _repair_routes(plan) == _routes(plan) != [], plan.name
        assert sorted(_repair_files(plan)) == sorted([REPAIR_SCRIPT, f"/etc/systemd/system/{REPAIR_SERVICE}",
                                                      f"/etc/systemd/system/{REPAIR_TIMER}"])
        # the timer is a unit apply enables and starts, right after the routes unit (a teardown
        # stops it first); the service it runs is not
        at = plan.units.index(ROUTES_UNIT)
        assert plan.units[at + 1] == REPAIR_TIMER and REPAIR_SERVICE not in plan.units
        timer = _unit(plan, REPAIR_TIMER)
        assert {k: ref.unit_values(timer, "Timer", k) for k in ("OnActiveSec", "OnUnitActiveSec", "AccuracySec")} == {
            "OnActiveSec": ["5s"], "OnUnitActiveSec": ["5s"], "AccuracySec": ["1s"]}
        assert ref.unit_values(timer, "Unit", "PartOf") == [ROUTES_UNIT]
        assert ref.unit_values(timer, "Install", "WantedBy") == ["timers.target"]
        service = _unit(plan, REPAIR_SERVICE)
        assert ref.unit_values(service, "Service", "Type") == ["oneshot"]
        assert ref.unit_values(service, "Unit", "After") == ref.unit_values(service, "Unit", "PartOf") == [ROUTES_UNIT]
        # systemd's start and finish lines (info) every 5 s are dropped; the script's lines are notice
        assert ref.unit_values(service, "Service", "LogLevelMax") == ["notice"]
        assert ref.unit_values(service, "Service", "SyslogLevel") == ["notice"]
        assert not ref.unit_values(service, "Install", "WantedBy")
        # the routes unit starts the timer again when it is started after a stop
        assert REPAIR_TIMER in ref.unit_values(_unit(plan, ROUTES_UNIT), "Unit", "Wants")
        # a new route list restarts nothing (the next run reads it); a new timer restarts the timer
        assert plan.files[f"/etc/systemd/system/{REPAIR_SERVICE}"].restarts == ()
        assert plan.files[f"/etc/systemd/system/{REPAIR_TIMER}"].restarts == (REPAIR_TIMER,)
        script = plan.files[REPAIR_SCRIPT]
        assert script.mode == 0o755 and script.content.startswith(b"#!/bin/sh\n")
        assert b"\nip=/sbin/ip\n" in script.content


def test_a_single_worker_gets_a_timer_with_nothing_to_put_back(doc, tmp_path):
    """Rendered with an empty list too: apply never removes a unit that leaves the plan, so a
    timer only while other workers exist would keep the last list after a node remove."""
    doc["spec"]["hosts"] = [h for h in doc["spec"]["hosts"] if h["name"] != "node3"]
    p = _prepare(tmp_path, doc)
    assert _repair_routes(p.plans["node2"]) == _routes(p.plans["node2"]) == []
    assert REPAIR_TIMER in p.plans["node2"].units
    assert _repair_routes(p.plans["cp1"]) == [(p.material.pod_cidrs["node2"], "192.168.56.231")]


FAKE_IP = """#!/bin/sh
# ip(8) as the repair calls it: `show` prints the routes in STATE, `replace` adds one unless the
# link is down (the file DOWN exists)
echo "$*" >> "$DIR/calls"
case "$2 $3" in
  "route show") cat "$DIR/routes" ;;
  "route replace") [ -e "$DIR/down" ] && { echo "Error: Nexthop has invalid gateway." >&2; exit 2; }
                   echo "$4 via $6 dev eth0 " >> "$DIR/routes" ;;
esac
"""


def test_the_repair_script_adds_only_what_is_missing_and_never_fails(prepared, tmp_path):
    plan = prepared.plans["cp1"]
    script = plan.files[REPAIR_SCRIPT].content.decode().replace("\nip=/sbin/ip\n", f"\nip={tmp_path}/ip\n")
    (tmp_path / "ip").write_text(FAKE_IP)
    (tmp_path / "ip").chmod(0o755)
    argv = ref.exec_start(_unit(plan, REPAIR_SERVICE))[1:]
    (first, via1), (second, via2) = _repair_routes(plan)

    def run():
        (tmp_path / "calls").write_text("")
        r = subprocess.run(["/bin/sh", "-c", script, "repair", *argv],
                           env={"DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=30)
        return r.returncode, r.stdout, r.stderr, (tmp_path / "calls").read_text().splitlines()

    # both there: one look, nothing added, nothing said
    (tmp_path / "routes").write_text(f"{first} via {via1} dev eth0 \n{second} via {via2} dev eth0 \n")
    assert run() == (0, "", "", [f"-4 route show proto {ROUTE_PROTO}"])
    # the link went down and took both: while it stays down, nothing is said and nothing fails
    (tmp_path / "routes").write_text("")
    (tmp_path / "down").write_text("")
    rc, out, err, calls = run()
    assert (rc, out, err) == (0, "", "") and len(calls) == 3
    # back up: both added again, with our marker, and said
    (tmp_path / "down").unlink()
    rc, out, err, calls = run()
    assert (rc, err) == (0, "") and calls[1:] == [f"-4 route replace {first} via {via1} proto {ROUTE_PROTO}",
                                                  f"-4 route replace {second} via {via2} proto {ROUTE_PROTO}"]
    assert out.splitlines() == [f"re-added the route to {first} via {via1} (proto {ROUTE_PROTO})",
                                f"re-added the route to {second} via {via2} (proto {ROUTE_PROTO})"]
    # one of two missing: only that one
    (tmp_path / "routes").write_text(f"{second} via {via2} dev eth0 \n")
    assert run()[3][1:] == [f"-4 route replace {first} via {via1} proto {ROUTE_PROTO}"]
    # no routes to keep (a single worker): not even a look
    (tmp_path / "calls").write_text("")
    r = subprocess.run(["/bin/sh", "-c", script, "repair", "4", str(ROUTE_PROTO)], env={"DIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout, (tmp_path / "calls").read_text()) == (0, "", "")


def test_apiserver_and_controller_manager_flags(prepared):
    cp = prepared.plans["cp1"]
    api_flags = ref.unit_flags(cp.files["/etc/systemd/system/kube-apiserver.service"].content)
    cm_flags = ref.unit_flags(cp.files["/etc/systemd/system/kube-controller-manager.service"].content)
    assert api_flags["--enable-aggregator-routing"] == "true"
    assert cm_flags["--allocate-node-cidrs"] == "false" and "--cluster-cidr" not in cm_flags
    kubelet = yaml.safe_load(prepared.plans["node2"].files["/var/lib/kubelet/config.yaml"].content)
    assert "podCIDR" not in kubelet      # standalone only; Node.spec.podCIDR is set by the workers phase


def _prepare(tmp_path, doc, name="inventory.yaml"):
    return api.prepare(write_inventory(tmp_path, doc, name), tmp_path / "state")


def test_konnectivity_egress_leaves_control_hosts_without_routes(doc, tmp_path):
    doc["spec"]["network"]["egress"] = "konnectivity"
    p = _prepare(tmp_path, doc)
    cp = p.plans["cp1"]
    assert ROUTES_UNIT not in cp.units and f"/etc/systemd/system/{ROUTES_UNIT}" not in cp.files
    assert not _repair_files(cp) and REPAIR_TIMER not in cp.units
    assert _repair_routes(p.plans["node2"]) == _routes(p.plans["node2"])
    assert "--enable-aggregator-routing" not in ref.unit_flags(
        cp.files["/etc/systemd/system/kube-apiserver.service"].content)
    assert _routes(p.plans["node2"]) == [(p.material.pod_cidrs["node3"], "192.168.56.232")]


def test_cilium_workers_keep_only_the_sysctls(doc, tmp_path):
    doc["spec"]["network"]["cni"] = "cilium"
    p = _prepare(tmp_path, doc)
    for name in ("node2", "node3"):
        plan = p.plans[name]
        assert network.CONFLIST not in plan.files and plan.units[0] == ROUTES_UNIT
        assert _routes(plan) == [] and not [line for line in _exec(plan) if "iptables" in line]
        # nothing to put back: no repair timer (the routes unit only applies the sysctls)
        assert not _repair_files(plan) and REPAIR_TIMER not in plan.units
        assert not ref.unit_values(plan.files[f"/etc/systemd/system/{ROUTES_UNIT}"].content, "Unit", "Wants")[1:]
        assert _exec(plan)[0].endswith("systemd-sysctl /etc/sysctl.d/90-hiddenplane.conf")
    assert ROUTES_UNIT not in p.plans["cp1"].units
    # the installer's allocation still exists: it becomes each Node's spec.podCIDR, which
    # Cilium's ipam.mode kubernetes takes the node's pod range from
    assert p.material.pod_cidrs == {"node2": "10.244.0.0/24", "node3": "10.244.1.0/24"}


# --- the state ----------------------------------------------------------------------------------

def test_state_keeps_the_allocation_across_inventory_changes(doc, tmp_path):
    first = _prepare(tmp_path, doc)
    path = tmp_path / "state" / "network.yaml"
    saved = yaml.safe_load(path.read_text())
    assert saved == {"podCIDRs": {"node2": "10.244.0.0/24", "node3": "10.244.1.0/24"}}
    assert path.stat().st_mode & 0o777 == 0o644
    conf = {n: first.plans[n].files[network.CONFLIST].content for n in ("node2", "node3")}

    # a new worker listed first takes the next slice; the others' files do not change
    more = copy.deepcopy(doc)
    more["spec"]["hosts"].insert(1, {"name": "node1", "address": "192.168.56.235", "role": "worker"})
    p = _prepare(tmp_path, more)
    assert p.material.pod_cidrs == {"node1": "10.244.2.0/24", "node2": "10.244.0.0/24", "node3": "10.244.1.0/24"}
    assert p.changes.reasons == {"kubelet/node1-serving": "new", "kube-proxy/node1": "new", "token/node1": "new",
                                 "network/node1": "pod CIDR 10.244.2.0/24"}
    assert {n: p.plans[n].files[network.CONFLIST].content for n in conf} == conf
    assert ("10.244.2.0/24", "192.168.56.235") in _routes(p.plans["node2"])

    # removed again: node1 keeps its slice in the state, but nobody routes to it any more
    p = _prepare(tmp_path, doc)
    assert p.material.pod_cidrs["node1"] == "10.244.2.0/24" and not p.changes
    assert [d for d, _ in _routes(p.plans["cp1"])] == ["10.244.0.0/24", "10.244.1.0/24"]
    mtime = path.stat().st_mtime_ns
    assert not _prepare(tmp_path, doc).changes and path.stat().st_mtime_ns == mtime


def test_corrupt_network_state_is_refused(doc, tmp_path):
    _prepare(tmp_path, doc)
    path = tmp_path / "state" / "network.yaml"
    for bad in ("podCIDRs: [1, 2]\n", "podCIDRs: {node2: [x]}\n", ": : :\n"):
        path.write_text(bad)
        with pytest.raises(StateError, match="network.yaml is corrupt"):
            _prepare(tmp_path, doc)


def test_pod_cidrs_are_inside_the_pod_network_and_disjoint(prepared):
    nets = [ipaddress.ip_network(c) for c in prepared.material.pod_cidrs.values()]
    pod = ipaddress.ip_network(prepared.inventory.spec.network.podCIDR)
    assert all(n.subnet_of(pod) and n.prefixlen == 24 for n in nets)
    assert not [(a, b) for i, a in enumerate(nets) for b in nets[i + 1:] if a.overlaps(b)]
