"""What a control plane offers the phases and the day-2 commands: ``ControlPlane``.

What a component is (its flags, certificates, configs) is rendered the same way wherever it runs
(core/render/); where it runs, how a run is locked, how etcd is reached and how the control
plane is rolled is its plane's, as in RKE2's executor. Two kinds exist: ``SystemdPlane``
(planes/systemd.py: systemd units on the control hosts) and ``HostedPlane`` (planes/hosted.py:
pods in a namespace of a hosting cluster). A command's ``Run`` (engine/run.py) holds one, made
by ``planes.plane_for`` from the inventory; nothing else asks the inventory which kind it is.

Units on hosts (workers' kubelet, kube-proxy, containerd, the API balancer; a systemd plane's
control-plane units) are restarted, stopped and waited for the same way on every plane: every
host runs systemd. A method a kind of plane has no use for says so in its default here.

``run`` is the command's Run, ``ctx`` apply's Context (engine/context.py); the ``up`` and ``r``
of the day-2 methods are the step state of upgrade (actions/upgrade.py) and of a certificate
roll (actions/renew.py), read by their fields.
"""

from __future__ import annotations

from installer.core import components
from installer.core.diff import HostChanges
from installer.host import waits

# the units a systemd plane runs: every control-plane row of the component table
CONTROL_PLANE_UNITS = tuple(c.unit for c in components.COMPONENTS if c.role == components.CONTROL)


