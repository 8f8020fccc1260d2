"""The cluster-bootstrap objects (``render.manifests.bootstrap_objects``) and the add-on objects
(``render.addons.addon_objects``: ServiceAccounts, ClusterRoles, ClusterRoleBindings, ConfigMaps,
Deployments, DaemonSets, Services) through the API: validated with kubernetes-validate (strict)
for the target version before any request, then created idempotently through the typed APIs (an
existing object is compared and replaced, or deleted and created when an immutable field
differs). ``plan_objects`` says what ``apply_objects`` would do, changing nothing.

Imported lazily, like ``host/kube.py``: the kubernetes client takes seconds to import.
"""

from __future__ import annotations

import base64
import copy

import kubernetes_validate
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from installer.core import versions
from installer.host.kube import JSON, RBAC_GROUP, KubeError, api_call, reason, status_message

def target_version(k8s_version: str) -> str:
    """``v1.36.4`` (or ``1.36.4``) -> ``1.36.0``: the schema version kubernetes-validate uses."""
    parsed = versions.parse(k8s_version if k8s_version.startswith("v") else f"v{k8s_version}")
    if parsed is None:
        raise ValueError(f"not a Kubernetes version: {k8s_version!r}")
    return f"{parsed[0]}.{parsed[1]}.0"


