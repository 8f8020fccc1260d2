"""``certs renew``: new leaf certificates under the same CAs, rolled out without downtime.

Re-issue leaf certificates (new keys; never a CA, the service-account key or the encryption
key), keep the old files in ``<state>/backups/renew-<time>/`` (0700, files 0600), push, then
restart in a safe order: etcd one member at a time (cluster healthy before the next),
kube-apiserver one host at a time (/livez and /readyz answer before the next),
konnectivity-server, controller-manager and scheduler, then the workers' kubelet and
kube-proxy. The files are pushed before any restart and every new leaf is signed by the CA
every peer already trusts, so old and new certificates work together throughout. Finally every
TLS endpoint is checked with a real handshake: it must present the state's certificate.

Refused unless the hosts match the state (``installer apply`` made no change): the renewal then
changes exactly the files that carry a renewed certificate, nothing else.

The host side (session, push, ordered restarts, handshakes) is in rollout.py; ``ca rotate``
(rotate.py) builds on this module: it re-issues every leaf with ``reissue`` and keeps, saves and
resumes the state with the helpers here.

Kubelet *client* certificates are never issued here: the cluster signs them (TLS
bootstrapping) and the kubelet renews them itself.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from installer.actions.certs import existing_state
from installer.actions.endpoints import endpoints, read_endpoints, verify
from installer.actions.rollout import (
    Reissued,
    RenewError,
    Report,
    Rollout,
    hex_serial,
    push,
    restart_order,
    roll,
    session,
)
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError, StateError
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.issue import Pair
from installer.core.pki.material import Material, ensure
from installer.core.pki.specs import CAS, CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA, cert_specs
from installer.core.render.plan import render_cluster
from installer.core.safefs import write_atomic
from installer.core.state import StateDir, write_admin_kubeconfig
from installer.engine.context import Context
from installer.engine.planes import ControlPlane
from installer.engine.run import Run, open_run
from installer.engine.steps import Step, plan, run_steps

BACKUPS = "backups"
CA_CHOICES = {"ca": CLUSTER_CA, "etcd-ca": ETCD_CA, "front-proxy-ca": FRONT_PROXY_CA}
NOT_OURS = ("kubelet client certificates (/var/lib/kubelet/pki/kubelet-client-current.pem) are not renewed "
            "here: the cluster signs them through TLS bootstrapping and each kubelet renews its own "
            "(short-lived, controller-manager --cluster-signing-duration)")


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


def copy_material(m: Material) -> Material:
    """New dicts holding the same pairs, keys and tokens."""
    return Material(cas=dict(m.cas), certs=dict(m.certs), sa_key=m.sa_key, encryption_key=m.encryption_key,
                    tokens=dict(m.tokens), pod_cidrs=dict(m.pod_cidrs))


def reissue(inv: Inventory, material: Material, names, now: dt.datetime | None = None) -> Material:
    """A copy of ``material`` with the leaves ``names`` re-issued under its CAs, each with a new
    key. CAs, the service-account key, the encryption key and tokens are the same objects."""
    now = now or dt.datetime.now(dt.timezone.utc)
    pki = inv.spec.pki
    new = copy_material(material)
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


def rollout(inv: Inventory, old: Material, new: Material, plane: ControlPlane | None = None) -> dict[str, Rollout]:
    """Per host (and what ``plane`` holds besides the hosts): the files that differ between the
    two materials and the units they restart (rendered without facts, as for a host that
    matches the state)."""
    before, after = render_cluster(inv, old), render_cluster(inv, new)
    plans = [(h.name, before[h.name], after[h.name]) for h in inv.spec.hosts]
    if plane is not None and (was := plane.beyond_plan(inv, old)) is not None:
        plans.append((plane.where, was, plane.beyond_plan(inv, new)))
    out = {}
    for name, was, now in plans:
        a, b = was.files, now.files
        files = sorted(p for p, f in b.items() if p not in a or a[p].sha256 != f.sha256)
        units = restart_order(u for p in files for u in b[p].restarts)
        if files:
            out[name] = Rollout(files, units)
    return out


def reissued_rows(inv: Inventory, old: Material, new: Material, names) -> list[Reissued]:
    """The report's rows for the leaves ``names``: old serial ("-" when there was none), new one."""
    ca = {s.name: s.ca for s in cert_specs(inv)}
    return [Reissued(n, ca[n], hex_serial(old.certs[n].cert.serial_number) if n in old.certs else "-",
                     hex_serial(new.certs[n].cert.serial_number), new.certs[n].cert.not_valid_after_utc.isoformat())
            for n in names]


# --- the state ---------------------------------------------------------------------------------

def load_state(cluster: Cluster) -> tuple[StateDir, Material]:
    """The state as it is; refused when it is missing, incomplete or does not match the
    inventory (an apply would change it): run ``installer apply`` first."""
    inv, state = cluster.inv, existing_state(cluster)
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
def resumable(backup_dir: str, finish: str) -> Iterator[None]:
    """After the state was saved: a failure says where the old material is and how to finish."""
    try:
        yield
    except InstallerError as e:
        raise RenewError(f"{e}\nthe state already holds the new certificates (the old ones are in {backup_dir}); "
                         f"{finish}") from None


