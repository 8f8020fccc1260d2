"""A hosted tenant's control plane (docs/hosted.md): etcd, the apiservers, controller-managers
and schedulers as pods in one namespace of a hosting cluster, reached through that cluster's API
(host/hosting.py) with the kubeconfig the inventory names. The tenant's hosts are its workers
alone; the apply lock is a Lease in the namespace; etcd is reached with ``pods/exec``
(planes/etcd_pods.py); the control plane rolls by component (planes/tenant_roll.py).

One ``HostedPlane`` per command (engine/run.py): one hosting client, one Lease taken at most
once. A run inside a day-2 command (upgrade's turns, node remove's refresh) is the same Run, so
its lock phase finds the Lease its own and leaves it to the command to give back.
"""

from __future__ import annotations

import time

from installer.core import tenancy, trust
from installer.core.etcd_rules import EtcdOpError
from installer.core.render.pods import key_for
from installer.core.render.tenant import namespace_object, render_tenant, tenant_plan_files
from installer.core.render.tenant_network import RISK, probe_argv, probe_verdict
from installer.core.render.tenant_sizing import priority_class
from installer.engine.events import Event
from installer.engine.planes import etcd_pods, tenant_roll
from installer.engine.planes.base import ControlPlane
from installer.engine.steps import Step
from installer.host import apireach, node_api
from installer.host.ssh import HostError

# a hosted tenant's apiservers answer on the exposed addresses, each for its own node's replicas:
# this many connections through every address must all see a revocation (one replica per node:
# all of them reach it; where two share a node, one is missed by all with a chance of 2^-8)
API_PROBES = 8


