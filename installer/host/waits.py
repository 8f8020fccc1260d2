"""What "started" means for each component after a (re)start, done on its host: the component
table's ``wait`` column names one of ``components.WAITS``, and ``wait`` here does it. The apply
phases, the rollouts (certs renew, ca rotate) and handover.py wait through these; the shell waits
are subshells, so that scripts chain them with ``&&``."""

from __future__ import annotations

from installer.core import components
from installer.host.etcdctl import cluster_health_script
from installer.host.health import client_context, wait_ok
from installer.host.ssh import HostError

READY_PATHS = ("/livez", "/readyz")


def active_script(units: tuple[str, ...], timeout: float) -> str:
    """Wait until every unit is active. A subshell, so that scripts chain with ``&&``."""
    names = " ".join(units)
    tries = max(1, int(timeout))
    # `systemctl is-active A B` succeeds when ANY of them is active: each unit is asked alone.
    # A unit that failed (started with --no-block, nothing else reports it) ends the wait early;
    # not in the first seconds, while a unit that failed before may not have begun its new start
    every = " && ".join(f"systemctl is-active --quiet {u}" for u in units)
    return (f"(i=0; while [ $i -lt {tries} ]; do {every} && exit 0; "
            f"if [ $i -ge 3 ] && systemctl is-failed --quiet {names}; then break; fi; "
            f"i=$((i+1)); sleep 1; done; systemctl --no-pager status {names} 2>&1 | tail -30 >&2; exit 1)")


def listening_script(ports: tuple[int, ...], timeout: float,
                     units: tuple[str, ...] = ("kube-controller-manager", "kube-scheduler")) -> str:
    """Wait until something listens on every port; on timeout show ``units``' status. A subshell,
    so that scripts chain with ``&&`` (its ``exit`` ends only itself)."""
    want = " ".join(str(p) for p in ports)
    tries = max(1, int(timeout))
    return (f"(i=0; while [ $i -lt {tries} ]; do ok=1; for p in {want}; do "
            f"ss -Htln | awk '{{print $4}}' | grep -q \":$p$\" || ok=0; done; "
            f"[ $ok = 1 ] && exit 0; i=$((i+1)); sleep 1; done; "
            f"echo \"not listening on all of: {want}\" >&2; systemctl --no-pager status "
            f"{' '.join(units)} 2>&1 | tail -20 >&2; exit 1)")


def apiserver_ready(ctx, host: str, after: str = "") -> None:
    """``host``'s apiserver answers /livez and /readyz (its TLS verified against the cluster CA)
    within the wait timeout; HostError naming it otherwise."""
    address, port = ctx.inv.host(host).address, ctx.inv.spec.apiServer.port
    with client_context(ctx.material) as tls:
        failure = wait_ok(tls, address, port, READY_PATHS, ctx.options.wait_timeout)
    if failure:
        raise HostError(host, f"kube-apiserver is not ready on {address}:{port}{after}: {failure}")


def secure_ports(unit: str) -> tuple[int, ...]:
    row = components.by_unit(unit)
    return tuple(p.number for p in row.ports if p.what == "secure") if row else ()


def script(ctx, unit: str) -> str | None:
    """The shell wait for ``unit`` on its host (None: its wait is not a shell one)."""
    t = ctx.options.wait_timeout
    kind = components.by_unit(unit).wait
    if kind == "active":
        return active_script((unit,), t)
    if kind == "listening":
        return active_script((unit,), t) + " && " + listening_script(secure_ports(unit), t, (unit,))
    if kind == "etcd-health":
        return cluster_health_script(ctx.inv, t)
    return None


# every kind of components.WAITS: the shell ones by script(), the others here
_NOT_SHELL = {"apiserver-ready": apiserver_ready}


def wait(ctx, host: str, unit: str) -> None:
    """Until ``unit`` on ``host`` counts as started (its row's wait); HostError naming the host
    and what did not happen otherwise."""
    kind = components.by_unit(unit).wait
    if kind in _NOT_SHELL:
        _NOT_SHELL[kind](ctx, host)
        return
    t = ctx.options.wait_timeout
    r = ctx.remotes[host].run(script(ctx, unit), check=False, what=f"wait for {unit}", timeout=t + 30)
    if r.rc != 0:
        raise HostError(host, f"{unit} did not start ({components.WAITS[kind]}): {r.stderr.strip()[-600:]}")
