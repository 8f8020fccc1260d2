"""``ca rotate``: new CA(s) (default all three; ``which`` limits), every leaf re-issued under them,
new bootstrap tokens.

Members holding different CAs cannot talk to each other, so the roll-out takes the control plane
down: stop every controller-manager, scheduler, konnectivity-server and apiserver; stop every etcd
member when the etcd CA rotates (otherwise members restart one at a time as in a renewal); push;
start etcd on every member, wait for a healthy cluster (the data directory is never touched: no
data is lost); start the apiservers one by one (wait for /readyz), then the rest of the control
plane. With a real API (``api=True``) the new bootstrap token Secrets are created and the old
ones deleted. Then each worker in turn: stop kubelet and kube-proxy, remove the kubelet's client
certificate and kubeconfig (signed by the old CA), push the new CA, serving pair, kube-proxy
kubeconfig and bootstrap kubeconfig, start them: the kubelet bootstraps again against the new
CA. The service-account key stays (tokens stay valid), and so does the encryption key. Finally
every endpoint is checked by TLS handshake, and must not be signed by a CA rotated away.

A rotation is a renewal of every leaf under new CAs: the leaves, the backup and the saved state
are renew.py's; the session, pushes, restarts and handshakes are rollout.py's.

Kubelet *client* certificates are never issued here: the cluster signs them (TLS
bootstrapping) and the kubelet renews them itself.
"""

from __future__ import annotations

import datetime as dt
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from installer.actions.certs import existing_state
from installer.actions.endpoints import verify
from installer.actions.renew import (
    CA_CHOICES,
    CONNECT,
    NOT_OURS,
    Roll,
    connect,
    copy_material,
    keep_and_save,
    pki_paths,
    reissue,
    reissued_rows,
    run_roll,
)
from installer.actions.rollout import (
    APISERVER,
    CONTROLLER_MANAGER,
    ETCD,
    KONNECTIVITY,
    KUBE_PROXY,
    KUBELET,
    SCHEDULER,
    Reissued,
    Report,
    hex_serial,
    push,
    restart_order,
    roll,
    stop_units,
)
from installer.core.cluster import Cluster
from installer.core.errors import InstallerError, StateError
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.issue import Pair
from installer.core.pki.material import Material, new_token
from installer.core.pki.specs import CAS, ETCD_CA, cert_specs
from installer.core.render.addons import addon_objects
from installer.core.render.addons.konnectivity import enabled as konnectivity_enabled
from installer.engine.bootstrap import send_bootstrap_objects
from installer.engine.context import Context
from installer.engine.run import open_run
from installer.engine.steps import Step, plan
from installer.host import apireach, csr_approval

KUBELET_CLIENT_FILES = ("/var/lib/kubelet/pki/kubelet-client-*.pem", "/etc/kubernetes/kubelet.conf")


# --- pure: which CAs, new material, the plan ------------------------------------------------

def which_cas(which) -> list[str]:
    """CLI names (ca, etcd-ca, front-proxy-ca, all) -> state names, in table order."""
    which = set(which or ("all",))
    unknown = which - set(CA_CHOICES) - {"all"}
    if unknown:
        raise InstallerError(f"unknown CA {', '.join(sorted(unknown))}; choose from {', '.join(CA_CHOICES)}, all")
    wanted = set(CA_CHOICES.values()) if "all" in which else {CA_CHOICES[w] for w in which}
    return [c.name for c in CAS if c.name in wanted]


def rotated(inv: Inventory, material: Material, which, now: dt.datetime | None = None) -> Material:
    """New CAs ``which`` (state names), every leaf re-issued (new keys), a new bootstrap token per
    worker; the service-account key, encryption key and pod CIDRs kept."""
    now = now or dt.datetime.now(dt.timezone.utc)
    pki = inv.spec.pki
    new = copy_material(material)
    for ca in CAS:
        if ca.name in which:
            key = issue.new_key(pki.keyAlgorithm)
            new.cas[ca.name] = Pair(issue.make_ca(ca.cn, key, pki.caValidityDays, now), key)
    new = reissue(inv, new, [s.name for s in cert_specs(inv)], now)
    ttl = dt.timedelta(hours=pki.bootstrapTokenTTLHours)
    new.tokens = {h.name: new_token(now + ttl) for h in inv.workers}
    return new


def rotate_plan(inv: Inventory, cas: list[str], use_api: bool) -> list[str]:
    """The rotation's steps in words (nothing is read or reached)."""
    with open_run(inv) as run:
        return plan(_rotate_steps(_Rotation(inv, run=run, cas=cas, use_api=use_api)))


