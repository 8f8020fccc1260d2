"""A fake kube-apiserver *transport* under the installer's API client, for every API test.

It replaces ``ApiClient.pool`` (a urllib3 PoolManager) and answers with real
``urllib3.HTTPResponse`` objects shaped like the apiserver's, recording every (method, path,
JSON body) and the headers. Resources are known by URL shape: ``.../<plural>`` is a collection
(POST creates or answers 409 AlreadyExists, GET lists with label and field selectors),
``.../<plural>/<name>`` an object (GET or 404 NotFound, PUT checked against resourceVersion,
PATCH as a merge, DELETE). Pod evictions (``.../pods/<name>/eviction``) delete the pod unless a
PodDisruptionBudget is made to refuse (``block_evictions``: 429 that many times per pod);
``fail`` forces an answer for a (method, path). Everything above the transport (paths, JSON,
error mapping) is the installer's own code; TLS is tested against a real ssl server
(tests/test_kube.py) and the whole client against a real kube-apiserver (tests/test_real_*.py).
"""
from __future__ import annotations

import base64
import contextlib
import copy
import json
from urllib.parse import parse_qs, unquote, urlsplit

import urllib3

PLURALS = {"nodes", "pods", "secrets", "clusterrolebindings", "clusterroles", "certificatesigningrequests",
           "validatingadmissionpolicies", "validatingadmissionpolicybindings", "events", "serviceaccounts",
           "configmaps", "services", "deployments", "daemonsets"}
REASONS = {200: "OK", 201: "Created", 403: "Forbidden", 404: "Not Found", 409: "Conflict", 429: "Too Many Requests"}


def _status(code: int, reason: str, message: str, **details) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "details": details, "code": code}


def stored(obj: dict, rv: int) -> dict:
    """``obj`` as the apiserver returns it once stored: server metadata added, and a Secret's
    write-only stringData merged into base64 ``data``."""
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    meta.update(uid=f"uid-{meta['name']}", resourceVersion=str(rv), creationTimestamp="2026-01-01T00:00:00Z")
    if out.get("kind") == "Secret":
        data = dict(out.get("data") or {})
        for k, v in (out.pop("stringData", None) or {}).items():
            data[k] = base64.b64encode(v.encode()).decode()
        out["data"] = data
    return out


def _merge(into: dict, patch: dict) -> None:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _field(obj: dict, dotted: str):
    for part in dotted.split("."):
        obj = (obj or {}).get(part)
    return obj


