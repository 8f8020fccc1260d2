"""What an upgrade may do, pure: the version-skew rules and the order of a rolling upgrade.

Kubernetes' version-skew policy (kubernetes.io/releases/version-skew-policy) as it bears on an
installer that rolls one cluster from one version to the next:

* kube-apiserver: in an HA cluster the apiservers may differ by at most one minor while they
  are rolled; so a cluster moves one minor at a time (1.36 -> 1.37, never 1.36 -> 1.38).
* kube-controller-manager and kube-scheduler must not be newer than the apiservers they talk
  to: on each control host the apiserver goes first.
* kubelet and kube-proxy must not be newer than kube-apiserver (up to three minors older is
  allowed): workers go after every control host.
* going down a minor is not supported upstream (stored objects may already use the newer
  API); a patch down within the minor is (the rollback this tool offers).

etcd has its own versions: a patch within its minor is rolled one member at a time; a new
etcd minor is not done by ``upgrade`` (its own migration rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from installer.core.inventory import Inventory
from installer.core.versions import parse

RULES = {
    "minor-skip": "the apiservers of a cluster may differ by at most one minor while they are rolled: upgrade one "
                  "minor at a time",
    "minor-down": "going down a minor is not supported (stored objects may already use the newer API versions); "
                  "only a patch within the same minor can be rolled back",
    "major": "a change of the major version is not supported",
    "etcd-minor": "upgrade rolls etcd patch releases only (3.6.x -> 3.6.y); a new etcd minor has its own "
                  "migration rules",
}


class SkewError(ValueError):
    """An upgrade the version-skew policy forbids; the message holds the rule."""


def _v(version: str, what: str) -> tuple[int, int, int]:
    parsed = parse(version if version.startswith("v") else f"v{version}")
    if parsed is None:
        raise SkewError(f"{what}: {version!r} is not a version (vMAJOR.MINOR.PATCH)")
    return parsed


def check_kubernetes(current: str, target: str) -> str:
    """The kind of move from ``current`` to ``target``: "none", "patch", "patch-down" or "minor";
    SkewError with the rule for what the policy forbids."""
    c, t = _v(current, "current version"), _v(target, "target version")
    if c == t:
        return "none"
    if c[0] != t[0]:
        raise SkewError(f"{current} -> {target}: {RULES['major']}")
    if t[1] > c[1] + 1:
        raise SkewError(f"{current} -> {target} skips v{c[0]}.{c[1] + 1}: {RULES['minor-skip']}")
    if t[1] < c[1]:
        raise SkewError(f"{current} -> {target} goes down a minor: {RULES['minor-down']}")
    if t[1] == c[1] + 1:
        return "minor"
    return "patch" if t > c else "patch-down"


def check_etcd(current: str, target: str) -> bool:
    """Whether etcd's version changes (a patch within its minor); SkewError for a new minor."""
    c, t = _v(current, "current etcd version"), _v(target, "target etcd version")
    if c[:2] != t[:2]:
        raise SkewError(f"etcd {current} -> {target}: {RULES['etcd-minor']}")
    return c != t


@dataclass(frozen=True)
class HostState:
    """What the upgrade needs to know of one host (read by the upgrade command's probes)."""
    name: str
    role: str
    kubernetes: str | None          # the version its Kubernetes binaries report (None: not installed)
    etcd: str | None = None         # control hosts: the version etcd reports


def batches(names: list[str], size: int) -> list[list[str]]:
    size = max(1, size)
    return [names[i:i + size] for i in range(0, len(names), size)]


def upgrade_order(hosts: list[HostState], target: str, target_etcd: str, max_unavailable: int) -> list[list[str]]:
    """The hosts still to do, in the order they are done: every control host whose etcd differs
    first (etcd, one member at a time), then each control host not at ``target`` alone, then the
    workers not at ``target`` in batches of ``max_unavailable``. A host already done is left out:
    a second run, or a run after an interruption, does only what is left."""
    controls = [h for h in hosts if h.role == "control"]
    workers = [h for h in hosts if h.role == "worker"]
    etcd = [[h.name] for h in controls if h.etcd is not None and h.etcd != target_etcd]
    control = [[h.name] for h in controls if h.kubernetes != target]
    return etcd + control + batches([h.name for h in workers if h.kubernetes != target], max_unavailable)


def oldest(found: list[str]) -> str | None:
    return min(found, key=lambda v: _v(v, "version")) if found else None


def current_version(hosts: list[HostState]) -> str | None:
    """The cluster's version: the oldest Kubernetes version a control host reports (an upgrade
    cut short leaves some control hosts newer; the check is made from the oldest)."""
    return oldest([h.kubernetes for h in hosts if h.role == "control" and h.kubernetes])


def current_etcd(hosts: list[HostState]) -> str | None:
    """The oldest etcd a control host reports."""
    return oldest([h.etcd for h in hosts if h.role == "control" and h.etcd])


def leases_waiting(now: dict[str, str | None], before: dict[str, str | None],
                   current_pods: set[str] | None = None) -> list[str]:
    """The leader Leases (name -> holder identity, ``<host or pod>_<uuid>``) that no restarted
    instance holds yet: none holds it, or the holder before the upgrade does, or (``current_pods``,
    a hosted tenant: its components' pods that run and are not being deleted) a holder that is
    not one of them. That is the old ReplicaSet's standby, which took the Lease when the old
    leader went and is itself terminating once the roll is done: a worker drained then would
    wait out one more hand-over (up to the Lease's 15 s) with nobody taking its evicted pods out
    of the Services (CI of 59e2dfc: 10 refused workload probes, the wait satisfied in 0.1 s)."""
    return [name for name, holder in now.items()
            if holder is None or holder == before.get(name)
            or (current_pods is not None and holder.split("_")[0] not in current_pods)]


def with_versions(inv: Inventory, kubernetes: str | None = None, etcd: str | None = None) -> Inventory:
    """``inv`` at other versions (the models are frozen: copies with the fields replaced)."""
    spec = inv.spec
    if kubernetes:
        spec = spec.model_copy(update={"kubernetes": spec.kubernetes.model_copy(update={"version": kubernetes})})
    if etcd:
        versions = spec.artifacts.versions.model_copy(update={"etcd": etcd})
        spec = spec.model_copy(update={"artifacts": spec.artifacts.model_copy(update={"versions": versions})})
    return inv.model_copy(update={"spec": spec})