def pki_paths(state: StateDir, names) -> list[Path]:
    """The state's certificate and key files of ``names`` (what a backup keeps)."""
    return [state.pki(n, ext) for n in names for ext in ("crt", "key")]


def save_state(state: StateDir, inv: Inventory, material: Material) -> None:
    """The new material into the state, and admin.conf written again from it."""
    state.save(material)
    write_admin_kubeconfig(inv, state, material)


# --- the steps renew and rotate share --------------------------------------------------------

CONNECT = ("connect to every host, check that it matches the state, take the apply lock; read every "
           "endpoint's certificate")


@dataclass
class Roll:
    """What the steps of one renewal or rotation pass each other."""
    inv: Inventory
    state: StateDir | None = None
    old: Material | None = None
    new: Material | None = None
    report: Report | None = None
    wait_timeout: float = 180.0
    log: Callable[[str], None] = print
    stack: ExitStack | None = None         # the session and, once the state is saved, resumable()
    run: Run | None = None                 # the command's (engine/run.py), opened by run_roll
    ctx: Context | None = None
    before: dict = field(default_factory=dict)
    pending: dict[str, list[str]] = field(default_factory=dict)


def connect(r: Roll) -> None:
    r.ctx = r.stack.enter_context(session(r.run, r.old, r.wait_timeout))
    r.before = read_endpoints(r.ctx, endpoints(r.inv, r.ctx.plane))


def keep_and_save(r: Roll, label: str, paths: list[Path], finish: str) -> None:
    """The old files backed up, the new material saved; from here a failure says how to finish."""
    r.report.backup = str(backup(r.state, label, paths))
    r.log(f"old certificates kept in {r.report.backup}")
    save_state(r.state, r.inv, r.new)
    r.stack.enter_context(resumable(r.report.backup, finish))
    r.ctx.material = r.new


def run_roll(subject: str, steps: list[Step[Roll]], r: Roll, cluster: Cluster | Run) -> None:
    with ExitStack() as stack:
        r.stack = stack
        r.run = stack.enter_context(open_run(cluster, log=r.log))
        run_steps(subject, steps, r, r.log)


# --- certs renew -------------------------------------------------------------------------------

def _push_all(r: Roll) -> None:
    r.ctx.rerender()       # every host's plan with the new material and its facts
    r.report.rollout = {}
    for h in r.inv.spec.hosts:
        pushed = push(r.ctx, h.name)
        if pushed.files:
            r.report.rollout[h.name] = pushed
            r.log(f"{h.name}: pushed {len(pushed.files)} file(s); to restart: {', '.join(pushed.units) or 'none'}")
        r.pending[h.name] = pushed.units


def renew_steps(names: list[str], use_api: bool, plane: ControlPlane | None = None) -> list[Step[Roll]]:
    def save(r: Roll) -> None:
        paths = pki_paths(r.state, names) + ([r.state.admin_kubeconfig] if "admin" in names else [])
        keep_and_save(r, "renew", paths, "after fixing the cause, `installer apply` pushes what is missing and "
                                         "restarts what each host's pending-restart ledger names")
    nodes = ", the workers' kubelet and kube-proxy (each Node Ready before the next)" if use_api else \
        ", the workers' kubelet and kube-proxy"
    beyond = plane.renew_steps() if plane is not None else []      # what the plane holds besides the hosts
    return [
        Step(CONNECT, connect),
        Step(f"save {len(names)} re-issued leaf certificate(s) (new keys, the same CAs); the old files kept in "
             "<state>/backups/renew-<time>/ (0700)", save),
        Step("push the new files to every host that holds one", _push_all),
        *beyond,
        Step("restart what uses them, in order: etcd one member at a time (healthy before the next), "
             f"kube-apiserver one host at a time (/livez, /readyz), then the rest of the control plane{nodes}",
             lambda r: roll(r.ctx, r.pending, r.report, nodes_ready=use_api)),
        Step("check by TLS handshake that every endpoint presents its new certificate",
             lambda r: verify(r.ctx, r.before, r.report)),
    ]


def renew(cluster: Cluster, *, only=(), dry_run: bool = False, wait_timeout: float = 180.0,
          use_api: bool = True, log: Callable[[str], None] = print) -> Report:
    inv = cluster.inv
    state, old = load_state(cluster)
    names = leaf_names(inv, old, only)
    new = reissue(inv, old, names)
    with open_run(cluster, log=log) as run:
        steps = renew_steps(names, use_api, run.plane)
        report = Report("renew", dry_run, reissued_rows(inv, old, new, names), rollout(inv, old, new, run.plane),
                        notes=[NOT_OURS], steps=plan(steps) if dry_run else [])
        if dry_run:
            return report
        run_roll("certs renew", steps, Roll(inv, state, old, new, report, wait_timeout, log), run)
    return report
