"""What a lab is: its hosts, names, addresses and where its files live. Pure; no side effects.

Naming (Linux interface names are at most 15 characters, so lab names are short):
  bridge            hp-<lab>                 the lab's private L2 segment, holds <subnet>.1
  network namespace hp-<lab>-<host>          one per nspawn host
  veth (root side)  hv-<lab>-<n>             peer is eth0 inside the namespace
  tap (VMs)         ht-<lab>-<n>
Addresses: control hosts from .11, workers from .21, in the lab's /24 (default 10.213.0.0/24).
Nothing is routed or NATed off the machine: the bridge has forwarding off.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from installer.core import versions
from installer.core.errors import InstallerError

LAB_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
DEFAULT_SUBNET = "10.213.0.0/24"
DEBIAN_SUITE = "bookworm"
CONTROL_BASE, WORKER_BASE = 11, 21


class LabError(InstallerError):
    pass


def labs_root() -> Path:
    return Path(os.environ.get("HIDDENPLANE_LAB_DIR", "/var/lib/hiddenplane/labs"))


def cache_root() -> Path:
    return Path(os.environ.get("HIDDENPLANE_CACHE_DIR", "/var/cache/hiddenplane"))


@dataclass(frozen=True)
class LabHost:
    name: str
    role: str            # control | worker
    kind: str            # nspawn | vm
    index: int           # 0-based position in the lab, for interface names
    address: str
    lab: str

    @property
    def netns(self) -> str:
        return f"hp-{self.lab}-{self.name}"

    @property
    def veth(self) -> str:
        return f"hv-{self.lab}-{self.index}"

    @property
    def tap(self) -> str:
        return f"ht-{self.lab}-{self.index}"


LAB_CNIS = ("routes", "cilium")


@dataclass(frozen=True)
class LabSpec:
    name: str
    controls: int = 1
    workers: int = 2
    vm_workers: int = 0
    subnet: str = DEFAULT_SUBNET
    hosts: tuple[LabHost, ...] = field(default=(), compare=False)
    # the pod network its inventory names: "cilium" also lets the nspawn workers load BPF
    # programs (nspawn.BPF_HOST_ARGS) and sends them Cilium's images
    cni: str = "routes"

    @staticmethod
    def create(name: str, controls: int = 1, workers: int = 2, vm_workers: int = 0,
               subnet: str = DEFAULT_SUBNET, cni: str = "routes") -> "LabSpec":
        problems = []
        if cni not in LAB_CNIS:
            problems.append(f"--cni: '{cni}': one of {', '.join(LAB_CNIS)}")
        if not LAB_NAME.match(name):
            problems.append(f"--name: '{name}' must be 1-8 lower-case letters or digits, starting with a "
                            "letter (it goes into network interface names)")
        if controls not in (1, 3, 5):
            problems.append(f"--control: {controls}: use 1, 3 or 5 (each control host runs an etcd member)")
        if workers < 1:
            problems.append(f"--workers: {workers}: a cluster needs at least one worker")
        if not 0 <= vm_workers <= workers:
            problems.append(f"--vm-workers: {vm_workers}: between 0 and --workers ({workers})")
        try:
            net = ipaddress.ip_network(subnet, strict=True)
            if net.version != 4 or net.prefixlen != 24 or not net.is_private:
                problems.append(f"--subnet: {subnet}: use a private IPv4 /24")
        except ValueError:
            problems.append(f"--subnet: '{subnet}' is not a network in CIDR notation")
        if controls + workers > 60:
            problems.append("a lab holds at most 60 hosts")
        if problems:
            raise LabError("lab: " + "; ".join(problems))
        net = ipaddress.ip_network(subnet)
        hosts = [LabHost(f"cp{i + 1}", "control", "nspawn", i, str(net[CONTROL_BASE + i]), name)
                 for i in range(controls)]
        for i in range(workers):
            kind = "vm" if i >= workers - vm_workers else "nspawn"
            hosts.append(LabHost(f"w{i + 1}", "worker", kind, controls + i, str(net[WORKER_BASE + i]), name))
        return LabSpec(name, controls, workers, vm_workers, subnet, tuple(hosts), cni)

    @property
    def bridge(self) -> str:
        return f"hp-{self.name}"

    @property
    def gateway(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)


@dataclass(frozen=True)
class LabPaths:
    """Where a lab keeps its files; everything below ``root`` is removed by ``lab down``."""

    root: Path

    @staticmethod
    def of(name: str) -> "LabPaths":
        return LabPaths(labs_root() / name)

    @property
    def spec_file(self) -> Path:
        return self.root / "lab.json"

    @property
    def ssh_key(self) -> Path:
        return self.root / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "ssh" / "known_hosts"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def inventory(self, name: str) -> Path:
        return self.root / f"{name}.inventory.yaml"

    def host_dir(self, host: str) -> Path:
        return self.root / "hosts" / host


def built_artifacts() -> Path | None:
    """What scripts/build-kubernetes (and scripts/try, scripts/test) leave for the default
    version, when present: a newcomer's `lab up` then runs the real binaries without a flag."""
    path = cache_root() / "build" / f"artifacts-{versions.DEFAULT_KUBERNETES_VERSION}"
    try:
        return path if (path / "SHA256SUMS").is_file() else None
    except OSError:
        return None
