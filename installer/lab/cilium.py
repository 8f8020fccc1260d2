"""A lab whose cluster runs Cilium (``installer lab up --cni cilium``): what only the lab sets.

The inventory gets ``network.cni: cilium`` and, while any worker is an nspawn host, Helm values
for the agent's containers without the two capabilities such a worker cannot grant:
CAP_SYS_MODULE (the agent loads no module: every option it needs is built into this machine's
kernel, which has no modules at all) and CAP_SYS_RESOURCE (not in this machine's bounding set;
since Linux 5.11 BPF memory is charged to the cgroup, not to RLIMIT_MEMLOCK). A VM worker has
its own kernel and keeps the chart's defaults when every worker is one. The nspawn side is
BPF_HOST_ARGS and BPF_HOST_UNIT below. The workers get Cilium's two images and the
konnectivity agent's (egress: konnectivity is the default with cni: cilium).

The images, the chart and helm come from ``scripts/build-kubernetes VERSION DIR --only cilium``
(tools/kubebuild/cilium.py); without them the lab says so before it boots anything.
"""

from __future__ import annotations

from pathlib import Path

from installer.core.artifacts import read_sums
from installer.core.render.addons.cilium import CILIUM_CHART
from installer.lab.model import LabError, LabSpec

# What Cilium's agent needs of an nspawn worker besides nspawn.POD_HOST_ARGS:
# - the bpf and perf_event_open system calls, which nspawn's filter refuses (BPF objects are
#   not namespaced): the agent loads its programs and maps, and reads its events ring;
# - CAP_IPC_LOCK, which the agent's container asks for and runc cannot grant from a set that
#   lacks it (CAP_SYS_MODULE and CAP_SYS_RESOURCE, which it asks for too, are left out of the
#   lab's Helm values instead: no module is loaded, and this machine has no CAP_SYS_RESOURCE);
# - what systemd gives a host outside a container and not inside one (BPF_HOST_UNIT): shared
#   mount propagation (the chart mounts /sys/fs/bpf and /run/cilium/cgroupv2 into its pods with
#   HostToContainer or Bidirectional propagation, which containerd refuses on a private mount)
#   and a BPF file system at /sys/fs/bpf, which the kubelet must find (the chart's hostPath) and
#   cannot create in nspawn's read-only /sys. Each worker mounts an instance of its own: the
#   maps Cilium pins there are per node, and two workers share one kernel.
BPF_HOST_ARGS = ("--system-call-filter=bpf perf_event_open", "--capability=CAP_IPC_LOCK")
BPF_HOST_UNIT = """[Unit]
Description=hiddenplane lab: shared mounts and /sys/fs/bpf (as systemd gives a host outside a container)
DefaultDependencies=no
Before=sysinit.target containerd.service kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount --make-rshared /
ExecStart=/bin/sh -c 'mountpoint -q /sys/fs/bpf || { mount -o remount,rw /sys && mkdir -p /sys/fs/bpf \
&& mount -o remount,ro /sys && mount -t bpf bpf /sys/fs/bpf; }'

[Install]
WantedBy=sysinit.target
"""


IMAGES = frozenset({"image-cilium.tar", "image-cilium-operator.tar", "image-konnectivity-agent.tar"})
NEEDED = (*sorted(IMAGES), CILIUM_CHART, "helm")

# the chart's defaults (values.yaml securityContext.capabilities) less SYS_MODULE, SYS_RESOURCE
AGENT_CAPS = ["CHOWN", "KILL", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "SYS_ADMIN", "DAC_OVERRIDE", "FOWNER",
              "SETGID", "SETUID", "SYSLOG"]
CLEAN_STATE_CAPS = ["NET_ADMIN", "SYS_ADMIN"]


def missing(artifacts: Path | None) -> list[str]:
    have = read_sums(artifacts) if artifacts is not None else {}
    return [n for n in NEEDED if n not in have]


def check(artifacts: Path | None) -> None:
    if gone := missing(artifacts):
        raise LabError(f"--cni cilium: the lab's artifacts have no {', '.join(gone)}: build everything into one "
                       "directory (`scripts/build-kubernetes default DIR`, then `scripts/build-kubernetes default "
                       "DIR --only cilium`) and pass --artifacts DIR")


def values(spec: LabSpec) -> dict:
    if not any(h.role == "worker" and h.kind == "nspawn" for h in spec.hosts):
        return {}
    return {"securityContext": {"capabilities": {"ciliumAgent": AGENT_CAPS, "cleanCiliumState": CLEAN_STATE_CAPS}}}


def configure(doc: dict, spec: LabSpec) -> None:
    """Set the lab inventory ``doc``'s pod network to Cilium."""
    net = doc["spec"].setdefault("network", {})
    net["cni"] = "cilium"
    if lab_values := values(spec):
        net["cilium"] = {"values": lab_values}
