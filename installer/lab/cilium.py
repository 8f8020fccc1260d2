"""A lab whose cluster runs Cilium (``installer lab up --cni cilium``): what only the lab sets.

The inventory gets ``network.cni: cilium`` and, while any worker is an nspawn host, Helm values
for the agent's containers without the two capabilities such a worker cannot grant:
CAP_SYS_MODULE (the agent loads no module: every option it needs is built into this machine's
kernel, which has no modules at all) and CAP_SYS_RESOURCE (not in this machine's bounding set;
since Linux 5.11 BPF memory is charged to the cgroup, not to RLIMIT_MEMLOCK). A VM worker has
its own kernel and keeps the chart's defaults when every worker is one. The nspawn side is
nspawn.BPF_HOST_ARGS and BPF_HOST_UNIT. The workers get Cilium's two images and the
konnectivity agent's (egress: konnectivity is the default with cni: cilium).

The images, the chart and helm come from ``scripts/build-kubernetes VERSION DIR --only cilium``
(tools/kubebuild/cilium.py); without them the lab says so before it boots anything.
"""

from __future__ import annotations

from pathlib import Path

from installer.core.artifacts import read_sums
from installer.core.render.addons.cilium import CILIUM_CHART
from installer.lab.model import LabError, LabSpec

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
        where = artifacts or "the built artifacts"
        raise LabError(f"--cni cilium: {where} has no {', '.join(gone)}: build them with "
                       f"`scripts/build-kubernetes default {artifacts or 'DIR'} --only cilium` and pass "
                       "--artifacts DIR")


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
