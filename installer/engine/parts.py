"""Which part of each host's plan every host-changing phase owns (apply's phases, and the
day-2 pushes that use the same parts). Every planned file, directory, user and
unit belongs to exactly one phase (a test checks the partition)."""

from __future__ import annotations

from installer.core import components, trust
from installer.core.diff import Selection
from installer.core.render.files import HostPlan
from installer.core.render.worker import KUBELET_KUBECONFIG
from installer.engine.context import Context, Event
from installer.host.fetch import binary_files


def _is_etcd(path: str) -> bool:
    # the etcd CA and health-check client are used to wait for etcd's health right after it starts
    return (path.startswith(("/etc/etcd", "/var/lib/etcd", "/etc/kubernetes/pki/etcd"))
            or path == f"/etc/systemd/system/{components.ETCD_UNIT}")


def etcd_part(plan: HostPlan) -> Selection:
    return Selection(
        files=tuple(f for f in plan.files.values() if _is_etcd(f.path)),
        dirs=tuple(d for d in plan.dirs.values() if _is_etcd(d.path)),
        users=tuple(plan.users),
        units=(components.ETCD_UNIT,),
    )


def control_plane_part(plan: HostPlan) -> Selection:
    # the control-plane units, then hiddenplane-routes.service and its repair timer when the host routes to pods
    return Selection(
        files=tuple(f for f in plan.files.values() if not _is_etcd(f.path)),
        dirs=tuple(d for d in plan.dirs.values() if not _is_etcd(d.path)),
        units=tuple(u for u in plan.units if u != components.ETCD_UNIT),
    )


def worker_part(plan: HostPlan) -> Selection:
    return Selection(files=tuple(plan.files.values()), dirs=tuple(plan.dirs.values()),
                     units=tuple(plan.units), absent=tuple(plan.absent))


def binaries_part(ctx: Context, host: str) -> Selection:
    return Selection(files=tuple(binary_files(ctx.artifacts, ctx.inv.host(host).role)))


def managed_paths(ctx: Context, host: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """Everything the probe must look at on ``host``: planned files and binaries, dirs, units,
    and the certificate files whose content it returns (core/trust.py: CAs and leaves)."""
    plan = ctx.plans[host]
    files = probed_files(plan) + [f.path for f in binaries_part(ctx, host).files]
    return files, list(plan.dirs), list(plan.units), trust.certificate_paths(plan)


def probed_files(plan: HostPlan) -> list[str]:
    """The files the facts probe reads on a host: the plan's, those it removes, and on a worker
    the joined kubelet's kubeconfig: a plan made before the facts assumes a kubelet that has
    not joined, and once the facts say it has, the plan holds that file too (render/worker.py)."""
    files = list(plan.files) + list(plan.absent)
    if plan.role == "worker" and KUBELET_KUBECONFIG not in files:
        files.append(KUBELET_KUBECONFIG)
    return files


def phase_parts(ctx: Context, host: str) -> dict[str, Selection]:
    """Each host-changing phase's selection for ``host``."""
    plan = ctx.plans[host]
    parts = {"artifacts": binaries_part(ctx, host)}
    if plan.role == "control":
        parts["etcd"] = etcd_part(plan)
        parts["control-plane"] = control_plane_part(plan)
    else:
        parts["workers"] = worker_part(plan)
    return parts


def _changes(ctx: Context):
    """(host, phase, HostChanges) for every non-empty change the running phases would make."""
    for h in (x.name for x in ctx.hosts()):
        if h in ctx.plans:
            for phase, sel in phase_parts(ctx, h).items():
                if ctx.will_run(phase) and not (ch := ctx.changes_for(h, sel)).empty:
                    yield h, phase, ch


def planned_changes(ctx: Context) -> list[Event]:
    """What the host-changing phases would do, per host and phase, as dry-run events: computed
    from the facts, no round trip."""
    return [Event(phase, h, "changed", detail=ch.summary()) for h, phase, ch in _changes(ctx)]


def pending_work(ctx: Context) -> bool:
    """Will any phase that runs change any host?"""
    return next(_changes(ctx), None) is not None
