"""etcd: install and start a member on every control host; wait until all are healthy (mTLS)."""

from __future__ import annotations

import shlex

from ..render.control import etcd_servers
from ..ssh import HostError
from .base import Context, Event, Phase
from .select import ETCD_UNIT, etcd_part

PKI = "/etc/kubernetes/pki"


def health_script(ctx: Context, timeout: float) -> str:
    cmd = (f"ETCDCTL_API=3 /usr/local/bin/etcdctl --endpoints={shlex.quote(etcd_servers(ctx.inv))} "
           f"--cacert={PKI}/etcd/ca.crt --cert={PKI}/etcd/healthcheck-client.crt "
           f"--key={PKI}/etcd/healthcheck-client.key --command-timeout=5s endpoint health")
    tries = max(1, int(timeout / 2))
    return (f"i=0; while [ $i -lt {tries} ]; do out=$({cmd} 2>&1) && {{ echo \"$out\"; exit 0; }}; "
            f"i=$((i+1)); sleep 2; done; echo \"$out\" >&2; exit 1")


class StartEtcd(Phase):
    name = "etcd"
    description = "etcd members as systemd units (dedicated user, mTLS); wait for a healthy cluster"

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts("control")]

    def run_host(self, ctx: Context, host: str) -> Event:
        changes = ctx.changes_for(host, etcd_part(ctx.plans[host]))
        # a new member waits for its peers before it reports ready: never block on it
        return ctx.execute(self.name, host, changes, no_block=True)

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or ctx.settled(events, (ETCD_UNIT,)):
            return
        first = ctx.hosts("control")[0].name
        r = ctx.remotes[first].run(health_script(ctx, ctx.options.wait_timeout), check=False,
                                   what="wait for etcd health", timeout=ctx.options.wait_timeout + 30)
        if r.rc != 0:
            raise HostError(first, f"etcd did not become healthy: {r.stderr.strip()[-500:]}")
        ctx.mark_active([h.name for h in ctx.hosts("control")], (ETCD_UNIT,))
        ctx.events.append(Event(self.name, first, "waited", detail=r.stdout.strip().splitlines()))