# --- ca rotate ---------------------------------------------------------------------------------

def _api_tokens(ctx: Context, old: Material, report: Report) -> None:
    from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
    ev = send_bootstrap_objects(ctx, "cluster-bootstrap")
    report.steps += ev.detail
    gone = {t.id for t in old.tokens.values()} - {t.id for t in ctx.material.tokens.values()}
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material, credential="super-admin") as client:
        for token_id in sorted(gone):
            if kube.delete_bootstrap_token(client, token_id):
                report.steps.append(f"deleted bootstrap token {token_id}")


# Helm installs Cilium (not in addon_objects); its agents and operator talk to the API too
CILIUM_WORKLOADS = (("DaemonSet", "kube-system", "cilium"), ("Deployment", "kube-system", "cilium-operator"))


def api_client_workloads(inv) -> list[tuple[str, str, str]]:
    """The installer's add-ons whose pods call the API: (kind, namespace, name)."""
    out = [(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in addon_objects(inv)
           if o["kind"] in ("Deployment", "DaemonSet")]
    return out + (list(CILIUM_WORKLOADS) if inv.spec.network.cni == "cilium" else [])


def _restart_api_clients(ctx: Context, report: Report) -> None:
    """Pods read the cluster CA once, at start: the add-ons' pods would keep refusing the
    apiserver's new certificate (CoreDNS: "x509: certificate signed by unknown authority"), so
    they are restarted; their new pods get the new CA from the kube-root-ca.crt ConfigMap."""
    from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material) as client:
        for kind, ns, name in api_client_workloads(ctx.inv):
            if kube.restart_workload(client, kind, ns, name, stamp):
                report.steps.append(f"restarted {kind} {ns}/{name} (its pods trusted the old CA)")


def _approve_rebootstrap(ctx: Context, host: str, report: Report, timeout: float) -> None:
    """The kubelet asks again with its new token: approve it (its own token, its own name),
    wait for the certificate, then delete the token's Secret."""
    from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
    token_nodes = {t.id: n for n, t in ctx.material.tokens.items()}
    token_id = ctx.material.tokens[host].id
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material) as client:
        def keys_of(nodes: set[str]) -> dict[str, frozenset[bytes]]:
            # only this host's kubelet key is read: its own request is the one approved
            return {host: csr_approval.read_kubelet_keys(ctx.remotes[host])} if host in nodes else {}
        for v in csr_approval.approve_until_issued(client, token_nodes, [token_id], timeout, keys_of,
                                                   keep_nodes={h.name for h in ctx.inv.spec.hosts}):
            report.steps.append(f"{'approved' if v.approve else 'denied'} CSR {v.csr}: {v.message}")
        if kube.delete_bootstrap_token(client, token_id):
            report.steps.append(f"{host}: deleted its bootstrap token Secret (it has its certificate)")


def _rebootstrap_worker(ctx: Context, host: str, report: Report, use_api: bool) -> None:
    stop_units(ctx, host, [KUBELET, KUBE_PROXY])
    ctx.log(f"{host}: remove the kubelet's client certificate and kubeconfig (old CA)")
    ctx.remotes[host].run("rm -f " + " ".join(KUBELET_CLIENT_FILES), what="remove the kubelet client credentials")
    # not joined now (the probe's test is that client certificate): the bootstrap kubeconfig is
    # planned again; the rest of the facts are current, no probe needed
    ctx.facts[host].kubelet_joined = False
    ctx.rejoin.add(host)
    ctx.rerender()
    r = push(ctx, host)
    report.rollout[host] = r
    roll(ctx, {host: restart_order({*r.units, KUBELET, KUBE_PROXY})}, report, nodes_ready=use_api)


def _rotation_on(ctx: Context, host: str, report: Report) -> None:
    """The kubelet has its new certificate: client certificate rotation on again and the
    bootstrap kubeconfig gone (rotation is off while it bootstraps: render/worker.kubelet_config)."""
    ctx.facts[host].kubelet_joined = True
    ctx.rejoin.discard(host)
    ctx.rerender()
    r = push(ctx, host)
    roll(ctx, {host: restart_order(r.units)}, report, nodes_ready=True)
    report.steps.append(f"{host}: client certificate rotation on again, the bootstrap kubeconfig removed")


