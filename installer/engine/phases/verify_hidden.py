"""verify: the control plane is hidden and every secret file is locked down.

Checked against the facts the run already holds (kept current as it wrote), so a no-op apply
spends no round trip here; `installer verify` runs the fuller testinfra checks on demand.
"""

from __future__ import annotations

from installer.core.facts import HostFacts
from installer.core.render.files import HostPlan
from installer.engine.context import Bootstrapped, Context, Event
from installer.engine.phases.base import Phase
from installer.host import apireach
from installer.host.ssh import HostError

NODE_CREDENTIALS = ("/etc/kubernetes/kubelet.conf", "/etc/kubernetes/bootstrap-kubelet.conf",
                    "/var/lib/kubelet/pki/kubelet-client-current.pem")


def violations(plan: HostPlan, facts: HostFacts) -> list[str]:
    """Pure: what is wrong with a host after apply."""
    out = []
    if plan.role == "control":
        for kind, name in sorted(facts.runtime):
            out.append(f"control host has a {name} {kind}: it would not stay hidden")
        out += [f"control host holds node credential {p}" for p in NODE_CREDENTIALS if p in facts.files]
    for f in plan.files.values():
        have = facts.files.get(f.path)
        if have is None:
            out.append(f"{f.path} is missing")
        elif (have.mode, have.owner, have.group) != (f.mode, f.owner, f.group):
            out.append(f"{f.path} is {have.mode:04o} {have.owner}:{have.group}, expected "
                       f"{f.mode:04o} {f.owner}:{f.group}")
        elif f.secret and have.mode & 0o077:
            out.append(f"{f.path} holds a secret but is readable by others")
    for unit in plan.units:
        if facts.units.get(unit, ("", ""))[0] != "active":
            out.append(f"{unit} is not active")
    return out


class VerifyHidden(Phase):
    name = "verify"
    description = "no kubelet, runtime or node credential on control hosts; secrets 0600"
    reads = (Bootstrapped,)

    def run_host(self, ctx: Context, host: str) -> Event:
        if ctx.options.dry_run:
            return Event(self.name, host, "skipped")
        found = violations(ctx.plans[host], ctx.facts[host])
        if found:
            raise HostError(host, "verify: " + "; ".join(found))
        return Event(self.name, host, "checked")

    def finish(self, ctx: Context, events: list[Event]) -> None:
        if ctx.options.dry_run or not ctx.result(Bootstrapped):
            return
        from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
        with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, kube.api_client(url, ctx.material) as api:
            nodes = kube.node_names(api)
        visible = sorted(set(nodes) & {h.name for h in ctx.inv.controls})
        if visible:
            raise HostError(visible[0], "verify: control hosts registered as nodes: " + ", ".join(visible))
