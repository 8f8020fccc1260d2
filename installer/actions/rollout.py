"""The host machinery that ``certs renew`` (renew.py) and ``ca rotate`` (rotate.py) share: the
session, pushes, restarts in a safe order, and the TLS check of every endpoint.

Both operations go through the apply machinery: the hosts' facts are read with the same probe,
the files are rendered by the same code and pushed by the same diff (one round trip per host and
part, atomic renames, the pending-restart ledger on the host), and units are restarted with the
same script (one retry, journal on failure). What differs from apply is *when* units restart:
never all at once. ``roll`` restarts in ``RANK`` order (etcd, kube-apiserver,
konnectivity-server, controller-manager and scheduler, then the workers' kubelet and kube-proxy),
one host at a time, waiting after each for the component to be healthy again; only when the etcd
CA rotates do all etcd members start together (members of different CAs cannot talk).

The session connects every host (verified host keys), reads its facts and is refused unless the
hosts match the state (``installer apply`` made no change): a roll-out then changes exactly the
files that carry a new certificate, nothing else. It holds the apply lock throughout.

``endpoints.verify`` checks every TLS endpoint with a real handshake (``actions/endpoints.py``).

This lives apart from the two operations so that each of them reads as its own plan.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Iterator

from installer.core import components
from installer.core.diff import HostChanges, Selection
from installer.core.errors import InstallerError
from installer.core.facts import PROBE, parse, probe_input
from installer.core.pki.material import Changes, Material
from installer.core.render.plan import render_cluster
from installer.engine.context import Context, Options
from installer.engine.parts import control_plane_part, etcd_part, probed_files, worker_part
from installer.engine.planes import CONTROL_PLANE_UNITS
from installer.engine.run import Run
from installer.host import apireach, handover, probes, waits
from installer.host.parallel import each
from installer.host.ssh import HostError

ETCD, APISERVER, KONNECTIVITY, CONTROLLER_MANAGER, SCHEDULER, KUBELET, KUBE_PROXY = components.units(
    "etcd", "kube-apiserver", "konnectivity-server", "kube-controller-manager", "kube-scheduler", "kubelet",
    "kube-proxy")
# restart order: lower first (the component table's ranks); units without one go last
RANK = components.ranks()


class RenewError(InstallerError):
    """A host could not be changed, or an endpoint does not present what the state holds."""

    exit_code = 3


# --- results -------------------------------------------------------------------------------

@dataclass
class Reissued:
    name: str
    ca: str
    old_serial: str
    new_serial: str
    not_after: str


@dataclass
class Rollout:
    files: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)


@dataclass
class EndpointCheck:
    host: str
    endpoint: str
    address: str
    port: int
    cert: str | None           # state name it must present; None: the component's own self-signed one
    before: str | None = None  # serial presented before (hex), None when not read
    after: str | None = None
    ok: bool = False
    note: str = ""


@dataclass
class Report:
    action: str                # renew | rotate
    dry_run: bool
    reissued: list[Reissued] = field(default_factory=list)
    rollout: dict[str, Rollout] = field(default_factory=dict)
    restarts: list[str] = field(default_factory=list)        # host:unit in the order done
    checks: list[EndpointCheck] = field(default_factory=list)
    backup: str | None = None
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def hex_serial(serial: int) -> str:
    """A serial number as the reports show it."""
    return format(serial, "x")


def restart_order(units) -> list[str]:
    """``units`` in the order ``roll`` restarts them (``RANK``, then by name)."""
    return sorted(set(units), key=lambda u: (components.rank(u), u))


# --- hosts: connect, probe, push, restart ---------------------------------------------------

def _parallel(fn, items) -> None:
    """``fn`` on every item; the hosts' failures together as one RenewError."""
    results = each(fn, items).values()
    for r in results:
        if isinstance(r, InstallerError) and not isinstance(r, HostError):
            raise r
    errors = [str(r) for r in results if isinstance(r, HostError)]
    if errors:
        raise RenewError("; ".join(errors))


def _probe(ctx: Context, host: str) -> None:
    """The apply probe over the host's planned files, dirs and units (binaries are not
    looked at: a renewal never touches them); re-render the host with its facts."""
    plan = ctx.plans[host]
    out = ctx.remotes[host].run(PROBE, stdin=probe_input(probed_files(plan), list(plan.dirs), list(plan.units)),
                                what="read facts")
    try:
        ctx.facts[host] = parse(out.stdout)
    except ValueError as e:
        raise HostError(host, f"read facts: {e}") from None


def refresh(ctx: Context) -> None:
    ctx.plans = render_cluster(ctx.inv, ctx.material)
    _parallel(lambda h: _probe(ctx, h), [h.name for h in ctx.inv.spec.hosts])
    ctx.rerender()


def _parts(ctx: Context, host: str) -> list[tuple[str, Selection]]:
    plan = ctx.plans[host]
    if plan.role == "control":
        return [("etcd", etcd_part(plan)), ("control-plane", control_plane_part(plan))]
    return [("workers", worker_part(plan))]


def _differences(ctx: Context, host: str) -> list[str]:
    return [f"{host}: {part}: {line}" for part, sel in _parts(ctx, host)
            for line in ctx.changes_for(host, sel).summary()]


