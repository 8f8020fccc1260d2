"""``spec.controlPlane``: where the control plane runs (docs/hosted.md).

``systemd`` (the default): on the control hosts of ``spec.hosts``, as units. ``hosted``: as
pods of a hosting cluster reached with a kubeconfig, one namespace per tenant; ``spec.hosts``
then lists workers only. The field checks are the models here; the checks across the document
(no control host when hosted, the hosted block only when hosted, the exposed addresses never a
worker's) are ``hosted_problems``, on the raw data like the other cluster checks.
"""

from __future__ import annotations

import ipaddress
import re
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from installer.core.errors import InstallerError
from installer.core.inventory_fields import Bool, HostIP, Int, Label, PathText, Port, StrictModel, Subdomain, quoted

HOSTED = "hosted"
# the hosting namespace of a tenant without spec.controlPlane.hosted.namespace
NAMESPACE_PREFIX = "hp-"
DEFAULT_REGISTRY = "registry.k8s.io"
# the components a tenant runs in the hosting cluster, as spec.controlPlane.hosted.resources keys
HOSTED_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "konnectivity-server")
# each one's requests and memory limit unless spec.controlPlane.hosted.resources sets a key:
# requests near its use at rest measured on the lab, the memory limit several times that
# (docs/hosted.md, "Neighbours"; benchmarks/hosted_sizing.py measures each under load beside
# them); no CPU limit (a throttled apiserver fails its probes).
# render/tenant_sizing.py sizes the namespace's quota from them.
SIZING: dict[str, dict[str, dict[str, str]]] = {
    "etcd": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}},
    "kube-apiserver": {"requests": {"cpu": "100m", "memory": "320Mi"}, "limits": {"memory": "2Gi"}},
    "konnectivity-server": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
    "kube-controller-manager": {"requests": {"cpu": "30m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
    "kube-scheduler": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
}
assert set(SIZING) == set(HOSTED_COMPONENTS)
ETCD_MEMBER_COUNTS = (1, 3)     # a tenant's etcd: one member, or three (apply changes it in place)
_UNITS = {"": 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?")


def quantity(v: str) -> Fraction:
    """The value of a quantity in the forms the inventory accepts (``Quantity``)."""
    m = _QUANTITY.fullmatch(v)
    if not m:
        raise ValueError(f"{v!r} is not a quantity")
    return Fraction(m.group(1)) * _UNITS[m.group(2) or ""]


def _quantity(v: str) -> str:
    # Kubernetes' resource.Quantity, the forms an operator writes (no exponent forms)
    if not _QUANTITY.fullmatch(v):
        raise PydanticCustomError("quantity", "{value} is not a Kubernetes quantity (for example 250m, 512Mi, 1Gi)",
                                  {"value": quoted(v)})
    return v


def _registry(v: str) -> str:
    # a host[:port] and an optional path, no tag or digest: images are <registry>/<name>:<tag>
    if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)*", v):
        raise PydanticCustomError("registry", "{value} is not an image registry (host[:port][/path], lower case)",
                                  {"value": quoted(v)})
    return v


# Kubernetes' own namespaces and its reserved prefix: a tenant there would share them with the
# hosting cluster's system components, and its reset would delete them
RESERVED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
RESERVED_PREFIX = "kube-"


def _tenant_namespace(v: str) -> str:
    if v in RESERVED_NAMESPACES or v.startswith(RESERVED_PREFIX):
        raise PydanticCustomError("namespace", "{value} is a namespace of the hosting cluster itself (default and "
                                  "kube-*): a tenant gets a namespace of its own, which its reset deletes",
                                  {"value": quoted(v)})
    return v


def _exposed_address(v: str) -> str:
    # workers dial this from their own network namespace: loopback there is the worker itself,
    # where any local process could listen and take their kubelets' API traffic
    if ipaddress.ip_address(v).is_loopback:
        raise PydanticCustomError("ip", "{value} is a loopback address: the tenant's workers would reach "
                                  "themselves, not the hosting cluster", {"value": quoted(v)})
    return v


Quantity = Annotated[str, AfterValidator(_quantity)]
Registry = Annotated[str, AfterValidator(_registry)]
TenantNamespace = Annotated[Label, AfterValidator(_tenant_namespace)]
ExposedAddress = Annotated[HostIP, AfterValidator(_exposed_address)]


class Resources(StrictModel):
    requests: dict[Literal["cpu", "memory"], Quantity] = Field(default_factory=dict)
    limits: dict[Literal["cpu", "memory"], Quantity] = Field(default_factory=dict)


class ExposeSpec(StrictModel):
    type: Literal["NodePort", "LoadBalancer"] = Field(
        "NodePort", description="How the tenant's API leaves the hosting cluster. NodePort: on every hosting "
        "node at port (and konnectivityPort); LoadBalancer: on the load balancer's address.")
    addresses: list[ExposedAddress] = Field(
        min_length=1, description="Where workers and users reach the tenant's API: hosting nodes' addresses "
        "(NodePort: one per node, each serving the apiserver replica on its node) or the load balancer's "
        "(LoadBalancer; the Service asks for the first). Each is in the apiserver's certificate and a backend of "
        "every worker's API balancer.")
    port: Port = Field(30443, description="The API's port on those addresses (the nodePort with NodePort).")
    konnectivityPort: Port = Field(30132, description="The konnectivity agents' port on those addresses.")


class HostedSpec(StrictModel):
    kubeconfig: PathText = Field(description="Kubeconfig of the hosting cluster (relative to the inventory). "
                                 "Its user needs to manage namespaces and the tenant's objects in them.")
    context: str | None = Field(None, description="Context of that kubeconfig. Default: its current-context.")
    namespace: TenantNamespace | None = Field(
        None, description=f"The tenant's namespace (not default nor kube-*). Default: "
        f"{NAMESPACE_PREFIX}<metadata.name>.")
    expose: ExposeSpec
    apiServerReplicas: Annotated[Int, Field(ge=2, le=5)] = Field(
        2, description="kube-apiserver pods (at least 2: a PodDisruptionBudget keeps one through a drain).")
    etcdReplicas: Literal[ETCD_MEMBER_COUNTS] = Field(  # type: ignore[valid-type]
        3, description="etcd members, each a pod with its own volume.")
    storageClass: Subdomain | None = Field(None, description="StorageClass of etcd's volumes. Default: the "
                                           "hosting cluster's default class.")
    etcdStorage: Quantity = Field("1Gi", description="Size of each etcd member's volume.")
    imageRegistry: Registry = Field(DEFAULT_REGISTRY, description="Registry the control plane's images come "
                                    "from, under their official names (kube-apiserver:<version>, etcd:<version>, "
                                    "kas-network-proxy/proxy-server:<version>): a mirror for air-gapped hosting "
                                    "clusters.")
    resources: dict[Literal[HOSTED_COMPONENTS], Resources] = Field(  # type: ignore[valid-type]
        default_factory=dict, description="Requests and limits per component (container), key by key over "
        "the defaults (docs/hosted.md, \"Sizing\"). The namespace's ResourceQuota is sized from them.")
    spread: Literal["required", "preferred"] = Field(
        "required", description="etcd members and apiserver replicas on distinct hosting nodes. required: "
        "apply refuses a hosting cluster with too few schedulable nodes. preferred accepts that replicas "
        "share a node when there are too few: losing that node then takes them together (etcd's quorum, "
        "or the API).")
    requireNetworkPolicy: Bool = Field(
        True, description="apply checks that the hosting cluster enforces the tenant's NetworkPolicies (a "
        "connection they deny must fail) and stops when it does not. false accepts the risk, and every apply "
        "warns: any pod of the hosting cluster, another tenant's included, then reaches this tenant's etcd "
        "and control-plane pods, guarded by TLS alone.")


    @model_validator(mode="after")
    def _requests_within_limits(self):
        # the API refuses a pod whose request is above its limit: say so here, by field
        for component in HOSTED_COMPONENTS:
            own = self.resources.get(component)
            requests = {**SIZING[component].get("requests", {}), **(own.requests if own else {})}
            limits = {**SIZING[component].get("limits", {}), **(own.limits if own else {})}
            for res, limit in limits.items():
                if res in requests and quantity(requests[res]) > quantity(limit):
                    raise PydanticCustomError(
                        "resources", "resources.{component}: requests.{res} {req} is above limits.{res} {limit} "
                        "(a default where not set: set both)",
                        {"component": component, "res": res, "req": requests[res], "limit": limit})
        return self


class ControlPlaneSpec(StrictModel):
    mode: Literal["systemd", "hosted"] = Field(
        "systemd", description="systemd: etcd and the control plane run as units on the control hosts. "
        "hosted: as pods of a hosting cluster (hosted: ...); spec.hosts then lists workers only.")
    hosted: HostedSpec | None = None


def hosted_namespace(cluster: str, spec: HostedSpec) -> str:
    return spec.namespace or f"{NAMESPACE_PREFIX}{cluster}"


# the Service in the hosting cluster exposing a tenant's apiservers (and konnectivity servers)
API_SERVICE = "kube-apiserver"


def api_service_names(namespace: str) -> list[str]:
    """The names the tenant's API has inside the hosting cluster (its controller-manager and
    scheduler dial the first long one)."""
    return [API_SERVICE, f"{API_SERVICE}.{namespace}", f"{API_SERVICE}.{namespace}.svc"]


def hosted_san_values(cluster: str, hosted: Any) -> list[str]:
    """What a hosted tenant adds to the apiserver's certificate, read defensively from the raw
    ``spec.controlPlane.hosted`` (the inventory rules and the certificate table share it): the
    exposed addresses and the Service's names in the hosting cluster."""
    if not isinstance(hosted, dict):
        return []
    expose = hosted.get("expose") if isinstance(hosted.get("expose"), dict) else {}
    addresses = expose.get("addresses") if isinstance(expose.get("addresses"), list) else []
    ns = hosted.get("namespace")
    namespace = ns if isinstance(ns, str) and ns else f"{NAMESPACE_PREFIX}{cluster}"
    return [a for a in addresses if isinstance(a, str)] + api_service_names(namespace)


class NotForHosted(InstallerError):
    """A command that does not handle hosted control planes yet: refused before it does anything."""


def refuse_hosted(inv, command: str, instead: str = "") -> None:
    """Refuse ``command`` on a hosted tenant, naming it and what to use ``instead`` (default:
    day 2 of hosted control planes not built yet, docs/hosted.md, "Not done yet")."""
    if inv.spec.controlPlane.mode == HOSTED:
        raise NotForHosted(f"`installer {command}` does not handle hosted control planes"
                           + (f": {instead}" if instead else " yet (spec.controlPlane.mode: hosted; docs/hosted.md, "
                              "\"Not done yet\")") + "; nothing was done")


# --- checks across the document (raw data: a bad field elsewhere never hides them) -----------

def is_hosted(data: Any) -> bool:
    cp = data.get("spec", {}).get("controlPlane") if isinstance(data.get("spec"), dict) else None
    return isinstance(cp, dict) and cp.get("mode") == HOSTED


def hosted_problems(data: dict, hosts: list, base_dir: Path) -> list[str]:
    spec = data.get("spec") if isinstance(data.get("spec"), dict) else {}
    cp = spec.get("controlPlane")
    if not isinstance(cp, dict):
        return []
    hosted = cp.get("hosted")
    if cp.get("mode") != HOSTED:
        if hosted is not None:
            return ["spec.controlPlane.hosted: set only with mode: hosted (the control plane runs on the control "
                    "hosts otherwise)"]
        return []
    out = []
    if hosted is None:
        out.append("spec.controlPlane.hosted: required field is missing with mode: hosted (the hosting "
                   "cluster's kubeconfig and how the API is exposed)")
    for i, h in enumerate(hosts):
        if isinstance(h, dict) and h.get("role") == "control":
            out.append(f"spec.hosts[{i}].role: 'control' with spec.controlPlane.mode: hosted: the control plane "
                       "runs in the hosting cluster; list workers only")
    if not isinstance(hosted, dict):
        return out
    path = hosted.get("kubeconfig")
    if isinstance(path, str) and path:
        p = (base_dir / Path(path).expanduser())
        if not p.is_file():
            out.append(f"spec.controlPlane.hosted.kubeconfig: {quoted(path)} is not a file")
    expose = hosted.get("expose") if isinstance(hosted.get("expose"), dict) else {}
    port, kport = expose.get("port", 30443), expose.get("konnectivityPort", 30132)
    if isinstance(port, int) and port == kport:
        out.append(f"spec.controlPlane.hosted.expose.konnectivityPort: {kport} is also the API's port")
    egress = spec.get("network", {}).get("egress") if isinstance(spec.get("network"), dict) else None
    if egress == "routes":
        out.append("spec.network.egress: 'routes' cannot reach a hosted tenant's pods and kubelets from the "
                   "hosting cluster: use egress: konnectivity (the default with mode: hosted)")
    return out


# --- the images a tenant's control plane runs (their official names; the lab builds them) ----

KONNECTIVITY_IMAGE_VERSION = "v0.36.0"


def hosted_images(registry: str, kubernetes: str, etcd: str,
                  konnectivity: str = KONNECTIVITY_IMAGE_VERSION) -> dict[str, str]:
    """component -> image reference, as registry.k8s.io names them: the Kubernetes components by
    the release tag, etcd by its version without the v and the image revision ``-0``,
    konnectivity under kas-network-proxy/."""
    return {
        **{c: f"{registry}/{c}:{kubernetes}" for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")},
        "etcd": f"{registry}/etcd:{etcd.lstrip('v')}-0",
        "konnectivity-server": f"{registry}/kas-network-proxy/proxy-server:{konnectivity}",
        "konnectivity-agent": f"{registry}/kas-network-proxy/proxy-agent:{konnectivity}",
    }
