"""Day-2 certificate operations: ``certs renew`` (new leaves under the same CAs) and ``ca rotate``
(new CAs, every leaf re-issued under them).

Both go through the apply machinery: the hosts' facts are read with the same probe, the files
are rendered by the same code and pushed by the same diff (one round trip per host and part,
atomic renames, the pending-restart ledger on the host), and units are restarted with the same
script (one retry, journal on failure). What differs is *when* units restart: never all at once.

``renew``: re-issue leaf certificates (new keys; never a CA, the service-account key or the
encryption key), keep the old files in ``<state>/backups/renew-<time>/`` (0700, files 0600),
push, then restart in a safe order: etcd one member at a time (cluster healthy before the
next), kube-apiserver one host at a time (/livez and /readyz answer before the next),
konnectivity-server, controller-manager and scheduler, then the workers' kubelet and
kube-proxy. The files are pushed before any restart and every new leaf is signed by the CA
every peer already trusts, so old and new certificates work together throughout. Finally every
TLS endpoint is checked with a real handshake, through an SSH channel to the host (so
loopback-only ports and bastions work too): it must present the state's certificate.

Refused unless the hosts match the state (``installer apply`` made no change): the renewal then
changes exactly the files that carry a renewed certificate, nothing else.

``rotate_ca``: new CA(s) (default all three; ``which`` limits), every leaf re-issued under them,
new bootstrap tokens. Members holding different CAs cannot talk to each other, so the roll-out
takes the control plane down: stop every controller-manager, scheduler, konnectivity-server and
apiserver; stop every etcd member when the etcd CA rotates (otherwise members restart one at a
time as in a renewal); push; start etcd on every member, wait for a healthy cluster (the data
directory is never touched: no data is lost); start the apiservers one by one (wait for
/readyz), then the rest of the control plane. With a real API (``api=True``) the new bootstrap
token Secrets are created and the old ones deleted. Then each worker in turn: stop kubelet and
kube-proxy, remove the kubelet's client certificate and kubeconfig (signed by the old CA), push
the new CA, serving pair, kube-proxy kubeconfig and bootstrap kubeconfig, start them: the
kubelet bootstraps again against the new CA. The service-account key stays (tokens stay valid),
and so does the encryption key.

Kubelet *client* certificates are never issued here: the cluster signs them (TLS
bootstrapping) and the kubelet renews them itself.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
import ssl
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from cryptography import x509

from . import api
from .diff import HostChanges, Selection
from .errors import InstallerError, StateError
from .facts import PROBE, parse, probe_input
from .health import client_context, wait_ok
from .inventory import Inventory
from .phases.acquire_lock import AcquireLock, release
from .phases.base import Context, Options
from .phases.connect_hosts import ConnectHosts
from .phases.join_workers import KUBELET_PORTS, active_script
from .phases.select import control_plane_part, etcd_part, worker_part
from .phases.start_control_plane import listening_script
from .phases.start_etcd import health_script
from .pki import issue
from .pki.issue import Pair
from .pki.material import Changes, Material, ensure, new_token
from .pki.specs import CAS, CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA, cert_specs
from .render.addons.konnectivity import AGENT_PORT, enabled as konnectivity_enabled
from .render.plan import render_cluster
from .ssh import HostError, Remote
from .state import StateDir, write_atomic
from .tlsfiles import client_files

ETCD = "etcd.service"
APISERVER = "kube-apiserver.service"
KONNECTIVITY = "konnectivity-server.service"
CONTROLLER_MANAGER = "kube-controller-manager.service"
SCHEDULER = "kube-scheduler.service"
KUBELET = "kubelet.service"
KUBE_PROXY = "kube-proxy.service"
# restart order: lower first; units not named here (none today) go last
RANK = {ETCD: 0, APISERVER: 1, KONNECTIVITY: 2, CONTROLLER_MANAGER: 3, SCHEDULER: 3, KUBELET: 4, KUBE_PROXY: 4}
SECURE_PORTS = {CONTROLLER_MANAGER: 10257, SCHEDULER: 10259}
KUBELET_CLIENT_FILES = ("/var/lib/kubelet/pki/kubelet-client-*.pem", "/etc/kubernetes/kubelet.conf")
BACKUPS = "backups"
CA_CHOICES = {"ca": CLUSTER_CA, "etcd-ca": ETCD_CA, "front-proxy-ca": FRONT_PROXY_CA}
NOT_OURS = ("kubelet client certificates (/var/lib/kubelet/pki/kubelet-client-current.pem) are not renewed "
            "here: the cluster signs them through TLS bootstrapping and each kubelet renews its own "
            "(short-lived, controller-manager --cluster-signing-duration)")


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


def _hex(serial: int) -> str:
    return format(serial, "x")


# --- pure: which certificates, new material, where it goes ----------------------------------

def leaf_names(inv: Inventory, material: Material, only=()) -> list[str]:
    """The leaves to re-issue: every certificate of the table (``only``: names or glob patterns)."""
    names = [s.name for s in cert_specs(inv)]
    if not only:
        return names
    cas = {c.name for c in CAS}
    picked, unknown = [], []
    for pattern in only:
        if pattern in cas or pattern in CA_CHOICES:
            raise InstallerError(f"--only {pattern}: a CA is never renewed; use `installer ca rotate`")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            unknown.append(pattern)
        picked += [n for n in hits if n not in picked]
    if unknown:
        raise InstallerError(f"--only: no certificate named {', '.join(unknown)}; certificates: {', '.join(names)}")
    return [n for n in names if n in picked]


def _copy(m: Material) -> Material:
    return Material(cas=dict(m.cas), certs=dict(m.certs), sa_key=m.sa_key, encryption_key=m.encryption_key,
                    tokens=dict(m.tokens), pod_cidrs=dict(m.pod_cidrs))


def reissue(inv: Inventory, material: Material, names, now: dt.datetime | None = None) -> Material:
    """A copy of ``material`` with the leaves ``names`` re-issued under its CAs, each with a new
    key. CAs, the service-account key, the encryption key and tokens are the same objects."""
    now = now or dt.datetime.now(dt.timezone.utc)
    pki = inv.spec.pki
    new = _copy(material)
    specs = {s.name: s for s in cert_specs(inv)}
    for name in names:
        spec = specs[name]
        ca = new.cas[spec.ca]
        if ca.cert.not_valid_after_utc <= now:
            raise StateError(f"the {spec.ca} CA expired on {ca.cert.not_valid_after_utc:%Y-%m-%d}: "
                             "rotate it with `installer ca rotate`")
        key = issue.new_key(pki.keyAlgorithm)
        new.certs[name] = Pair(issue.issue(spec, key, ca, pki.certValidityDays, now), key)
    return new


def rotated(inv: Inventory, material: Material, which, now: dt.datetime | None = None) -> Material:
    """New CAs ``which`` (state names), every leaf re-issued (new keys), a new bootstrap token per
    worker; the service-account key, encryption key and pod CIDRs kept."""
    now = now or dt.datetime.now(dt.timezone.utc)
    pki = inv.spec.pki
    new = _copy(material)
    for ca in CAS:
        if ca.name in which:
            key = issue.new_key(pki.keyAlgorithm)
            new.cas[ca.name] = Pair(issue.make_ca(ca.cn, key, pki.caValidityDays, now), key)
    new = reissue(inv, new, [s.name for s in cert_specs(inv)], now)
    ttl = dt.timedelta(hours=pki.bootstrapTokenTTLHours)
    new.tokens = {h.name: new_token(now + ttl) for h in inv.workers}
    return new


def rollout(inv: Inventory, old: Material, new: Material) -> dict[str, Rollout]:
    """Per host: the files that differ between the two materials and the units they restart
    (rendered without facts, as for a host that matches the state)."""
    before, after = render_cluster(inv, old), render_cluster(inv, new)
    out = {}
    for h in inv.spec.hosts:
        a, b = before[h.name].files, after[h.name].files
        files = sorted(p for p, f in b.items() if p not in a or a[p].sha256 != f.sha256)
        units = sorted({u for p in files for u in b[p].restarts}, key=lambda u: (RANK.get(u, 9), u))
        if files:
            out[h.name] = Rollout(files, units)
    return out


def _reissued(inv: Inventory, old: Material, new: Material, names) -> list[Reissued]:
    ca = {s.name: s.ca for s in cert_specs(inv)}
    return [Reissued(n, ca[n], _hex(old.certs[n].cert.serial_number) if n in old.certs else "-",
                     _hex(new.certs[n].cert.serial_number), new.certs[n].cert.not_valid_after_utc.isoformat())
            for n in names]


# --- the state -----------------------------------------------------------------------------

def load_state(inv: Inventory, state_dir) -> tuple[StateDir, Material]:
    """The state as it is; refused when it is missing, incomplete or does not match the
    inventory (an apply would change it): run ``installer apply`` first."""
    state = api.state_for(inv, state_dir)
    if not state.root.is_dir():
        raise StateError(f"state directory {state.root} does not exist; run `installer apply` first (or pass --state)")
    loaded = state.load(inv)
    _, changes = ensure(inv, loaded)
    # an expired leaf is what a renewal is for; tokens are not touched by a renewal
    stale = {n: why for n, why in changes.reasons.items()
             if why not in ("expired", "expiring") and not (n.startswith("token/") and why != "new")}
    if stale:
        raise StateError(f"the state in {state.root} does not match the inventory ("
                         + ", ".join(f"{n}: {w}" for n, w in sorted(stale.items()))
                         + "); run `installer apply` first")
    return state, loaded


def backup(state: StateDir, label: str, paths: list[Path]) -> Path:
    """Copy ``paths`` (inside the state) to ``<state>/backups/<label>-<UTC time>/`` keeping their
    relative layout: directories 0700, files 0600. Returns the backup directory."""
    base = state.root / BACKUPS
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    root = base / f"{label}-{stamp}"
    n = 1
    while root.exists():
        n += 1
        root = base / f"{label}-{stamp}-{n}"
    for p in paths:
        if p.is_file():
            write_atomic(root / p.relative_to(state.root), p.read_bytes(), 0o600)
    root.mkdir(parents=True, exist_ok=True)
    for d in [base, root, *(x for x in root.rglob("*") if x.is_dir())]:
        os.chmod(d, 0o700)
    return root


@contextmanager
def _resumable(backup_dir: str, finish: str) -> Iterator[None]:
    """After the state was saved: a failure says where the old material is and how to finish."""
    try:
        yield
    except InstallerError as e:
        raise RenewError(f"{e}\nthe state already holds the new certificates (the old ones are in {backup_dir}); "
                         f"{finish}") from None


def _pki_paths(state: StateDir, names) -> list[Path]:
    return [state.pki(n, ext) for n in names for ext in ("crt", "key")]


def _save(state: StateDir, inv: Inventory, material: Material) -> None:
    state.save(material)
    api.write_admin_kubeconfig(inv, state, material)


# --- hosts: connect, probe, push, restart ---------------------------------------------------

def _parallel(fn, items) -> None:
    errors = []
    items = list(items)
    with ThreadPoolExecutor(max_workers=max(1, min(10, len(items)))) as pool:
        for fut in [pool.submit(fn, i) for i in items]:
            try:
                fut.result()
            except HostError as e:
                errors.append(str(e))
    if errors:
        raise RenewError("; ".join(errors))


def _probe(ctx: Context, host: str) -> None:
    """The apply probe over the host's planned files, dirs and units (binaries are not
    looked at: a renewal never touches them); re-render the host with its facts."""
    plan = ctx.plans[host]
    out = ctx.remotes[host].run(PROBE, stdin=probe_input(list(plan.files) + list(plan.absent), list(plan.dirs),
                                                         list(plan.units)), what="read facts")
    try:
        ctx.facts[host] = parse(out.stdout)
    except ValueError as e:
        raise HostError(host, f"read facts: {e}") from None


def _refresh(ctx: Context, hosts=None) -> None:
    ctx.plans = render_cluster(ctx.inv, ctx.material)
    _parallel(lambda h: _probe(ctx, h), hosts or [h.name for h in ctx.inv.spec.hosts])
    ConnectHosts().finish(ctx, [])           # render again with what the hosts told us


def _parts(ctx: Context, host: str) -> list[tuple[str, Selection]]:
    plan = ctx.plans[host]
    if plan.role == "control":
        return [("etcd", etcd_part(plan)), ("control-plane", control_plane_part(plan))]
    return [("workers", worker_part(plan))]


def _differences(ctx: Context, host: str) -> list[str]:
    return [f"{host}: {part}: {line}" for part, sel in _parts(ctx, host)
            for line in ctx.changes_for(host, sel).summary()]


def _push(ctx: Context, host: str) -> Rollout:
    """Write what differs on ``host``; every restart it implies is recorded in the host's
    pending-restart ledger instead of done (``_restart`` does them in order)."""
    done = Rollout()
    for part, sel in _parts(ctx, host):
        ch = ctx.changes_for(host, sel)
        ch.defer = sorted(set(ch.defer) | set(ch.restart) | set(ch.start))
        ch.restart, ch.start = [], []
        ctx.execute(f"push {part}", host, ch)
        done.files += [f.path for f in ch.write] + [f"- {p}" for p in ch.remove]
    done.units = sorted(ctx.facts[host].pending_restarts, key=lambda u: (RANK.get(u, 9), u))
    return done


def _run(ctx: Context, host: str, script: str, what: str, timeout: float) -> None:
    r = ctx.remotes[host].run(script, check=False, what=what, timeout=timeout + 30)
    if r.rc != 0:
        raise RenewError(f"{host}: {what}: {r.stderr.strip()[-600:]}")


def _wait(ctx: Context, host: str, unit: str) -> None:
    t = ctx.options.wait_timeout
    h = ctx.inv.host(host)
    if unit == ETCD:
        _run(ctx, host, health_script(ctx, t), "wait for etcd health", t)
    elif unit == APISERVER:
        port = ctx.inv.spec.apiServer.port
        with client_context(ctx.material) as tls:
            failure = wait_ok(tls, h.address, port, ("/livez", "/readyz"), t)
        if failure:
            raise RenewError(f"{host}: kube-apiserver is not healthy on {h.address}:{port}: {failure}")
    elif unit in SECURE_PORTS:
        _run(ctx, host, listening_script((SECURE_PORTS[unit],), t), f"wait for {unit}", t)
    elif unit == KUBELET:
        _run(ctx, host, active_script((unit,), t) + "\n" + listening_script(KUBELET_PORTS, t), "wait for the kubelet",
             2 * t)
    else:
        _run(ctx, host, active_script((unit,), t), f"wait for {unit}", t)


def _restart(ctx: Context, host: str, unit: str, report: Report, no_block: bool = False) -> None:
    ctx.log(f"{host}: restart {unit}")
    # the apply script: one retry, the journal in the error, the ledger entry cleared after
    ctx.execute("restart", host, HostChanges(host, restart=[unit]), no_block=no_block)
    report.restarts.append(f"{host}:{unit}")


def roll(ctx: Context, pending: dict[str, list[str]], report: Report, etcd_together: bool = False) -> None:
    """Restart ``pending`` (host -> units) in the safe order, waiting after each host. With
    ``etcd_together`` every etcd member starts at once (members of a new etcd CA cannot reach
    the old ones) and the cluster's health is waited for once."""
    order = [h.name for h in ctx.inv.spec.hosts]
    for rank in sorted({RANK.get(u, 9) for units in pending.values() for u in units}):
        if rank == 0 and etcd_together:
            hosts = [h for h in order if ETCD in pending.get(h, ())]
            for h in hosts:
                _restart(ctx, h, ETCD, report, no_block=True)
            ctx.log(f"{hosts[0]}: wait for a healthy etcd cluster")
            _wait(ctx, hosts[0], ETCD)
            continue
        for h in order:
            units = [u for u in pending.get(h, ()) if RANK.get(u, 9) == rank]
            for u in units:
                _restart(ctx, h, u, report)
            for u in units:
                ctx.log(f"{h}: wait for {u}")
                _wait(ctx, h, u)


