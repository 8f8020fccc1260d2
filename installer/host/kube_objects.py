"""The cluster-bootstrap objects (``render.manifests.bootstrap_objects``) and the add-on objects
(``render.addons.addon_objects``: ServiceAccounts, ClusterRoles, ClusterRoleBindings, ConfigMaps,
Deployments, DaemonSets, Services) and the revoked-nodes admission policy and its binding
(``render.revocation``) through the API: validated with kubernetes-validate's schemas
(strict) for the target version before any write, then read and created or brought back to what
we set (an existing object is compared and replaced, or deleted and created when an immutable
field differs). ``plan_objects`` says what ``apply_objects`` would do, changing nothing.

Requests go by path (``kube.rest``), the kinds in one table: no typed API class or model is
imported, so a converged cluster costs one GET per object and no client import beyond the base.
"""

from __future__ import annotations

import base64
import copy
import functools
from collections.abc import Callable

import jsonschema
from kubernetes_validate import utils
from referencing import Registry, Resource

from installer.core import versions
from installer.host.kube import RBAC_GROUP, ApiError, KubeError, reason, rest, status_message


def target_version(k8s_version: str) -> str:
    """``v1.36.4`` (or ``1.36.4``) -> ``1.36.0``: the schema version kubernetes-validate uses."""
    parsed = versions.parse(k8s_version if k8s_version.startswith("v") else f"v{k8s_version}")
    if parsed is None:
        raise ValueError(f"not a Kubernetes version: {k8s_version!r}")
    return f"{parsed[0]}.{parsed[1]}.0"