def _ident(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


def validate_objects(objects: list[dict], k8s_version: str) -> None:
    """kubernetes-validate (strict) every object for the target version; every failure at once."""
    version = target_version(k8s_version)
    failures = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            failures.append(f"{_ident(obj)}: {path + ': ' if path else ''}{e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.VersionNotSupportedError) as e:
            failures.append(f"{_ident(obj)}: {e}")
    if failures:
        raise KubeError(f"{len(failures)} object(s) invalid for Kubernetes {version}, nothing sent:\n"
                        + "\n".join(f"  {f}" for f in failures))


def _labels_ok(want: dict, live: dict) -> bool:
    have = (live.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in ((want.get("metadata") or {}).get("labels") or {}).items())


def _for_update(want: dict, live: dict) -> dict:
    """``want`` as a PUT body: the live resourceVersion (optimistic concurrency) and labels
    merged (labels others added stay)."""
    body = copy.deepcopy(want)
    meta = body.setdefault("metadata", {})
    live_meta = live.get("metadata") or {}
    meta["resourceVersion"] = live_meta.get("resourceVersion")
    meta["labels"] = {**(live_meta.get("labels") or {}), **(meta.get("labels") or {})}
    return body


class _ClusterRoleBindings:
    kind = "ClusterRoleBinding"

    def __init__(self, api: k8s.ApiClient):
        self.rbac = k8s.RbacAuthorizationV1Api(api)

    def create(self, obj, **kw):
        return self.rbac.create_cluster_role_binding(obj, _headers={"Content-Type": JSON}, **kw)

    def read(self, obj, **kw):
        return self.rbac.read_cluster_role_binding(obj["metadata"]["name"], **kw)

    def replace(self, obj, **kw):
        return self.rbac.replace_cluster_role_binding(obj["metadata"]["name"], obj, _headers={"Content-Type": JSON}, **kw)

    def delete(self, obj, **kw):
        return self.rbac.delete_cluster_role_binding(obj["metadata"]["name"], **kw)

    @staticmethod
    def compare(want: dict, live: dict) -> str | None:
        """None when equal in what we set; "replace" for subjects/labels; "recreate" for
        roleRef, which the API refuses to change on an existing binding."""
        if live.get("roleRef") != want["roleRef"]:
            return "recreate"
        if live.get("subjects") != want["subjects"] or not _labels_ok(want, live):
            return "replace"
        return None


class _TokenSecrets:
    kind = "Secret"

    def __init__(self, api: k8s.ApiClient):
        self.core = k8s.CoreV1Api(api)

    def create(self, obj, **kw):
        return self.core.create_namespaced_secret(obj["metadata"]["namespace"], obj, _headers={"Content-Type": JSON}, **kw)

    def read(self, obj, **kw):
        return self.core.read_namespaced_secret(obj["metadata"]["name"], obj["metadata"]["namespace"], **kw)

    def replace(self, obj, **kw):
        return self.core.replace_namespaced_secret(obj["metadata"]["name"], obj["metadata"]["namespace"], obj, _headers={"Content-Type": JSON}, **kw)

    def delete(self, obj, **kw):
        return self.core.delete_namespaced_secret(obj["metadata"]["name"], obj["metadata"]["namespace"], **kw)

    @staticmethod
    def compare(want: dict, live: dict) -> str | None:
        """Equal when the type and every key we set (token-id, token-secret, expiration, usage,
        groups, description) decode to the same values; ``type`` is immutable."""
        if live.get("type") != want["type"]:
            return "recreate"
        data = live.get("data") or {}
        try:
            have = {k: base64.b64decode(v).decode() for k, v in data.items()}
        except (ValueError, UnicodeDecodeError):
            return "replace"
        if have != want["stringData"] or not _labels_ok(want, live):
            return "replace"
        return None


def _zero(value) -> bool:
    """A value the apiserver leaves out of its answers (Go ``omitempty``): false, 0, "", [], {}."""
    return value is not None and not value


def _subset(want, have) -> bool:
    """Whether every field of ``want`` is in ``have`` with the same value: extra fields in
    ``have`` (server defaults, status, metadata the server keeps) do not count. Lists must have
    the same length, each element a subset of its counterpart; a field we set to a zero value
    may be absent (the server omits it)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            _subset(v, have[k]) if k in have else _zero(v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_subset, want, have))
    return want == have


def _immutable_changed(kind: str, want: dict, live: dict) -> bool:
    """A field the API refuses to change on an existing object differs: delete and create."""
    w, h = want.get("spec") or {}, live.get("spec") or {}
    if kind == "Service":
        return "clusterIP" in w and w["clusterIP"] != h.get("clusterIP")
    if kind in ("Deployment", "DaemonSet"):
        return "selector" in w and w["selector"] != h.get("selector")
    return False


# apiVersion, kind -> (typed API, the method names' suffix, namespaced): create_<suffix>,
# read_<suffix>, replace_<suffix>, delete_<suffix> with the usual argument order
# ([name], [namespace], [body]). The API classes by name: each costs 0.2-0.3 s to import (the
# client loads its models then), so only the kinds a run sends load theirs.
_TYPED: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "ServiceAccount"): ("CoreV1Api", "namespaced_service_account", True),
    ("v1", "ConfigMap"): ("CoreV1Api", "namespaced_config_map", True),
    ("v1", "Service"): ("CoreV1Api", "namespaced_service", True),
    (f"{RBAC_GROUP}/v1", "ClusterRole"): ("RbacAuthorizationV1Api", "cluster_role", False),
    ("apps/v1", "Deployment"): ("AppsV1Api", "namespaced_deployment", True),
    ("apps/v1", "DaemonSet"): ("AppsV1Api", "namespaced_daemon_set", True),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        ("AdmissionregistrationV1Api", "validating_admission_policy", False),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        ("AdmissionregistrationV1Api", "validating_admission_policy_binding", False),
}


class _Typed:
    """Any kind of ``_TYPED`` through its typed API. Equal when every field we set is in the
    live object with the same value (``_subset``); otherwise replaced with the live
    resourceVersion (labels and annotations others added stay), or deleted and created when
    an immutable field differs (a Service's clusterIP, a workload's selector)."""

    def __init__(self, api: k8s.ApiClient, obj: dict):
        cls, self.suffix, self.namespaced = _TYPED[(obj["apiVersion"], obj["kind"])]
        self.kind, self.typed = obj["kind"], getattr(k8s, cls)(api)
        if self.namespaced and not (obj.get("metadata") or {}).get("namespace"):
            raise ValueError(f"{_ident(obj)}: a namespaced kind needs metadata.namespace")

    def _args(self, obj: dict) -> list:
        meta = obj["metadata"]
        return [meta["name"]] + ([meta["namespace"]] if self.namespaced else [])

    def _method(self, verb: str):
        return getattr(self.typed, f"{verb}_{self.suffix}")

    def create(self, obj, **kw):
        ns = [obj["metadata"]["namespace"]] if self.namespaced else []
        return self._method("create")(*ns, obj, _headers={"Content-Type": JSON}, **kw)

    def read(self, obj, **kw):
        return self._method("read")(*self._args(obj), **kw)

    def replace(self, obj, **kw):
        return self._method("replace")(*self._args(obj), obj, _headers={"Content-Type": JSON}, **kw)

    def delete(self, obj, **kw):
        # the answer is a Status or the deleted object, depending on the kind and the server:
        # not deserialized (errors still raise ApiException)
        resp = self._method("delete")(*self._args(obj), _preload_content=False, **kw)
        resp.read()
        resp.release_conn()

    def compare(self, want: dict, live: dict) -> str | None:
        if _immutable_changed(self.kind, want, live):
            return "recreate"
        return None if _subset(want, live) else "replace"

    @staticmethod
    def for_update(want: dict, live: dict) -> dict:
        body = _for_update(want, live)
        live_ann = (live.get("metadata") or {}).get("annotations") or {}
        if live_ann:
            meta = body["metadata"]
            meta["annotations"] = {**live_ann, **(meta.get("annotations") or {})}
        return body


def _handler(api: k8s.ApiClient, obj: dict):
    if obj.get("kind") == "ClusterRoleBinding" and obj.get("apiVersion") == f"{RBAC_GROUP}/v1":
        return _ClusterRoleBindings(api)
    if obj.get("kind") == "Secret" and obj.get("apiVersion") == "v1" and "stringData" in obj:
        return _TokenSecrets(api)
    if (obj.get("apiVersion"), obj.get("kind")) in _TYPED:
        return _Typed(api, obj)
    kinds = ", ".join(sorted({k for _, k in _TYPED} | {"ClusterRoleBinding"}))
    raise ValueError(f"{_ident(obj)}: apply_objects handles {kinds} and bootstrap token Secrets only")


def _read_if_exists(h, obj: dict):
    """The live ``obj``, or None. A create can be refused as invalid (422) before the
    apiserver looks for a name clash: a Service asking again for its own clusterIP gets
    "provided IP is already allocated", not AlreadyExists (seen on 1.36)."""
    try:
        return h.read(obj)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _apply_one(api: k8s.ApiClient, obj: dict) -> str:
    h, what = _handler(api, obj), _ident(obj)
    try:
        api_call(what, h.create, obj)
        return "created"
    except ApiException as e:
        clash = e.status == 409 and reason(e) == "AlreadyExists"
        found = None if clash or e.status != 422 else _read_if_exists(h, obj)
        if not clash and found is None:
            raise KubeError(f"{what}: create refused: {status_message(e)}") from None
    try:
        live = api.sanitize_for_serialization(found if found is not None else api_call(what, h.read, obj))
        change = h.compare(obj, live)
        if change is None:
            return "unchanged"
        if change == "replace":
            api_call(what, h.replace, getattr(h, "for_update", _for_update)(obj, live))
        else:
            api_call(what, h.delete, obj)
            api_call(what, h.create, obj)
        return "replaced"
    except ApiException as e:
        raise KubeError(f"{what}: update refused: {status_message(e)}") from None


def _plan_one(api: k8s.ApiClient, obj: dict) -> str:
    """What ``_apply_one`` would do to ``obj``, found by reading only."""
    h, what = _handler(api, obj), _ident(obj)
    try:
        live = _read_if_exists(h, obj)
    except ApiException as e:
        raise KubeError(f"{what}: read refused: {status_message(e)}") from None
    if live is None:
        return "created"
    return "unchanged" if h.compare(obj, api.sanitize_for_serialization(live)) is None else "replaced"


def plan_objects(api: k8s.ApiClient, objects: list[dict], k8s_version: str) -> list[tuple[str, str, str]]:
    """``apply_objects`` stopped before any write: validates, then reads each object and says
    what applying it would do (``created``, ``unchanged``, ``replaced``)."""
    validate_objects(objects, k8s_version)
    return [(obj["kind"], obj["metadata"]["name"], _plan_one(api, obj)) for obj in objects]


def apply_objects(api: k8s.ApiClient, objects: list[dict], k8s_version: str) -> list[tuple[str, str, str]]:
    """Validate every object (strict, for ``k8s_version``'s minor) before sending any, then
    create each in order; an existing one is left when it matches, otherwise replaced with the
    live resourceVersion (deleted and created when an immutable field differs: a binding's
    roleRef, a token Secret's type, a Service's clusterIP, a Deployment's or DaemonSet's
    selector). What "matches" means: bindings and token Secrets compare what we set exactly;
    the other kinds compare as a subset (every field we set has our value; server defaults and
    fields others add are ignored). Returns ``(kind, name, action)`` per object,
    action one of ``created``, ``unchanged``, ``replaced``."""
    validate_objects(objects, k8s_version)
    for obj in objects:
        _handler(api, obj)                     # refuse unknown kinds before sending anything too
    return [(obj["kind"], obj["metadata"]["name"], _apply_one(api, obj)) for obj in objects]
