"""The hosting cluster of a hosted tenant (docs/hosted.md), through the API only: a client from
the inventory's kubeconfig, the tenant's objects applied (host/kube_objects.py), its workloads
waited for, its apply lock as a Lease in its namespace, and its removal.

The kubeconfig is the operator's, not the state's: its credentials are read into memory
(``tlsfiles.memory_file``), never written anywhere; a kubeconfig that turns verification off
(``insecure-skip-tls-verify``) or names an exec or auth-provider plugin is refused: the
installer runs no program a kubeconfig names.
"""

from __future__ import annotations

import base64
import datetime as dt
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from installer.core import tenancy
from installer.core.errors import InstallerError
from installer.core.inventory import Inventory
from installer.core.safefs import input_file_problem
from installer.core.tlsfiles import fd_path, memory_file
from installer.host.kube import ApiClient, ApiError, rest, status_message
from installer.host.kube_objects import apply_objects, plan_objects


class HostingError(InstallerError):
    """The hosting cluster refused, or its kubeconfig cannot be used; the message says which."""


def _data(entry: dict, key: str, base: Path, what: str) -> bytes | None:
    """``key-data`` (base64) or ``key`` (a file, relative to the kubeconfig) of a kubeconfig entry."""
    if entry.get(f"{key}-data"):
        try:
            return base64.b64decode(entry[f"{key}-data"], validate=True)
        except ValueError:
            raise HostingError(f"{what}: {key}-data is not base64") from None
    if entry.get(key):
        path = base / Path(entry[key]).expanduser()
        try:
            return path.read_bytes()
        except OSError as e:
            raise HostingError(f"{what}: {key} {path}: {e.strerror}") from None
    return None


# the kubeconfig fields this client acts on as kubectl does (extensions carry nothing it acts on)
CLUSTER_FIELDS = frozenset({"server", "certificate-authority", "certificate-authority-data", "tls-server-name",
                            "insecure-skip-tls-verify", "extensions"})
USER_FIELDS = frozenset({"client-certificate", "client-certificate-data", "client-key", "client-key-data", "token",
                         "exec", "auth-provider", "extensions"})


