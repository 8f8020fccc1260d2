"""An apiserver kept out of every client's way while its own host's etcd member restarts.

Each kube-apiserver talks to its own host's etcd member only (render/control.py's LOCAL_ETCD:
with every member listed, the apiservers kept timing out on a lost member). The price: while that
member restarts, its apiserver answers /readyz with 500 and fails writes, and the workers'
balancers need two failed checks to mark it down. Measured on the balanced lab before this
existed: `certs renew` failed 7 of 600 API probes per worker, all while a member restarted.

So before a running member restarts on a cluster with other control hosts, its host's apiserver
is stopped the graceful way (SIGTERM: /readyz fails at once, requests are served for
--shutdown-delay-duration while the balancers mark it down, then in-flight requests drain), and
started again once the member is healthy, ready before the next host is touched. With one
control host there is nobody to hand over to: the apiserver stays as it was.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from installer.core import components
from installer.core.render.balancer import SETTLE_SECONDS
from installer.host.health import client_context, wait_ok
from installer.host.ssh import HostError

APISERVER = components.unit("kube-apiserver")


def needed(ctx, host: str) -> bool:
    """Whether ``host``'s apiserver must step aside: another control host serves, and it runs."""
    if ctx.options.dry_run or len(ctx.inv.controls) < 2:
        return False
    facts = ctx.facts.get(host)
    return facts is not None and facts.units.get(APISERVER, ("", ""))[0] == "active"


def back(ctx, host: str) -> None:
    """Start ``host``'s apiserver and wait until it is ready; with the workers' balancers, give
    them one check interval to mark it up before the next one may leave."""
    ctx.remotes[host].run(f"systemctl start {APISERVER}", what="start kube-apiserver",
                          timeout=ctx.options.wait_timeout + 30)
    address, port = ctx.inv.host(host).address, ctx.inv.spec.apiServer.port
    with client_context(ctx.material) as tls:
        failure = wait_ok(tls, address, port, ("/livez", "/readyz"), ctx.options.wait_timeout)
    if failure:
        raise HostError(host, f"kube-apiserver is not ready on {address}:{port} after its etcd member "
                        f"restarted: {failure}")
    if ctx.inv.local_balancer:
        time.sleep(SETTLE_SECONDS)


@contextmanager
def aside(ctx, host: str) -> Iterator[bool]:
    """``host``'s apiserver stopped for the body (yields whether it was); started and ready
    after it. When the body fails, the apiserver is still started (best effort: the body's
    error is the one reported)."""
    if not needed(ctx, host):
        yield False
        return
    ctx.log(f"{host}: kube-apiserver out of the way while its etcd member restarts (the other "
            f"apiservers serve)")
    ctx.remotes[host].run(f"systemctl stop {APISERVER}", what="stop kube-apiserver",
                          timeout=ctx.options.wait_timeout + 30)
    try:
        yield True
    except BaseException:
        try:
            ctx.remotes[host].run(f"systemctl start {APISERVER}", check=False, what="start kube-apiserver",
                                  timeout=60)
        except HostError:
            pass
        raise
    back(ctx, host)