RESUME = ("after fixing the cause, `installer apply` finishes the control plane (it starts what is stopped and "
          "pushes what is missing); a worker whose kubelet still holds its old client certificate needs "
          "/var/lib/kubelet/pki/kubelet-client-*.pem and /etc/kubernetes/kubelet.conf removed, then `installer apply`")


@dataclass
class _Rotation(Roll):
    cas: list[str] = field(default_factory=list)
    use_api: bool = True

    @property
    def etcd_together(self) -> bool:
        return ETCD_CA in self.cas

    @property
    def controls(self) -> list[str]:
        return [h.name for h in self.inv.controls]


def _save(r: _Rotation) -> None:
    paths = (pki_paths(r.state, r.cas + [s.name for s in cert_specs(r.inv)])
             + [r.state.tokens_path, r.state.admin_kubeconfig])
    keep_and_save(r, "ca-rotate", paths, RESUME)


def _stop_control_plane(r: _Rotation) -> None:
    for h in r.controls:
        stop_units(r.ctx, h, [SCHEDULER, CONTROLLER_MANAGER, KONNECTIVITY, APISERVER])


def _stop_etcd(r: _Rotation) -> None:
    for h in r.controls:
        stop_units(r.ctx, h, [ETCD])


def _push_controls(r: _Rotation) -> None:
    r.ctx.rerender()
    r.report.rollout = {}
    for h in r.controls:
        rollout = push(r.ctx, h)
        r.report.rollout[h] = rollout
        # a stopped unit is started even when none of its files changed
        stopped = {u for u in (ETCD, APISERVER, KONNECTIVITY, CONTROLLER_MANAGER, SCHEDULER)
                   if u in r.ctx.plans[h].units and (u != ETCD or r.etcd_together)}
        r.pending[h] = restart_order({*rollout.units, *stopped})


def _start_control_plane(r: _Rotation) -> None:
    roll(r.ctx, r.pending, r.report, etcd_together=r.etcd_together)
    # every worker bootstraps again, with a new token: none counts as joined any more
    for w in r.inv.workers:
        r.ctx.facts[w.name].kubelet_joined = False
        r.ctx.rejoin.add(w.name)


def _rebootstrap_workers(r: _Rotation) -> None:
    for w in r.inv.workers:
        if r.use_api:
            # the kubelet waits for its certificate before it serves :10250, which the
            # restart waits for: approve beside the restart
            with ThreadPoolExecutor(max_workers=1) as pool:
                approval = pool.submit(_approve_rebootstrap, r.ctx, w.name, r.report, r.wait_timeout)
                _rebootstrap_worker(r.ctx, w.name, r.report, r.use_api)
                approval.result()
            _rotation_on(r.ctx, w.name, r.report)
        else:
            _rebootstrap_worker(r.ctx, w.name, r.report, r.use_api)


def _stop_tenant(r: _Rotation) -> None:
    r.run.plane.stop_all(r, etcd=r.etcd_together)


def _start_tenant(r: _Rotation) -> None:
    r.run.plane.start_all(r)
    r.ctx.material = r.new
    for w in r.inv.workers:
        r.ctx.facts[w.name].kubelet_joined = False
        r.ctx.rejoin.add(w.name)


def _tenant_steps(r: _Rotation) -> list[Step[_Rotation]]:
    ns = r.inv.hosted_namespace
    etcd = ", and etcd's members (their volumes stay: members of different CAs cannot talk)" \
        if r.etcd_together else ""
    return [Step(f"stop the tenant's kube-apiserver, kube-controller-manager and kube-scheduler in {ns} (replicas 0)"
                 f"{etcd}; the API is down from here", _stop_tenant),
            Step(f"write the tenant's Secrets, ConfigMaps and workloads in {ns} with the new files and start it: "
                 + ("etcd's members together, " if r.etcd_together else "etcd's members one at a time, ")
                 + "then the apiserver replicas, controller-managers and schedulers; wait until every one is ready",
                 _start_tenant)]


def _rotate_steps(r: _Rotation) -> list[Step[_Rotation]]:
    return _steps_around(r, CONTROL_PLANE_STEPS[r.run.plane.name](r))


