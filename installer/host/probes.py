"""Named read-only questions day-2 commands ask a host, beside the facts probe of apply
(core/facts.py): each is the shell it runs and a pure parser of the answer, which tests feed
with recorded output. ``ask`` is the only place they meet a host.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from installer.core.etcd_rules import EtcdOpError, Member, parse_members
from installer.core.render.control import ETCD_DATA_DIR
from installer.core.render.files import BIN_DIR
from installer.host.ssh import Remote

T = TypeVar("T")
_VERSION = re.compile(r"(?:Kubernetes v|[Vv]ersion:? v?)(\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class Answer:
    host: str
    stdout: str
    stderr: str
    rc: int


@dataclass(frozen=True)
class Probe(Generic[T]):
    what: str                                 # for error messages: "read the kubelet's start time"
    command: str
    parse: Callable[[Answer], T]


def ask(remote: Remote, probe: Probe[T], timeout: float = 60) -> T:
    r = remote.run(probe.command, check=False, what=probe.what, timeout=timeout)
    return probe.parse(Answer(remote.name, r.stdout, r.stderr, r.rc))


# --- etcd --------------------------------------------------------------------------------------

def holds_etcd_data() -> Probe[bool]:
    """Whether the host has a member's data (a new member must start empty)."""
    return Probe("look for etcd data", f"test -d {ETCD_DATA_DIR}/member", lambda a: a.rc == 0)


def parse_health(a: Answer) -> dict[str, bool]:
    """``etcdctl endpoint health -w json``: endpoint -> healthy. etcdctl exits 1 when one is
    not, and still prints every endpoint; output that is no such list reads as none healthy."""
    try:
        return {e.get("endpoint"): bool(e.get("health")) for e in json.loads(a.stdout)}
    except (ValueError, AttributeError, TypeError):
        return {}


def endpoint_health(etcdctl: str) -> Probe[dict[str, bool]]:
    """``etcdctl``: the etcdctl command line with its endpoints (etcd_ops.day2_etcdctl)."""
    return Probe("etcdctl endpoint health", f"{etcdctl} endpoint health -w json", parse_health)


def parse_member_list(a: Answer) -> list[Member]:
    if a.rc != 0:
        raise EtcdOpError(f"{a.host}: etcdctl member list failed: {(a.stderr.strip().splitlines() or [''])[-1]}")
    return parse_members(a.stdout, a.host)


def member_list(etcdctl: str) -> Probe[list[Member]]:
    return Probe("etcdctl member list", f"{etcdctl} member list -w json", parse_member_list)


# --- units -------------------------------------------------------------------------------------

def parse_epoch(a: Answer) -> float | None:
    out = a.stdout.strip()
    return float(out) if a.rc == 0 and out.isdigit() else None


def unit_started(unit: str) -> Probe[float | None]:
    """When ``unit`` last became active, in whole seconds on the host's clock (the kubelet's
    Node heartbeats are compared with it); None when it never did."""
    return Probe(f"read {unit}'s start time",
                 f"t=$(systemctl show -p ActiveEnterTimestamp --value {unit}) && [ -n \"$t\" ] && date -d \"$t\" +%s",
                 parse_epoch)


# --- versions ----------------------------------------------------------------------------------

def parse_version(a: Answer) -> str | None:
    """The ``vX.Y.Z`` in what ``<binary> --version`` prints ("Kubernetes v1.36.5", "etcd Version:
    3.6.16"); None when the binary is missing or says no version."""
    m = _VERSION.search(a.stdout) if a.rc == 0 else None
    return f"v{m[1]}" if m else None


def binary_version(binary: str) -> Probe[str | None]:
    """The version ``binary`` (in the installer's bin directory) reports of itself."""
    return Probe(f"read {binary}'s version", f"{BIN_DIR}/{binary} --version 2>/dev/null | head -3", parse_version)
