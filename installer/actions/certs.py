"""`installer certs check`: every certificate in the state directory and as deployed on each
host, with its expiry. Read-only: nothing is issued, saved or changed anywhere.

Deployed certificates are read in one SSH round trip per host. Only the CERTIFICATE blocks of
each file leave the host (kubelet-client-current.pem also holds the kubelet's private key), and
of a kubeconfig only its ``client-certificate-data`` (a worker's kube-proxy.conf holds the
node's own kube-proxy certificate, a control host's admin.conf and the components' theirs).
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from cryptography import x509
from cryptography.x509.oid import NameOID

from installer.core.cluster import Cluster
from installer.core.errors import InstallerError, StateError
from installer.core.inventory import Inventory
from installer.core.pki.material import Material, ensure
from installer.core.pki.specs import CAS
from installer.core.render import kubeconfig
from installer.core.render.plan import render_cluster
from installer.core.render.worker import KUBELET_CLIENT_PEM
from installer.core.state import StateDir
from installer.engine.run import open_run
from installer.host.parallel import each
from installer.host.ssh import HostError

STATE = "state"
KUBELET_CLIENT = KUBELET_CLIENT_PEM             # the kubelet's rotating pair (render/worker.py)
# certificates their holder renews itself: the kubelet's client pair (the cluster signs it,
# short-lived on purpose). client-go's certificate manager renews at a random point between 70 %
# and 90 % of the lifetime, so one past 90 % means rotation is not working.
SELF_ROTATED = frozenset({KUBELET_CLIENT})
ROTATED_BY = 0.9
MARK = "== "


class CertsError(InstallerError):
    exit_code = 3


@dataclass
class CertRow:
    where: str              # "state" or a host name
    name: str               # state name (``etcd/ca``) or path on the host
    subject: str            # subject CN
    issuer: str             # issuer CN
    not_after: dt.datetime
    serial: int
    notes: list[str] = field(default_factory=list)
    not_before: dt.datetime | None = None
    self_rotated: bool = False    # renewed by its holder (SELF_ROTATED): judged by rotation, not by days left

    def days_left(self, now: dt.datetime) -> int:
        return (self.not_after - now) // dt.timedelta(days=1)

    def rotation_due(self) -> dt.datetime | None:
        """When a self-rotated certificate must have been replaced by (None: not one)."""
        if not self.self_rotated or self.not_before is None:
            return None
        return self.not_before + (self.not_after - self.not_before) * ROTATED_BY

    def expiring(self, now: dt.datetime, within_days: float) -> bool:
        due = self.rotation_due()
        if due is not None:
            return now >= due
        return self.not_after - now <= dt.timedelta(days=within_days)

    def as_dict(self, now: dt.datetime, within_days: float) -> dict:
        return {"where": self.where, "name": self.name, "subject": self.subject, "issuer": self.issuer,
                "notAfter": self.not_after.isoformat(), "daysLeft": self.days_left(now),
                "serial": format(self.serial, "x"), "expiring": self.expiring(now, within_days),
                "selfRotated": self.self_rotated, "notes": self.notes}


def _cn(name: x509.Name) -> str:
    attrs = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else name.rfc4514_string()


def row(where: str, name: str, cert: x509.Certificate) -> CertRow:
    return CertRow(where, name, _cn(cert.subject), _cn(cert.issuer), cert.not_valid_after_utc, cert.serial_number,
                   not_before=cert.not_valid_before_utc, self_rotated=name in SELF_ROTATED and where != STATE)


def state_rows(material: Material) -> list[CertRow]:
    return [row(STATE, name, p.cert) for name, p in {**material.cas, **material.certs}.items()]


KUBECONFIG_SUFFIX = kubeconfig.SUFFIX


def fetch_script(paths: list[str]) -> str:
    """A kubeconfig (``*.conf``) embeds its certificate base64-encoded, beside the key: only the
    ``client-certificate-data`` line is decoded and sent."""
    quoted = " ".join(shlex.quote(p) for p in paths)
    return (f'for f in {quoted}; do [ -f "$f" ] && {{ echo "{MARK}$f"; case "$f" in '
            f"*{KUBECONFIG_SUFFIX}) sed -n 's/^[[:space:]]*client-certificate-data:[[:space:]]*//p' \"$f\" "
            "| base64 -d 2>/dev/null;; "
            "*) sed -n '/-----BEGIN CERTIFICATE-----/,/-----END CERTIFICATE-----/p' \"$f\";; esac; }; done; true")


def kubeconfig_serial(content: bytes) -> int | None:
    """The serial of the client certificate a rendered kubeconfig embeds; None when it has none
    (a token, as the bootstrap kubeconfig)."""
    try:
        pem = kubeconfig.client_certificate(content)
        return x509.load_pem_x509_certificate(pem).serial_number if pem else None
    except ValueError:
        return None


_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def parse_fetched(raw: bytes) -> dict[str, list[x509.Certificate] | None]:
    """path -> its certificates (first is the leaf); None when a file holds no parsable one."""
    out: dict[str, list[x509.Certificate] | None] = {}
    path, buf = None, b""

    def flush():
        if path is None:
            return
        certs = []
        for block in _PEM.findall(buf):
            try:
                certs.append(x509.load_pem_x509_certificate(block))
            except ValueError:
                pass
        out[path] = certs or None

    for line in raw.splitlines(keepends=True):
        if line.startswith(MARK.encode()):
            flush()
            path, buf = line[len(MARK):].decode(errors="replace").rstrip("\n"), b""
        else:
            buf += line
    flush()
    return out


def certificate_paths(plan) -> dict[str, int | None]:
    """A plan's certificate files and kubeconfigs with one: {path: serial the state puts there
    (None: not from the state)}."""
    paths: dict[str, int | None] = {}
    for path, f in sorted(plan.files.items()):
        if path.endswith(".crt"):
            try:
                paths[path] = x509.load_pem_x509_certificate(f.content).serial_number
            except ValueError:
                paths[path] = None
        elif path.endswith(KUBECONFIG_SUFFIX) and (serial := kubeconfig_serial(f.content)) is not None:
            paths[path] = serial
    return paths


def expected_paths(inv: Inventory, plans) -> dict[str, dict[str, int | None]]:
    """host -> {path: serial the state puts there (None: not from the state)}."""
    out: dict[str, dict[str, int | None]] = {}
    for h in inv.spec.hosts:
        paths = certificate_paths(plans[h.name])
        if h.role == "worker":
            paths[KUBELET_CLIENT] = None       # issued by the cluster (TLS bootstrap), not by us
        out[h.name] = paths
    return out


def host_rows(name: str, expected: dict[str, int | None], raw: bytes) -> list[CertRow]:
    rows = []
    for path, certs in parse_fetched(raw).items():
        if certs is None:
            rows.append(CertRow(name, path, "", "", dt.datetime.min.replace(tzinfo=dt.timezone.utc), 0,
                                ["no readable certificate in the file"]))
            continue
        r = row(name, path, certs[0])
        if r.self_rotated:
            r.notes.append(f"renewed by its holder (due by {r.rotation_due():%Y-%m-%d %H:%M})")
        want = expected.get(path)
        if want is not None and r.serial != want:
            r.notes.append("differs from state")
        rows.append(r)
    return rows


def as_fetched(files: dict[str, bytes]) -> bytes:
    """Files read elsewhere (a hosted tenant's Secrets and ConfigMaps) in what ``fetch_script``
    prints: the certificates of each, a kubeconfig's client certificate only."""
    out = b""
    for path, content in sorted(files.items()):
        if path.endswith(KUBECONFIG_SUFFIX):
            content = kubeconfig.client_certificate(content) or b""
        out += f"{MARK}{path}\n".encode() + b"".join(m + b"\n" for m in _PEM.findall(content))
    return out


def beyond_rows(plane, inv: Inventory, loaded: Material) -> list[CertRow]:
    """The control-plane certificates ``plane`` holds besides the hosts (a hosted tenant's
    Secrets and ConfigMaps in the hosting cluster, where its pods read them), each compared with
    the state's."""
    material, _ = ensure(inv, loaded)
    material.cas.update(loaded.cas)
    material.certs.update(loaded.certs)
    plan = plane.beyond_plan(inv, material)
    if plan is None:
        return []
    # the files a pod reads (the rest of the plan, admin.conf, the health-check client, goes to
    # no pod)
    expected = {p: serial for p, serial in certificate_paths(plan).items() if plan.files[p].restarts}
    log_where = plane.where
    held = plane.read_files(list(expected), secrets=True)
    rows = host_rows(log_where, expected, as_fetched(held))
    rows += [CertRow(log_where, p, "", "", dt.datetime.min.replace(tzinfo=dt.timezone.utc), 0,
                     ["not in the tenant's Secrets or ConfigMaps"]) for p in expected if p not in held]
    return rows


def _plans_for(inv: Inventory, loaded: Material):
    """The rendered plans with the state's own certificates in them (ensure() only fills the
    gaps in memory; nothing is saved). An expired certificate stays what it is here."""
    material, _ = ensure(inv, loaded)
    material.cas.update(loaded.cas)
    material.certs.update(loaded.certs)
    return render_cluster(inv, material)


def existing_state(cluster: Cluster) -> StateDir:
    """The cluster's state directory; refused when there is none (no apply has run)."""
    state = cluster.state
    if not state.root.is_dir():
        raise StateError(f"state directory {state.root} does not exist; run `installer apply` first "
                         "(or pass --state)")
    return state


def check(cluster: Cluster, offline: bool = False, remote_for: Callable | None = None,
          log: Callable[[str], None] = lambda _: None) -> list[CertRow]:
    """Every certificate, sorted by not-after (soonest first)."""
    inv = cluster.inv
    state = existing_state(cluster)
    loaded = state.load(inv)
    if not loaded.cas:
        raise StateError(f"{state.root} holds no certificates; run `installer apply` first (or pass --state)")
    rows = state_rows(loaded)
    if not offline:
        if any(ca.name not in loaded.cas for ca in CAS):
            raise StateError(f"{state.root} lacks a CA; run `installer apply` (or use --offline)")
        expected = expected_paths(inv, _plans_for(inv, loaded))
        with open_run(cluster) as run:
            remote_for = remote_for or run.session.remote

            def one(h):
                log(f"{h.name}: reading {len(expected[h.name])} certificate path(s)")
                r = remote_for(h).run(fetch_script(list(expected[h.name])), what="read certificates")
                return host_rows(h.name, expected[h.name], r.raw)

            errors = []
            for result in each(one, inv.spec.hosts).values():
                if isinstance(result, HostError):
                    errors.append(str(result))
                elif isinstance(result, Exception):
                    raise result
                else:
                    rows += result
            if errors:
                raise CertsError("cannot read certificates from " + "; ".join(errors)
                                 + " (use --offline to check the state only)")
            if run.plane.where:
                log(f"{run.plane.where}: reading the control plane's certificates")
                rows += beyond_rows(run.plane, inv, loaded)
    rows.sort(key=lambda r: (r.not_after, r.where != STATE, r.where, r.name))
    return rows