def _stop(ctx: Context, host: str, units: list[str]) -> None:
    present = [u for u in units if u in ctx.plans[host].units]
    if present:
        ctx.log(f"{host}: stop {' '.join(present)}")
        ctx.remotes[host].run(f"systemctl stop {' '.join(present)}", what="stop units")
        for u in present:
            ctx.facts[host].units[u] = ("inactive", "enabled")


# --- TLS handshakes through SSH ---------------------------------------------------------------

class _Creds:
    def __init__(self, directory: str, material: Material):
        self.directory, self.material = directory, material
        self._files: dict[str, tuple[str, str, str]] = {}

    def context(self, credential: str | None) -> ssl.SSLContext:
        """A client context presenting ``credential``; the server's certificate is taken as
        presented and judged afterwards (serial, signature), so a wrong one can be named."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if credential:
            if credential not in self._files:
                d = os.path.join(self.directory, credential.replace("/", "_"))
                os.mkdir(d, 0o700)
                self._files[credential] = client_files(d, self.material, credential)
            cert, key, _ = self._files[credential]
            ctx.load_cert_chain(cert, key)
        return ctx


@contextmanager
def _client_dir(material: Material) -> Iterator[_Creds]:
    with tempfile.TemporaryDirectory(prefix="hiddenplane-renew-") as tmp:
        os.chmod(tmp, 0o700)
        yield _Creds(tmp, material)


def handshake(remote: Remote, address: str, port: int, tls: ssl.SSLContext, timeout: float = 10) -> bytes:
    """A TLS handshake with ``address:port`` as seen from ``remote``'s host (an SSH direct-tcpip
    channel, so a loopback-only port is reached too); the DER certificate the server presented."""
    remote.open()
    chan = remote._conn.transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0),
                                                timeout=timeout)
    try:
        chan.settimeout(timeout)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = tls.wrap_bio(incoming, outgoing, server_side=False)
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                if outgoing.pending:
                    chan.sendall(outgoing.read())
                data = chan.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                incoming.write(data)
        if outgoing.pending:
            chan.sendall(outgoing.read())
        der = obj.getpeercert(binary_form=True)
        if not der:
            raise ssl.SSLError("the server presented no certificate")
        return der
    finally:
        chan.close()


@dataclass(frozen=True)
class Endpoint:
    host: str
    name: str
    address: str
    port: int
    cert: str | None           # state name of the certificate it serves; None: self-signed
    credential: str | None     # client certificate presented (the server may require one)
    unit: str
    ca: str = CLUSTER_CA       # state name of the CA that signs ``cert``


def endpoints(inv: Inventory) -> list[Endpoint]:
    out = []
    for h in inv.controls:
        out += [Endpoint(h.name, "etcd client", h.address, 2379, f"etcd/server-{h.name}", "etcd/healthcheck-client", ETCD,
                         ETCD_CA),
                Endpoint(h.name, "etcd peer", h.address, 2380, f"etcd/peer-{h.name}", "etcd/healthcheck-client", ETCD,
                         ETCD_CA),
                Endpoint(h.name, "kube-apiserver", h.address, inv.spec.apiServer.port, "apiserver", "admin", APISERVER)]
        if konnectivity_enabled(inv):
            out.append(Endpoint(h.name, "konnectivity-server", h.address, AGENT_PORT, "apiserver", None, KONNECTIVITY))
        # no --tls-cert-file: they serve a self-signed certificate made at each start; what we
        # renew for them is the client certificate in their kubeconfig
        out += [Endpoint(h.name, "kube-controller-manager", "127.0.0.1", 10257, None, None, CONTROLLER_MANAGER),
                Endpoint(h.name, "kube-scheduler", "127.0.0.1", 10259, None, None, SCHEDULER)]
    for h in inv.workers:
        out.append(Endpoint(h.name, "kubelet", h.address, 10250, f"kubelet/{h.name}-serving",
                            "apiserver-kubelet-client", KUBELET))
    return out


def _present(ctx: Context, creds: _Creds, ep: Endpoint) -> x509.Certificate:
    der = handshake(ctx.remotes[ep.host], ep.address, ep.port, creds.context(ep.credential))
    return x509.load_der_x509_certificate(der)


def read_endpoints(ctx: Context, eps: list[Endpoint]) -> dict[Endpoint, x509.Certificate | str]:
    """Each endpoint's presented certificate (or why it could not be read)."""
    out: dict[Endpoint, x509.Certificate | str] = {}
    with _client_dir(ctx.material) as creds:
        for ep in eps:
            try:
                out[ep] = _present(ctx, creds, ep)
            except Exception as e:   # noqa: BLE001 - refused, reset, TLS alert...: reported per endpoint
                out[ep] = f"{type(e).__name__}: {e}"
    return out


