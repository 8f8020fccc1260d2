"""An apiserver that stops on purpose hands its clients over first, and takes them back after.

With the workers' balancers (render/balancer.py) a stopping apiserver used to leave them by
their health checks alone: SIGTERM fails its /readyz at once, it serves through its
--shutdown-delay-duration, and two failed checks (~2 s) later every balancer marked it down and,
with shutdown-sessions, cut every connection it carried, the requests in flight with them
(seen in CI: `certs renew`, 1 of 974 API probes). So every planned stop goes this way:

1. ``leave``: on every worker, ``hiddenplane-api-balancer-ctl leave`` drains the server (no new
   connection goes to it) and pauses its checks (so nothing cuts the connections it carries);
   LEAVE_GRACE for the requests already sent to it.
2. The apiserver stops or restarts; as it shuts down it answers what it accepted and closes
   its connections itself, and the clients reconnect through the balancer to the others.
3. ``back``: /livez and /readyz answer, then every balancer checks it again and sends it
   connections; SETTLE_SECONDS before the next apiserver may leave (a worker that could not be
   told marks it up by its checks within that time).

A worker that cannot be told (unreachable, no balancer yet) is named in the log and not waited
for: its checks take the apiserver out as before. A leave that no back follows (the run died)
undoes itself after LEAVE_EXPIRY_SECONDS on the worker (a systemd timer). With one control host
there is nobody to hand over to: nothing is drained, and an etcd restart leaves the apiserver
running.

``aside``: the same around a restart of the host's etcd member, which its apiserver alone uses
(render/control.py's LOCAL_ETCD): the apiserver is stopped for the member's restart and started
after it, which also does a restart of it that was pending.
"""

from __future__ import annotations

import shlex
import time
from contextlib import contextmanager
from typing import Iterator

from installer.core import components
from installer.core.render.balancer import CTL, LEAVE_EXPIRY_SECONDS, SETTLE_SECONDS
from installer.host.parallel import each
from installer.host.ssh import HostError

APISERVER = components.unit("kube-apiserver")
BALANCER = components.unit("api-balancer")
# after every balancer drained an apiserver, before it stops: the requests already on their way
# to it reach it (a request takes milliseconds on the control hosts' network)
LEAVE_GRACE = 1.0


def balanced(ctx) -> bool:
    """Whether an apiserver may leave the balancers: they exist, and another apiserver serves."""
    return not ctx.options.dry_run and ctx.inv.local_balancer and len(ctx.inv.controls) > 1


def _workers(ctx) -> list[str]:
    """Workers whose balancer may carry connections: all of them, except those whose facts say
    the balancer does not run (a worker joining in this run)."""
    out = []
    for w in ctx.inv.workers:
        facts = ctx.facts.get(w.name)
        if facts is None or facts.units.get(BALANCER, ("", ""))[0] == "active":
            out.append(w.name)
    return out


def _tell(ctx, host: str, action: str) -> None:
    """Run the ctl's ``action`` for ``host``'s apiserver on every worker; log who was not told."""
    workers = _workers(ctx)
    if not workers:
        return
    args = [action, host] + ([str(LEAVE_EXPIRY_SECONDS)] if action == "leave" else [])
    command = f"if [ -x {CTL} ]; then {shlex.join([CTL, *args])}; fi"

    def tell(worker: str) -> None:
        # a run limited to other hosts (an upgrade's step) had not connected it: the run's session does
        remote = ctx.session.remote(ctx.inv.host(worker))
        r = remote.run(command, check=False, what=f"balancer: {action} {host}", timeout=60)
        if r.rc != 0:
            raise HostError(worker, (r.stderr.strip() or f"exit {r.rc}")[-300:])
    failed = {w: e for w, e in each(tell, workers).items() if e is not None}
    told = len(workers) - len(failed)
    ctx.log(f"{host}: kube-apiserver {'left' if action == 'leave' else 'is back in'} the API balancers "
            f"of {told} worker(s)" + (" (drained, checks paused)" if action == "leave" else ""))
    for w, e in failed.items():
        ctx.log(f"  warning: {w}: its balancer was not told ({e}); its checks "
                + ("take the apiserver out, and may cut requests it still answers" if action == "leave"
                   else "put it back within a second"))


def leave(ctx, host: str) -> None:
    """``host``'s apiserver out of every worker's balancer before it stops."""
    if balanced(ctx):
        _tell(ctx, host, "leave")
        time.sleep(LEAVE_GRACE)


def back(ctx, host: str, after: str = "") -> None:
    """``host``'s apiserver ready, then back in every balancer, then SETTLE_SECONDS."""
    ctx.plane.wait(ctx, host, APISERVER, after)
    if balanced(ctx):
        _tell(ctx, host, "back")
        time.sleep(SETTLE_SECONDS)


def back_anyway(ctx, host: str) -> None:
    """After a failure: every balancer checks ``host`` again (its checks, not this run, decide
    whether it serves); what fails here is not reported over the failure being raised."""
    if balanced(ctx):
        try:
            _tell(ctx, host, "back")
        except Exception:               # noqa: BLE001 - the caller's error is the one to report
            pass


@contextmanager
def restarting(ctx, host: str, after: str = " after its restart") -> Iterator[None]:
    """The body restarts ``host``'s apiserver: it leaves the balancers before and comes back
    (ready, then in every balancer) after. The body's failure is raised once the balancers
    check it again."""
    leave(ctx, host)
    try:
        yield
    except BaseException:
        back_anyway(ctx, host)
        raise
    back(ctx, host, after)


def needed(ctx, host: str) -> bool:
    """Whether ``host``'s apiserver must step aside for its etcd member: another control host
    serves, and it runs."""
    if ctx.options.dry_run or len(ctx.inv.controls) < 2:
        return False
    facts = ctx.facts.get(host)
    return facts is not None and facts.units.get(APISERVER, ("", ""))[0] == "active"


@contextmanager
def aside(ctx, host: str) -> Iterator[bool]:
    """``host``'s apiserver stopped for the body (yields whether it was), the etcd member's
    restart; started, ready and back in the balancers after. When the body fails, the
    apiserver is still started (best effort: the body's error is the one reported)."""
    if not needed(ctx, host):
        yield False
        return
    ctx.log(f"{host}: kube-apiserver out of the way while its etcd member restarts (the other "
            f"apiservers serve)")
    leave(ctx, host)
    ctx.plane.stop(ctx, host, APISERVER)
    try:
        yield True
    except BaseException:
        try:
            ctx.plane.restart(ctx, host, APISERVER)
        except HostError:
            pass
        back_anyway(ctx, host)
        raise
    # a restart: one pending for it (its files are in place now) is done by this start, not again
    ctx.plane.restart(ctx, host, APISERVER)
    back(ctx, host, after=" after its etcd member restarted")