def hosting_client(inv: Inventory) -> ApiClient:
    """An ApiClient for the hosting cluster of ``inv`` (spec.controlPlane.hosted.kubeconfig and
    its context), verifying the server with the kubeconfig's CA, which it must name."""
    assert inv.hosted is not None
    path = (inv.base_dir / Path(inv.hosted.kubeconfig).expanduser()).resolve()
    what = f"spec.controlPlane.hosted.kubeconfig {path}"
    if (why := input_file_problem(path)) is not None:
        raise HostingError(f"{what}: {why}: whoever can change it can point the installer at another cluster "
                           "or credentials; fix that, or move the file")
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise HostingError(f"{what}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise HostingError(f"{what}: not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise HostingError(f"{what}: not a kubeconfig")

    def named(section: str, name: str | None) -> dict:
        # kubectl reads one entry per name; a second one would be another reader's choice
        found = [item for item in doc.get(section) or [] if isinstance(item, dict) and item.get("name") == name]
        if len(found) > 1:
            raise HostingError(f"{what}: {len(found)} {section} named {name!r}: give each one name only once")
        if not found:
            raise HostingError(f"{what}: no {section[:-1]} named {name!r}")
        entry = found[0].get(section[:-1]) or {}
        if not isinstance(entry, dict):
            raise HostingError(f"{what}: {section[:-1]} {name!r} is not a mapping")
        return entry
    context = named("contexts", inv.hosted.context or doc.get("current-context"))
    cluster, user = named("clusters", context.get("cluster")), named("users", context.get("user"))
    if cluster.get("insecure-skip-tls-verify"):
        raise HostingError(f"{what}: insecure-skip-tls-verify is refused: the hosting cluster's certificate "
                           "must be verified (give certificate-authority-data)")
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise HostingError(f"{what}: a user with {plugin} is not supported (the installer runs no program a "
                               "kubeconfig names): use a client certificate or a token")
    # a field kubectl acts on and this client would not (a proxy, impersonation, a password) is
    # refused by name: silently dropping it would act as someone else, by another road
    for kind, entry, known in (("cluster", cluster, CLUSTER_FIELDS), ("user", user, USER_FIELDS)):
        unknown = sorted(k for k in entry if k not in known and entry[k] not in (None, "", False, [], {}))
        if unknown:
            raise HostingError(f"{what}: the {kind}'s {', '.join(unknown)} is not supported (the installer "
                               f"would not act on it as kubectl does): remove it, or use a kubeconfig without it")
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith("https://"):
        raise HostingError(f"{what}: the cluster's server must be an https:// URL")
    base = path.parent
    ca = _data(cluster, "certificate-authority", base, what)
    if not ca:
        raise HostingError(f"{what}: the cluster has no certificate-authority(-data): the hosting cluster's "
                           "certificate is verified against its own CA only, never the system's roots")
    cert, key = _data(user, "client-certificate", base, what), _data(user, "client-key", base, what)

    token = user.get("token")
    if not token and not (cert and key):
        raise HostingError(f"{what}: its user has no client certificate and key, and no token")

    def context() -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cadata=ca.decode(errors="replace"))
        except ssl.SSLError:
            raise HostingError(f"{what}: the cluster's certificate-authority is not a PEM certificate") from None
        if cert and key:
            with memory_file(cert + b"\n" + key) as fd:
                try:
                    ctx.load_cert_chain(fd_path(fd))
                except ssl.SSLError:
                    # never the bytes: they hold the key
                    raise HostingError(f"{what}: the user's client-certificate and client-key are not a PEM "
                                       "certificate and its key") from None
        return ctx
    client = ApiClient(server, context(), cluster.get("tls-server-name"))
    client.stream_context = context()       # check_hostname stays on: websocket-client checks nothing itself
    if token:
        client.headers = {"Authorization": f"Bearer {token}"}
    return client


# --- the tenant's objects and their rollouts -------------------------------------------------------

def converge(api: ApiClient, objects: list[dict], k8s_version: str, dry_run: bool = False
             ) -> list[tuple[str, str, str]]:
    """Bring the tenant's objects to what is rendered (``plan_objects`` in a dry run)."""
    return (plan_objects if dry_run else apply_objects)(api, objects, k8s_version)


def ensure_namespace(api: ApiClient, namespace: dict, k8s_version: str, create: bool) -> tuple[str | None, bool]:
    """The tenant's namespace as rendered; made when missing only when ``create`` (apply), else
    ``tenancy.NoNamespace``. A hosting identity of least privilege (``installer hosting-access``)
    may not create namespaces: the admin makes this one, and a missing one is named with who
    makes it, not as a bare 403. Returns its UID (the state keeps it: core/tenancy.py) and
    whether this call made it."""
    name = namespace["metadata"]["name"]
    path = f"/api/v1/namespaces/{name}"
    live = get_object(api, path)
    if live is None:
        if not create:
            raise tenancy.NoNamespace(f"namespace {name} does not exist in the hosting cluster: the tenant is not "
                                      "applied there (`installer apply` makes it); nothing was changed")
        try:
            live = rest(api, "POST", "/api/v1/namespaces", f"namespace {name}", namespace)
            return _uid(live) or _uid(get_object(api, path)), True
        except ApiError as e:
            if e.status == 403:
                raise HostingError(f"namespace {name} does not exist in the hosting cluster, and this hosting "
                                   f"identity may not create it: {GRANT_HINT}") from None
            if e.status != 409:
                raise HostingError(f"namespace {name}: create refused: {status_message(e)}") from None
    converge(api, [namespace], k8s_version)
    return _uid(live) or _uid(get_object(api, path)), False


