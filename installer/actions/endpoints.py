"""The TLS check of every endpoint after a renewal or a CA rotation: a real handshake, through an
SSH channel to the host (so loopback-only ports and bastions work too); each endpoint must present
the state's certificate, signed by the state's CA (and not by a CA just rotated away). A
self-signed endpoint (controller-manager, scheduler) must present a new certificate when it was
restarted.
"""

from __future__ import annotations

import ssl
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from cryptography import x509

from installer.actions.rollout import (
    APISERVER,
    CONTROLLER_MANAGER,
    ETCD,
    KONNECTIVITY,
    KUBELET,
    SCHEDULER,
    EndpointCheck,
    RenewError,
    Report,
    hex_serial,
)
from installer.core import components
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.issue import Pair
from installer.core.pki.material import Material
from installer.core.pki.specs import CLUSTER_CA, ETCD_CA
from installer.core.render.addons.konnectivity import AGENT_PORT
from installer.core.render.addons.konnectivity import enabled as konnectivity_enabled
from installer.core.tlsfiles import load_client_cert
from installer.engine.context import Context
from installer.host.ssh import Remote


class ClientCreds:
    def __init__(self, material: Material):
        self.material = material

    def context(self, credential: str | None) -> ssl.SSLContext:
        """A client context presenting ``credential``; the server's certificate is taken as
        presented and judged afterwards (serial, signature), so a wrong one can be named."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if credential:
            load_client_cert(ctx, self.material, credential)      # from memory, never a file
        return ctx


@contextmanager
def client_dir(material: Material) -> Iterator[ClientCreds]:
    """The credentials the checks present (kept in memory: no key file is written)."""
    yield ClientCreds(material)


def handshake(remote: Remote, address: str, port: int, tls: ssl.SSLContext, timeout: float = 10) -> bytes:
    """A TLS handshake with ``address:port`` as seen from ``remote``'s host (an SSH direct-tcpip
    channel, so a loopback-only port is reached too); the DER certificate the server presented."""
    remote.open()
    chan = remote.open_channel(address, port, timeout)
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


# how an exposed component (ControlPlane.exposed) is checked: its serving pair, the client the
# check presents, the unit it is
EXPOSED = {"kube-apiserver": ("apiserver", "admin", APISERVER),
           "konnectivity-server": ("apiserver", None, KONNECTIVITY)}


def endpoints(inv: Inventory, plane=None) -> list[Endpoint]:
    out = []
    for h in inv.controls:
        out += [Endpoint(h.name, "etcd client", h.address, components.port("etcd", "client"), f"etcd/server-{h.name}",
                         "etcd/healthcheck-client", ETCD, ETCD_CA),
                Endpoint(h.name, "etcd peer", h.address, components.port("etcd", "peer"), f"etcd/peer-{h.name}",
                         "etcd/healthcheck-client", ETCD, ETCD_CA),
                Endpoint(h.name, "kube-apiserver", h.address, inv.spec.apiServer.port, "apiserver", "admin", APISERVER)]
        if konnectivity_enabled(inv):
            out.append(Endpoint(h.name, "konnectivity-server", h.address, AGENT_PORT, "apiserver", None, KONNECTIVITY))
        # no --tls-cert-file: they serve a self-signed certificate made at each start; what we
        # renew for them is the client certificate in their kubeconfig
        out += [Endpoint(h.name, "kube-controller-manager", "127.0.0.1",
                         components.port("kube-controller-manager", "secure"), None, None, CONTROLLER_MANAGER),
                Endpoint(h.name, "kube-scheduler", "127.0.0.1", components.port("kube-scheduler", "secure"),
                         None, None, SCHEDULER)]
    if plane is not None and inv.workers:
        # what answers outside the hosts (a hosted tenant's apiservers and konnectivity servers),
        # as the first worker reaches it
        out += [Endpoint(inv.workers[0].name, label, address, port, *EXPOSED[component])
                for component, label, address, port in plane.exposed(inv)]
    for h in inv.workers:
        out.append(Endpoint(h.name, "kubelet", h.address, components.port("kubelet", "secure"),
                            f"kubelet/{h.name}-serving", "apiserver-kubelet-client", KUBELET))
    return out


def _present(ctx: Context, creds: ClientCreds, ep: Endpoint) -> x509.Certificate:
    der = handshake(ctx.remotes[ep.host], ep.address, ep.port, creds.context(ep.credential))
    return x509.load_der_x509_certificate(der)


def read_endpoints(ctx: Context, eps: list[Endpoint]) -> dict[Endpoint, x509.Certificate | str]:
    """Each endpoint's presented certificate (or why it could not be read)."""
    out: dict[Endpoint, x509.Certificate | str] = {}
    with client_dir(ctx.material) as creds:
        for ep in eps:
            try:
                out[ep] = _present(ctx, creds, ep)
            except Exception as e:   # noqa: BLE001 - refused, reset, TLS alert...: reported per endpoint
                out[ep] = f"{type(e).__name__}: {e}"
    return out


def judge(ep: Endpoint, cert: x509.Certificate, material: Material, before, restarted: bool,
           old_cas: dict[str, Pair]) -> tuple[bool, str]:
    if ep.cert is None:
        if not restarted:
            return True, "self-signed; not restarted"
        if isinstance(before, x509.Certificate) and before.serial_number == cert.serial_number:
            return False, "self-signed certificate unchanged: the process was not restarted"
        return True, "self-signed, new since the restart (its kubeconfig's client certificate was renewed)"
    want = material.certs[ep.cert]
    if cert.serial_number != want.cert.serial_number:
        return False, (f"presents serial {hex_serial(cert.serial_number)}, "
                       f"the state's {ep.cert} is {hex_serial(want.cert.serial_number)}")
    ca_name = ep.ca
    if not issue.signed_by(cert, material.cas[ca_name].cert):
        return False, f"not signed by the state's {ca_name}"
    old = old_cas.get(ca_name)
    if old is not None and old.cert.serial_number != material.cas[ca_name].cert.serial_number \
            and issue.signed_by(cert, old.cert):
        return False, f"still signed by the old {ca_name}"
    return True, f"{ep.cert}, signed by {ca_name}"


def verify(ctx: Context, before: dict, report: Report, old_cas: dict[str, Pair] | None = None) -> None:
    """Handshake with every endpoint until it presents what the state holds (or the wait ends).
    What was restarted is ``report.restarts``."""
    eps = endpoints(ctx.inv, ctx.plane)
    restarted = {tuple(x.split(":", 1)) for x in report.restarts}
    deadline = time.monotonic() + ctx.options.wait_timeout
    pending = list(eps)
    results: dict[Endpoint, EndpointCheck] = {}
    while pending:
        seen = read_endpoints(ctx, pending)
        for ep, cert in seen.items():
            b = before.get(ep)
            check = EndpointCheck(ep.host, ep.name, ep.address, ep.port, ep.cert,
                                  before=hex_serial(b.serial_number) if isinstance(b, x509.Certificate) else None)
            if isinstance(cert, str):
                check.note = cert
            else:
                check.after = hex_serial(cert.serial_number)
                check.ok, check.note = judge(ep, cert, ctx.material, b, (ep.host, ep.unit) in restarted,
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
