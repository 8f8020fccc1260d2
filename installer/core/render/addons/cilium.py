"""Cilium (``cni: cilium``): Helm values and the Helm command line, chart from the artifacts.

Cilium brings its own pod network (VXLAN between workers, IPs from each Node's
``spec.podCIDR``: ``ipam.mode: kubernetes``, so the controller-manager must allocate node
CIDRs). There are **no static routes in this mode**: not between workers (Cilium tunnels) and
not from the control hosts, which are not nodes and so cannot join the tunnel mesh; the
apiserver reaches pods, services and kubelets through konnectivity instead (the default egress
with ``cni: cilium``). kube-proxy stays (``kubeProxyReplacement: "false"``); Hubble and the
Envoy DaemonSet are off; BPF maps are not preallocated (less memory on small workers).

The chart is a local ``.tgz`` from the artifacts directory: ``helm upgrade --install`` with a
file path never touches the network (no repository, no ``oci://``). The images the chart names
are pulled by the workers' containerd, or must already be imported there.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from installer.core.inventory import Inventory

CILIUM_VERSION = "1.20.2"
CILIUM_CHART = f"cilium-{CILIUM_VERSION}.tgz"    # the name `helm package`/`helm pull` give it
# what the chart renders with its default image settings (no digest): the archives
# scripts/build-kubernetes --only cilium makes carry these names, imported on every worker
IMAGES = {"agent": f"quay.io/cilium/cilium:v{CILIUM_VERSION}",
          "operator": f"quay.io/cilium/operator-generic:v{CILIUM_VERSION}"}
RELEASE = "cilium"
# what the agent leaves on a worker, which a teardown removes (installer/actions/teardown_script.py;
# the paths are the chart's defaults: cni.binPath, cni.confPath, bpf.root, cgroup.hostRoot)
HOST_LINKS = r"cilium_[a-z0-9_]+|lxc_health|lxc[0-9a-f]{12}"   # its devices, the pods' host-side veths
HOST_BPF_PINS = ("/sys/fs/bpf/cilium", "/sys/fs/bpf/tc/globals/cilium_*")   # unpinned, its programs detach
HOST_RUN = "/run/cilium"                               # sockets, state; cgroupv2 is mounted below
HOST_FILES = ("/etc/cni/net.d/05-cilium.conflist", "/opt/cni/bin/cilium-cni",
              "/etc/sysctl.d/99-zzz-override_cilium.conf")
CNI_BACKUP_SUFFIX = ".cilium_bak"     # the agent renames other CNI configurations so (cni.exclusive)
CHAIN_PREFIX = "CILIUM_"
NAMESPACE = "kube-system"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")     # https:, oci:, file: ... (Path turns :// into :/)


def cilium_values(inv: Inventory) -> dict:
    """The Helm values: these settings, ``spec.network.cilium.values`` merged over them, everything
    else the chart's defaults."""
    return merged(_ours(inv), inv.spec.network.cilium.values)


def merged(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` as Helm merges values files: a map into a map key by key,
    anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _ours(inv: Inventory) -> dict:
    net = inv.spec.network
    routing = ({"routingMode": "native", "ipv4NativeRoutingCIDR": net.podCIDR, "autoDirectNodeRoutes": True}
               if net.cilium.routingMode == "native" else {"routingMode": "tunnel", "tunnelProtocol": "vxlan"})
    return {
        "ipam": {"mode": "kubernetes"},
        # a string, like the chart's own default: its templates compare it with strings
        "kubeProxyReplacement": "false",
        "hubble": {"enabled": False},
        "envoy": {"enabled": False},
        # no Envoy at all: the agent would start one for the first L7 rule (the images built
        # here have none, tools/kubebuild/cilium.py); L7 policies are refused instead
        "l7Proxy": False,
        # a change of these values reaches the running agents and operators: the chart then
        # stamps its ConfigMap's checksum on their pods (by default they keep the old settings
        # until something restarts them; seen on the lab with tunnel -> native)
        "rollOutCiliumPods": True,
        "operator": {"rollOutPods": True},
        **routing,
        "bpf": {"preallocateMaps": False},
        # the agents reach the API directly: the kubernetes Service needs kube-proxy, which
        # needs the network Cilium is about to set up
        "k8sServiceHost": "127.0.0.1" if inv.local_balancer else inv.endpoint,   # its node's balancer
        "k8sServicePort": inv.spec.apiServer.port,
    }


def cilium_values_yaml(inv: Inventory) -> bytes:
    return yaml.safe_dump(cilium_values(inv), sort_keys=False, default_flow_style=False).encode()


def cilium_chart(artifacts_dir: Path) -> Path:
    """Where the chart lives in an artifacts directory."""
    return Path(artifacts_dir) / CILIUM_CHART


def helm_argv(chart: Path | str, values_file: Path | str, *, kubeconfig: Path | None = None,
              helm: str = "helm") -> list[str]:
    """``helm upgrade --install cilium CHART --namespace kube-system --values FILE``: installs
    on the first run, upgrades (or does nothing new) on later ones. ``chart`` must be a local
    file: a URL or repository reference is refused, so the install cannot reach the network."""
    if _SCHEME.match(str(chart)) or not str(chart).endswith(".tgz"):
        raise ValueError(f"{chart}: the Cilium chart must be a local .tgz from the artifacts directory")
    chart, values_file = Path(chart), Path(values_file)
    argv = [helm, "upgrade", "--install", RELEASE, str(chart), "--namespace", NAMESPACE,
            "--values", str(values_file)]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    return argv