def _ident(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def _schemas(version: str) -> tuple[str, dict]:
    """kubernetes-validate's strict schema directory for ``version`` (``1.36.0``: the newest
    release not newer than it) and its shared definitions, loaded once per process:
    kubernetes_validate.validate re-reads and re-links the 1.6 MB of definitions for every
    object (15 ms each, 0.1 s a phase)."""
    known = [v for v in utils.all_versions() if _minor(v) <= _minor(version)]
    if not known or _minor(version) > _minor(utils.latest_version()):
        raise utils.VersionNotSupportedError(version=utils.major_minor(version))
    directory = f"kubernetes-json-schema/v{known[-1]}-local-strict"
    return directory, utils.schema_contents(f"{directory}/_definitions.json", version)


@functools.lru_cache(maxsize=None)
def _validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    """The strict validator of one kind (files named like ``deployment-apps-v1.json``: the
    group's first label, then the version)."""
    directory, definitions = _schemas(version)
    group, _, ver = api_version.rpartition("/")
    name = f"{kind.lower()}-{group.split('.')[0] + '-' if group else ''}{ver}.json"
    try:
        schema = utils.schema_contents(f"{directory}/{name}", version)
    except FileNotFoundError:
        raise utils.SchemaNotFoundError(version=utils.major_minor(version), kind=kind,
                                                      api_version=api_version) from None
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_objects(objects: list[dict], k8s_version: str) -> None:
    """Validate every object (strict) for the target version; every failure at once."""
    version = target_version(k8s_version)
    failures = []
    for obj in objects:
        try:
            error = next(iter(_validator(version, obj.get("apiVersion", ""), obj.get("kind", ""))
                              .iter_errors(obj)), None)
        except (utils.SchemaNotFoundError, utils.VersionNotSupportedError) as e:
            failures.append(f"{_ident(obj)}: {e.message}")
            continue
        if error is not None:
            path = "/".join(str(p) for p in error.path)
            failures.append(f"{_ident(obj)}: {path + ': ' if path else ''}{error.message}")
    if failures:
        raise KubeError(f"{len(failures)} object(s) invalid for Kubernetes {version}, nothing sent:\n"
                        + "\n".join(f"  {f}" for f in failures))


def _labels_ok(want: dict, live: dict, field: str = "labels") -> bool:
    """Every label (``field="annotations"``: annotation) we set has our value on ``live``."""
    have = (live.get("metadata") or {}).get(field) or {}
    return all(have.get(k) == v for k, v in ((want.get("metadata") or {}).get(field) or {}).items())


def _exact_binding(want: dict, live: dict) -> str | None:
    """A ClusterRoleBinding: None when equal in what we set; "replace" for subjects/labels/annotations;
    "recreate" for roleRef, which the API refuses to change on an existing binding."""
    if live.get("roleRef") != want["roleRef"]:
        return "recreate"
    # an empty subject list is left out of the apiserver's answers (omitempty); an annotation we
    # set is compared too (``autoupdate: "false"`` keeps the apiserver from adding subjects back)
    if ((live.get("subjects") or []) != want["subjects"] or not _labels_ok(want, live)
            or not _labels_ok(want, live, "annotations")):
        return "replace"
    return None


def _token_secret(want: dict, live: dict) -> str | None:
    """A bootstrap token Secret: equal when the type and every key we set (token-id,
    token-secret, expiration, usage, groups, description) decode to the same values; ``type``
    is immutable."""
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


def _opaque_secret(want: dict, live: dict) -> str | None:
    """A Secret of files (a hosted tenant's keys): equal when the type, every key's bytes (no
    key more, none less: a key left over would still be projected) and the labels are ours."""
    if "stringData" in want:
        return _token_secret(want, live)
    if live.get("type") != want.get("type", "Opaque"):
        return "recreate"
    if (live.get("data") or {}) != want.get("data", {}) or not _labels_ok(want, live):
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


def _as_subset(want: dict, live: dict) -> str | None:
    """Any other kind: equal when every field we set is in the live object with the same value
    (``_subset``); "recreate" when a field the API refuses to change differs (a Service's
    clusterIP, a workload's selector)."""
    w, h = want.get("spec") or {}, live.get("spec") or {}
    if want["kind"] == "Service" and "clusterIP" in w and w["clusterIP"] != h.get("clusterIP"):
        return "recreate"
    if want["kind"] in ("Deployment", "DaemonSet", "StatefulSet") and "selector" in w \
            and w["selector"] != h.get("selector"):
        return "recreate"
    if want["kind"] == "StatefulSet" and any(
            k in w and not _subset(w[k], h.get(k)) for k in ("serviceName", "volumeClaimTemplates",
                                                             "podManagementPolicy")):
        return "recreate"
    if want["kind"] == "ConfigMap" and set(want.get("data") or {}) != set(live.get("data") or {}):
        return "replace"          # a key left over would still be projected
    if want["kind"] == "EndpointSlice" and want.get("addressType") != live.get("addressType"):
        return "recreate"
    return None if _subset(want, live) else "replace"


def _match_defaults(match: dict) -> dict:
    """A MatchResources with the apiserver's defaults for what is left out (defaults.go:
    SetDefaults_MatchResources, SetDefaults_Rule)."""
    out = {"matchPolicy": "Equivalent", "namespaceSelector": {}, "objectSelector": {}, **match}
    for key in ("resourceRules", "excludeResourceRules"):
        if isinstance(out.get(key), list):
            out[key] = [{"scope": "*", **r} if isinstance(r, dict) else r for r in out[key]]
    return out


def _admission_defaults(kind: str, spec: dict) -> dict:
    """``spec`` of a ValidatingAdmissionPolicy(Binding) with every default the apiserver fills in
    (kubernetes pkg/apis/admissionregistration/v1 defaults.go and zz_generated.defaults.go, the
    same from 1.30 to 1.36): a policy's failurePolicy Fail; in a policy's matchConstraints and a
    binding's matchResources, matchPolicy Equivalent, namespaceSelector and objectSelector {}
    (everything), each rule's scope "*". A binding's paramRef has no default."""
    spec = dict(spec)
    if kind == "ValidatingAdmissionPolicy":
        spec.setdefault("failurePolicy", "Fail")
    key = "matchConstraints" if kind == "ValidatingAdmissionPolicy" else "matchResources"
    if isinstance(spec.get(key), dict):
        spec[key] = _match_defaults(spec[key])
    return spec


def _pruned(value):
    """``value`` without the fields the apiserver leaves out of its answers when empty (Go
    ``omitempty``): None, "", [] and {} (an empty selector is the default, and matches all)."""
    if isinstance(value, dict):
        value = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in value.items() if v not in (None, "", [], {})}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _exact_spec(want: dict, live: dict) -> str | None:
    """An admission policy or its binding: equal only when the whole live spec is ours, field by
    field, each field we leave out holding the apiserver's default (``_admission_defaults``).
    A subset check would read as unchanged what switches the policy off or narrows it: a
    matchConditions of "false", a paramRef, selectors, excludeResourceRules, validationActions
    [Warn], failurePolicy Ignore, another validation or variable. An ownerReference or finalizer
    is not ours either (the garbage collector would delete the policy with its "owner"). The
    replace that follows PUTs exactly ours."""
    kind = want["kind"]
    meta = live.get("metadata") or {}
    if (_pruned(_admission_defaults(kind, want.get("spec") or {}))
            != _pruned(_admission_defaults(kind, live.get("spec") or {}))
            or meta.get("ownerReferences") or meta.get("finalizers") or not _labels_ok(want, live)):
        return "replace"
    return None