class ControlPlane:
    name = ""

    def __init__(self, inv, session, state=None):
        self.inv = inv
        self.session = session
        self.state = state          # the command's state directory (a StateDir), when it has one

    # --- apply: where it runs ------------------------------------------------------------

    def targets(self) -> list[str]:
        """What apply's ``hosted`` phase converges (none: the etcd and control-plane phases
        place the control plane on hosts)."""
        return []

    def converge(self, ctx, target: str):
        """Bring ``target``'s objects to what is rendered; the ``hosted`` phase's Event."""
        raise NotImplementedError

    def wait_converged(self, ctx) -> list[str]:
        """Until what ``converge`` changed runs everywhere; what was waited for."""
        return []

    def place(self, ctx, phase: str, host: str, changes: HostChanges, no_block: bool = False):
        """Make ``changes`` real on ``host`` (files, users, directories; the units they restart,
        start or enable) and return the phase's Event; in a dry run only describe them."""
        return ctx.execute(phase, host, changes, no_block=no_block)

    # --- units on hosts ----------------------------------------------------------------------

    def restart(self, ctx, host: str, unit: str, no_block: bool = False) -> None:
        """Restart ``unit`` on ``host`` (start it when it is stopped); a restart that was pending
        for it is done. ``no_block``: do not wait for it to report started (etcd members of a new
        CA start together: each waits for the others)."""
        # the apply script: one retry, the journal in the error, the ledger entry cleared after
        ctx.execute("restart", host, HostChanges(host, restart=[unit]), no_block=no_block)

    def stop(self, ctx, host: str, unit: str) -> None:
        """Stop ``unit`` on ``host`` the graceful way (SIGTERM: an apiserver serves its shutdown
        delay and answers what it accepted)."""
        ctx.remotes[host].run(f"systemctl stop {unit}", what=f"stop {unit}", timeout=ctx.options.wait_timeout + 30)
        facts = ctx.facts.get(host)
        if facts is not None:
            facts.units[unit] = ("inactive", facts.units.get(unit, ("", "enabled"))[1] or "enabled")

    def wait(self, ctx, host: str, unit: str, after: str = "") -> None:
        """Until ``unit`` on ``host`` counts as started (its row's wait); a HostError otherwise
        (``after`` says after what, for the message)."""
        waits.wait(ctx, host, unit, after)

    def wait_all(self, ctx, host: str, units: tuple[str, ...]) -> None:
        """``wait`` for each of ``units`` on ``host``, the shell waits in one round trip."""
        waits.wait_all(ctx, host, units)

    # --- the apply lock --------------------------------------------------------------------

    def lock_targets(self, ctx, pending: bool) -> list[str]:
        """What apply's ``lock`` phase takes the lock on; ``pending``: whether any phase that
        runs will change a host (from the facts)."""
        raise NotImplementedError

    def take_lock(self, ctx, target: str, pending: bool) -> list[str]:
        """Apply's lock on ``target`` (a ``lock_targets`` entry) for the run; what to report."""
        raise NotImplementedError

    def hold(self, run, skip: frozenset[str] = frozenset()) -> None:
        """The apply lock for a day-2 command's whole length (``Run.hold``), taken at once;
        ``skip``: hosts known to be gone. Given back by ``release``."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back every lock this plane's run took (the session's, then the plane's own)."""
        self.session.release()

    def forget_lock(self) -> None:
        """The lock went with what held it (a reset deleted it)."""

    def close(self) -> None:
        """The command ends: give back what the plane holds (locks, clients)."""
        self.release()

    # --- what apply reads ---------------------------------------------------------------------

    def held_certificates(self, ctx) -> list[tuple[str, object, dict[str, bytes]]]:
        """The certificates held beyond the hosts' files, for the CA and stale-leaf guards
        (core/trust.py): (where, the plan of what is written there, path -> content)."""
        return []

    def api_live(self, ctx) -> bool:
        """Whether a kube-apiserver already runs: then a dry run can ask it."""
        raise NotImplementedError

    # --- etcd day 2 -----------------------------------------------------------------------------

    def members(self, run) -> list:
        """The etcd member list (core/etcd_rules.Member)."""
        raise NotImplementedError

    def etcd_sites(self, run) -> list[str]:
        """Where each member can be asked alone, in member order: a control host (its local
        member), a tenant's member pod (running, ready or not: a member with an alarm is not
        ready, and that is when it is asked)."""
        raise NotImplementedError

    def etcdctl_at(self, run, site: str, args: list[str], what: str, timeout: float = 60) -> str:
        """``etcdctl args`` against the member at ``site`` alone; its stdout (an EtcdOpError
        naming the site and etcdctl's error when it fails)."""
        raise NotImplementedError

    def snapshot_save(self, run, dest, force: bool = False):
        """A snapshot of a healthy member written to ``dest`` (0600); its SnapshotInfo."""
        raise NotImplementedError

    def restore_plan(self, inv, snapshot: str, stamp: str) -> list[str]:
        """``snapshot_restore``'s steps in words (nothing reached)."""
        raise NotImplementedError

    def snapshot_restore(self, run, snapshot, wait_timeout: float) -> list[str]:
        """``snapshot`` restored into every member, the run holding the apply lock; the members."""
        raise NotImplementedError

    # --- upgrade and certificate rolls -----------------------------------------------------------

    def survey(self, run, remotes: dict) -> tuple[list, dict[str, bool]]:
        """What upgrade reads of the control plane beyond its hosts' binaries: more control
        states (core/upgrade_rules.HostState) and each etcd endpoint's health."""
        raise NotImplementedError

    def leader_pods(self, run) -> set[str] | None:
        """The controller-manager and scheduler instances that may lead after a roll (upgrade's
        lead wait); None: any holder other than the one before counts."""
        return None

    def upgrade_turn(self, up, batch: list[str], etcd_turn: bool, etcd_inv, current_etcd: str | None,
                     was: str):
        """The Step of upgrade's turn for the control-plane ``batch`` (an etcd turn, the etcd
        version moving, or the control plane's own)."""
        raise NotImplementedError

    where = ""      # what holds the files of ``beyond_plan``, for messages and reports

    def beyond_plan(self, inv, material):
        """The files the control plane holds besides the hosts (a HostPlan), rendered from
        ``material``; None: nothing beyond the hosts."""
        return None

    def read_files(self, paths: list[str], secrets: bool = True) -> dict[str, bytes]:
        """The files of ``beyond_plan`` at ``paths`` as they are held now (those missing left
        out); ``secrets``: the key files too."""
        return {}

    def renew_steps(self) -> list:
        """The Steps that roll what ``tenant_plans`` names with a renewed material (``r.new``)."""
        return []

    def stop_all(self, r, etcd: bool) -> None:
        """Stop the whole control plane (a CA rotation; with ``etcd`` its members too)."""
        raise NotImplementedError

    def start_all(self, r) -> None:
        """Start it again with ``r.new``'s files, waiting until every part is ready."""
        raise NotImplementedError

    def exposed(self, inv) -> list[tuple[str, str, str, int]]:
        """(component, label, address, port) of what answers outside the hosts, for the TLS
        check of every endpoint."""
        return []

    def api_probes(self) -> int:
        """How many connections through the exposed API a revocation check makes (0: each
        control host's apiserver is asked directly)."""
        return 0

    # --- reset -------------------------------------------------------------------------------------

    def beyond_hosts(self) -> tuple[str, str] | None:
        """What ``reset`` takes away besides the hosts: the words of its lock step and of its
        deletion step; None: nothing (a plane on hosts goes with them)."""
        return None

    def delete(self, run) -> dict[str, list[str]]:
        """Delete what ``beyond_hosts`` names, its lock with it; what was done, by where (the
        reset report's keys)."""
        raise NotImplementedError