def _judge(ep: Endpoint, cert: x509.Certificate, material: Material, before, restarted: bool,
           old_cas: dict[str, Pair]) -> tuple[bool, str]:
    if ep.cert is None:
        if not restarted:
            return True, "self-signed; not restarted"
        if isinstance(before, x509.Certificate) and before.serial_number == cert.serial_number:
            return False, "self-signed certificate unchanged: the process was not restarted"
        return True, "self-signed, new since the restart (its kubeconfig's client certificate was renewed)"
    want = material.certs[ep.cert]
    if cert.serial_number != want.cert.serial_number:
        return False, f"presents serial {_hex(cert.serial_number)}, the state's {ep.cert} is {_hex(want.cert.serial_number)}"
    ca_name = ep.ca
    if not issue.signed_by(cert, material.cas[ca_name].cert):
        return False, f"not signed by the state's {ca_name}"
    old = old_cas.get(ca_name)
    if old is not None and old.cert.serial_number != material.cas[ca_name].cert.serial_number \
            and issue.signed_by(cert, old.cert):
        return False, f"still signed by the old {ca_name}"
    return True, f"{ep.cert}, signed by {ca_name}"


def verify(ctx: Context, before: dict, restarted: set[tuple[str, str]], report: Report,
           old_cas: dict[str, Pair] | None = None) -> None:
    """Handshake with every endpoint until it presents what the state holds (or the wait ends)."""
    eps = endpoints(ctx.inv)
    deadline = time.monotonic() + ctx.options.wait_timeout
    pending = list(eps)
    results: dict[Endpoint, EndpointCheck] = {}
    while pending:
        seen = read_endpoints(ctx, pending)
        for ep, cert in seen.items():
            b = before.get(ep)
            check = EndpointCheck(ep.host, ep.name, ep.address, ep.port, ep.cert,
                                  before=_hex(b.serial_number) if isinstance(b, x509.Certificate) else None)
            if isinstance(cert, str):
                check.note = cert
            else:
                check.after = _hex(cert.serial_number)
                check.ok, check.note = _judge(ep, cert, ctx.material, b, (ep.host, ep.unit) in restarted,
                                              old_cas or {})
            results[ep] = check
        pending = [ep for ep in pending if not results[ep].ok]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(2)
    report.checks = [results[ep] for ep in eps]
    bad = [c for c in report.checks if not c.ok]
    ctx.log(f"checked {len(eps)} endpoint(s) by TLS handshake: {len(eps) - len(bad)} present the state's certificate")
    if bad:
        raise RenewError("endpoints not presenting the state's certificate: "
                         + "; ".join(f"{c.host} {c.endpoint} :{c.port}: {c.note}" for c in bad))


