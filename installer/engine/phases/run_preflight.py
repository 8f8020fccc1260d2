"""preflight: refuse hosts that cannot take their role, with the reason and the fix."""

from __future__ import annotations

from installer.core import components
from installer.core.artifacts import ARTIFACTS_ARCH
from installer.core.facts import HostFacts
from installer.core.inventory import HostSpec
from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase
from installer.host.fetch import ARCHES
from installer.host.ssh import HostError

SUPPORTED_OS = {("debian", "12"), ("debian", "13"), ("ubuntu", "22.04"), ("ubuntu", "24.04")}
SUPPORTED_ARCH = {"x86_64", "aarch64"}
PORTS = {role: components.preflight_ports(role) for role in (components.CONTROL, components.WORKER)}
WORKER_MODULES = ("overlay", "br_netfilter")
# kube-proxy (mode iptables) runs iptables-restore/-save; hiddenplane-routes runs iptables.
# kube-proxy cleans conntrack entries over netlink since 1.31: no `conntrack` command needed.
WORKER_TOOLS = ("iptables", "iptables-save", "iptables-restore")
# the probe's own tests (facts.py): overlay in /proc/filesystems, br_netfilter's sysctl
MODULE_CHECK = {"overlay": "grep -qw overlay /proc/filesystems",
                "br_netfilter": "[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]"}


def missing_modules(facts: HostFacts) -> list[str]:
    return [m for m in WORKER_MODULES if m not in facts.modules]


def load_script(modules: list[str]) -> str:
    """modprobe what is missing, then check with the probe's own tests (a module built into
    the kernel, or loaded by a container's host, passes without modprobe)."""
    checks = " && ".join(MODULE_CHECK[m] for m in modules)
    return (f"modprobe -a {' '.join(modules)} 2>&1 || true\n"
            f"{checks} || {{ echo 'still not loaded' >&2; exit 1; }}\n")


def problems(host: HostSpec, facts: HostFacts, artifacts_arch: str = ARTIFACTS_ARCH) -> list[str]:
    """Pure: why ``host`` cannot take its role, one line each (empty when fine).
    ``artifacts_arch``: the release architecture (amd64, arm64) the binaries were resolved for."""
    out = []
    if facts.init != "systemd":
        out.append(f"PID 1 is {facts.init or 'unknown'}, not systemd: every component runs as a systemd unit")
    os_id, _, version = facts.os.partition(" ")
    if (os_id, version) not in SUPPORTED_OS:
        out.append(f"unsupported OS {facts.os!r}; supported: "
                   + ", ".join(f"{o} {v}" for o, v in sorted(SUPPORTED_OS)))
    if facts.arch not in SUPPORTED_ARCH:
        out.append(f"unsupported architecture {facts.arch!r} (supported: x86_64, aarch64)")
    elif ARCHES[facts.arch] != artifacts_arch:
        out.append(f"architecture is {facts.arch} ({ARCHES[facts.arch]}) but the artifacts are linux-{artifacts_arch}: "
                   f"its binaries would not run there; use {artifacts_arch} hosts only")
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
        missing = missing_modules(facts)
        if missing:
            out.append(f"kernel modules not loaded and not loadable here: {', '.join(missing)} "
                       f"(`modprobe -a {' '.join(missing)}` as root; in a container, load them on its host)")
        tools = [t for t in WORKER_TOOLS if t not in facts.tools]
        if tools:
            out.append(f"missing {', '.join(tools)}: kube-proxy and the pod network's masquerade rule need them "
                       "(`apt-get install iptables`)")
    for port, unit in PORTS[host.role].items():
        # "activating" counts as ours too: a unit restarted without blocking is still starting
        if port in facts.listening and facts.units.get(unit, ("", ""))[0] in ("inactive", "failed", "", "unknown"):
            out.append(f"port {port} is in use by something other than {unit}")
    return out


class RunPreflight(Phase):
    name = "preflight"
    description = "check OS, systemd, swap, ports, and that control hosts can stay hidden"

    def run_host(self, ctx: Context, host: str) -> Event:
        spec, facts = ctx.inv.host(host), ctx.facts[host]
        detail = []
        missing = missing_modules(facts) if spec.role == "worker" else []
        if missing and ctx.options.dry_run:
            detail.append(f"would load kernel modules {', '.join(missing)}")
        elif missing and "modprobe" in facts.tools:
            r = ctx.remotes[host].run(load_script(missing), check=False, what="load kernel modules", timeout=60)
            if r.rc == 0:
                facts.modules.update(missing)
                detail.append(f"loaded kernel modules {', '.join(missing)}")
            elif r.stdout.strip():
                detail.append(f"modprobe: {r.stdout.strip()[-300:]}")
        found = problems(spec, facts, ctx.artifacts_arch) + [d for d in detail if d.startswith("modprobe: ")]
        if missing and ctx.options.dry_run:
            found = [f for f in found if not f.startswith("kernel modules not loaded")]
        if found:
            raise HostError(host, "preflight: " + "; ".join(found))
        return Event(self.name, host, "changed" if any(d.startswith("loaded") for d in detail) else "checked",
                     detail=detail)
