"""The inventory: a validated description of one cluster.

Validation has two layers, and both always run so that a user sees every problem at once:
field checks (pydantic: unknown fields, types, formats) and cluster checks over the whole
document (roles, overlaps, address families), which read the raw data defensively so that a
bad field elsewhere never hides them.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic_core import PydanticCustomError

from installer.core import versions, yamlsafe
from installer.core.errors import InventoryError
from installer.core.network import capacity, slice_prefix

API_VERSION = "hiddenplane/v1alpha1"
# always used with fullmatch: re.match(...$) also accepts a trailing newline
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# POSIX portable user names (what useradd accepts by default, a little wider)
LOGIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
MAX_PATH = 4096
MAX_PROBLEMS = 50
MAX_LINE = 300
BOTH_ROLES = {"control+worker", "controller+worker", "worker+control", "both", "single"}
HIDDEN_MSG = (
    "a host cannot be both control and worker: it would run a kubelet beside the control "
    "plane and register it as a node, un-hiding the control plane; use separate hosts"
)


# --- field types ---------------------------------------------------------------------------

def _q(v: Any) -> str:
    """A value as quoted in a message: repr (so a newline shows as \\n), at most a short prefix."""
    if isinstance(v, str) and len(v) > yamlsafe.QUOTE_CHARS:
        return repr(v[:yamlsafe.QUOTE_CHARS]) + "…"
    return yamlsafe.short(repr(v))


def _label(v: str) -> str:
    if not DNS1123_LABEL.fullmatch(v):
        raise PydanticCustomError(
            "dns1123", "{value} is not a DNS-1123 label (lower-case a-z, 0-9, '-', at most "
            "63 characters, starting and ending alphanumeric)", {"value": _q(v)})
    return v


def _subdomain(v: str) -> str:
    if not DNS1123_SUBDOMAIN.fullmatch(v):
        raise PydanticCustomError("dns1123", "{value} is not a DNS-1123 subdomain", {"value": _q(v)})
    return v


def _parse_ip(v: str):
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        raise PydanticCustomError("ip", "{value} is not an IP address", {"value": _q(v)}) from None
    if getattr(ip, "scope_id", None):
        # no certificate SAN, etcd URL or kubelet --node-ip can carry an interface zone
        raise PydanticCustomError("ip", "{value} has an interface zone (%...); use an address without one",
                                  {"value": _q(v)})
    return ip


def _ip(v: str) -> str:
    return str(_parse_ip(v))


def _unusable(ip) -> str | None:
    """Why ``ip`` can never be where a host (or the API, or a bastion) is reached, or None.
    Loopback is not here: a single-machine test may put every host on it (see _host_problems)."""
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if ip.is_unspecified:
        return "is the unspecified address (it means 'any' to a listener and reaches no host)"
    if ip.is_multicast:
        return "is a multicast address, not one host's"
    if ip.version == 4 and ip == ipaddress.IPv4Address("255.255.255.255"):
        return "is the broadcast address, not one host's"
    if ip.is_link_local:
        return ("is link-local: it is not routed beyond one link, and etcd URLs, certificates and "
                "the kubelet's --node-ip cannot name the interface it needs")
    if ip.version == 4 and ip.is_reserved:
        return "is in the reserved range 240.0.0.0/4, which hosts cannot use"
    return None


def _host_ip(v: str) -> str:
    ip = _parse_ip(v)
    why = _unusable(ip)
    if why:
        raise PydanticCustomError("ip", "{value} {why}", {"value": _q(v), "why": why})
    return str(ip)


def _cidr(v: str) -> str:
    try:
        return str(ipaddress.ip_network(v, strict=True))
    except ValueError:
        raise PydanticCustomError(
            "cidr", "{value} is not a network in CIDR notation with host bits zero "
            "(for example 10.244.0.0/16)", {"value": _q(v)}) from None


def _ip_or_name(v: str) -> str:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        if DNS1123_SUBDOMAIN.fullmatch(v):
            return v
        raise PydanticCustomError("host", "{value} is neither an IP address nor a DNS name",
                                  {"value": _q(v)}) from None
    return _ip(v)


def _reachable_ip_or_name(v: str) -> str:
    v = _ip_or_name(v)
    return _host_ip(v) if _as_ip(v) is not None else v


def _login(v: str) -> str:
    if not LOGIN_NAME.fullmatch(v):
        raise PydanticCustomError(
            "login", "{value} is not a user name (a letter or '_', then letters, digits, '_', '.', '-'; "
            "at most 32 characters)", {"value": _q(v)})
    return v


def _path_text(v: str) -> str:
    if not v or len(v) > MAX_PATH or re.search(r"[\x00-\x1f\x7f]", v):
        raise PydanticCustomError(
            "path", "{value} is not a usable path (empty, longer than {n} characters, or with a "
            "control character such as a newline)", {"value": _q(v), "n": MAX_PATH})
    return v


def _version(v: str) -> str:
    # versions.parse matches with `$`, which also takes "v1.36.5\n"
    parsed = versions.parse(v) if versions.VERSION_RE.fullmatch(v) else None
    if parsed is None:
        raise PydanticCustomError(
            "version", "{value} is not a version of the form vMAJOR.MINOR.PATCH (for example {d})",
            {"value": _q(v), "d": versions.DEFAULT_KUBERNETES_VERSION})
    if not versions.is_supported(parsed):
        raise PydanticCustomError(
            "version", "{value} is outside the supported range {r}",
            {"value": _q(v), "r": versions.supported_range_text()})
    return v


def _semver(v: str) -> str:
    if not re.fullmatch(r"v?\d+\.\d+\.\d+", v):
        raise PydanticCustomError("version", "{value} is not a version MAJOR.MINOR.PATCH", {"value": _q(v)})
    return v


def _role(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in BOTH_ROLES:
        raise PydanticCustomError("role", HIDDEN_MSG)
    return v


def _port(v: int) -> int:
    if not 1 <= v <= 65535:
        raise PydanticCustomError("port", "{value} is not a TCP port (1-65535)", {"value": v})
    return v


# Strict: pydantic's lax mode takes `true` as 1 (and "22" as 22); YAML already types numbers
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Label = Annotated[str, AfterValidator(_label)]
Subdomain = Annotated[str, AfterValidator(_subdomain)]
IP = Annotated[str, AfterValidator(_ip)]
HostIP = Annotated[str, AfterValidator(_host_ip)]
CIDR = Annotated[str, AfterValidator(_cidr)]
IPOrName = Annotated[str, AfterValidator(_ip_or_name)]
ReachableIPOrName = Annotated[str, AfterValidator(_reachable_ip_or_name)]
Login = Annotated[str, AfterValidator(_login)]
PathText = Annotated[str, AfterValidator(_path_text)]
Port = Annotated[int, Strict(), AfterValidator(_port)]
Role = Annotated[Literal["control", "worker"], BeforeValidator(_role)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- the document --------------------------------------------------------------------------

class Metadata(_Strict):
    name: Label = Field(description="Cluster name; also names the state directory.")


class KubernetesSpec(_Strict):
    version: Annotated[str, AfterValidator(_version)] = Field(
        versions.DEFAULT_KUBERNETES_VERSION,
        description=f"Kubernetes release, vMAJOR.MINOR.PATCH, supported {versions.supported_range_text()}.")


class NetworkSpec(_Strict):
    podCIDR: CIDR = Field("10.244.0.0/16", description="Pod network; each worker gets a slice.")
    serviceCIDR: CIDR = Field("10.96.0.0/12", description="ClusterIP range; its first address is the kubernetes Service.")
    clusterDNS: IP = Field("10.96.0.10", description="ClusterIP of the cluster DNS Service.")
    clusterDomain: Subdomain = "cluster.local"
    resolvConf: PathText | None = Field(
        None, description="resolv.conf the kubelet hands to pods with dnsPolicy Default (and CoreDNS "
        "uses upstream). Default: /run/systemd/resolve/resolv.conf on hosts running systemd-resolved "
        "(its stub 127.0.0.53 would make CoreDNS loop), else /etc/resolv.conf.")
    cni: Literal["routes", "cilium"] = Field(
        "routes", description="routes: bridge CNI with a pod CIDR per worker and static routes between "
        "hosts (no images needed); cilium: installed with Helm from the artifacts, no routes.")
    egress: Literal["routes", "konnectivity"] | None = Field(
        None, description="How control hosts reach pods and services (webhooks, aggregated APIs, logs/exec): "
        "routes (default with cni: routes) or konnectivity (default with cni: cilium).")
    nodeCIDRMaskSize: Annotated[Int, Field(ge=16, le=28)] = Field(
        24, description="Prefix length of each worker's slice of podCIDR (IPv4).")
    upstreamDNS: list[HostIP] = Field(
        default_factory=list, description="Resolvers CoreDNS forwards to; empty: the kubelet's resolvConf.")


class ApiServerSpec(_Strict):
    endpoint: ReachableIPOrName | None = Field(
        None, description="Address clients and workers use for the API (VIP, LB name or a control "
        "host's IP). Default: the first control host's address.")
    port: Port = 6443
    extraSANs: list[IPOrName] = Field(default_factory=list, description="More names/IPs for the serving certificate.")
    alwaysPullImages: Bool = Field(
        True, description="Enable the AlwaysPullImages admission plugin (CIS 1.2.11). Turn off for "
        "clusters whose images are imported into containerd with no registry to pull from.")


class BastionSpec(_Strict):
    address: ReachableIPOrName = Field(description="The jump host every SSH connection goes through (IP or DNS name).")
    user: Login | None = Field(None, description="Login user on the bastion. Default: spec.ssh.user.")
    port: Port = 22
    keyPath: PathText | None = Field(None, description="Private key for the bastion. Default: spec.ssh.keyPath.")


class SSHSpec(_Strict):
    user: Login = Field("root", description="Login user; a user other than root runs every command "
                      "through `sudo -n` and so needs passwordless sudo.")
    port: Port = 22
    keyPath: PathText = Field("~/.ssh/id_ed25519", description="Private key used to log in.")
    knownHosts: PathText = Field("~/.ssh/known_hosts", description="Host keys are verified against this file "
                            "(the bastion's too).")
    bastion: BastionSpec | None = Field(
        None, description="Reach the hosts through this jump host (an SSH direct-tcpip channel, "
        "like ProxyJump). Default: connect directly.")


class HostSSHSpec(_Strict):
    user: Login | None = None
    port: Port | None = None
    keyPath: PathText | None = None
    knownHosts: PathText | None = None
    bastion: BastionSpec | None = Field(
        None, description="This host's bastion instead of spec.ssh.bastion; null connects directly.")


class HostSpec(_Strict):
    name: Label = Field(description="Host and node name (a DNS-1123 label); must equal the host's hostname.")
    address: HostIP
    role: Role
    ssh: HostSSHSpec = Field(default_factory=HostSSHSpec, description="Per-host overrides of spec.ssh.")


def _sha256(v: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        raise PydanticCustomError("sha256", "{value} is not a lower-case hex sha256 digest", {"value": _q(v)})
    return v


class ComponentVersions(_Strict):
    etcd: Annotated[str, AfterValidator(_semver)] = versions.DEFAULT_COMPONENTS["etcd"]
    containerd: Annotated[str, AfterValidator(_semver)] = versions.DEFAULT_COMPONENTS["containerd"]
    runc: Annotated[str, AfterValidator(_semver)] = versions.DEFAULT_COMPONENTS["runc"]
    cni: Annotated[str, AfterValidator(_semver)] = versions.DEFAULT_COMPONENTS["cni"]


class ArtifactsSpec(_Strict):
    source: Literal["download", "dir"] = "download"
    path: PathText | None = Field(None, description="With source: dir, the directory holding binaries and SHA256SUMS (relative to the inventory).")
    versions: ComponentVersions = Field(default_factory=ComponentVersions,
                                        description="Versions of the non-Kubernetes components: downloaded with source: "
                                        "download; with either source, containerd's decides its config format "
                                        "(1.x: version 2, 2.x: version 3).")
    checksums: dict[str, Annotated[str, AfterValidator(_sha256)]] = Field(
        default_factory=dict, description="Pinned sha256 per binary name (e.g. kube-apiserver); checked in "
        "addition to the published checksums, for both sources.")
    cacheDir: PathText | None = Field(None, description="Where downloads are kept. Default: $XDG_CACHE_HOME/hiddenplane/artifacts.")
    sandboxImage: str = Field("registry.k8s.io/pause:3.10.2", pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$",
                              description="containerd's "
                              "sandbox (pause) image; name the one an image-*.tar in the artifacts holds to "
                              "run without a registry.")


class PKISpec(_Strict):
    keyAlgorithm: Literal["ecdsa-p256", "rsa-2048"] = "ecdsa-p256"
    # bounded: a date past year 9999 cannot be written into a certificate
    caValidityDays: Annotated[Int, Field(gt=0, le=36500)] = 3650
    certValidityDays: Annotated[Int, Field(gt=0, le=36500)] = 365
    bootstrapTokenTTLHours: Annotated[Int, Field(gt=0, le=24 * 7)] = 24
    kubeletClientCertHours: Annotated[Int, Field(gt=0, le=24 * 30)] = Field(
        24, description="Lifetime of kubelet client certificates the controller-manager signs "
        "(--cluster-signing-duration); short, so a stolen one dies soon.")


class ClusterSpec(_Strict):
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    apiServer: ApiServerSpec = Field(default_factory=ApiServerSpec)
    ssh: SSHSpec = Field(default_factory=SSHSpec)
    hosts: list[HostSpec]
    allowEvenControlHosts: Bool = Field(
        False, description="Accept 2 or 4 control hosts (etcd members). Only as a step of replacing one: "
        "`installer etcd member remove --allow-even` (3 -> 2), then `installer etcd member add` (2 -> 3).")
    artifacts: ArtifactsSpec = Field(default_factory=ArtifactsSpec)
    pki: PKISpec = Field(default_factory=PKISpec)


class Inventory(_Strict):
    apiVersion: Literal["hiddenplane/v1alpha1"]
    kind: Literal["Cluster"]
    metadata: Metadata
    spec: ClusterSpec

    # Where the file lives: relative artifact paths are resolved against it.
    base_dir: Path = Field(default=Path("."), exclude=True, json_schema_extra={"hidden": True})

    @property
    def controls(self) -> list[HostSpec]:
        return [h for h in self.spec.hosts if h.role == "control"]

    @property
    def workers(self) -> list[HostSpec]:
        return [h for h in self.spec.hosts if h.role == "worker"]

    @property
    def endpoint(self) -> str:
        return self.spec.apiServer.endpoint or self.controls[0].address

    @property
    def api_url(self) -> str:
        host = self.endpoint
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return f"https://{host}:{self.spec.apiServer.port}"

    @property
    def kubernetes_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.spec.network.serviceCIDR)[1])

    def host(self, name: str) -> HostSpec:
        for h in self.spec.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def ssh_for(self, host: HostSpec) -> SSHSpec:
        """spec.ssh with the host's overrides; key and known_hosts paths made absolute
        (relative ones are relative to the inventory file, like artifacts.path)."""
        merged = self.spec.ssh.model_dump() | host.ssh.model_dump(exclude_none=True, exclude={"bastion"})
        for key in ("keyPath", "knownHosts"):
            merged[key] = self._abs(merged[key])
        # an explicit `bastion: null` on the host means: connect directly
        bastion = host.ssh.bastion if "bastion" in host.ssh.model_fields_set else self.spec.ssh.bastion
        if bastion is None or bastion.address == host.address:
            merged["bastion"] = None     # a host is never its own jump host
        else:
            merged["bastion"] = bastion.model_copy(update={
                "user": bastion.user or self.spec.ssh.user,
                "keyPath": self._abs(bastion.keyPath or self.spec.ssh.keyPath)})
        return SSHSpec(**merged)

    def _abs(self, path: str) -> str:
        return str((self.base_dir / Path(path).expanduser()).resolve())

    def artifacts_dir(self) -> Path | None:
        p = self.spec.artifacts.path
        return None if p is None else (self.base_dir / Path(p).expanduser()).resolve()


def json_schema() -> dict:
    schema = Inventory.model_json_schema()
    schema.get("properties", {}).pop("base_dir", None)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "hiddenplane inventory (hiddenplane/v1alpha1, kind Cluster)"
    return schema


# --- loading and error reporting -----------------------------------------------------------

def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith("function-") or part in ("literal['control','worker']",):
            continue
        elif isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,60}", part):
            out += ("." if out else "") + part
        else:   # a key a user typed: quoted, so a newline or 5 MB of it cannot break the line
            out += ("." if out else "") + _q(part)
    return out or "(document)"


def _describe(err: dict) -> str:
    path, kind, value = _path(err["loc"]), err["type"], err.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown field"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "literal_error":
        return f"{path}: {_q(value)} is not allowed; expected {err['ctx']['expected']}"
    if kind in ("dns1123", "ip", "cidr", "host", "version", "role", "port", "sha256", "login", "path"):
        return f"{path}: {err['msg']}"
    if kind in ("int_type", "bool_type") and isinstance(value, bool | int):
        want = "a whole number" if kind == "int_type" else "true or false"
        return f"{path}: {_q(value)} is not {want}"
    return f"{path}: {_q(value)}: {err['msg']}"


def _get(data: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(k, int):
            if not isinstance(data, list) or k >= len(data):
                return None
            data = data[k]
        else:
            if not isinstance(data, dict):
                return None
            data = data.get(k)
    return data


def _as_net(v: Any):
    try:
        return ipaddress.ip_network(v, strict=True) if isinstance(v, str) else None
    except ValueError:
        return None


def _as_ip(v: Any):
    return _cached_ip(v) if isinstance(v, str) else None


@functools.lru_cache(maxsize=65536)
def _cached_ip(v: str):
    # the cluster checks look at each address several times; ipaddress parsing dominates them
    try:
        return ipaddress.ip_address(v)
    except ValueError:
        return None


def _network_problems(data: dict, hosts: list) -> list[str]:
    out: list[str] = []
    defaults = NetworkSpec()
    net = _get(data, "spec", "network") or {}
    raw = {k: (net.get(k) if isinstance(net, dict) and k in net else getattr(defaults, k))
           for k in ("podCIDR", "serviceCIDR", "clusterDNS")}
    pod, svc, dns = _as_net(raw["podCIDR"]), _as_net(raw["serviceCIDR"]), _as_ip(raw["clusterDNS"])
    endpoint = _as_ip(_get(data, "spec", "apiServer", "endpoint"))

    if pod and svc:
        if pod.version != svc.version:
            out.append(f"spec.network.podCIDR: {pod} is IPv{pod.version} but serviceCIDR {svc} is "
                       f"IPv{svc.version}; dual-stack is not supported yet")
        elif pod.overlaps(svc):
            out.append(f"spec.network.serviceCIDR: {svc} overlaps spec.network.podCIDR {pod}")
    if svc:
        limit = 12 if svc.version == 4 else 108
        if svc.prefixlen < limit:
            out.append(f"spec.network.serviceCIDR: {svc} is too large; kube-apiserver accepts at "
                       f"most /{limit} for IPv{svc.version}")
    if svc and dns:
        if dns.version != svc.version or dns not in svc:
            out.append(f"spec.network.clusterDNS: '{dns}' is outside spec.network.serviceCIDR {svc}")
        elif dns == svc[1]:
            out.append(f"spec.network.clusterDNS: '{dns}' is the first address of the service CIDR, "
                       "which the kubernetes Service takes; pick another (for example the tenth)")
    if svc and endpoint and endpoint.version != svc.version:
        out.append(f"spec.apiServer.endpoint: '{endpoint}' is IPv{endpoint.version} but "
                   f"spec.network.serviceCIDR {svc} is IPv{svc.version}")
    out += _pod_slice_problems(net if isinstance(net, dict) else {}, pod, hosts)
    for label, n in (("podCIDR", pod), ("serviceCIDR", svc)):
        if not n:
            continue
        for i, h in enumerate(hosts):
            ip = _comparable(_as_ip(_get(h, "address")))     # ::ffff:10.244.0.5 is in 10.244.0.0/16
            if ip and ip.version == n.version and ip in n:
                out.append(f"spec.hosts[{i}].address: '{ip}' lies inside spec.network.{label} {n}")
        if endpoint and endpoint.version == n.version and endpoint in n:
            out.append(f"spec.apiServer.endpoint: '{endpoint}' lies inside spec.network.{label} {n}")
    if isinstance(net, dict) and net.get("cni") == "cilium" and net.get("egress") == "routes":
        # Cilium's pod network is not routed from hosts that are not nodes
        out.append("spec.network.egress: 'routes' needs cni: routes; with cni: cilium the control hosts "
                   "cannot route to pods: use egress: konnectivity (the default with cilium)")
    return out


def _pod_slice_problems(net: dict, pod, hosts: list) -> list[str]:
    """Every worker needs its own slice of podCIDR (see installer/core/network.py): its CNI config
    and routes with cni: routes, its Node.spec.podCIDR with either CNI."""
    mask = net.get("nodeCIDRMaskSize", NetworkSpec().nodeCIDRMaskSize)
    if not pod or not isinstance(mask, int) or isinstance(mask, bool):
        return []
    if pod.version == 4 and mask < pod.prefixlen:
        return [f"spec.network.nodeCIDRMaskSize: /{mask} is larger than spec.network.podCIDR {pod}; "
                f"each worker's slice must fit inside it (use {pod.prefixlen} or more)"]
    workers = sum(1 for h in hosts if isinstance(h, dict) and h.get("role") == "worker")
    room = capacity(pod, mask)
    if workers > room:
        return [f"spec.network.podCIDR: {pod} has room for {room} worker(s) at /{slice_prefix(pod, mask)} "
                f"(nodeCIDRMaskSize) but the inventory has {workers}; use a larger podCIDR or a longer "
                "nodeCIDRMaskSize"]
    return []


def _name_of(h: dict) -> str:
    name = h.get("name")
    if not isinstance(name, str):
        return ""
    return f" of {name if DNS1123_LABEL.fullmatch(name) else _q(name)}"


def _duplicate(hosts: list, i: int, j: int, field: str, value: str) -> str:
    if {hosts[i].get("role"), hosts[j].get("role")} == {"control", "worker"}:
        return f"spec.hosts[{i}].{field}: {_q(value)} is listed as both control and worker: {HIDDEN_MSG}"
    if field == "address":
        raw = hosts[i].get("address")
        same = "" if _as_ip(raw) == _as_ip(hosts[j].get("address")) else f", written as {_q(raw)}"
        return (f"spec.hosts[{i}].address: {_q(value)}{_name_of(hosts[i])} duplicates "
                f"spec.hosts[{j}].address{_name_of(hosts[j])}{same}")
    return f"spec.hosts[{i}].{field}: {_q(value)} duplicates spec.hosts[{j}].{field}"


def _comparable(ip):
    """The address a socket would reach: ::ffff:10.0.0.1 is 10.0.0.1."""
    return getattr(ip, "ipv4_mapped", None) or ip


# one etcd member per control host; more than 5 makes every write wait for more members (README)
CONTROL_COUNTS = (1, 3, 5)
EVEN_CONTROL_COUNTS = (2, 4)      # only while replacing a control host


def _host_problems(hosts: list, allow_even: bool = False) -> list[str]:
    out: list[str] = []
    seen: dict[tuple[str, str], int] = {}     # (field, value) -> first index
    roles = {"control": 0, "worker": 0}
    loopback: list[int] = []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict):
            continue
        if h.get("role") in roles:
            roles[h["role"]] += 1
        ip = _as_ip(h.get("address"))
        keys = [("name", h["name"])] if isinstance(h.get("name"), str) else []
        keys += [("address", str(_comparable(ip)))] if ip is not None else []
        if ip is not None and _comparable(ip).is_loopback:
            loopback.append(i)
        for key in keys:
            if key in seen:
                out.append(_duplicate(hosts, i, seen[key], *key))
            else:
                seen[key] = i
    if not hosts:
        out.append("spec.hosts: no hosts; a cluster needs at least one control host and one worker")
        return out
    addressed = sum(1 for h in hosts if isinstance(h, dict) and _as_ip(h.get("address")) is not None)
    if loopback and len(loopback) < addressed:
        # loopback is this machine: fine when every host is on it (a one-machine test), a typo otherwise
        for i in loopback:
            out.append(f"spec.hosts[{i}].address: {_q(hosts[i]['address'])} is a loopback address: from the "
                       "other hosts it names themselves, not this one; loopback is only allowed when every "
                       "host is on it")
    count = roles["control"]
    allowed = CONTROL_COUNTS + (EVEN_CONTROL_COUNTS if allow_even else ())
    if count == 0:
        out.append("spec.hosts: no host has role control; the control plane needs one (or 3, 5)")
    elif count in EVEN_CONTROL_COUNTS and not allow_even:
        out.append(f"spec.hosts: {count} control hosts; each runs an etcd member and an "
                   "even count adds no fault tolerance: use 1, 3 or 5 (while replacing a control host, "
                   "set spec.allowEvenControlHosts: true)")
    elif count not in allowed:
        out.append(f"spec.hosts: {count} control hosts; each runs an etcd member and every write waits for "
                   "a majority of them: use 1, 3 or 5" + (" (2 or 4 while replacing one)" if allow_even else ""))
    if roles["worker"] == 0:
        out.append("spec.hosts: no host has role worker; workloads need at least one worker "
                   "(control hosts never run pods)")
    return out


def _artifact_problems(data: dict, base_dir: Path) -> list[str]:
    art = _get(data, "spec", "artifacts")
    if not isinstance(art, dict) or art.get("source") != "dir":
        return []
    path = art.get("path")
    if not isinstance(path, str) or not path:
        return ["spec.artifacts.path: required when spec.artifacts.source is 'dir'"]
    resolved = _resolve(base_dir, path)
    if resolved is None:
        return []        # the field check says what is wrong with it
    if not resolved.is_dir():
        return [f"spec.artifacts.path: {_q(path)} is not a directory (resolved to {_q(str(resolved))})"]
    return []


def _resolve(base_dir: Path, path: Any) -> Path | None:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\x00" in path:
        return None
    try:
        return (base_dir / Path(path).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError):   # e.g. ~nosuchuser, a symlink loop
        return None


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _ssh_file_problems(data: dict, hosts: list, base_dir: Path) -> list[str]:
    """A key or known_hosts path that exists but is no regular file fails only at connect time,
    host by host; say it now. A missing file stays legal here: the key's absence is reported at
    connect time, and a missing known_hosts is created by --accept-new-host-keys."""
    ssh = _get(data, "spec", "ssh")
    ssh = ssh if isinstance(ssh, dict) else {}
    defaults = SSHSpec.model_fields
    fields = [(f"spec.ssh.{k}", ssh[k] if k in ssh else defaults[k].default) for k in ("keyPath", "knownHosts")]
    fields.append(("spec.ssh.bastion.keyPath", _get(ssh, "bastion", "keyPath")))
    for i, h in enumerate(hosts):
        for k in ("keyPath", "knownHosts"):
            fields.append((f"spec.hosts[{i}].ssh.{k}", _get(h, "ssh", k)))
        fields.append((f"spec.hosts[{i}].ssh.bastion.keyPath", _get(h, "ssh", "bastion", "keyPath")))
    out = []
    for field, value in fields:
        resolved = _resolve(base_dir, value)
        if resolved is None:
            continue
        try:
            mode = os.stat(resolved).st_mode
        except OSError:
            continue
        kind = next((name for test, name in _FILE_KINDS if test(mode)), None)
        if kind is not None:
            what = "a private key" if field.endswith("keyPath") else "a known_hosts file"
            out.append(f"{field}: {_q(value)} is {kind}, not a regular file; it must be {what}")
    return out


def cluster_problems(data: dict, base_dir: Path) -> list[str]:
    hosts = _get(data, "spec", "hosts")
    hosts = hosts if isinstance(hosts, list) else []
    allow_even = _get(data, "spec", "allowEvenControlHosts") is True
    return (_host_problems(hosts, allow_even) + _network_problems(data, hosts)
            + _endpoint_problems(data, hosts) + _artifact_problems(data, base_dir)
            + _ssh_file_problems(data, hosts, base_dir))


def _endpoint_problems(data: dict, hosts: list) -> list[str]:
    endpoint = _as_ip(_get(data, "spec", "apiServer", "endpoint"))
    if endpoint is None or not _comparable(endpoint).is_loopback:
        return []
    addresses = [_as_ip(h.get("address")) for h in hosts if isinstance(h, dict)]
    if all(a is not None and _comparable(a).is_loopback for a in addresses):
        return []
    return [f"spec.apiServer.endpoint: '{endpoint}' is a loopback address: kubelets on the workers would "
            "reach themselves, not the API; use a control host's address, a VIP or a load balancer"]


def _bounded(problems: list[str]) -> list[str]:
    problems = [p if len(p) <= MAX_LINE else p[:MAX_LINE] + "…" for p in dict.fromkeys(problems)]
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems = problems[:MAX_PROBLEMS] + [f"(document): {more} more problem(s) not shown"]
    return problems


def parse(data: Any, source: str = "inventory", base_dir: Path | None = None,
          problems: list[str] | None = None) -> Inventory:
    """Validate a loaded document; raise InventoryError listing every problem (``problems``
    found earlier, e.g. while parsing the file, first)."""
    base_dir = base_dir or Path(".")
    problems = list(problems or [])
    if not isinstance(data, dict):
        raise InventoryError(source, _bounded(
            problems + ["(document): expected a mapping with apiVersion, kind, metadata, spec"]))
    model = None
    try:
        model = Inventory.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        problems += [_describe(err) for err in e.errors()]
    problems += cluster_problems(data, base_dir)
    if problems:
        # one problem can be found by both layers (a role alias, say); say it once
        raise InventoryError(source, _bounded(problems))
    assert model is not None
    return model


def load(path: str | Path) -> Inventory:
    """Read, parse (bounded: see installer/core/yamlsafe.py) and validate the inventory at ``path``."""
    path = Path(path)
    try:
        raw = yamlsafe.read(path)
    except OSError as e:
        raise InventoryError(str(path), [f"(file): cannot read: {e.strerror}"]) from None
    try:
        data, duplicates = yamlsafe.load(raw)
    except yamlsafe.InputError as e:
        raise InventoryError(str(path), e.problems) from None
    return parse(data, str(path), path.parent.resolve(), problems=duplicates)


def as_inventory(inventory: "str | Path | Inventory") -> Inventory:
    """A path is loaded and validated; an Inventory (e.g. one a day-2 command derived) is taken as is."""
    return inventory if isinstance(inventory, Inventory) else load(inventory)