# --- the session both operations share -----------------------------------------------------

@contextmanager
def _session(inv: Inventory, state: StateDir, material: Material, wait_timeout: float,
             log: Callable[[str], None]) -> Iterator[Context]:
    """Hosts connected (verified host keys), facts read, apply lock held; all released after."""
    ctx = Context(inv, state, Options(wait_timeout=wait_timeout), material, Changes(), log=log,
                  run_id=uuid.uuid4().hex)
    with ExitStack() as stack:
        stack.callback(lambda: [r.close() for r in ctx.remotes.values()])
        for h in inv.spec.hosts:
            ctx.remotes[h.name] = Remote(h, inv)
        log(f"connecting to {len(inv.spec.hosts)} host(s)")
        _refresh(ctx)
        differences = [line for h in inv.spec.hosts for line in _differences(ctx, h.name)]
        if differences:
            raise RenewError("the hosts do not match the state (run `installer apply` first): "
                             + "; ".join(differences[:8]) + (" ..." if len(differences) > 8 else ""))
        stack.callback(release, ctx)
        lock = AcquireLock()
        _parallel(lambda h: lock.run_host(ctx, h.name), inv.controls)
        yield ctx


def _inventory(inventory) -> Inventory:
    return inventory if isinstance(inventory, Inventory) else api.validate(inventory)


