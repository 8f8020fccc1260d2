"""Reaching a cluster's API from the operator's machine, and the admin kubeconfig.

- ``api_access``: the base URL of an apiserver that answers, failing over across the endpoint and
  the control hosts, else an SSH local port forward through a control host to its apiserver on
  loopback (a SAN of the apiserver certificate, so verification still holds).
- ``answering_server``, ``write_kubeconfig``: what ``installer kubeconfig`` names and writes.

No HTTP client here (host/kube.py has it, and urllib3 with it): these only connect over TCP and
SSH, so commands that never send an API request stay light.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from invoke.exceptions import ThreadException

from installer.core.errors import InstallerError, StateError
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.pki.specs import cert_specs
from installer.core.render.kubeconfig import kubeconfig
from installer.core.safefs import write_atomic
from installer.host.ssh import Remote

ADMIN_USER = "kubernetes-admin"


class KubeError(InstallerError):
    """The API refused or could not be reached; the message names the object and the reason."""


# --- the client -----------------------------------------------------------------------------

# --- reaching the API -----------------------------------------------------------------------

def tcp_reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RemoteSource = Mapping[str, Remote] | Sequence[Remote] | Callable[[HostSpec], Remote]


def _control_remote(inv: Inventory, remotes: RemoteSource, host: HostSpec | None = None) -> tuple[Remote, bool]:
    """The Remote of ``host`` (default: the first control host) and whether we created it (and
    so must close it)."""
    host = host or inv.controls[0]
    if callable(remotes):
        return remotes(host), True
    if isinstance(remotes, Mapping):
        return remotes[host.name], False
    for r in remotes:
        if r.name == host.name:
            return r, False
    raise KeyError(f"no Remote for control host {host.name}")


def first_reachable(addresses: Sequence[str], port: int, timeout: float) -> str | None:
    """The first of ``addresses`` (in their order) that accepts a TCP connection on ``port``
    within ``timeout``; all are tried at once, so a lost host costs one timeout, not one each."""
    if not addresses:
        return None
    results: dict[str, bool] = {}

    def probe(a: str) -> None:
        results[a] = tcp_reachable(a, port, timeout)
    threads = [threading.Thread(target=probe, args=(a,), daemon=True) for a in dict.fromkeys(addresses)]
    for t in threads:
        t.start()
    order = list(dict.fromkeys(addresses))
    deadline = time.monotonic() + timeout + 0.5
    while True:
        for a in order:
            if a not in results:
                break               # undecided: an earlier address is preferred, wait for it
            if results[a]:
                return a
        else:
            return None             # none answered
        if time.monotonic() > deadline:
            return next((a for a in order if results.get(a)), None)
        time.sleep(0.01)


def base_url(address: str, port: int) -> str:
    return f"https://[{address}]:{port}" if ":" in address else f"https://{address}:{port}"


@contextlib.contextmanager
def _tunnel(remote: Remote, port: int, stack: contextlib.ExitStack) -> Iterator[str]:
    """An SSH local port forward through ``remote`` to its apiserver on loopback, listening
    before it is yielded (entered into ``stack``, which closes it)."""
    remote.open()
    local = _free_local_port()
    stack.enter_context(remote.forward_local(local, port))
    # the forwarder binds in its own thread: wait until it listens
    deadline = time.monotonic() + 5
    while not tcp_reachable("127.0.0.1", local, 0.5):
        if time.monotonic() > deadline:
            raise KubeError(f"{remote.name}: the SSH tunnel to the API did not start listening on 127.0.0.1:{local}")
        time.sleep(0.02)
    yield f"https://127.0.0.1:{local}"


@contextlib.contextmanager
def api_access(inv: Inventory, remotes: RemoteSource, material: Material | None = None, *,
               probe_timeout: float = 2.0, apiserver: HostSpec | None = None) -> Iterator[str]:
    """Yield the base URL of an apiserver that answers, failing over across control hosts:
    ``spec.apiServer.endpoint`` when set, else the first control host, else the next, ... (all
    probed at once: a TCP connection within ``probe_timeout``); when none answers from here,
    ``https://127.0.0.1:LOCALPORT``, an SSH local port forward through the first control host
    that SSH reaches to the apiserver on its loopback (kept open for the block). ``remotes``:
    Remotes by host name, a list of Remotes, or a factory ``HostSpec -> Remote`` (a Remote made
    by the factory is closed afterwards). ``material`` is not used (the probe is plain TCP;
    ``api_client`` verifies the server: every control host's address and 127.0.0.1 are SANs).
    ``apiserver``: that control host's own apiserver only, directly or through that host."""
    hosts = [apiserver] if apiserver else list(inv.controls)
    if apiserver is not None:
        port, addresses = inv.spec.apiServer.port, [apiserver.address]
    else:
        # every place an apiserver answers: the control hosts (the tunnels' too), or where a hosting
        # cluster exposes a hosted tenant's (no host to tunnel through)
        port, addresses = inv.api_port, [address for _, address, _ in inv.api_backends]
    if apiserver is None and inv.spec.apiServer.endpoint:
        addresses.insert(0, inv.spec.apiServer.endpoint)
    reached = first_reachable(addresses, port, probe_timeout)
    if reached is not None:
        yield base_url(reached, port)
        return
    body_error: BaseException | None = None
    try:
        with contextlib.ExitStack() as stack:
            url, failures = None, []
            for host in hosts:
                remote, owned = _control_remote(inv, remotes, host)
                if owned:
                    stack.callback(remote.close)
                try:
                    url = stack.enter_context(_tunnel(remote, port, stack))
                    break
                except Exception as e:  # noqa: BLE001 - SSH failed for this host: try the next one
                    failures.append(f"{host.name}: {e}" if isinstance(e, (KubeError, OSError))
                                    else f"{host.name}: {type(e).__name__}: {e}")
            if url is None:
                raise KubeError(f"no apiserver answers on :{port} from here ({', '.join(addresses)}) and no "
                                f"control host gives an SSH tunnel to one: {'; '.join(failures)}")
            try:
                yield url
            except BaseException as e:
                body_error = e
                raise
    except ThreadException as e:
        # the forwarder's threads failed (e.g. nothing listens on the control host's :port);
        # an error of the block itself is the one to report
        if body_error is not None:
            raise body_error from None
        what = "; ".join(f"{w.type.__name__}: {w.value}" for w in e.exceptions) or "unknown error"
        raise KubeError(f"the SSH tunnel to 127.0.0.1:{port} failed: {what}") from None


# --- the admin kubeconfig -------------------------------------------------------------------

def admin_kubeconfig_bytes(inv: Inventory, material: Material, server: str | None = None) -> bytes:
    ca = material.pair("ca")
    return kubeconfig(inv.metadata.name, server or inv.api_url, issue.cert_pem(ca.cert), ADMIN_USER,
                      client=material.pair("admin"))


def answering_server(inv: Inventory, timeout: float = 2.0) -> tuple[str, str | None]:
    """The server a user's kubeconfig should name now, and why when it is not ``inv.api_url``:
    ``spec.apiServer.endpoint`` when set (the user's VIP or balancer); else the first place an
    apiserver answers from here: a control host, or an address exposing a hosted tenant's
    (kubectl does not fail over by itself: written again while one is lost, the kubeconfig
    names one that answers)."""
    if inv.spec.apiServer.endpoint or len(inv.api_backends) < 2:
        return inv.api_url, None
    return chosen_server(inv, first_reachable([a for _, a, _ in inv.api_backends], inv.api_port, timeout))


def chosen_server(inv: Inventory, reached: str | None) -> tuple[str, str | None]:
    """Pure: the server for ``reached`` (the first backend address that answered, or None), and
    why when it is not the first: the backends before it, by host name (a control host) or by
    address (a tenant's exposed one)."""
    backends = inv.api_backends
    if reached is None:
        return inv.api_url, "no apiserver answered from here"
    addresses = [a for _, a, _ in backends]
    if reached == addresses[0]:
        return inv.api_url, None
    hosts = {h.name for h in inv.spec.hosts}
    down = [name if name in hosts else address for name, address, _ in backends[:addresses.index(reached)]]
    return base_url(reached, inv.api_port), f"{', '.join(down)}: no answer from the apiserver"


def check_admin_material(inv: Inventory, material: Material, now: dt.datetime | None = None) -> None:
    """The state must hold a current admin certificate under the current cluster CA."""
    ca, admin = material.cas.get("ca"), material.certs.get("admin")
    if ca is None or admin is None:
        raise StateError(f"the state holds no cluster CA or admin certificate for {inv.metadata.name}: "
                         "run `installer plan` (or apply) first")
    spec = next(s for s in cert_specs(inv) if s.name == "admin")
    why = issue.why_reissue(spec, admin, ca, inv.spec.pki.keyAlgorithm, now or dt.datetime.now(dt.timezone.utc))
    if why is not None:
        raise StateError(f"the state's admin certificate must be re-issued ({why}): run `installer plan` first")


def write_kubeconfig(inv: Inventory, material: Material, path: str | Path, *, force: bool = False,
                     server: str | None = None) -> bool:
    """Write the admin kubeconfig (user kubernetes-admin, server ``server`` or ``inv.api_url``)
    to ``path`` with mode 0600, atomically. An existing file with other content is kept unless
    ``force``. Returns False when the file already held exactly this (mode corrected if needed)."""
    path = Path(path)
    data = admin_kubeconfig_bytes(inv, material, server)
    if not force:
        try:
            same = path.read_bytes() == data
        except FileNotFoundError:
            same = True
        except OSError as e:
            raise InstallerError(f"{path}: {e.strerror}") from None
        if not same:
            raise InstallerError(f"{path} exists with other content; pass --force to overwrite it")
    try:
        return write_atomic(path, data, 0o600)
    except OSError as e:
        raise InstallerError(f"{path}: {e.strerror}") from None
