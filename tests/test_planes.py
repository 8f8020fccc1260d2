"""The control plane's seam (installer/engine/planes/): its components are put in place,
restarted, stopped and waited for only through ``ctx.plane``, the run's plane chosen once.

A third implementation drives the real phases and a real rollout here: ``TablePlane`` keeps
a table of what runs where (each component's state and how many times it started) instead of
systemd units, the way the hosted plane keeps Deployments in another cluster. The hosts'
Remotes refuse every command, so anything that still reached a control host over SSH for a
control-plane component would fail the test. The systemd implementation is what every lab test
runs."""

from __future__ import annotations

import pytest

from installer.actions import rollout
from installer.core.cluster import Cluster
from installer.core.diff import HostChanges
from installer.core.facts import HostFacts
from installer.core.render.plan import render_cluster
from installer.engine.context import Context, Event, Options
from installer.engine.parts import control_plane_part
from installer.engine.phases.start_control_plane import StartControlPlane
from installer.engine.planes import CONTROL_PLANE_UNITS, ControlPlane, SystemdPlane
from installer.engine.run import open_run
from installer.host.ssh import HostError

ETCD, APISERVER, CM, SCHEDULER = "etcd.service", "kube-apiserver.service", "kube-controller-manager.service", \
    "kube-scheduler.service"


class TablePlane(ControlPlane):
    """The control plane as a table: (host, unit) -> [running, starts]. ``log`` is every
    operation in order."""

    name = "table"

    def __init__(self, running: dict[str, list[str]]):
        super().__init__(None, None)
        self.table = {(h, u): [True, 1] for h, units in running.items() for u in units}
        self.log: list[tuple[str, str, str]] = []

    def place(self, ctx, phase, host, changes: HostChanges, no_block=False) -> Event:
        self.log.append(("place", host, ",".join(changes.restart)))
        for unit in changes.restart + changes.start:
            self.restart(ctx, host, unit)
        return Event(phase, host, "unchanged" if changes.empty else "changed", restarts=list(changes.restart))

    def restart(self, ctx, host, unit, no_block=False) -> None:
        self.log.append(("restart", host, unit))
        row = self.table.setdefault((host, unit), [False, 0])
        row[0], row[1] = True, row[1] + 1

    def stop(self, ctx, host, unit) -> None:
        self.log.append(("stop", host, unit))
        self.table.setdefault((host, unit), [False, 0])[0] = False

    def wait(self, ctx, host, unit, after="") -> None:
        self.log.append(("wait", host, unit))
        if not self.table.get((host, unit), [False])[0]:
            raise HostError(host, f"{unit} is not running{after}")

    def wait_all(self, ctx, host, units) -> None:
        for unit in units:
            self.wait(ctx, host, unit)


class NoSSH:
    """A control host reached over SSH: never, in these tests."""

    def __init__(self, name):
        self.name = name

    def run(self, script, **kw):
        raise AssertionError(f"{self.name}: a command over SSH: {kw.get('what')}: {script[:120]}")


def context(prepared, plane: ControlPlane) -> Context:
    inv = prepared.inventory
    assert not inv.local_balancer          # these tests are about the plane, not the balancers
    ctx = Context(inv, prepared.state, Options(wait_timeout=5), prepared.material, prepared.changes,
                  log=lambda m: None, plane=plane)
    ctx.plans = render_cluster(inv, prepared.material)
    ctx.facts = {h.name: HostFacts(units={u: ("active", "enabled") for u in CONTROL_PLANE_UNITS})
                 for h in inv.controls}
    ctx.remotes = {h.name: NoSSH(h.name) for h in inv.spec.hosts}
    return ctx


def test_a_run_picks_its_plane_once_from_the_inventory(three_controls):
    """open_run makes the one plane of a command (systemd for control hosts); a command inside
    it is handed the same Run, so the same plane, session and run id."""
    cluster = Cluster(three_controls.inventory, three_controls.state)
    with open_run(cluster, log=lambda m: None) as run:
        assert isinstance(run.plane, SystemdPlane) and run.plane.name == "systemd"
        assert run.plane.session is run.session
        with open_run(run) as inner:
            assert inner is run
        other = run.derived(three_controls.inventory.model_copy())
        assert (other.plane, other.session, other.state) == (run.plane, run.session, run.state)
        assert other.inv is not run.inv
    assert set(CONTROL_PLANE_UNITS) == {ETCD, APISERVER, CM, SCHEDULER, "konnectivity-server.service"}


