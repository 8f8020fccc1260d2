"""The lab's network: one bridge, one network namespace and veth pair per nspawn host.

Thin wrappers over iproute2. Every function is idempotent (re-running ``lab up`` keeps what is
there) and every ``remove_*`` tolerates absence (``lab down`` after a crash).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from pathlib import Path

from installer.lab.model import LabError, LabHost, LabSpec


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return ip("link", "show", "dev", name, check=False).returncode == 0


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def routes_overlapping(subnet: str, ignore_dev: str) -> list[str]:
    """Routes of the machine that already cover (part of) ``subnet``, except our own bridge's."""
    net = ipaddress.ip_network(subnet)
    out = json.loads(ip("-j", "route", "show", "table", "all").stdout or "[]")
    hits = []
    for r in out:
        dst = r.get("dst")
        if not dst or dst == "default" or r.get("dev") == ignore_dev or r.get("type") in ("local", "broadcast"):
            continue
        try:
            if ipaddress.ip_network(dst, strict=False).overlaps(net):
                hits.append(f"{dst} dev {r.get('dev')}")
        except ValueError:
            continue
    return hits


def ensure_bridge(spec: LabSpec) -> None:
    if not link_exists(spec.bridge):
        ip("link", "add", spec.bridge, "type", "bridge")
    addr = f"{spec.gateway}/{spec.prefixlen}"
    if addr not in ip("-o", "addr", "show", "dev", spec.bridge).stdout:
        ip("addr", "add", addr, "dev", spec.bridge)
    # lab traffic stays on this machine: nothing arriving on the bridge is forwarded anywhere
    Path(f"/proc/sys/net/ipv4/conf/{spec.bridge}/forwarding").write_text("0\n")
    ip("link", "set", spec.bridge, "up")


def ensure_host_net(spec: LabSpec, host: LabHost) -> None:
    """A namespace whose eth0 sits on the lab bridge with the host's static address."""
    if not netns_exists(host.netns):
        ip("netns", "add", host.netns)
    if not link_exists(host.veth):
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
    ip("link", "set", host.veth, "master", spec.bridge, "up")
    ns = ("-n", host.netns)
    if f"{host.address}/" not in ip(*ns, "-o", "addr", "show", "dev", "eth0").stdout:
        ip(*ns, "addr", "add", f"{host.address}/{spec.prefixlen}", "dev", "eth0")
    ip(*ns, "link", "set", "lo", "up")
    ip(*ns, "link", "set", "eth0", "up")
    # a default route lets service and pod addresses route to the bridge; the bridge forwards
    # nothing, so no lab packet leaves the machine
    ip(*ns, "route", "replace", "default", "via", spec.gateway)


def remove_host_net(host: LabHost) -> None:
    if link_exists(host.veth):
        ip("link", "del", host.veth, check=False)
    if netns_exists(host.netns):
        ip("netns", "del", host.netns, check=False)


def remove_bridge(spec: LabSpec) -> None:
    if link_exists(spec.bridge):
        ip("link", "del", spec.bridge, check=False)


def cut_link(host: LabHost) -> None:
    """Take the host off the network as a pulled cable would: its bridge port goes down, so
    its packets are dropped silently (no RST, no ICMP). Lab-only, for fault tests."""
    ip("link", "set", host.veth, "down")


def restore_link(host: LabHost) -> None:
    ip("link", "set", host.veth, "up")
