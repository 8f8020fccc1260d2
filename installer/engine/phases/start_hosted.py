"""hosted: a hosted tenant's control plane in its hosting cluster (docs/hosted.md).

The tenant's objects (render/tenant.py: its files as Secrets and ConfigMaps, etcd's
StatefulSet, the apiserver's Deployment, PodDisruptionBudget and Service, the controller-manager
and scheduler) are brought to what is rendered, then every workload is waited for until it runs
its current template on every replica, all ready, and the tenant's API answers /readyz where it
is exposed. An object already as rendered is not written: a run that changes nothing rolls
nothing. Nothing to do for a control plane on control hosts (the etcd and control-plane phases').
"""

from __future__ import annotations

import time

from installer.core import trust
from installer.core.etcd_rules import EtcdOpError
from installer.core.render.pods import key_for
from installer.core.render.tenant import render_tenant, tenant_plan_files
from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase
from installer.host.ssh import HostError


class StartHosted(Phase):
    name = "hosted"
    description = "a hosted tenant's control plane: its objects in the hosting cluster; wait for its API"

    def prepare(self, ctx: Context) -> list[str]:
        return [ctx.inv.hosted_namespace] if ctx.inv.hosted else []

    def run_host(self, ctx: Context, host: str) -> Event:
        from installer.host import hosting, tenant_members  # lazy: urllib3, for hosted tenants only
        started = time.monotonic()
        tenant = render_tenant(ctx.inv, ctx.material)
        api = ctx.executor.api(ctx.inv)
        try:
            # another etcdReplicas for a running tenant: one member at a time, before the objects
            # name the new member list (host/tenant_members.py)
            members = tenant_members.change_member_count(api, ctx.inv, ctx.options.wait_timeout, ctx.log,
                                                         dry_run=ctx.options.dry_run)
            done = hosting.converge(api, tenant.objects, ctx.inv.spec.kubernetes.version, dry_run=ctx.options.dry_run)
        except (hosting.HostingError, EtcdOpError) as e:
            raise HostError(host, str(e)) from None
        verb = "would " if ctx.options.dry_run else ""
        changed = members + [f"{verb}{'create' if a == 'created' else 'replace'} {k} {n}" if verb else f"{a} {k} {n}"
                             for k, n, a in done if a != "unchanged"]
        self.workloads = tenant.workloads()
        return Event(self.name, host, "changed" if changed else "unchanged", time.monotonic() - started,
                     files=len(changed), detail=changed)

    def finish(self, ctx: Context, events: list[Event]) -> None:
        from installer.host import hosting
        if ctx.options.dry_run:
            return
        ns = ctx.inv.hosted_namespace
        try:
            lines = hosting.wait_workloads(ctx.executor.api(ctx.inv), ns, self.workloads, ctx.options.wait_timeout,
                                           ctx.log)
        except hosting.HostingError as e:
            raise HostError(ns, str(e)) from None
        ctx.events.append(Event(self.name, ns, "waited", detail=lines))


def hosted_trust(ctx: Context) -> list[trust.Mismatch]:
    """The CA guard for a hosted tenant (core/trust.py): the CA files its ConfigMaps in the
    hosting cluster hold, each compared with what the state would write there. A wrong
    ``--state`` would otherwise replace the tenant's PKI under its running etcd and workers."""
    from installer.host import hosting  # lazy: urllib3, for hosted tenants only
    plan = tenant_plan_files(ctx.inv, ctx.material)
    paths = {key_for(f.path): f.path for f in plan.files.values() if f.trust}
    try:
        held = hosting.held_files(ctx.executor.api(ctx.inv), ctx.inv.hosted_namespace, paths)
    except hosting.HostingError as e:
        raise HostError(ctx.inv.hosted_namespace, str(e)) from None
    return trust.held_mismatches(f"hosting namespace {ctx.inv.hosted_namespace}", plan, held)