def _for_update(want: dict, live: dict, annotations: bool) -> dict:
    """``want`` as a PUT body: the live resourceVersion (optimistic concurrency) and the labels
    (with ``annotations``, the annotations too) that others added kept."""
    body = copy.deepcopy(want)
    meta = body.setdefault("metadata", {})
    live_meta = live.get("metadata") or {}
    meta["resourceVersion"] = live_meta.get("resourceVersion")
    meta["labels"] = {**(live_meta.get("labels") or {}), **(meta.get("labels") or {})}
    if annotations and live_meta.get("annotations"):
        meta["annotations"] = {**live_meta["annotations"], **(meta.get("annotations") or {})}
    return body


# apiVersion, kind -> (resource, namespaced, how a live object compares, whether a replace keeps
# the annotations others added). Bindings and token Secrets are compared exactly: what they
# grant is all in the fields we set; so are admission policies and their bindings, whose every
# field, set or not by us, decides what they deny.
KINDS: dict[tuple[str, str], tuple[str, bool, Callable[[dict, dict], str | None], bool]] = {
    ("v1", "ServiceAccount"): ("serviceaccounts", True, _as_subset, True),
    ("v1", "ConfigMap"): ("configmaps", True, _as_subset, True),
    ("v1", "Service"): ("services", True, _as_subset, True),
    ("v1", "Endpoints"): ("endpoints", True, _as_subset, True),
    ("discovery.k8s.io/v1", "EndpointSlice"): ("endpointslices", True, _as_subset, True),
    ("v1", "Secret"): ("secrets", True, _opaque_secret, False),
    ("v1", "Namespace"): ("namespaces", False, _as_subset, True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True, _as_subset, True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True, _as_subset, True),
    ("v1", "ResourceQuota"): ("resourcequotas", True, _as_subset, True),
    ("v1", "LimitRange"): ("limitranges", True, _as_subset, True),
    ("scheduling.k8s.io/v1", "PriorityClass"): ("priorityclasses", False, _as_subset, True),
    # compared exactly: a field the API kept that we no longer set (a peer, a port) still opens a door
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True, _exact_spec, True),
    (f"{RBAC_GROUP}/v1", "ClusterRole"): ("clusterroles", False, _as_subset, True),
    (f"{RBAC_GROUP}/v1", "ClusterRoleBinding"): ("clusterrolebindings", False, _exact_binding, False),
    ("apps/v1", "Deployment"): ("deployments", True, _as_subset, True),
    ("apps/v1", "DaemonSet"): ("daemonsets", True, _as_subset, True),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        ("validatingadmissionpolicies", False, _exact_spec, True),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        ("validatingadmissionpolicybindings", False, _exact_spec, True),
}


