"""The control plane as systemd units on the control hosts: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler (and konnectivity-server) changed by the apply script
(host/hostops.py: one round trip per change, the pending-restart ledger on the host); the apply
lock a file on every control host (host/applylock.py); etcd reached with etcdctl over SSH
(planes/etcd_hosts.py)."""

from __future__ import annotations

import time

from installer.core import components
from installer.core.render.control import etcd_servers
from installer.engine.planes import etcd_hosts
from installer.engine.planes.base import ControlPlane
from installer.engine.steps import Step
from installer.host import probes
from installer.host.applylock import UNLOCK, break_stale, dead_here, end_dead_run, stale_reason

APISERVER = components.unit("kube-apiserver")


class SystemdPlane(ControlPlane):
    name = "systemd"

    # --- the apply lock: a file on every control host ----------------------------------------

    def lock_targets(self, ctx, pending: bool) -> list[str]:
        if not pending:
            # nothing to change: only clear stale locks this run may break (the facts saw them)
            return [h.name for h in ctx.inv.controls if h.name in ctx.facts and _breakable(ctx, h.name)]
        return [h.name for h in ctx.inv.controls]      # also in a run limited to some hosts

    def take_lock(self, ctx, target: str, pending: bool) -> list[str]:
        if not pending:
            # a stale lock left by a killed run would block every other machine for an hour
            why = stale_reason(ctx.facts[target].lock or "", time.time())
            ctx.log(f"{target}: clearing a stale apply lock ({why}); nothing else to do")
            end_dead_run([ctx.remotes[target], *self.session.others(target)], ctx.facts[target].lock, ctx.log)
            break_stale(ctx.remotes[target])
            return []
        self.session.take(target, force_unlock=ctx.options.force_unlock)
        return []

    def hold(self, run, skip: frozenset[str] = frozenset()) -> None:
        hosts = [h for h in run.inv.controls if h.name not in skip]
        self.session.connect(hosts)
        self.session.lock([h.name for h in hosts], flag=UNLOCK)

    def api_live(self, ctx) -> bool:
        return any(ctx.facts.get(h.name) and ctx.facts[h.name].units.get(APISERVER, ("",))[0] == "active"
                   for h in ctx.inv.controls)

    # --- etcd day 2: etcdctl on a control host ---------------------------------------------------

    def members(self, run) -> list:
        return etcd_hosts.members(run)

    def etcd_sites(self, run) -> list[str]:
        return [h.name for h in run.inv.controls]

    def etcdctl_at(self, run, site: str, args: list[str], what: str, timeout: float = 60) -> str:
        return etcd_hosts.etcdctl_local(run, site, args, what, timeout)

    def snapshot_save(self, run, dest, force: bool = False):
        return etcd_hosts.snapshot_save(run, dest, force)

    def restore_plan(self, inv, snapshot: str, stamp: str) -> list[str]:
        return etcd_hosts.restore_plan(inv, snapshot, stamp)

    def snapshot_restore(self, run, snapshot, wait_timeout: float) -> list[str]:
        return etcd_hosts.snapshot_restore(run, snapshot, wait_timeout)

    # --- upgrade -------------------------------------------------------------------------------------

    def survey(self, run, remotes: dict) -> tuple[list, dict[str, bool]]:
        inv = run.inv
        etcd = probes.ask(remotes[inv.controls[0].name],
                          probes.endpoint_health(etcd_hosts.day2_etcdctl(etcd_servers(inv))))
        return [], etcd             # the control hosts' own binaries say the rest

    def upgrade_turn(self, up, batch: list[str], etcd_turn: bool, etcd_inv, current_etcd: str | None,
                     was: str):
        names = ", ".join(batch)
        if etcd_turn:
            return Step(f"{names}: etcd {current_etcd} -> {etcd_inv.spec.artifacts.versions.etcd}, this member "
                        "alone; a healthy cluster before the next",
                        lambda up: up.converge(etcd_inv, frozenset(batch),
                                               only=frozenset({"preflight", "artifacts", "etcd"})))
        return Step(f"{names}: kube-apiserver, kube-controller-manager, kube-scheduler {was} -> {up.target} (apply "
                    f"on {names} alone: the apiserver restarts first and answers /readyz before the next host)",
                    lambda up: up.converge(up.inv, frozenset(batch), skip=up.control_only))


def _breakable(ctx, host: str) -> bool:
    content = ctx.facts[host].lock
    why = stale_reason(content, time.time()) if content is not None else None
    return bool(why) and (ctx.options.force_unlock or dead_here(why))
