"""The executor seam: how the control plane's components are put in place, started, stopped and
waited for, apart from what they are.

What a control-plane component is (its flags, certificates, configs) is rendered the same way
wherever it runs (core/render/). Where it runs is the executor's business, as in RKE2 and k3s:
today every control host runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler (and
konnectivity-server) as systemd units (``SystemdExecutor``); a hosted control plane runs them as
pods of another cluster (the next issue). The apply phases that own the control plane
(phases/start_etcd.py, phases/start_control_plane.py), the rollouts (actions/rollout.py) and an
apiserver's handover (host/handover.py) go through ``ctx.executor`` for every one of these
operations; workers (containerd, kubelet, kube-proxy, the API balancer) are not the executor's.

``tests/test_executor.py`` drives the phases and a rollout through a second implementation.
"""

from __future__ import annotations

from installer.core import components
from installer.core.diff import HostChanges
from installer.core.render.tenant import namespace_object
from installer.host import waits

# the units an executor runs: every control-plane row of the component table
CONTROL_PLANE_UNITS = tuple(c.unit for c in components.COMPONENTS if c.role == components.CONTROL)


class Executor:
    """The operations on the control plane's components of one target (a control host today).
    ``ctx`` is the run's Context (engine/context.py); ``unit`` names a component by its
    unit, as the component table does."""

    name = ""

    def place(self, ctx, phase: str, host: str, changes: HostChanges, no_block: bool = False):
        """Make ``changes`` real on ``host`` (files, users, directories; the units they restart,
        start or enable) and return the phase's Event; in a dry run only describe them."""
        raise NotImplementedError

    def restart(self, ctx, host: str, unit: str, no_block: bool = False) -> None:
        """Restart ``unit`` on ``host`` (start it when it is stopped); a restart that was pending
        for it is done. ``no_block``: do not wait for it to report started (etcd members of a new
        CA start together: each waits for the others)."""
        raise NotImplementedError

    def stop(self, ctx, host: str, unit: str) -> None:
        """Stop ``unit`` on ``host`` the graceful way (SIGTERM: an apiserver serves its shutdown
        delay and answers what it accepted)."""
        raise NotImplementedError

    def wait(self, ctx, host: str, unit: str, after: str = "") -> None:
        """Until ``unit`` on ``host`` counts as started (its row's wait); a HostError otherwise
        (``after`` says after what, for the message)."""
        raise NotImplementedError

    def wait_all(self, ctx, host: str, units: tuple[str, ...]) -> None:
        """``wait`` for each of ``units`` on ``host``; an executor may do them at once."""
        for unit in units:
            self.wait(ctx, host, unit)

    def close(self, ctx) -> None:
        """The run ends: give back what the executor holds (a hosted tenant's lock, its client)."""


class SystemdExecutor(Executor):
    """The control plane as systemd units on the control hosts, changed by the apply script
    (host/hostops.py: one round trip per change, the pending-restart ledger on the host)."""

    name = "systemd"

    def place(self, ctx, phase: str, host: str, changes: HostChanges, no_block: bool = False):
        return ctx.execute(phase, host, changes, no_block=no_block)

    def restart(self, ctx, host: str, unit: str, no_block: bool = False) -> None:
        # the apply script: one retry, the journal in the error, the ledger entry cleared after
        ctx.execute("restart", host, HostChanges(host, restart=[unit]), no_block=no_block)

    def stop(self, ctx, host: str, unit: str) -> None:
        ctx.remotes[host].run(f"systemctl stop {unit}", what=f"stop {unit}", timeout=ctx.options.wait_timeout + 30)
        facts = ctx.facts.get(host)
        if facts is not None:
            facts.units[unit] = ("inactive", facts.units.get(unit, ("", "enabled"))[1] or "enabled")

    def wait(self, ctx, host: str, unit: str, after: str = "") -> None:
        waits.wait(ctx, host, unit, after)

    def wait_all(self, ctx, host: str, units: tuple[str, ...]) -> None:
        waits.wait_all(ctx, host, units)            # the shell waits in one round trip


class HostedExecutor(Executor):
    """The control plane as pods of a hosting cluster (docs/hosted.md): one target, the tenant's
    namespace; its objects applied and its workloads waited for through the hosting cluster's
    API (host/hosting.py), the apply lock a Lease there. Its control plane has no units: day 2
    rolls its objects by component (actions/upgrade_hosted.py)."""

    name = "hosted"

    def __init__(self):
        self._api = None
        self._held: tuple[str, str] | None = None

    def api(self, inv):
        """The hosting cluster's client, made once per command."""
        if self._api is None:
            from installer.host.hosting import hosting_client  # lazy: urllib3, for hosted tenants only
            self._api = hosting_client(inv)
        return self._api

    def place(self, ctx, phase: str, host: str, changes, no_block: bool = False):
        raise NotImplementedError("a hosted control plane has no host to place files on")

    # a tenant's hosts are its workers, whose units (kubelet, kube-proxy, containerd, the API
    # balancer) are systemd's as on any cluster: a rollout (certs renew, ca rotate) restarts,
    # stops and waits for them the same way
    def restart(self, ctx, host: str, unit: str, no_block: bool = False) -> None:
        SystemdExecutor.restart(self, ctx, host, unit, no_block)

    def stop(self, ctx, host: str, unit: str) -> None:
        SystemdExecutor.stop(self, ctx, host, unit)

    def wait(self, ctx, host: str, unit: str, after: str = "") -> None:
        SystemdExecutor.wait(self, ctx, host, unit, after)

    def wait_all(self, ctx, host: str, units: tuple[str, ...]) -> None:
        SystemdExecutor.wait_all(self, ctx, host, units)

    def take_lock(self, inv, run_id: str, force: bool = False) -> None:
        """The tenant's apply lock: its namespace made when missing, the Lease taken for ``run_id``."""
        from installer.host import hosting
        hosting.converge(self.api(inv), [namespace_object(inv)], inv.spec.kubernetes.version)
        if hosting.take_lease(self.api(inv), inv.hosted_namespace, run_id, force=force):
            self._held = (inv.hosted_namespace, run_id)

    def forget_lock(self) -> None:
        """The lock went with its namespace (a reset)."""
        self._held = None

    def close(self, ctx=None) -> None:
        from installer.host import hosting
        if self._api is None:
            return
        if self._held:
            hosting.release_lease(self._api, *self._held)
            self._held = None
        self._api.close()
        self._api = None