class _Object:
    """One object of ``KINDS``: its paths, and how its live state compares."""

    def __init__(self, obj: dict, api=None):
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key not in KINDS or (obj.get("kind") == "Secret" and "stringData" not in obj and "data" not in obj):
            kinds = ", ".join(sorted({k for (_, k) in KINDS}))
            raise ValueError(f"{_ident(obj)}: apply_objects handles {kinds} only")
        resource, namespaced, self.compare, self.keep_annotations = KINDS[key]
        meta = obj.get("metadata") or {}
        if namespaced and not meta.get("namespace"):
            raise ValueError(f"{_ident(obj)}: a namespaced kind needs metadata.namespace")
        group = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        scope = f"/namespaces/{meta['namespace']}" if namespaced else ""
        self.collection = f"{group}{scope}/{resource}"
        self.path = f"{self.collection}/{meta['name']}"
        self.api, self.what = api, _ident(obj)

    def read(self) -> dict | None:
        """The live object, or None when there is none."""
        try:
            return rest(self.api, "GET", self.path, self.what)
        except ApiError as e:
            if e.status == 404:
                return None
            raise KubeError(f"{self.what}: read refused: {status_message(e)}") from None


def _write(o: _Object, obj: dict, live: dict | None, change: str) -> None:
    """Bring one object to ``obj``: create it, replace it, or delete and create it."""
    try:
        if change == "created":
            try:
                rest(o.api, "POST", o.collection, o.what, obj)
                return
            except ApiError as e:
                if not (e.status == 409 and reason(e) == "AlreadyExists"):
                    raise
            live = o.read()          # created by someone else meanwhile: compare with that
            change = o.compare(obj, live) or "unchanged"
        if change == "replace":
            rest(o.api, "PUT", o.path, o.what, _for_update(obj, live, o.keep_annotations))
        elif change == "recreate":
            rest(o.api, "DELETE", o.path, o.what)
            rest(o.api, "POST", o.collection, o.what, obj)
    except ApiError as e:
        raise KubeError(f"{o.what}: {'create' if live is None else 'update'} refused: {status_message(e)}") from None


def _changes(api, objects: list[dict], k8s_version: str) -> list[tuple[_Object, dict | None, str | None]]:
    """Each object's handle, its live state and what it needs (None, "created", "replace",
    "recreate"), read before anything is written; those that need a write are validated
    (strict) first, all failures at once. Unknown kinds are refused before any request."""
    handles = [_Object(obj, api) for obj in objects]
    out = []
    for o, obj in zip(handles, objects):
        live = o.read()
        out.append((o, live, "created" if live is None else o.compare(obj, live)))
    validate_objects([obj for obj, (_, _, change) in zip(objects, out) if change], k8s_version)
    return out


def _action(change: str | None) -> str:
    return {None: "unchanged", "created": "created"}.get(change, "replaced")


def plan_objects(api, objects: list[dict], k8s_version: str) -> list[tuple[str, str, str]]:
    """``apply_objects`` stopped before any write: reads each object, validates those that
    would be written, and says what applying would do (``created``, ``unchanged``, ``replaced``)."""
    return [(obj["kind"], obj["metadata"]["name"], _action(change))
            for obj, (_, _, change) in zip(objects, _changes(api, objects, k8s_version))]


def apply_objects(api, objects: list[dict], k8s_version: str) -> list[tuple[str, str, str]]:
    """Bring each object, in order, to what we set: all are read first; those that need a
    write are validated (strict, for ``k8s_version``'s minor) before any is sent; then a missing
    one is created, and one that differs is replaced with the live resourceVersion (deleted
    and created when an immutable field differs: a binding's roleRef, a token Secret's type, a
    Service's clusterIP, a Deployment's or DaemonSet's selector). What "differs" means:
    ClusterRoleBindings and token Secrets compare what we set exactly; admission policies and
    their bindings compare the whole spec (``_exact_spec``: a field we leave out must hold the
    apiserver's default); the other kinds compare as a subset (every field we set has our
    value; server defaults and fields others add are ignored). Returns ``(kind, name, action)``
    per object, action one of ``created``, ``unchanged``, ``replaced``."""
    out = []
    for obj, (o, live, change) in zip(objects, _changes(api, objects, k8s_version)):
        if change:
            _write(o, obj, live, change)
        out.append((obj["kind"], obj["metadata"]["name"], _action(change)))
    return out
