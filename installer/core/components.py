"""The component table: every systemd-run component of a cluster, declared once.

One row per component (role, binaries, unit, restart rank, ports, health check, version
source), in the style of the certificate table (core/pki/specs.py): declarative, pure, no
I/O. Preflight (ports), fetch (which unit a binary restarts), select (the phases' units),
rollout (restart order) and teardown/verify (unit names) read it instead of lists of their own.

Adding a worker component: one row here, its render function (core/render/worker.py) and its
unit template.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTROL, WORKER, ANY = "control", "worker", "any"
# what a component's ``wait`` may name: after a (re)start, it counts as started when ...
WAITS = {
    "active": "systemd reports the unit active (a oneshot: it ran)",
    "listening": "the unit is active and something listens on its secure port",
    "etcd-health": "every member of the cluster answers etcdctl endpoint health (mTLS)",
    "apiserver-ready": "/livez and /readyz answer 200 over TLS verified with the cluster CA",
}
LAST_RANK = 9                      # rollout restarts units without a rank last


@dataclass(frozen=True)
class Port:
    number: int
    what: str
    preflight: bool = True         # preflight refuses a host where something else listens on it


@dataclass(frozen=True)
class Component:
    name: str
    role: str                      # control | worker | any (both kinds of host)
    unit: str
    binaries: tuple[str, ...] = ()  # a changed one restarts ``unit``
    rank: int | None = None        # restart order in a rollout, lower first; None: last
    ports: tuple[Port, ...] = ()
    wait: str = ""                 # what "started" means for it: a key of WAITS (host/waits.py does them)
    version: tuple[str, ...] = ()  # the field of the inventory's spec its version comes from; () pinned here
    addon: bool = False            # rendered only when its addon is enabled
    # a change reloads the unit instead of restarting it (systemctl reload-or-restart): the
    # balancer re-executes itself and keeps the connections it carries
    reload: bool = False


COMPONENTS = (
    Component("etcd", CONTROL, "etcd.service", ("etcd",), rank=0,
              ports=(Port(2379, "client"), Port(2380, "peer")),
              wait="etcd-health", version=("artifacts", "versions", "etcd")),
    Component("kube-apiserver", CONTROL, "kube-apiserver.service", ("kube-apiserver",), rank=1,
              ports=(Port(6443, "secure"),), wait="apiserver-ready", version=("kubernetes", "version")),
    Component("konnectivity-server", CONTROL, "konnectivity-server.service", ("konnectivity-server",), rank=2,
              ports=(Port(8132, "agent", preflight=False), Port(8133, "admin", preflight=False),
                     Port(8134, "health", preflight=False)),
              wait="active",
              addon=True),
    Component("kube-controller-manager", CONTROL, "kube-controller-manager.service", ("kube-controller-manager",),
              rank=3, ports=(Port(10257, "secure"),), wait="listening", version=("kubernetes", "version")),
    Component("kube-scheduler", CONTROL, "kube-scheduler.service", ("kube-scheduler",), rank=3,
              ports=(Port(10259, "secure"),), wait="listening", version=("kubernetes", "version")),
    # spec.apiServer.balancer: local. Before containerd, kubelet and kube-proxy (its unit orders
    # itself so); a new binary or config is a reload (haproxy -Ws re-executes the new binary)
    # rank 3: a rollout reloads it (a new cluster CA: its checks verify the apiservers with it)
    # before it restarts kubelet and kube-proxy, which reach the API through it
    Component("api-balancer", WORKER, "hiddenplane-api-balancer.service", ("haproxy",), rank=3,
              wait="active",
              addon=True, reload=True),
    Component("hiddenplane-routes", ANY, "hiddenplane-routes.service",
              wait="active"),
    # with cni: routes, the timer that puts back the routes a link going down took away
    # (core/render/network.py); its service is run by it, never started by the installer
    Component("hiddenplane-routes-repair", ANY, "hiddenplane-routes-repair.timer",
              wait="active"),
    Component("containerd", WORKER, "containerd.service", ("containerd",),
              wait="active", version=("artifacts", "versions", "containerd")),
    Component("kubelet", WORKER, "kubelet.service", ("kubelet",), rank=4,
              ports=(Port(10248, "healthz"), Port(10250, "secure")),
              wait="listening", version=("kubernetes", "version")),
    Component("kube-proxy", WORKER, "kube-proxy.service", ("kube-proxy",), rank=4,
              ports=(Port(10249, "metrics"), Port(10256, "healthz")),
              wait="active", version=("kubernetes", "version")),
)

# binaries installed next to a component that restart nothing when they change
HELPER_BINARIES = {
    "etcdctl": "etcd", "etcdutl": "etcd",
    "containerd-shim-runc-v2": "containerd", "ctr": "containerd", "runc": "containerd",
    # the client of the balancer's runtime API (host/handover.py drains an apiserver with it)
    "socat": "api-balancer",
}


def by_name(name: str) -> Component:
    return next(c for c in COMPONENTS if c.name == name)


def by_unit(unit: str) -> Component | None:
    return next((c for c in COMPONENTS if c.unit == unit), None)


def by_role(role: str) -> tuple[Component, ...]:
    return tuple(c for c in COMPONENTS if c.role in (role, ANY))


def reloads(unit_name: str) -> bool:
    """Whether a change to ``unit_name``'s inputs reloads it rather than restarting it."""
    c = by_unit(unit_name)
    return c is not None and c.reload


