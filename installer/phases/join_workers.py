"""workers: kernel settings, containerd, kubelet (bootstrap kubeconfig) and kube-proxy.

Waits until the units are active and the kubelet serves its port. With a real cluster (the
cluster-bootstrap phase ran) it also waits for each Node to be Ready and sets its
spec.podCIDR to the installer's allocation (cni: routes); once a kubelet holds a
client certificate of its own, the next run removes its bootstrap kubeconfig.
"""

from __future__ import annotations

from ..ssh import HostError
from .base import Context, Event, Phase
from .select import WORKER_UNITS, worker_part
from .start_control_plane import listening_script

KUBELET_PORTS = (10250,)


def active_script(units: tuple[str, ...], timeout: float) -> str:
    names = " ".join(units)
    tries = max(1, int(timeout))
    return (f"i=0; while [ $i -lt {tries} ]; do systemctl is-active --quiet {names} && exit 0; "
            f"i=$((i+1)); sleep 1; done; systemctl --no-pager status {names} 2>&1 | tail -30 >&2; exit 1")


class JoinWorkers(Phase):
    name = "workers"
    description = "containerd, kubelet and kube-proxy on the workers; wait until they run"

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts("worker")]

    def run_host(self, ctx: Context, host: str) -> Event:
        ev = ctx.execute(self.name, host, ctx.changes_for(host, worker_part(ctx.plans[host])))
        if not ctx.options.dry_run and not ctx.settled([ev], WORKER_UNITS):
            timeout = ctx.options.wait_timeout
            script = active_script(WORKER_UNITS, timeout) + "\n" + listening_script(KUBELET_PORTS, timeout)
            r = ctx.remotes[host].run(script, check=False, what="wait for the worker units",
                                      timeout=2 * timeout + 30)
            if r.rc != 0:
                raise HostError(host, f"worker units did not come up: {r.stderr.strip()[-800:]}")
            ctx.mark_active([host], WORKER_UNITS)
        return ev

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or not ctx.bootstrap_ran:
            return   # Node objects exist only on a real cluster bootstrapped in this run
        from .. import kube
        names = [h.name for h in ctx.hosts("worker")]
        with kube.api_access(ctx.inv, ctx.remotes, ctx.material) as url, kube.api_client(url, ctx.material) as api:
            kube.wait_nodes_ready(api, names, ctx.options.wait_timeout)
            ctx.events.append(Event(self.name, "(api)", "waited", detail=[f"node {n} Ready" for n in names]))
            if ctx.inv.spec.network.cni == "routes":
                # Node.spec.podCIDR agrees with the installer's allocation (kube.set_pod_cidr)
                done = {n: kube.set_pod_cidr(api, n, ctx.material.pod_cidrs[n]) for n in names}
                ctx.events.append(Event(self.name, "(api)", "changed" if "set" in done.values() else "unchanged",
                                        detail=[f"node {n} podCIDR {ctx.material.pod_cidrs[n]}: {how}"
                                                for n, how in done.items()]))