def _host_steps(r: _Rotation) -> list[Step[_Rotation]]:
    controls = ", ".join(r.controls)
    stop = "kube-scheduler, kube-controller-manager" + (", konnectivity-server" if konnectivity_enabled(r.inv) else "")
    steps = [Step(f"stop {stop}, kube-apiserver on {controls} (the API is down from here)", _stop_control_plane)]
    if r.etcd_together:
        steps.append(Step(f"stop etcd on {controls} (members of different CAs cannot talk; the data directory "
                          "stays)", _stop_etcd))
    steps.append(Step(f"push the new files to {controls}", _push_controls))
    etcd = ("start etcd on every member, wait for a healthy cluster" if r.etcd_together else
            "restart etcd one member at a time, waiting for a healthy cluster after each")
    steps.append(Step(f"{etcd}; then start kube-apiserver on each control host in turn (wait for /livez and "
                      "/readyz), then the rest of the control plane", _start_control_plane))
    return steps


# a rotation's own steps for each kind of control plane (engine/planes/): stopping all of it and
# starting it with the new files is one operation of a tenant's plane, several on control hosts
CONTROL_PLANE_STEPS = {"systemd": _host_steps, "hosted": _tenant_steps}


def _steps_around(r: _Rotation, control_plane: list[Step[_Rotation]]) -> list[Step[_Rotation]]:
    """The rotation's steps around those of its control plane (on control hosts, or a tenant's)."""
    steps = [
        Step(CONNECT, connect),
        Step(f"new CA(s): {', '.join(r.cas)}; every leaf certificate re-issued with a new key; a new bootstrap "
             "token per worker; the service-account key and the encryption key kept; the old CA material, leaves, "
             "tokens and admin.conf kept in <state>/backups/ca-rotate-<time>/ (0700)", _save),
        *control_plane,
    ]
    if r.use_api:
        steps.append(Step("through the API: create the new bootstrap token Secrets, delete the old ones",
                          lambda r: _api_tokens(r.ctx, r.old, r.report)))
    if r.inv.workers:
        steps.append(Step(f"each worker in turn ({', '.join(h.name for h in r.inv.workers)}): stop kubelet and "
                          f"kube-proxy, remove {' and '.join(KUBELET_CLIENT_FILES)}, push the new CA, serving "
                          "pair, kube-proxy and bootstrap kubeconfigs, start them: the kubelet bootstraps again "
                          "against the new CA", _rebootstrap_workers))
    if r.use_api and "ca" in r.cas:
        names = ", ".join(f"{ns}/{n}" for _, ns, n in api_client_workloads(r.inv))
        steps.append(Step(f"restart the add-ons whose pods call the API ({names}): they read the CA once, at start",
                          lambda r: _restart_api_clients(r.ctx, r.report)))
    steps.append(Step("check by TLS handshake that every endpoint presents its new certificate, signed by the "
                      "new CA", lambda r: verify(r.ctx, r.before, r.report, old_cas=r.old.cas)))
    return steps


def _notes(use_api: bool) -> list[str]:
    notes = [NOT_OURS, "kubeconfigs handed out before (installer kubeconfig) trust the old CA: write them again"]
    if not use_api:
        notes.append("no API calls (--no-api): the new bootstrap token Secrets must be created by "
                     "`installer apply --only cluster-bootstrap` before the workers can join")
    return notes


def rotate_ca(cluster: Cluster, *, which=("all",), yes: bool = False, use_api: bool = True,
              wait_timeout: float = 180.0, log: Callable[[str], None] = print) -> Report:
    """Without ``yes``: the report of a dry run (its steps); nothing is read but the state."""
    inv = cluster.inv
    cas = which_cas(which)
    state = existing_state(cluster)
    old = state.load(inv)
    missing = ([c.name for c in CAS if c.name not in old.cas]
               + [s.name for s in cert_specs(inv) if s.name not in old.certs])
    if missing:
        raise StateError(f"{state.root} lacks {', '.join(missing)}; run `installer apply` first")
    with open_run(cluster, log=log) as run:
        r = _Rotation(inv, state, old, wait_timeout=wait_timeout, log=log, run=run, cas=cas, use_api=use_api)
        steps = _rotate_steps(r)
        report = Report("rotate", not yes, steps=plan(steps), notes=_notes(use_api))
        if not yes:
            return report
        r.new = rotated(inv, old, cas)
        report.steps = []
        report.reissued = [Reissued(c, c, hex_serial(old.cas[c].cert.serial_number),
                                    hex_serial(r.new.cas[c].cert.serial_number),
                                    r.new.cas[c].cert.not_valid_after_utc.isoformat()) for c in cas]
        report.reissued += reissued_rows(inv, old, r.new, [s.name for s in cert_specs(inv)])
        r.report = report
        run_roll("ca rotate", steps, r, run)
    return report