# --- certs renew -------------------------------------------------------------------------------

def renew(inventory, *, state_dir=None, only=(), dry_run: bool = False, wait_timeout: float = 180.0,
          log: Callable[[str], None] = print) -> Report:
    inv = _inventory(inventory)
    state, old = load_state(inv, state_dir)
    names = leaf_names(inv, old, only)
    new = reissue(inv, old, names)
    report = Report("renew", dry_run, _reissued(inv, old, new, names), rollout(inv, old, new), notes=[NOT_OURS])
    if dry_run:
        return report
    with _session(inv, state, old, wait_timeout, log) as ctx:
        before = read_endpoints(ctx, endpoints(inv))
        paths = _pki_paths(state, names) + ([state.admin_kubeconfig] if "admin" in names else [])
        report.backup = str(backup(state, "renew", paths))
        log(f"old certificates kept in {report.backup}")
        _save(state, inv, new)
        with _resumable(report.backup, "after fixing the cause, `installer apply` pushes what is missing and "
                                       "restarts what each host's pending-restart ledger names"):
            ctx.material = new
            ConnectHosts().finish(ctx, [])       # every host's plan with the new material and its facts
            report.rollout, pending = {}, {}
            for h in inv.spec.hosts:
                r = _push(ctx, h.name)
                if r.files:
                    report.rollout[h.name] = r
                    log(f"{h.name}: pushed {len(r.files)} file(s); to restart: {', '.join(r.units) or 'none'}")
                pending[h.name] = r.units
            roll(ctx, pending, report)
            restarted = {tuple(x.split(":", 1)) for x in report.restarts}
            verify(ctx, before, restarted, report)
    return report