def push(ctx: Context, host: str) -> Rollout:
    """Write what differs on ``host``; every restart it implies is recorded in the host's
    pending-restart ledger instead of done (``_restart`` does them in order)."""
    done = Rollout()
    for part, sel in _parts(ctx, host):
        ch = ctx.changes_for(host, sel)
        ch.defer = sorted(set(ch.defer) | set(ch.restart) | set(ch.start))
        ch.restart, ch.start = [], []
        ctx.execute(f"push {part}", host, ch)
        done.files += [f.path for f in ch.write] + [f"- {p}" for p in ch.remove]
    done.units = restart_order(ctx.facts[host].pending_restarts)
    return done


def _wait_node_ready(ctx: Context, host: str, since: float | None, timeout: float) -> None:
    """The Node of ``host`` Ready again through the API, as posted by the kubelet started at
    ``since`` (the host's clock): a restarted kubelet reports NotReady until its first
    pod-lifecycle relist, seconds later. The next worker waits for it."""
    from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
    ctx.log(f"{host}: wait for Node {host} Ready")
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material) as client:
        try:
            kube.wait_nodes_ready(client, [host], timeout, since=since)
        except kube.KubeError as e:
            raise RenewError(f"{host}: {e}") from None


def _wait(ctx: Context, host: str, unit: str, nodes_ready: bool = False) -> None:
    """``unit`` started again (its row's wait, host/waits.py); with ``nodes_ready`` a restarted
    kubelet's Node also Ready again through the API."""
    # the kubelet's start, on its own clock (whole seconds, as its heartbeats)
    started = probes.ask(ctx.remotes[host], probes.unit_started(unit)) if unit == KUBELET and nodes_ready else None
    if unit in CONTROL_PLANE_UNITS:
        ctx.plane.wait(ctx, host, unit)
    else:
        waits.wait(ctx, host, unit)
    if unit == KUBELET and nodes_ready:
        _wait_node_ready(ctx, host, started, ctx.options.wait_timeout)


def _restart(ctx: Context, host: str, unit: str, report: Report, no_block: bool = False) -> None:
    ctx.log(f"{host}: restart {unit}")
    if unit in CONTROL_PLANE_UNITS:
        ctx.plane.restart(ctx, host, unit, no_block=no_block)
    else:
        # the apply script: one retry, the journal in the error, the ledger entry cleared after
        ctx.execute("restart", host, HostChanges(host, restart=[unit]), no_block=no_block)
    report.restarts.append(f"{host}:{unit}")


def roll(ctx: Context, pending: dict[str, list[str]], report: Report, etcd_together: bool = False,
         nodes_ready: bool = False) -> None:
    """Restart ``pending`` (host -> units) in the safe order, waiting after each host. With
    ``etcd_together`` every etcd member starts at once (members of a new etcd CA cannot reach
    the old ones) and the cluster's health is waited for once. With ``nodes_ready`` a restarted
    kubelet's Node must be Ready through the API before the next host."""
    order = [h.name for h in ctx.inv.spec.hosts]
    started: dict[str, set[str]] = {}      # host -> units already (re)started by a step aside
    for rank in sorted({components.rank(u) for units in pending.values() for u in units}):
        if rank == 0 and etcd_together:
            hosts = [h for h in order if ETCD in pending.get(h, ())]
            for h in hosts:
                _restart(ctx, h, ETCD, report, no_block=True)
            ctx.log(f"{hosts[0]}: wait for a healthy etcd cluster")
            _wait(ctx, hosts[0], ETCD)
            continue
        for h in order:
            units = [u for u in pending.get(h, ()) if components.rank(u) == rank and u not in started.get(h, ())]
            # a restarting etcd member: its own apiserver (the only one using it) steps aside, and
            # its start after the member does the apiserver's pending restart too; a restarting
            # apiserver leaves the workers' balancers first (host/handover.py)
            with handover.aside(ctx, h) if ETCD in units else nullcontext() as aside, \
                    handover.restarting(ctx, h) if APISERVER in units else nullcontext():
                for u in units:
                    _restart(ctx, h, u, report)
                for u in units:
                    if u != APISERVER:              # restarting() waits for it, ready and back
                        ctx.log(f"{h}: wait for {u}")
                        _wait(ctx, h, u, nodes_ready)
            if aside and APISERVER in pending.get(h, ()):
                started.setdefault(h, set()).add(APISERVER)
                report.restarts.append(f"{h}:{APISERVER}")


def stop_units(ctx: Context, host: str, units: list[str]) -> None:
    present = [u for u in units if u in ctx.plans[host].units]
    if present:
        ctx.log(f"{host}: stop {' '.join(present)}")
        for u in present:
            ctx.plane.stop(ctx, host, u)



# --- the session both operations share -----------------------------------------------------

@contextmanager
def session(run: Run, material: Material, wait_timeout: float) -> Iterator[Context]:
    """Hosts connected (verified host keys), facts read, apply lock held (the control hosts' or
    a hosted tenant's Lease: ``Run.hold``) for the block."""
    inv, log = run.inv, run.log
    ctx = Context(inv, run.state, Options(wait_timeout=wait_timeout), material, Changes(), log=log,
                  session=run.session, plane=run.plane)
    run.session.connect(inv.spec.hosts)
    log(f"connecting to {len(inv.spec.hosts)} host(s)")
    refresh(ctx)
    differences = [line for h in inv.spec.hosts for line in _differences(ctx, h.name)]
    if differences:
        raise RenewError("the hosts do not match the state (run `installer apply` first): "
                         + "; ".join(differences[:8]) + (" ..." if len(differences) > 8 else ""))
    held = ExitStack()
    try:
        held.enter_context(run.hold())
    except InstallerError as e:          # a host's lock, or the tenant's Lease, refused
        raise RenewError(str(e)) from None
    with held:
        yield ctx