def _uid(obj: dict | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("uid")


def workload_state(api: ApiClient, namespace: str, kind: str, name: str) -> tuple[bool, str]:
    """Whether a StatefulSet or Deployment runs its current template on every replica, all ready,
    and a line saying where it is."""
    resource = {"StatefulSet": "statefulsets", "Deployment": "deployments"}[kind]
    obj = rest(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/{resource}/{name}", f"{kind}/{name}") or {}
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    want = spec.get("replicas", 1)
    ready, updated = status.get("readyReplicas", 0), status.get("updatedReplicas", 0)
    current = status.get("observedGeneration", 0) >= (obj.get("metadata") or {}).get("generation", 0)
    if kind == "StatefulSet":
        done = current and ready == want and updated == want and \
            status.get("currentRevision") == status.get("updateRevision")
    else:
        done = current and ready == want and updated == want and status.get("replicas", 0) == want
    return done, f"{kind}/{name}: {ready}/{want} ready, {updated} updated"


def wait_workloads(api: ApiClient, namespace: str, workloads: list[tuple[str, str]], timeout: float,
                   log: Callable[[str], None], every: float = 2.0) -> list[str]:
    """Until every workload is rolled out and ready; lines for the report. A HostingError after
    ``timeout`` names those still waiting and what their pods say."""
    deadline, last = time.monotonic() + timeout, ""
    while True:
        states = [workload_state(api, namespace, k, n) for k, n in workloads]
        line = "; ".join(s for _, s in states)
        if all(done for done, _ in states):
            return [s for _, s in states]
        if line != last:
            log(f"  hosting {namespace}: {line}")
            last = line
        if time.monotonic() > deadline:
            raise HostingError(f"namespace {namespace}: not ready after {timeout:.0f} s: {line}"
                               + pod_problems(api, namespace))
        time.sleep(every)


def pod_problems(api: ApiClient, namespace: str) -> str:
    """What the namespace's pods that are not ready say (waiting reasons, last termination), for
    an error message: where an operator would look first."""
    pods = (rest(api, "GET", f"/api/v1/namespaces/{namespace}/pods", "pods") or {}).get("items", [])
    out = []
    for p in pods:
        for c in (p.get("status") or {}).get("containerStatuses") or []:
            if c.get("ready"):
                continue
            state = c.get("state") or {}
            waiting, last = state.get("waiting") or {}, (c.get("lastState") or {}).get("terminated") or {}
            why = waiting.get("reason") or ("running, not ready" if "running" in state else "")
            if last:
                why += f"; last exit {last.get('exitCode')} ({last.get('reason', '')})"
            out.append(f"\n  pod {p['metadata']['name']} {c['name']}: {why}")
        if not (p.get("status") or {}).get("containerStatuses"):
            conds = [c.get("message") for c in (p.get("status") or {}).get("conditions") or [] if c.get("message")]
            out.append(f"\n  pod {p['metadata']['name']}: {(p.get('status') or {}).get('phase')} "
                       f"{'; '.join(conds)[:300]}")
    return "".join(out[:12])


def held_files(api: ApiClient, namespace: str, paths: dict[str, str], secrets: bool = False) -> dict[str, bytes]:
    """What the tenant's ConfigMaps (and with ``secrets`` its Secrets) in the hosting cluster hold
    of ``paths`` (key -> host path): path -> bytes; nothing when the namespace or its objects are
    not there yet. Secrets' other keys are read and dropped, never kept."""
    out = {}
    for resource in ("configmaps", "secrets") if secrets else ("configmaps",):
        try:
            found = rest(api, "GET", f"/api/v1/namespaces/{namespace}/{resource}", f"the tenant's {resource}") or {}
        except ApiError as e:
            if e.status == 404:
                return {}
            raise HostingError(f"namespace {namespace}: its {resource} cannot be read: {status_message(e)}") from None
        for obj in found.get("items", []):
            for key, value in (obj.get("data") or {}).items():
                if key in paths and isinstance(value, str):
                    out.setdefault(paths[key], base64.b64decode(value) if resource == "secrets" else value.encode())
    return out


# --- the apply lock of a hosted tenant: a Lease in its namespace -------------------------------

LEASE = "hiddenplane-apply"
LEASE_SECONDS = 3600        # as the control hosts' lock: a run killed leaves it stale for an hour


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def take_lease(api: ApiClient, namespace: str, holder: str, force: bool = False) -> bool:
    """Hold the tenant's apply lock for ``holder`` (the run's id): create the Lease, or take it
    over when it is free (no holder), or stale (not renewed for LEASE_SECONDS) and ``force``, as
    the control hosts' lock is; a HostingError names the holder otherwise. The
    apiserver's resourceVersion check makes two takers exclusive. False when ``holder`` held it
    already (a run inside a day-2 command that holds it: the outer one gives it back)."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    spec = {"holderIdentity": holder, "leaseDurationSeconds": LEASE_SECONDS, "acquireTime": _now(),
            "renewTime": _now()}
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": LEASE, "namespace": namespace}, "spec": spec}
    try:
        rest(api, "POST", path, "the apply lock (Lease)", body)
        return True
    except ApiError as e:
        if e.status != 409:
            raise HostingError(f"the apply lock (Lease {namespace}/{LEASE}): {status_message(e)}") from None
    live = rest(api, "GET", f"{path}/{LEASE}", "the apply lock (Lease)") or {}
    have = live.get("spec") or {}
    held_by = have.get("holderIdentity") or ""
    if held_by == holder:
        return False
    renewed = have.get("renewTime") or have.get("acquireTime")
    expired = True
    if renewed:
        at = dt.datetime.strptime(renewed.rstrip("Z")[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=dt.timezone.utc)
        expired = (dt.datetime.now(dt.timezone.utc) - at).total_seconds() > have.get("leaseDurationSeconds", 0)
    if held_by and not expired:
        raise HostingError(f"the apply lock of {namespace} (Lease {LEASE}) is held by run {held_by} since {renewed}: "
                           "another apply or day-2 command runs on this tenant; nothing was changed")
    if held_by and not force:
        raise HostingError(f"the apply lock of {namespace} (Lease {LEASE}) is stale: run {held_by}, last renewed "
                           f"{renewed}, more than {LEASE_SECONDS // 60} minutes ago; if that run is gone, pass "
                           "--force-unlock")
    try:
        rest(api, "PUT", f"{path}/{LEASE}", "the apply lock (Lease)",
             {**body, "metadata": {**body["metadata"], "resourceVersion": live["metadata"]["resourceVersion"]}})
    except ApiError as e:
        raise HostingError(f"the apply lock of {namespace}: taken by another run meanwhile ({status_message(e)})"
                           ) from None
    return True


def release_lease(api: ApiClient, namespace: str, holder: str) -> None:
    """Give the lock back when it is still ours (a run that lost it leaves it alone)."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}"
    try:
        live = rest(api, "GET", path, "the apply lock (Lease)") or {}
        if (live.get("spec") or {}).get("holderIdentity") == holder:
            rest(api, "DELETE", path, "the apply lock (Lease)",
                 {"kind": "DeleteOptions", "apiVersion": "v1",
                  "preconditions": {"resourceVersion": live["metadata"]["resourceVersion"]}})
    except ApiError:
        pass


def delete_namespace(api: ApiClient, namespace: str, timeout: float, log: Callable[[str], None]) -> bool:
    """Delete the tenant's namespace (its pods, Secrets and, with the StatefulSet's claims,
    volumes the provisioner then deletes) and wait until it is gone; False when there was none."""
    path = f"/api/v1/namespaces/{namespace}"
    claims = rest(api, "GET", f"{path}/persistentvolumeclaims", "claims") if _exists(api, path) else None
    if claims is None:
        return False
    rest(api, "DELETE", path, f"namespace {namespace}", {"kind": "DeleteOptions", "apiVersion": "v1",
                                                          "propagationPolicy": "Foreground"})
    stop_pods(api, namespace)
    deadline = time.monotonic() + timeout
    while _exists(api, path):
        if time.monotonic() > deadline:
            raise HostingError(f"namespace {namespace}: still terminating after {timeout:.0f} s")
        time.sleep(2)
    log(f"  hosting: namespace {namespace} deleted ({len(claims.get('items', []))} volume claim(s) with it)")
    return True


# A reset's pods stop within this: the tenant's data goes with its namespace, so their graceful
# stops (etcd's ~8 s, the apiservers' shutdown delay, 30 s allowed) protect nothing and held a
# reset most of a minute on the lab. Not 0 (forced): the kubelet still confirms each stop, so
# no container outlives its pod in the API.
RESET_GRACE_SECONDS = 1


def stop_pods(api: ApiClient, namespace: str) -> None:
    """Shorten the stop of every pod of ``namespace`` (being deleted: no controller makes new
    ones) to RESET_GRACE_SECONDS; one already gone is skipped."""
    pods = (rest(api, "GET", f"/api/v1/namespaces/{namespace}/pods", "pods") or {}).get("items", [])
    for p in pods:
        name = p["metadata"]["name"]
        try:
            rest(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", f"pod {name}",
                 {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": RESET_GRACE_SECONDS})
        except ApiError as e:
            if e.status != 404:
                raise HostingError(f"namespace {namespace}: pod {name}: {status_message(e)}") from None


def delete_priority_class(api: ApiClient, name: str, tenant: str) -> tuple[bool, str] | None:
    """Delete the tenant's PriorityClass (cluster-scoped: the namespace takes it not), when it is
    labelled as this tenant's: (deleted, in words); None when there was none of it."""
    path = f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}"
    try:
        live = rest(api, "GET", path, f"PriorityClass {name}") or {}
        if ((live.get("metadata") or {}).get("labels") or {}).get(tenancy.TENANT_LABEL) != tenant:
            return None
        rest(api, "DELETE", path, f"PriorityClass {name}")
    except ApiError as e:
        if e.status == 404:
            return None
        if e.status == 403:
            return False, (f"hosting: kept PriorityClass {name}: this identity may not delete it (the hosting admin "
                           "removes it with the tenant's access objects, docs/hosted.md)")
        raise HostingError(f"PriorityClass {name}: {status_message(e)}") from None
    return True, f"deleted PriorityClass {name}"


GRANT_HINT = ("the hosting cluster's admin makes the tenant's namespace and grants this identity its rights there: "
              "`installer hosting-access INVENTORY --user NAME | kubectl apply -f -` (docs/hosted.md)")


def get_object(api: ApiClient, path: str) -> dict | None:
    """The object at ``path``; None when there is none (404)."""
    try:
        return rest(api, "GET", path, path) or {}
    except ApiError as e:
        if e.status == 404:
            return None
        hint = f"; {GRANT_HINT}" if e.status == 403 else ""
        raise HostingError(f"{path}: {status_message(e)}{hint}") from None


def check_owner(api: ApiClient, namespace: str, tenant: str, state_id: str | None,
                state_uid: str | None = None) -> tuple[bool, bool]:
    """Refuse (``tenancy.NotOurNamespace``) a namespace that is not ``tenant``'s, that another
    state applied, or that is not the one (``state_uid``) this state applied it in
    (core/tenancy.py); else whether it exists, and whether its owner (this state) is recorded
    in it already."""
    live = get_object(api, f"/api/v1/namespaces/{namespace}")
    owner = get_object(api, f"/api/v1/namespaces/{namespace}/configmaps/{tenancy.OWNER}") if live is not None else None
    problem = tenancy.ownership_problem(namespace, tenant, live, (owner or {}).get("data") if owner else None,
                                        state_id, state_uid)
    if problem:
        raise tenancy.NotOurNamespace(problem)
    return live is not None, owner is not None


def _exists(api: ApiClient, path: str) -> bool:
    return get_object(api, path) is not None