# --- ca rotate ---------------------------------------------------------------------------------

def which_cas(which) -> list[str]:
    """CLI names (ca, etcd-ca, front-proxy-ca, all) -> state names, in table order."""
    which = set(which or ("all",))
    unknown = which - set(CA_CHOICES) - {"all"}
    if unknown:
        raise InstallerError(f"unknown CA {', '.join(sorted(unknown))}; choose from {', '.join(CA_CHOICES)}, all")
    wanted = set(CA_CHOICES.values()) if "all" in which else {CA_CHOICES[w] for w in which}
    return [c.name for c in CAS if c.name in wanted]


def rotate_plan(inv: Inventory, cas: list[str], use_api: bool) -> list[str]:
    controls = ", ".join(h.name for h in inv.controls)
    stop = "kube-scheduler, kube-controller-manager" + (", konnectivity-server" if konnectivity_enabled(inv) else "")
    etcd_rotates = ETCD_CA in cas
    steps = [
        f"new CA(s): {', '.join(cas)}; every leaf certificate re-issued with a new key; a new bootstrap token "
        "per worker; the service-account key and the encryption key kept",
        "old CA material, leaves, tokens and admin.conf kept in <state>/backups/ca-rotate-<time>/ (0700)",
        f"stop {stop}, kube-apiserver on {controls} (the API is down from here)",
    ]
    if etcd_rotates:
        steps += [f"stop etcd on {controls} (members of different CAs cannot talk; the data directory stays)",
                  f"push the new files to {controls}",
                  "start etcd on every member, wait for a healthy cluster"]
    else:
        steps += [f"push the new files to {controls}",
                  "restart etcd one member at a time, waiting for a healthy cluster after each"]
    steps += ["start kube-apiserver on each control host in turn, wait for /livez and /readyz",
              "start the rest of the control plane"]
    if use_api:
        steps.append("through the API: create the new bootstrap token Secrets, delete the old ones")
    else:
        steps.append("no API calls (--no-api): the new bootstrap token Secrets must be created by "
                     "`installer apply --only cluster-bootstrap` before the workers can join")
    if inv.workers:
        steps.append(f"each worker in turn ({', '.join(h.name for h in inv.workers)}): stop kubelet and kube-proxy, "
                     f"remove {' and '.join(KUBELET_CLIENT_FILES)}, push the new CA, serving pair, kube-proxy "
                     "and bootstrap kubeconfigs, start them: the kubelet bootstraps again against the new CA")
    steps.append("check by TLS handshake that every endpoint presents its new certificate, signed by the new CA")
    steps.append("kubeconfigs handed out before (installer kubeconfig) trust the old CA: write them again")
    return steps


