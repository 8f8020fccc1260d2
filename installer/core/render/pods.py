"""A control-plane component as a pod's parts, from the same host plan a control host gets
(docs/hosted.md): the files its plan gives it (those whose change restarts its unit) as a Secret
(keys, kubeconfigs: ``HostFile.secret``) and a ConfigMap (certificates, configurations), projected
at the **same paths**, so the flags rendered for its systemd unit are the container's args
unchanged; and the digest of everything it runs with, for the pod template's annotation: a change
of what the component runs with rolls its pods, a new installer release alone does not.

Pure: no cluster is reached here. The hosted executor (issue 25) puts these parts into its
Deployments and StatefulSets.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import re
from dataclasses import dataclass, field

from installer.core.render.files import SYSTEMD_DIR, HostFile, HostPlan

# the pod template's annotation that carries the inputs' digest
INPUTS_ANNOTATION = "hiddenplane.io/inputs-sha256"
# a file is projected under its top two directories (/etc/kubernetes, /etc/etcd): mounted there,
# never over /etc itself, which the image needs
MOUNT_DEPTH = 2


def component_files(plan: HostPlan, unit: str) -> list[HostFile]:
    """The files of ``plan`` that ``unit`` reads: those whose change restarts it, its own unit
    file (and restart key) left out: in a pod, the container's args are the unit."""
    return [f for f in plan.files.values()
            if unit in f.restarts and not f.path.startswith(f"{SYSTEMD_DIR}/") and f.source is None
            and not f.path.endswith(".restart-key")]


def key_for(path: str) -> str:
    """A Secret or ConfigMap key for a host path (keys allow ``[-._a-zA-Z0-9]``)."""
    return re.sub(r"[^-._a-zA-Z0-9]", "_", path.strip("/"))


def mount_root(path: str) -> str:
    parts = path.strip("/").split("/")
    if len(parts) <= MOUNT_DEPTH:
        raise ValueError(f"{path}: a projected file must lie below {MOUNT_DEPTH} directories")
    return "/" + "/".join(parts[:MOUNT_DEPTH])


@dataclass
class PodParts:
    """What one component's pods need: the objects holding its files, its volumes and mounts,
    and the digest of its inputs."""
    secret: dict
    config_map: dict
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    inputs_sha256: str = ""

    @property
    def objects(self) -> list[dict]:
        """The Secret and the ConfigMap, each only when it holds a file."""
        return [o for o in (self.secret, self.config_map) if o["data"]]

    def paths(self) -> set[str]:
        """Every file path the pod sees from these parts."""
        out = set()
        for m in self.mounts:
            vol = next(v for v in self.volumes if v["name"] == m["name"])
            for src in vol["projected"]["sources"]:
                for item in next(iter(src.values()))["items"]:
                    out.add(posixpath.join(m["mountPath"], item["path"]))
        return out


def pod_parts(plan: HostPlan, unit: str, name: str, namespace: str, args: list[str],
              labels: dict[str, str] | None = None) -> PodParts:
    """``unit``'s files of ``plan`` for pods named ``name`` in ``namespace``, running with ``args``."""
    files = sorted(component_files(plan, unit), key=lambda f: f.path)
    meta = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {**meta, "name": f"{name}-files"},
              "type": "Opaque", "data": {}}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-config"}, "data": {}}
    roots: dict[str, dict[str, list[dict]]] = {}
    digest = hashlib.sha256()
    for f in files:
        key = key_for(f.path)
        if f.secret:
            secret["data"][key] = base64.b64encode(f.content).decode()
        else:
            try:
                config["data"][key] = f.content.decode()
            except UnicodeDecodeError:
                raise ValueError(f"{f.path}: not text: it cannot go in a ConfigMap") from None
        root = mount_root(f.path)
        kind = "secret" if f.secret else "configMap"
        roots.setdefault(root, {}).setdefault(kind, []).append(
            {"key": key, "path": posixpath.relpath(f.path, root), "mode": f.mode})
        digest.update(f"{f.path}\0{f.mode:o}\0{f.sha256}\n".encode())
    digest.update("\0".join(args).encode())
    parts = PodParts(secret, config, inputs_sha256=digest.hexdigest())
    for i, (root, kinds) in enumerate(sorted(roots.items())):
        sources = []
        if "secret" in kinds:
            sources.append({"secret": {"name": secret["metadata"]["name"], "items": kinds["secret"]}})
        if "configMap" in kinds:
            sources.append({"configMap": {"name": config["metadata"]["name"], "items": kinds["configMap"]}})
        vol = f"{name}-files-{i}"     # several components' parts may share a pod
        parts.volumes.append({"name": vol, "projected": {"sources": sources, "defaultMode": 0o400}})
        parts.mounts.append({"name": vol, "mountPath": root, "readOnly": True})
    return parts


def flag_paths(args: list[str]) -> set[str]:
    """The absolute paths ``args`` name (``--x=/a/b``, and each of ``--x=/a,/b``)."""
    out = set()
    for a in args:
        _, _, value = a.partition("=")
        for v in value.split(","):
            if v.startswith("/"):
                out.add(v)
    return out