class FakeCluster:
    def __init__(self):
        self.store: dict[str, dict] = {}          # object path -> stored object
        self.requests: list[tuple[str, str, dict | None]] = []
        self.headers: list[dict] = []
        self.fail: dict[tuple[str, str], tuple[int, dict]] = {}    # (method, path) -> forced answer
        self.block_evictions: dict[str, int] = {}   # "ns/name" -> 429 answers left
        self.rv = 100

    # -- seeding --
    def add(self, path: str, obj: dict) -> dict:
        self.rv += 1
        self.store[f"{path}/{obj['metadata']['name']}"] = stored(obj, self.rv)
        return self.store[f"{path}/{obj['metadata']['name']}"]

    def objects(self, collection: str) -> dict[str, dict]:
        return {k.rpartition("/")[2]: v for k, v in self.store.items() if k.rpartition("/")[0] == collection}

    def calls(self, method: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == method]

    # -- the PoolManager interface --
    def request(self, method, url, body=None, headers=None, fields=None, **kwargs):
        parts = urlsplit(url)
        path = unquote(parts.path)          # as the apiserver decodes it (":" arrives as %3A)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        query.update(dict(fields or ()))
        doc = json.loads(body) if body else None
        self.requests.append((method, path, doc))
        self.headers.append(dict(headers or {}))
        code, answer = self.fail.get((method, path)) or self._handle(method, path, query, doc)
        return urllib3.HTTPResponse(body=json.dumps(answer).encode(), status=code, reason=REASONS.get(code, ""),
                                    headers={"Content-Type": "application/json"}, preload_content=False)

    def clear(self):      # ApiClient.close() -> pool.clear()
        pass

    # -- the server --
    def _list(self, path: str, query: dict) -> list[dict]:
        if path == "/api/v1/pods":           # every namespace
            items = [v for k, v in self.store.items() if "/pods/" in k]
        else:
            items = list(self.objects(path).values())
        for sel, get in (("labelSelector", lambda o, k: ((o["metadata"].get("labels") or {}).get(k))),
                         ("fieldSelector", _field)):
            for term in filter(None, (query.get(sel) or "").split(",")):
                k, _, v = term.partition("=")
                items = [o for o in items if get(o, k) == v]
        return items

    def _handle(self, method: str, path: str, query: dict, doc):
        if path.endswith("/subjectaccessreviews") and method == "POST":
            # the authorizers' answer: a read is allowed only while a pod bound to the node
            # (spec.user system:node:<node>) still exists
            node = doc["spec"]["user"].removeprefix("system:node:")
            bound = any(o.get("kind") == "Pod" and o["spec"].get("nodeName") == node for o in self.store.values())
            return 201, {**doc, "status": {"allowed": bound}}
        if path.endswith("/eviction") and method == "POST":
            pod_path = path.removesuffix("/eviction")
            ns, name = pod_path.split("/")[4], pod_path.rpartition("/")[2]
            if pod_path not in self.store:
                return 404, _status(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods")
            if self.block_evictions.get(f"{ns}/{name}", 0) > 0:
                self.block_evictions[f"{ns}/{name}"] -= 1
                return 429, _status(429, "TooManyRequests",
                                    "Cannot evict pod as it would violate the pod's disruption budget.")
            del self.store[pod_path]
            return 201, _status(201, "", "", name=name)
        if path.endswith("/approval") and method == "PUT":
            # the CSR approval subresource: only status.conditions are taken from the body
            csr_path = path.removesuffix("/approval")
            if csr_path not in self.store:
                return 404, _status(404, "NotFound", "not found", name=csr_path.rpartition("/")[2])
            self.rv += 1
            stored_csr = self.store[csr_path]
            stored_csr.setdefault("status", {})["conditions"] = (doc.get("status") or {}).get("conditions") or []
            stored_csr["metadata"]["resourceVersion"] = str(self.rv)
            return 200, stored_csr
        head, _, last = path.rpartition("/")
        if last in PLURALS or path == "/api/v1/pods":
            if method == "GET":
                return 200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                             "items": self._list(path, query)}
            if method == "POST":
                key, name = f"{path}/{doc['metadata']['name']}", doc["metadata"]["name"]
                ip = (doc.get("spec") or {}).get("clusterIP") if last == "services" else None
                taken = [o for k, o in self.store.items() if "/services/" in k and ip
                         and (o.get("spec") or {}).get("clusterIP") == ip]
                if taken:
                    # as kube-apiserver 1.36 does: the IP allocation fails before the name clash
                    return 422, _status(422, "Invalid", f'Service "{name}" is invalid: spec.clusterIPs: Invalid '
                                        f'value: ["{ip}"]: failed to allocate IP {ip}: provided IP is already '
                                        "allocated", name=name, kind="Service")
                if key in self.store:
                    group = path.split("/")[2] if path.startswith("/apis/") else ""
                    return 409, _status(409, "AlreadyExists", f'{last}{"." + group if group else ""} "{name}" '
                                        "already exists", name=name, group=group, kind=last)
                return 201, self.add(path, doc)
        if path not in self.store:
            return 404, _status(404, "NotFound", f'{head.rpartition("/")[2]} "{last}" not found', name=last)
        if method == "GET":
            return 200, self.store[path]
        if method == "PUT":
            if doc["metadata"].get("resourceVersion") != self.store[path]["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", "the object has been modified", name=last)
            self.rv += 1
            self.store[path] = stored(doc, self.rv)
            return 200, self.store[path]
        if method == "PATCH":
            _merge(self.store[path], doc)
            self.rv += 1
            self.store[path]["metadata"]["resourceVersion"] = str(self.rv)
            return 200, self.store[path]
        if method == "DELETE":
            gone = self.store.pop(path)
            # the apiserver answers a pod's deletion with the pod (the client parses a V1Pod)
            return 200, (gone if gone.get("kind") == "Pod" else _status(200, "", "", name=last))
        raise AssertionError(f"unexpected {method} {path}")


API = "https://192.168.56.230:6443"        # the example inventory's endpoint: never dialled here


def client_factory(material, cluster: "FakeCluster"):
    """A factory of the installer's real API client over ``cluster`` (as day-2 code takes one:
    each call a context manager that closes the client)."""
    from installer.host import kube

    @contextlib.contextmanager
    def factory():
        a = kube.api_client(API, material)
        a.pool = cluster
        try:
            yield a
        finally:
            a.close()
    return factory