def test_a_command_inside_a_held_run_goes_on_under_its_hold(three_controls):
    """The apply lock is taken once per command (Run.hold) and given back at its end; a command
    run inside it (node remove -> etcd member remove) holds nothing more and gives nothing back
    early; the run's remote commands carry its mark from the hold on, new connections too."""
    said = []

    class Recording(SystemdPlane):
        def hold(self, run, skip=frozenset()):
            said.append(("hold", tuple(sorted(skip))))

        def release(self):
            said.append(("release",))

    cluster = Cluster(three_controls.inventory, three_controls.state)
    with open_run(cluster, log=lambda m: None) as run:
        run.plane = Recording(run.inv, run.session)
        with run.hold(skip=frozenset({"cp3"})):
            assert run.session.holding and run.session.scope == f"hp-{run.session.run_id[:12]}"
            with open_run(run) as inner, inner.hold():
                assert said == [("hold", ("cp3",))]
            assert said == [("hold", ("cp3",))] and run.session.holding
            late = run.session.connect(run.inv.controls[:1])
            assert next(iter(late.values())).scope == run.session.scope
        assert said == [("hold", ("cp3",)), ("release",)] and not run.session.holding


def test_a_rollout_restarts_the_control_plane_through_the_plane_one_host_at_a_time(three_controls):
    """certs renew's rollout of every control-plane unit on three control hosts: each etcd
    member restarts with its host's apiserver stopped meanwhile and started after it (once:
    that start is its restart), each waited for before the next host; then the
    controller-managers and schedulers. All of it through the plane."""
    controls = [h.name for h in three_controls.inventory.controls]
    ex = TablePlane({h: list(CONTROL_PLANE_UNITS) for h in controls})
    ctx = context(three_controls, ex)
    report = rollout.Report("renew", False)
    rollout.roll(ctx, {h: [ETCD, APISERVER, CM, SCHEDULER] for h in controls}, report)
    per_host = [("stop", APISERVER), ("restart", ETCD), ("wait", ETCD), ("restart", APISERVER), ("wait", APISERVER)]
    assert ex.log[:15] == [(op, h, u) for h in controls for op, u in per_host], ex.log
    assert ex.log[15:] == [(op, h, u) for h in controls for op, u in
                           [("restart", CM), ("restart", SCHEDULER), ("wait", CM), ("wait", SCHEDULER)]]
    assert all(ex.table[(h, APISERVER)] == [True, 2] for h in controls)       # started once more, not twice
    assert [r.split(":")[1] for r in report.restarts[:6]] == [ETCD, APISERVER] * 3


def test_the_control_plane_phase_restarts_one_apiserver_at_a_time_and_waits_for_all(three_controls):
    """apply's control-plane phase with a changed apiserver on every control host: each restart
    is placed and waited for (ready) before the phase returns for that host; the phase's finish
    waits for every apiserver, controller-manager and scheduler; all through the plane."""
    controls = [h.name for h in three_controls.inventory.controls]
    ex = TablePlane({h: list(CONTROL_PLANE_UNITS) for h in controls})
    ctx = context(three_controls, ex)
    phase = StartControlPlane()

    def changes_for(host, sel):            # the apiserver's flags changed on every host
        return HostChanges(host, write=list(control_plane_part(ctx.plans[host]).files)[:1], restart=[APISERVER])
    ctx.changes_for = changes_for
    events = [phase.run_host(ctx, h) for h in phase.prepare(ctx)]
    assert [ev.detail[-1] for ev in events] == ["kube-apiserver restarted alone; /readyz ok again"] * 3
    assert ex.log[:9] == [x for h in controls for x in
                          [("place", h, APISERVER), ("restart", h, APISERVER), ("wait", h, APISERVER)]]
    phase.finish(ctx, events)
    assert ex.log[9:] == [("wait", h, APISERVER) for h in controls] + [
        ("wait", h, u) for h in controls for u in (CM, SCHEDULER)]


def test_a_component_the_plane_does_not_run_fails_the_wait_naming_the_host(three_controls):
    controls = [h.name for h in three_controls.inventory.controls]
    ex = TablePlane({h: [ETCD, APISERVER, CM] for h in controls})       # no scheduler anywhere
    ctx = context(three_controls, ex)
    with pytest.raises(HostError, match=f"{controls[0]}: {SCHEDULER} is not running"):
        StartControlPlane().finish(ctx, [Event("control-plane", h, "changed") for h in controls])