def unit(name: str) -> str:
    return by_name(name).unit


def units(*names: str) -> tuple[str, ...]:
    return tuple(unit(n) for n in names)


def restarts() -> dict[str, str]:
    """binary -> the unit to restart when it changes."""
    return {b: c.unit for c in COMPONENTS for b in c.binaries}


def ranks() -> dict[str, int]:
    """unit -> restart rank, for the units that have one."""
    return {c.unit: c.rank for c in COMPONENTS if c.rank is not None}


def rank(unit_name: str) -> int:
    return ranks().get(unit_name, LAST_RANK)


def preflight_ports(role: str) -> dict[int, str]:
    """port -> the unit allowed to listen on it, for the ports preflight checks on a ``role`` host."""
    return {p.number: c.unit for c in by_role(role) for p in c.ports if p.preflight}


def binaries_of(name: str) -> tuple[str, ...]:
    """Row ``name``'s binaries, then its helpers."""
    return (*by_name(name).binaries, *(h for h, owner in HELPER_BINARIES.items() if owner == name))


def installed_binaries(role: str) -> tuple[str, ...]:
    """What a ``role`` host gets in /usr/local/bin: each row's binaries, then its helpers, in
    table order (add-ons are added by fetch when enabled)."""
    rows = [c for c in COMPONENTS if c.role == role and not c.addon]
    return tuple(b for c in rows for b in binaries_of(c.name))


def ports(name: str) -> tuple[int, ...]:
    return tuple(p.number for p in by_name(name).ports)


def port(name: str, what: str) -> int:
    """The port ``name`` serves ``what`` on (e.g. ``port("etcd", "peer")``)."""
    return next(p.number for p in by_name(name).ports if p.what == what)


def version_of(name: str, spec) -> str | None:
    """The version the inventory's ``spec`` asks for ``name`` (None: pinned by the installer,
    e.g. konnectivity's KONNECTIVITY_VERSION)."""
    path = by_name(name).version
    if not path:
        return None
    value = spec
    for attr in path:
        value = getattr(value, attr)
    return value


# the units the phases and day-2 commands start and wait for: each role's rows in table order
# (add-ons and hiddenplane-routes with its repair timer are not waited for); etcd has steps of its own
ETCD_UNIT = unit("etcd")
CONTROL_UNITS = tuple(c.unit for c in COMPONENTS if c.role == CONTROL and c.name != "etcd" and not c.addon)
WORKER_UNITS = tuple(c.unit for c in COMPONENTS if c.role == WORKER and not c.addon)
BALANCER_UNIT = unit("api-balancer")
# the ports the controller-manager and scheduler serve on loopback only
LOCAL_CONTROL_PORTS = ports("kube-controller-manager") + ports("kube-scheduler")


def worker_units(inv) -> tuple[str, ...]:
    """The units every worker starts and waits for: the API balancer first when it runs one."""
    return ((BALANCER_UNIT,) if inv.local_balancer else ()) + WORKER_UNITS