class HostedPlane(ControlPlane):
    name = "hosted"

    def __init__(self, inv, session, state=None):
        super().__init__(inv, session, state)
        self._api = None
        self._found = self._owner_recorded = False    # the namespace exists; this state owns it (api)
        self._held: tuple[str, str] | None = None
        self._uid: str | None = None                 # the namespace's, once _take made or found it
        self._made = False                           # _take made it
        self._workloads: list = []
        self._placement = None                      # where its pods go: read once per command

    @property
    def namespace(self) -> str:
        return self.inv.hosted_namespace

    @property
    def where(self) -> str:
        return f"hosting {self.namespace}"

    def api(self):
        """The hosting cluster's client, made once per command: every command's first request
        is the ownership guard (core/tenancy.py), before it reads or writes anything there."""
        if self._api is None:
            from installer.host import hosting  # lazy: urllib3, for hosted tenants only
            api = hosting.hosting_client(self.inv)
            try:
                self._found, self._owner_recorded = hosting.check_owner(
                    api, self.namespace, self.inv.metadata.name, self.state.tenant_id() if self.state else None,
                    self.state.namespace_uid(self.namespace) if self.state else None)
            except BaseException:
                api.close()
                raise
            self._api = api
        return self._api

    # --- apply: the tenant's objects in its namespace -----------------------------------------

    def targets(self) -> list[str]:
        return [self.namespace]

    def converge(self, ctx, target: str):
        from installer.host import hosting, tenant_members  # lazy: urllib3, for hosted tenants only
        started = time.monotonic()
        try:
            tenant = render_tenant(ctx.inv, ctx.material, self.placement())
            # another etcdReplicas for a running tenant: one member at a time, before the objects
            # name the new member list (host/tenant_members.py)
            members = tenant_members.change_member_count(self.api(), ctx.inv, ctx.options.wait_timeout, ctx.log,
                                                         dry_run=ctx.options.dry_run)
            done = hosting.converge(self.api(), tenant.objects, ctx.inv.spec.kubernetes.version,
                                    dry_run=ctx.options.dry_run)
        except (hosting.HostingError, EtcdOpError) as e:
            raise HostError(target, str(e)) from None
        verb = "would " if ctx.options.dry_run else ""
        changed = members + [f"{verb}{'create' if a == 'created' else 'replace'} {k} {n}" if verb else f"{a} {k} {n}"
                             for k, n, a in done if a != "unchanged"]
        self._workloads = tenant.workloads()
        return Event("hosted", target, "changed" if changed else "unchanged", time.monotonic() - started,
                     files=len(changed), detail=changed)

    def placement(self):
        """Where the tenant's pods go on the hosting nodes (host/tenant_guards.py), or a refusal
        before anything is changed."""
        if self._placement is None:
            from installer.host import tenant_guards  # lazy: urllib3, for hosted tenants only
            self._placement = tenant_guards.place(self.api(), self.inv)
        return self._placement

    def wait_converged(self, ctx) -> list[str]:
        from installer.host import hosting, tenant_members  # lazy: urllib3, for hosted tenants only
        try:
            lines = hosting.wait_workloads(self.api(), self.namespace, self._workloads, ctx.options.wait_timeout,
                                           ctx.log)
            # every member now runs a certificate that names its Service: off the legacy URLs
            lines += tenant_members.move_peer_urls(self.api(), ctx.inv, ctx.options.wait_timeout, ctx.log)
        except (hosting.HostingError, EtcdOpError) as e:
            raise HostError(self.namespace, str(e)) from None
        return lines + self._isolation(ctx)

    def _isolation(self, ctx) -> list[str]:
        """The tenant's NetworkPolicies enforced, or apply stops (``requireNetworkPolicy: false``:
        a warning each run). Probed every apply: a hosting cluster can lose its enforcer."""
        from installer.host import tenant_etcd  # lazy: urllib3, for hosted tenants only
        api, inv = self.api(), ctx.inv
        port = inv.spec.apiServer.port
        try:
            target = next((p for p in tenant_etcd.component_pods(api, inv, "kube-apiserver")
                           if tenant_etcd.pod_ready(p) and (p.get("status") or {}).get("podIP")), None)
            if target is None:
                raise HostError(self.namespace, "no ready kube-apiserver pod with an address to probe "
                                "NetworkPolicy enforcement against")
            member = tenant_etcd.ready_members(api, inv)[0]
            r = tenant_etcd.run_in_member(api, inv, member, probe_argv(target["status"]["podIP"], port),
                                          "NetworkPolicy probe", check=False, timeout=60)
        except EtcdOpError as e:
            raise HostError(self.namespace, str(e)) from None
        stderr = r.stderr.decode(errors="replace").strip()
        verdict = probe_verdict(r.rc, stderr)
        to = f"{target['metadata']['name']}:{port}"
        if verdict == "denied":
            return [f"NetworkPolicy enforced: {member} could not connect to {to}, which the tenant's policies deny"]
        why = (f"{member} connected to {to}, which the tenant's policies deny" if verdict == "reached" else
               f"the probe from {member} to {to} did not tell (exit {r.rc}: {stderr[-300:] or 'no output'})")
        if not inv.hosted.requireNetworkPolicy:
            return [f"warning: NetworkPolicy not enforced ({why}): {RISK}; accepted by "
                    "spec.controlPlane.hosted.requireNetworkPolicy: false"]
        raise HostError(self.namespace, f"the hosting cluster does not enforce NetworkPolicy: {why}. So {RISK}. "
                        "Run an enforcer there (a cluster this installer built: spec.network.policy: "
                        "kube-network-policies; docs/hosted.md), or accept the risk with "
                        "spec.controlPlane.hosted.requireNetworkPolicy: false")

    def place(self, ctx, phase: str, host: str, changes, no_block: bool = False):
        raise HostError(host, "a hosted control plane has no host to place files on")

    # --- the apply lock: a Lease in the tenant's namespace ---------------------------------

    def lock_targets(self, ctx, pending: bool) -> list[str]:
        # taken every run: whether its control plane needs a change is known only once the
        # hosting cluster is read
        return [self.namespace]

    def take_lock(self, ctx, target: str, pending: bool) -> list[str]:
        from installer.host import hosting, tenant_guards  # lazy: urllib3, for hosted tenants only
        try:
            # before the namespace is made and the artifacts go to its workers: nothing of a
            # tenant that stops here changes
            self.placement()
            self._take(force=ctx.options.force_unlock, create=True)
            tenant_guards.refuse_root_tenant(self.api(), ctx.inv)
            recorded = self._record_owner()
        except hosting.HostingError as e:
            raise HostError(target, str(e)) from None
        return ["the apply lock (a Lease) taken", *recorded]

    def hold(self, run, skip: frozenset[str] = frozenset()) -> None:
        self._take()

    def _take(self, force: bool = False, create: bool = False) -> None:
        """The namespace made when missing (``create``: apply; a day-2 command or a reset is
        refused with ``tenancy.NoNamespace``), the Lease taken for the run (take_lease says False
        when this run holds it already: whoever took it gives it back)."""
        from installer.host import hosting  # lazy: urllib3, for hosted tenants only
        self._uid, self._made = hosting.ensure_namespace(self.api(), namespace_object(self.inv),
                                                         self.inv.spec.kubernetes.version, create)
        self._found = True
        if hosting.take_lease(self.api(), self.namespace, self.session.run_id, force=force):
            self._held = (self.namespace, self.session.run_id)

    def _record_owner(self) -> list[str]:
        """This state recorded as the namespace's owner, by the first apply that holds its Lease
        (the guard in ``api`` let it in: the namespace is new, or labelled for this tenant)."""
        if self.state is None:
            return []
        from installer.host import hosting  # lazy: urllib3, for hosted tenants only
        out = []
        if self._made or not self.state.namespace_uid(self.namespace):
            # this run made it (the one the state knew is gone: the ownership guard let an apply
            # in only because none stood there), or a state from before the UID was kept
            self.state.record_namespace_uid(self.namespace, self._uid)
            out.append(f"this state keeps the UID of namespace {self.namespace}")
        if self._owner_recorded:
            return out
        owner = tenancy.owner_object(self.namespace, self.inv.metadata.name, self.state.ensure_tenant_id())
        hosting.converge(self.api(), [owner], self.inv.spec.kubernetes.version)
        self._owner_recorded = True
        return out + [f"this state recorded as the owner of namespace {self.namespace} (ConfigMap {tenancy.OWNER})"]

    def release(self) -> None:
        from installer.host import hosting  # lazy: urllib3, for hosted tenants only
        try:
            super().release()
        finally:
            if self._held and self._api is not None:
                held, self._held = self._held, None
                hosting.release_lease(self._api, *held)

    def forget_lock(self) -> None:
        self._held = None

    def close(self) -> None:
        try:
            self.release()
        finally:
            if self._api is not None:
                self._api.close()
                self._api = None

    # --- what apply reads ---------------------------------------------------------------------

    def held_certificates(self, ctx) -> list[tuple[str, object, dict[str, bytes]]]:
        """The CA files of the tenant's ConfigMaps and the leaf certificates of its Secrets, for
        the guards: a wrong ``--state`` would otherwise replace the tenant's PKI under its running
        etcd and workers, a stale copy bring back keys a renewal replaced."""
        from installer.host.hosting import HostingError  # lazy: urllib3, for hosted tenants only
        plan = self.beyond_plan(ctx.inv, ctx.material)
        try:
            self.api()
            # no namespace (a first apply, or after a reset): nothing is held there yet
            held = self.read_files(trust.certificate_paths(plan), secrets=True) if self._found else {}
        except HostingError as e:
            raise HostError(self.namespace, str(e)) from None
        return [(f"hosting namespace {self.namespace}", plan, held)]

    def api_live(self, ctx) -> bool:
        # its exposed address answers
        return apireach.first_reachable([a for _, a, _ in ctx.inv.api_backends], ctx.inv.api_port, 2.0) is not None

    def beyond_plan(self, inv, material):
        return tenant_plan_files(inv, material)

    def read_files(self, paths: list[str], secrets: bool = True) -> dict[str, bytes]:
        from installer.host import hosting  # lazy: urllib3, for hosted tenants only
        return hosting.held_files(self.api(), self.namespace, {key_for(p): p for p in paths}, secrets=secrets)

    # --- etcd day 2: etcdctl in a member's container -------------------------------------------

    def members(self, run) -> list:
        return etcd_pods.members(self.api(), run.inv)

    def etcd_sites(self, run) -> list[str]:
        from installer.host import tenant_etcd  # lazy: urllib3, for hosted tenants only
        return tenant_etcd.running_members(self.api(), run.inv)

    def etcdctl_at(self, run, site: str, args: list[str], what: str, timeout: float = 60) -> str:
        from installer.host import tenant_etcd  # lazy: urllib3, for hosted tenants only
        return tenant_etcd.etcdctl_in(self.api(), run.inv, site, args, what, timeout)

    def snapshot_save(self, run, dest, force: bool = False):
        return etcd_pods.snapshot_save(self.api(), run.inv, dest, force)

    def restore_plan(self, inv, snapshot: str, stamp: str) -> list[str]:
        return etcd_pods.restore_plan(inv, snapshot, stamp)

    def snapshot_restore(self, run, snapshot, wait_timeout: float) -> list[str]:
        return etcd_pods.snapshot_restore(self.api(), run.inv, snapshot, wait_timeout, run.log)

    # --- upgrade and certificate rolls: the tenant's objects by component -------------------------

    def survey(self, run, remotes: dict) -> tuple[list, dict[str, bool]]:
        control, etcd = tenant_roll.control_state(self.api(), run.inv)
        return [control], etcd

    def leader_pods(self, run) -> set[str] | None:
        return tenant_roll.running_pods(self.api(), run.inv, node_api.LEADER_LEASES)

    def upgrade_turn(self, up, batch: list[str], etcd_turn: bool, etcd_inv, current_etcd: str | None,
                     was: str):
        ns = self.namespace
        if etcd_turn:
            return Step(f"etcd (StatefulSet etcd in {ns}) {current_etcd} -> {etcd_inv.spec.artifacts.versions.etcd}: "
                        "one member at a time, each ready (healthy) before the next",
                        lambda up: tenant_roll.roll(self.api(), etcd_inv, up.material, tenant_roll.ETCD,
                                                    up.wait_timeout, up.log))

        def run(up) -> None:
            for components in (tenant_roll.APISERVER, tenant_roll.CONTROLLERS):
                tenant_roll.roll(self.api(), up.inv, up.material, components, up.wait_timeout, up.log)
        return Step(f"kube-apiserver, kube-controller-manager, kube-scheduler in {ns} {was} -> {up.target}: the "
                    "apiserver replicas first (a new one ready before an old one goes: its PodDisruptionBudget "
                    "holds), then the controller-managers and schedulers", run)

    def renew_steps(self) -> list:
        def roll(r) -> None:
            for components in (tenant_roll.ETCD, tenant_roll.APISERVER, tenant_roll.CONTROLLERS):
                tenant_roll.roll(self.api(), r.inv, r.new, components, r.wait_timeout, r.log)
        return [Step("roll the tenant's control plane in its hosting cluster with the new files: etcd's members one "
                     "at a time (each healthy before the next), then the apiserver replicas (a new one ready before "
                     "an old one goes), then the controller-managers and schedulers", roll)]

    def stop_all(self, r, etcd: bool) -> None:
        tenant_roll.stop(self.api(), r.inv, r.wait_timeout, r.log, etcd=etcd)

    def start_all(self, r) -> None:
        # its objects as the new material renders them, the replica counts with them: etcd's
        # members start together on their volumes, then the rest rolls out
        tenant_roll.roll(self.api(), r.inv, r.new, tenant_roll.ALL, r.wait_timeout, r.log)

    def exposed(self, inv) -> list[tuple[str, str, str, int]]:
        # its apiservers and konnectivity servers, as its workers reach them: on each exposed
        # address, the replica of that address's node
        return [row for _, address, port in inv.api_backends for row in (
                ("kube-apiserver", f"kube-apiserver (hosted, {address})", address, port),
                ("konnectivity-server", f"konnectivity-server (hosted, {address})", address,
                 inv.hosted.expose.konnectivityPort))]

    def api_probes(self) -> int:
        return API_PROBES

    # --- reset ---------------------------------------------------------------------------------------

    def beyond_hosts(self) -> tuple[str, str] | None:
        ns = self.namespace
        return (f"take the apply lock of the hosted control plane (a Lease in namespace {ns} of the hosting cluster)",
                f"delete namespace {ns} in the hosting cluster: the control plane's pods, Secrets and etcd volumes; "
                f"then its PriorityClass {priority_class(self.inv)}")

    def delete(self, run) -> dict[str, list[str]]:
        from installer.host import hosting  # lazy: urllib3, for hosted tenants only
        ns = self.namespace
        gone = hosting.delete_namespace(self.api(), ns, 600, run.log)
        self.forget_lock()          # it went with the namespace
        if self.state is not None:
            self.state.record_namespace_uid(ns, None)     # and its UID: the next apply makes another
        done = [f"deleted namespace {ns} (the control plane, its Secrets, its volumes)"] if gone else []
        if not gone:
            run.log(f"hosting: no namespace {ns}")
        # cluster-scoped, so not the namespace's: after it (its pods named it)
        if (pc := hosting.delete_priority_class(self.api(), priority_class(self.inv), self.inv.metadata.name)):
            deleted, words = pc
            (done.append if deleted else run.log)(words)
        return {f"hosting:{ns}": done} if done else {}