def _api_tokens(ctx: Context, old: Material, report: Report) -> None:
    from . import kube
    from .phases.bootstrap_cluster import BootstrapCluster
    ev = BootstrapCluster().run_host(ctx, "(api)")
    report.steps += ev.detail
    gone = {t.id for t in old.tokens.values()} - {t.id for t in ctx.material.tokens.values()}
    with kube.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material, credential="super-admin") as client:
        for token_id in sorted(gone):
            if kube.delete_bootstrap_token(client, token_id):
                report.steps.append(f"deleted bootstrap token {token_id}")


def _rebootstrap_worker(ctx: Context, host: str, report: Report) -> None:
    _stop(ctx, host, [KUBELET, KUBE_PROXY])
    ctx.log(f"{host}: remove the kubelet's client certificate and kubeconfig (old CA)")
    ctx.remotes[host].run("rm -f " + " ".join(KUBELET_CLIENT_FILES), what="remove the kubelet client credentials")
    _refresh(ctx, [host])                    # not joined now: the bootstrap kubeconfig is planned again
    r = _push(ctx, host)
    report.rollout[host] = r
    roll(ctx, {host: sorted(set(r.units) | {KUBELET, KUBE_PROXY}, key=lambda u: (RANK.get(u, 9), u))}, report)


def rotate_ca(inventory, *, state_dir=None, which=("all",), yes: bool = False, use_api: bool = True,
              wait_timeout: float = 180.0, log: Callable[[str], None] = print) -> Report:
    inv = _inventory(inventory)
    cas = which_cas(which)
    state = api.state_for(inv, state_dir)
    if not state.root.is_dir():
        raise StateError(f"state directory {state.root} does not exist; run `installer apply` first (or pass --state)")
    old = state.load(inv)
    missing = [c.name for c in CAS if c.name not in old.cas] + [s.name for s in cert_specs(inv) if s.name not in old.certs]
    if missing:
        raise StateError(f"{state.root} lacks {', '.join(missing)}; run `installer apply` first")
    report = Report("rotate", not yes, steps=rotate_plan(inv, cas, use_api), notes=[NOT_OURS])
    if not yes:
        return report
    new = rotated(inv, old, cas)
    report.steps = []
    report.reissued = [Reissued(c, c, _hex(old.cas[c].cert.serial_number), _hex(new.cas[c].cert.serial_number),
                                new.cas[c].cert.not_valid_after_utc.isoformat()) for c in cas]
    report.reissued += _reissued(inv, old, new, [s.name for s in cert_specs(inv)])
    with _session(inv, state, old, wait_timeout, log) as ctx:
        before = read_endpoints(ctx, endpoints(inv))
        paths = (_pki_paths(state, cas + [s.name for s in cert_specs(inv)])
                 + [state.tokens_path, state.admin_kubeconfig])
        report.backup = str(backup(state, "ca-rotate", paths))
        log(f"old CA material kept in {report.backup}")
        _save(state, inv, new)
        with _resumable(report.backup, "after fixing the cause, `installer apply` finishes the control plane "
                                       "(it starts what is stopped and pushes what is missing); a worker whose "
                                       "kubelet still holds its old client certificate needs /var/lib/kubelet/pki/"
                                       "kubelet-client-*.pem and /etc/kubernetes/kubelet.conf removed, then "
                                       "`installer apply`"):
            ctx.material = new
            controls = [h.name for h in inv.controls]
            for h in controls:
                _stop(ctx, h, [SCHEDULER, CONTROLLER_MANAGER, KONNECTIVITY, APISERVER])
            etcd_together = ETCD_CA in cas
            if etcd_together:
                for h in controls:
                    _stop(ctx, h, [ETCD])
            ConnectHosts().finish(ctx, [])
            report.rollout, pending = {}, {}
            for h in controls:
                r = _push(ctx, h)
                report.rollout[h] = r
                # a stopped unit is started even when none of its files changed
                stopped = {u for u in (ETCD, APISERVER, KONNECTIVITY, CONTROLLER_MANAGER, SCHEDULER)
                           if u in ctx.plans[h].units and (u != ETCD or etcd_together)}
                pending[h] = sorted(set(r.units) | stopped, key=lambda u: (RANK.get(u, 9), u))
            roll(ctx, pending, report, etcd_together=etcd_together)
            if use_api:
                _api_tokens(ctx, old, report)
            for w in inv.workers:
                _rebootstrap_worker(ctx, w.name, report)
            restarted = {tuple(x.split(":", 1)) for x in report.restarts}
            verify(ctx, before, restarted, report, old_cas=old.cas)
    return report
