"""The inventory document as pydantic models: field checks (unknown fields, types, formats)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from installer.core import versions
from installer.core.inventory_fields import (
    API_VERSION,
    CIDR,
    IP,
    Bool,
    HostIP,
    Int,
    IPOrName,
    Label,
    Login,
    PathText,
    Port,
    ReachableIPOrName,
    Role,
    StrictModel,
    Subdomain,
    quoted,
    semver,
    version_field,
)
from installer.core.inventory_hosted import ControlPlaneSpec, HostedSpec, hosted_namespace, quantity

# --- the document --------------------------------------------------------------------------

SANDBOX_IMAGE = "registry.k8s.io/pause:3.10.2"      # the default of spec.artifacts.sandboxImage
# the defaults of spec.apiServer.balancerAddress, by the cluster's family (serviceCIDR's)
BALANCER_ADDRESS, BALANCER_ADDRESS_V6 = "172.20.0.1", "fd72:20::1"


class Metadata(StrictModel):
    name: Label = Field(description="Cluster name; also names the state directory.")


class KubernetesSpec(StrictModel):
    version: Annotated[str, AfterValidator(version_field)] = Field(
        versions.DEFAULT_KUBERNETES_VERSION,
        description=f"Kubernetes release, vMAJOR.MINOR.PATCH, supported {versions.supported_range_text()}.")


class CiliumSpec(StrictModel):
    routingMode: Literal["tunnel", "native"] = Field(
        "tunnel", description="tunnel: VXLAN between workers (Cilium's default; any network between them). "
        "native: pod traffic routed as is between workers on one L2 network (autoDirectNodeRoutes); the "
        "control hosts still reach pods only through konnectivity.")
    values: dict = Field(
        default_factory=dict, description="More Helm values, merged over the installer's (a map in a map "
        "key by key; anything else replaced): e.g. capabilities a sandboxed worker cannot grant. The "
        "installer's own settings (IPAM, kube-proxy kept, Envoy and Hubble off) are what this install "
        "was built and tested with: change them at your own risk.")


class NetworkSpec(StrictModel):
    podCIDR: CIDR = Field("10.244.0.0/16", description="Pod network; each worker gets a slice.")
    serviceCIDR: CIDR = Field("10.96.0.0/12",
                              description="ClusterIP range; its first address is the kubernetes Service.")
    clusterDNS: IP = Field("10.96.0.10", description="ClusterIP of the cluster DNS Service.")
    clusterDomain: Subdomain = "cluster.local"
    resolvConf: PathText | None = Field(
        None, description="resolv.conf the kubelet hands to pods with dnsPolicy Default (and CoreDNS "
        "uses upstream). Default: /run/systemd/resolve/resolv.conf on hosts running systemd-resolved "
        "(its stub 127.0.0.53 would make CoreDNS loop), else /etc/resolv.conf.")
    cni: Literal["routes", "cilium"] = Field(
        "routes", description="routes: bridge CNI with a pod CIDR per worker and static routes between "
        "hosts (no images needed); cilium: installed with Helm from the artifacts, no routes.")
    cilium: CiliumSpec = Field(default_factory=CiliumSpec, description="With cni: cilium: its settings.")
    policy: Literal["none", "kube-network-policies"] = Field(
        "none", description="What enforces NetworkPolicy objects. none: nothing (cni: routes alone accepts "
        "policies and enforces none; Cilium enforces its own); kube-network-policies: an enforcer on every "
        "worker (cni: routes only; its image from the artifacts). A cluster hosting tenants needs one "
        "(docs/hosted.md).")
    egress: Literal["routes", "konnectivity"] | None = Field(
        None, description="How control hosts reach pods and services (webhooks, aggregated APIs, logs/exec): "
        "routes (default with cni: routes) or konnectivity (default with cni: cilium).")
    nodeCIDRMaskSize: Annotated[Int, Field(ge=16, le=28)] = Field(
        24, description="Prefix length of each worker's slice of podCIDR (IPv4).")
    upstreamDNS: list[HostIP] = Field(
        default_factory=list, description="Resolvers CoreDNS forwards to; empty: the kubelet's resolvConf.")


class ApiServerSpec(StrictModel):
    endpoint: ReachableIPOrName | None = Field(
        None, description="Address clients and workers use for the API (VIP, LB name or a control "
        "host's IP). Default: the first control host's address.")
    port: Port = 6443
    extraSANs: list[IPOrName] = Field(default_factory=list, description="More names/IPs for the serving certificate.")
    alwaysPullImages: Bool = Field(
        True, description="Enable the AlwaysPullImages admission plugin (CIS 1.2.11). Turn off for "
        "clusters whose images are imported into containerd with no registry to pull from.")
    balancer: Literal["auto", "local", "none"] = Field(
        "auto", description="How workers reach the API. local: every worker runs a balancer (HAProxy, a "
        "systemd unit) on 127.0.0.1:port and balancerAddress:port over every control host's apiserver, "
        "checked on /readyz each second: kubelet, kube-proxy and pods (the kubernetes Service) keep "
        "working while a control host is lost. none: workers use endpoint. auto: local with more than "
        "one control host and no endpoint, else none.")
    balancerAddress: IP | None = Field(
        None, description="With the local balancer: the address every worker also holds (on lo) and its "
        "balancer listens on, which the kubernetes Service's endpoints name, so that pods reach the API "
        f"through their own node's balancer. Must be free on every network the workers reach, outside "
        f"podCIDR and serviceCIDR. Default: {BALANCER_ADDRESS} (HyperShift's), {BALANCER_ADDRESS_V6} in "
        "an IPv6 cluster.")


def _local_path(v: str) -> str:
    # a path on this machine is expanded (``~user``) and resolved when a command uses it: a
    # ``~user`` naming no user here would stop that command with a traceback, not be reported now
    try:
        Path(v).expanduser()
    except RuntimeError:
        raise PydanticCustomError("path", "{value} starts with a ~user that has no home directory on this machine",
                                  {"value": quoted(v)}) from None
    return v


LocalPath = Annotated[PathText, AfterValidator(_local_path)]


class BastionSpec(StrictModel):
    address: ReachableIPOrName = Field(description="The jump host every SSH connection goes through (IP or DNS name).")
    user: Login | None = Field(None, description="Login user on the bastion. Default: spec.ssh.user.")
    port: Port = 22
    keyPath: LocalPath | None = Field(None, description="Private key for the bastion. Default: spec.ssh.keyPath.")


class SSHSpec(StrictModel):
    user: Login = Field("root", description="Login user; a user other than root runs every command "
                      "through `sudo -n` and so needs passwordless sudo.")
    port: Port = 22
    keyPath: LocalPath = Field("~/.ssh/id_ed25519", description="Private key used to log in.")
    knownHosts: LocalPath = Field("~/.ssh/known_hosts", description="Host keys are verified against this file "
                            "(the bastion's too).")
    bastion: BastionSpec | None = Field(
        None, description="Reach the hosts through this jump host (an SSH direct-tcpip channel, "
        "like ProxyJump). Default: connect directly.")


class HostSSHSpec(StrictModel):
    user: Login | None = None
    port: Port | None = None
    keyPath: LocalPath | None = None
    knownHosts: LocalPath | None = None
    bastion: BastionSpec | None = Field(
        None, description="This host's bastion instead of spec.ssh.bastion; null connects directly.")


class HostSpec(StrictModel):
    name: Label = Field(description="Host and node name (a DNS-1123 label); must equal the host's hostname.")
    address: HostIP
    role: Role
    ssh: HostSSHSpec = Field(default_factory=HostSSHSpec, description="Per-host overrides of spec.ssh.")


def _sha256(v: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        raise PydanticCustomError("sha256", "{value} is not a lower-case hex sha256 digest", {"value": quoted(v)})
    return v


class ComponentVersions(StrictModel):
    etcd: Annotated[str, AfterValidator(semver)] = versions.DEFAULT_COMPONENTS["etcd"]
    containerd: Annotated[str, AfterValidator(semver)] = versions.DEFAULT_COMPONENTS["containerd"]
    runc: Annotated[str, AfterValidator(semver)] = versions.DEFAULT_COMPONENTS["runc"]
    cni: Annotated[str, AfterValidator(semver)] = versions.DEFAULT_COMPONENTS["cni"]


class ArtifactsSpec(StrictModel):
    source: Literal["download", "dir"] = "download"
    path: LocalPath | None = Field(None, description="With source: dir, the directory holding binaries and SHA256SUMS "
                                   "(relative to the inventory).")
    versions: ComponentVersions = Field(default_factory=ComponentVersions,
                                        description="Versions of the non-Kubernetes components: downloaded with "
                                        "source: download; with either source, containerd's decides its config format "
                                        "(1.x: version 2, 2.x: version 3).")
    checksums: dict[str, Annotated[str, AfterValidator(_sha256)]] = Field(
        default_factory=dict, description="Pinned sha256 per binary name (e.g. kube-apiserver); checked in "
        "addition to the published checksums, for both sources.")
    cacheDir: LocalPath | None = Field(None, description="Where downloads are kept. "
                                       "Default: $XDG_CACHE_HOME/hiddenplane/artifacts.")
    sandboxImage: str = Field(SANDBOX_IMAGE, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$",
                              description="containerd's "
                              "sandbox (pause) image; name the one an image-*.tar in the artifacts holds to "
                              "run without a registry.")


class PKISpec(StrictModel):
    keyAlgorithm: Literal["ecdsa-p256", "rsa-2048"] = "ecdsa-p256"
    # bounded: a date past year 9999 cannot be written into a certificate
    caValidityDays: Annotated[Int, Field(gt=0, le=36500)] = 3650
    certValidityDays: Annotated[Int, Field(gt=0, le=36500)] = 365
    bootstrapTokenTTLHours: Annotated[Int, Field(gt=0, le=24 * 7)] = 24
    kubeletClientCertHours: Annotated[Int, Field(gt=0, le=24 * 30)] = Field(
        24, description="Lifetime of kubelet client certificates the controller-manager signs "
        "(--cluster-signing-duration); short, so a stolen one dies soon.")


# The kubelet's own hard eviction thresholds (k8s.io/kubernetes pkg/kubelet/eviction,
# DefaultEvictionHard). A KubeletConfiguration that names some signals turns the others off
# (mergeDefaultEvictionSettings is false by default): the rendered map is always all of these
# with spec.workerHosts.evictionHard's over them.
KUBELET_EVICTION_HARD = {"memory.available": "100Mi", "nodefs.available": "10%", "nodefs.inodesFree": "5%",
                         "imagefs.available": "15%", "imagefs.inodesFree": "5%"}
EvictionSignal = Literal["memory.available", "nodefs.available", "nodefs.inodesFree", "imagefs.available",
                         "imagefs.inodesFree", "pid.available"]
_PERCENT = re.compile(r"([0-9]{1,3}(?:\.[0-9]+)?)%")


def _eviction_threshold(v: str) -> str:
    # the kubelet reads "N%" (0 % and 100 % turn the signal off) or a positive quantity; it
    # refuses a zero or negative quantity and any percentage over 100 at start, so they are
    # refused here, before a kubelet would not start
    m = _PERCENT.fullmatch(v)
    try:
        valid = float(m.group(1)) <= 100 if m else quantity(v) > 0
    except ValueError:
        valid = False
    if valid:
        return v
    raise PydanticCustomError("eviction", "{value} is not an eviction threshold (a percentage from 0% to 100%, "
                              "0% turning it off, or a positive quantity such as 2Gi)", {"value": quoted(v)})


EvictionThreshold = Annotated[str, AfterValidator(_eviction_threshold)]


class WorkerHostsSpec(StrictModel):
    """What the worker hosts are (cluster-wide: every worker), for hosts that need it; the
    defaults describe an ordinary machine and render nothing extra."""

    cgroupV1: Bool = Field(
        False, description="true: the workers run cgroup v1. The kubelet (1.35+) refuses cgroup v1 "
        "unless its KubeletConfiguration says failCgroupV1: false, which this sets; cgroup v1 support "
        "is deprecated upstream and will be removed. Only for hosts that need it (the local lab's "
        "systemd-nspawn workers on a cgroup v1 machine), not a default. Changing it restarts the kubelet.")
    inContainer: Bool = Field(
        False, description="true: each worker is itself a container (e.g. systemd-nspawn) that may not "
        "lower oom_score_adj nor set nf_conntrack_max: containerd gets restrict_oom_score_adj = true "
        "and kube-proxy conntrack {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s} "
        "(leaves the host's conntrack sysctls alone, as kind does). Only for hosts that need it (the "
        "local lab's nspawn workers), not a default. Changing it restarts containerd and kube-proxy.")
    evictionHard: dict[EvictionSignal, EvictionThreshold] = Field(
        default_factory=dict, description="Hard eviction thresholds that replace the kubelet's own for "
        f"these signals ({', '.join(f'{k} {v}' for k, v in KUBELET_EVICTION_HARD.items())}; the others "
        "keep them): for workers whose "
        "filesystem is shared with what they do not own, where a percentage of the whole is not theirs "
        "to keep free (the local lab's nspawn workers see the lab machine's disk). Only for hosts that "
        "need it, not a default. Changing it restarts the kubelet.")


class ClusterSpec(StrictModel):
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
    controlPlane: ControlPlaneSpec = Field(
        default_factory=ControlPlaneSpec, description="Where the control plane runs: on the control hosts "
        "(systemd, the default) or as pods of a hosting cluster (hosted; docs/hosted.md).")
    workerHosts: WorkerHostsSpec = Field(
        default_factory=WorkerHostsSpec, description="The worker hosts' environment (every worker): "
        "only for workers that need it, such as the local lab's systemd-nspawn containers.")


class Inventory(StrictModel):
    apiVersion: Literal[API_VERSION]
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
    def hosted(self) -> HostedSpec | None:
        """spec.controlPlane.hosted when the control plane runs in a hosting cluster, else None."""
        cp = self.spec.controlPlane
        return cp.hosted if cp.mode == "hosted" else None

    @property
    def hosted_namespace(self) -> str:
        assert self.hosted is not None
        return hosted_namespace(self.metadata.name, self.hosted)

    @property
    def endpoint(self) -> str:
        if self.spec.apiServer.endpoint:
            return self.spec.apiServer.endpoint
        return self.hosted.expose.addresses[0] if self.hosted else self.controls[0].address

    @property
    def api_port(self) -> int:
        """The API's port where clients reach it: a hosted tenant's exposed port, else the apiservers'."""
        return self.hosted.expose.port if self.hosted else self.spec.apiServer.port

    @property
    def api_url(self) -> str:
        return _https(self.endpoint, self.api_port)

    @property
    def api_backends(self) -> list[tuple[str, str, int]]:
        """(name, address, port) of every place an apiserver answers: the control hosts, or the
        addresses exposing a hosted tenant's apiservers."""
        if self.hosted:
            return [(f"api-{i}", a, self.hosted.expose.port) for i, a in enumerate(self.hosted.expose.addresses)]
        return [(c.name, c.address, self.spec.apiServer.port) for c in self.controls]

    @property
    def local_balancer(self) -> bool:
        """Whether every worker runs the API balancer (spec.apiServer.balancer, auto resolved).
        A hosted tenant's workers do by default: the kubernetes Service's endpoint is their
        balancer's address (its apiservers have none a pod could reach)."""
        mode = self.spec.apiServer.balancer
        if mode == "auto":
            return bool(self.hosted) or (len(self.controls) > 1 and not self.spec.apiServer.endpoint)
        return mode == "local"

    @property
    def balancer_address(self) -> str:
        """spec.apiServer.balancerAddress, or the default of the cluster's address family."""
        return self.spec.apiServer.balancerAddress or default_balancer_address(self.spec.network.serviceCIDR)

    @property
    def worker_api_url(self) -> str:
        """The API as kubelet and kube-proxy reach it: their own balancer on loopback, or api_url."""
        return _https("127.0.0.1", self.spec.apiServer.port) if self.local_balancer else self.api_url

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


def _https(host: str, port: int) -> str:
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def default_balancer_address(service_cidr: str) -> str:
    return BALANCER_ADDRESS_V6 if ":" in str(service_cidr) else BALANCER_ADDRESS
