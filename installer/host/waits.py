"""What "started" means for each component after a (re)start, done on its host: the component
table's ``wait`` column names one of ``components.WAITS``, and ``wait`` here does it. The apply
phases, the rollouts (certs renew, ca rotate) and handover.py wait through these; the shell waits
are subshells, so that scripts chain them with ``&&``."""

from __future__ import annotations

import shlex

from installer.core import components
from installer.core.shellfiles import shell_file
from installer.host.etcdctl import cluster_health_script
from installer.host.health import client_context, wait_ok
from installer.host.ssh import HostError

READY_PATHS = ("/livez", "/readyz")


def _subshell(name: str, *args: object) -> str:
    """installer/sh/``name`` run with ``args`` in a subshell: scripts chain it with ``&&`` (its
    ``exit`` ends only itself)."""
    return f"(set -- {' '.join(shlex.quote(str(a)) for a in args)}\n{shell_file(name)})"


def active_script(units: tuple[str, ...], timeout: float) -> str:
    """Until every unit is active (installer/sh/wait-active.sh), at most ``timeout`` seconds."""
    return _subshell("wait-active.sh", max(1, int(timeout)), *units)


def listening_script(ports: tuple[int, ...], timeout: float,
                     units: tuple[str, ...] = ("kube-controller-manager", "kube-scheduler")) -> str:
    """Until something listens on every port (installer/sh/wait-listening.sh), at most
    ``timeout`` seconds; on timeout ``units``' status is shown."""
    return _subshell("wait-listening.sh", max(1, int(timeout)), *ports, "--", *units)


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


def wait_all(ctx, host: str, units: tuple[str, ...], after: str = "") -> None:
    """``wait`` for each of ``units`` on ``host``, the shell ones in one round trip (in order;
    the first that times out is named)."""
    shell = [u for u in units if components.by_unit(u).wait not in _NOT_SHELL]
    for u in units:
        if u not in shell:
            wait(ctx, host, u, after)
    if len(shell) < 2:
        for u in shell:
            wait(ctx, host, u, after)
        return
    t = ctx.options.wait_timeout
    r = ctx.remotes[host].run(all_script(ctx, shell), check=False, what=f"wait for {', '.join(shell)}",
                              timeout=len(shell) * t + 30)
    if r.rc != 0:
        failed = next((line[len(_FAILED):] for line in r.stderr.splitlines() if line.startswith(_FAILED)), shell[0])
        detail = "\n".join(line for line in r.stderr.splitlines() if not line.startswith(_FAILED)).strip()
        kind = components.by_unit(failed).wait
        raise HostError(host, f"{failed} did not start{after} ({components.WAITS[kind]}): {detail[-600:]}")


_FAILED = "hiddenplane-wait-failed: "


def all_script(ctx, units) -> str:
    """The shell waits of ``units`` in order, in one script: a wait that fails names its unit on
    a line of its own and ends the script."""
    return "\n".join(f"if ! {{ {script(ctx, u)}\n}}; then echo {shlex.quote(_FAILED + u)} >&2; exit 1; fi"
                     for u in units)


def wait(ctx, host: str, unit: str, after: str = "") -> None:
    """Until ``unit`` on ``host`` counts as started (its row's wait); HostError naming the host
    and what did not happen otherwise."""
    kind = components.by_unit(unit).wait
    if kind in _NOT_SHELL:
        _NOT_SHELL[kind](ctx, host, after)
        return
    t = ctx.options.wait_timeout
    r = ctx.remotes[host].run(script(ctx, unit), check=False, what=f"wait for {unit}", timeout=t + 30)
    if r.rc != 0:
        raise HostError(host, f"{unit} did not start{after} ({components.WAITS[kind]}): {r.stderr.strip()[-600:]}")
