"""preflight: refuse hosts that cannot take their role, with the reason and the fix."""

from __future__ import annotations

from ..facts import HostFacts
from ..inventory import HostSpec
from ..ssh import HostError
from .base import Context, Event, Phase
from .select import CONTROL_UNITS, ETCD_UNIT, WORKER_UNITS

SUPPORTED_OS = {("debian", "12"), ("debian", "13"), ("ubuntu", "22.04"), ("ubuntu", "24.04")}
SUPPORTED_ARCH = {"x86_64", "aarch64"}
PORTS = {
    "control": {2379: ETCD_UNIT, 2380: ETCD_UNIT, 6443: CONTROL_UNITS[0], 10257: CONTROL_UNITS[1],
                10259: CONTROL_UNITS[2]},
    "worker": {10248: WORKER_UNITS[1], 10250: WORKER_UNITS[1], 10249: WORKER_UNITS[2], 10256: WORKER_UNITS[2]},
}
WORKER_MODULES = ("overlay", "br_netfilter")


def problems(host: HostSpec, facts: HostFacts) -> list[str]:
    """Pure: why ``host`` cannot take its role, one line each (empty when fine)."""
    out = []
    if facts.init != "systemd":
        out.append(f"PID 1 is {facts.init or 'unknown'}, not systemd: every component runs as a systemd unit")
    os_id, _, version = facts.os.partition(" ")
    if (os_id, version) not in SUPPORTED_OS:
        out.append(f"unsupported OS {facts.os!r}; supported: "
                   + ", ".join(f"{o} {v}" for o, v in sorted(SUPPORTED_OS)))
    if facts.arch not in SUPPORTED_ARCH:
        out.append(f"unsupported architecture {facts.arch!r} (supported: x86_64, aarch64)")
    if host.role == "control":
        runtime = sorted({name for _, name in facts.runtime})
        if runtime:
            out.append("runs or has " + ", ".join(runtime) + ": a control host must have no kubelet and no "
                       "container runtime, or it would not stay hidden; remove them or use another host")
    else:
        if facts.hostname != host.name:
            out.append(f"hostname is {facts.hostname!r} but the inventory names it {host.name!r}: the kubelet "
                       f"registers under its hostname; run `hostnamectl set-hostname {host.name}`")
        if facts.swap_devices:
            out.append("swap is on and the kubelet refuses to run with it: `swapoff -a` and remove the swap "
                       "lines from /etc/fstab")
        missing = [m for m in WORKER_MODULES if m not in facts.modules]
        if missing:
            out.append(f"kernel modules not loaded: {', '.join(missing)} (`modprobe -a {' '.join(missing)}`)")
    for port, unit in PORTS[host.role].items():
        # "activating" counts as ours too: a unit restarted without blocking is still starting
        if port in facts.listening and facts.units.get(unit, ("", ""))[0] in ("inactive", "failed", "", "unknown"):
            out.append(f"port {port} is in use by something other than {unit}")
    return out


class RunPreflight(Phase):
    name = "preflight"
    description = "check OS, systemd, swap, ports, and that control hosts can stay hidden"

    def run_host(self, ctx: Context, host: str) -> Event:
        found = problems(ctx.inv.host(host), ctx.facts[host])
        if found:
            raise HostError(host, "preflight: " + "; ".join(found))
        return Event(self.name, host, "checked")
