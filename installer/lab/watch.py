"""Watching lab hosts come up, from outside them: sshd's banner, and when a host does not
answer, what can be seen of it (its nspawn or qemu process, links, ping, TCP 22, console)."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from pathlib import Path
from typing import Callable

from installer.lab import net, nspawn, vm
from installer.lab.model import LabError, LabHost, LabPaths, LabSpec

SSH_TIMEOUT = {"nspawn": 60, "vm": 300}


def ssh_banner(address: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-2.0-")
    except OSError:
        return False


def _host_alive(paths: LabPaths, h: LabHost) -> bool:
    host_dir = paths.host_dir(h.name)
    if h.kind == "vm":
        return vm.vm_running(host_dir)
    return nspawn.pid_of(host_dir) is not None


def _icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _ping(address: str, timeout: float = 1.0) -> bool:
    """One ICMP echo over a raw socket (the lab machine has no ping binary; the lab runs as root)."""
    ident, payload = os.getpid() & 0xFFFF, b"hiddenplane-lab"
    checksum = _icmp_checksum(struct.pack("!BBHHH", 8, 0, 0, ident, 1) + payload)
    packet = struct.pack("!BBHHH", 8, 0, checksum, ident, 1) + payload
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
            s.sendto(packet, (address, 0))
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                s.settimeout(left)
                data, (src, _) = s.recvfrom(1024)
                icmp = data[(data[0] & 0x0F) * 4:]
                if src == address and icmp[0] == 0 and int.from_bytes(icmp[4:6], "big") == ident:
                    return True
    except OSError:
        return False
    return False


def _tcp22(address: str, timeout: float = 1.0) -> str:
    try:
        with socket.create_connection((address, 22), timeout=timeout) as s:
            s.settimeout(timeout)
            try:
                banner = s.recv(64)
            except OSError:
                banner = b""
            return "open, SSH banner" if banner.startswith(b"SSH-2.0-") else "open but no SSH banner"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return f"no answer ({e.strerror or e.__class__.__name__})"


def _route_dev(address: str) -> str | None:
    proc = net.ip("-j", "route", "get", address, check=False)
    try:
        return json.loads(proc.stdout)[0].get("dev") if proc.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def _link_state(name: str, netns: str | None = None) -> str:
    args = (["-n", netns] if netns else []) + ["-j", "link", "show", "dev", name]
    proc = net.ip(*args, check=False)
    if proc.returncode != 0:
        return "missing"
    try:
        info = json.loads(proc.stdout)[0]
    except (ValueError, IndexError):
        return "unknown"
    master = f", on {info['master']}" if info.get("master") else ""
    return f"{info.get('operstate', '?').lower()}{master}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def console_tail(path: Path, lines: int = 10) -> list[str]:
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError as e:
        return [f"(no console log: {e.strerror})"]
    out = [_ANSI.sub("", ln).rstrip() for ln in text.replace("\r", "\n").splitlines()]
    out = [ln for ln in out if ln.strip()]
    return out[-lines:] or ["(console log is empty)"]


def host_report(paths: LabPaths, h: LabHost) -> str:
    """What can be seen of a host that does not answer SSH, from outside it."""
    host_dir = paths.host_dir(h.name)
    lines = [f"{h.name} ({h.address}, {h.kind}):"]
    if h.kind == "vm":
        lines.append(f"  qemu: {'running' if vm.vm_running(host_dir) else 'not running'}")
        lines.append(f"  link: {h.tap} {_link_state(h.tap)}")
    else:
        pid = nspawn.pid_of(host_dir)
        procs = nspawn.cgroup_pids(host_dir)
        ended = None if pid else nspawn.exit_status(host_dir)
        lines.append(f"  nspawn: {f'running (pid {pid})' if pid else 'not running'}"
                     f"{f' ({ended})' if ended else ''}, {len(procs)} processes in its cgroup")
        lines += [f"    {line}" for line in nspawn.describe_pids(procs[:8])]
        inner = _link_state("eth0", h.netns) if net.netns_exists(h.netns) else f"netns {h.netns} missing"
        lines.append(f"  link: {h.veth} {_link_state(h.veth)}; eth0 in {h.netns}: {inner}")
    bridge = LabSpec.create(h.lab).bridge
    if _route_dev(h.address) == bridge:
        lines.append(f"  ping {h.address}: {'answers' if _ping(h.address) else 'no answer'}")
        lines.append(f"  tcp {h.address}:22: {_tcp22(h.address)}")
    else:
        # without the lab's route the probes would leave through the machine's default route
        lines.append(f"  ping, tcp 22: not tried: {h.address} is not routed via the lab bridge {bridge}")
    console = host_dir / "console.log"
    lines.append(f"  last lines of {console}:")
    lines += [f"    {ln}" for ln in console_tail(console)]
    return "\n".join(lines)


def wait_ssh(hosts: list[LabHost], log=print, timeout: dict[str, float] | None = None,
             restart: Callable[[LabHost], None] | None = None) -> None:
    """Wait until every host's sshd answers. A host whose nspawn/qemu exited is booted again
    once with ``restart`` (its report logged first), else fails at once; one still silent after
    its kind's timeout fails then; the error shows what was seen of each."""
    timeout = timeout or SSH_TIMEOUT
    pending = {h.name: h for h in hosts}
    start = time.monotonic()
    began = {name: start for name in pending}
    restarted: set[str] = set()
    while pending:
        for name, h in list(pending.items()):
            if ssh_banner(h.address):
                log(f"  {name}: sshd answers ({time.monotonic() - start:.1f} s)")
                del pending[name]
        if not pending:
            break
        now = time.monotonic()
        paths = {n: LabPaths.of(h.lab) for n, h in pending.items()}
        dead = [n for n, h in pending.items() if not _host_alive(paths[n], h) and not ssh_banner(h.address)]
        for n in [n for n in dead if restart is not None and n not in restarted]:
            log(f"  {n}: exited before sshd answered; booting it once more. What was seen:\n"
                + host_report(paths[n], pending[n]))
            restart(pending[n])
            restarted.add(n)
            began[n] = time.monotonic()
            dead.remove(n)
        late = [n for n, h in pending.items() if n not in dead and now - began[n] > timeout[h.kind]]
        if dead or late:
            why = ([f"{', '.join(dead)}: exited before sshd answered"
                    + (" (twice)" if set(dead) & restarted else "")] if dead else []) + \
                  ([f"{', '.join(late)}: no SSH answer after {now - start:.0f} s"] if late else [])
            reports = [host_report(paths[n], pending[n]) for n in dead + late]
            raise LabError("lab up: " + "; ".join(why) + "\n" + "\n".join(reports))
        time.sleep(0.3)
