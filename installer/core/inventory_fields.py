"""The inventory's field types: each a pydantic validator with the message a user reads."""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Strict
from pydantic_core import PydanticCustomError

from installer.core import versions, yamlsafe

API_VERSION = "hiddenplane/v1alpha1"
# always used with fullmatch: re.match(...$) also accepts a trailing newline
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# POSIX portable user names (what useradd accepts by default, a little wider)
LOGIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
MAX_PATH = 4096
MAX_PROBLEMS = 50
MAX_LINE = 300
BOTH_ROLES = {"control+worker", "controller+worker", "worker+control", "both", "single"}
HIDDEN_MSG = (
    "a host cannot be both control and worker: it would run a kubelet beside the control "
    "plane and register it as a node, un-hiding the control plane; use separate hosts"
)


# --- field types ---------------------------------------------------------------------------

def quoted(v: Any) -> str:
    """A value as quoted in a message: repr (so a newline shows as \\n), at most a short prefix."""
    if isinstance(v, str) and len(v) > yamlsafe.QUOTE_CHARS:
        return repr(v[:yamlsafe.QUOTE_CHARS]) + "…"
    return yamlsafe.short(repr(v))


def _label(v: str) -> str:
    if not DNS1123_LABEL.fullmatch(v):
        raise PydanticCustomError(
            "dns1123", "{value} is not a DNS-1123 label (lower-case a-z, 0-9, '-', at most "
            "63 characters, starting and ending alphanumeric)", {"value": quoted(v)})
    return v


def _subdomain(v: str) -> str:
    if not DNS1123_SUBDOMAIN.fullmatch(v):
        raise PydanticCustomError("dns1123", "{value} is not a DNS-1123 subdomain", {"value": quoted(v)})
    return v


def _parse_ip(v: str):
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        raise PydanticCustomError("ip", "{value} is not an IP address", {"value": quoted(v)}) from None
    if getattr(ip, "scope_id", None):
        # no certificate SAN, etcd URL or kubelet --node-ip can carry an interface zone
        raise PydanticCustomError("ip", "{value} has an interface zone (%...); use an address without one",
                                  {"value": quoted(v)})
    return ip


def as_ip(v: Any):
    return _cached_ip(v) if isinstance(v, str) else None


@functools.lru_cache(maxsize=65536)
def _cached_ip(v: str):
    # the cluster checks look at each address several times; ipaddress parsing dominates them
    try:
        return ipaddress.ip_address(v)
    except ValueError:
        return None


def _ip(v: str) -> str:
    return str(_parse_ip(v))


def _unusable(ip) -> str | None:
    """Why ``ip`` can never be where a host (or the API, or a bastion) is reached, or None.
    Loopback is not here: a single-machine test may put every host on it (see _host_problems)."""
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if ip.is_unspecified:
        return "is the unspecified address (it means 'any' to a listener and reaches no host)"
    if ip.is_multicast:
        return "is a multicast address, not one host's"
    if ip.version == 4 and ip == ipaddress.IPv4Address("255.255.255.255"):
        return "is the broadcast address, not one host's"
    if ip.is_link_local:
        return ("is link-local: it is not routed beyond one link, and etcd URLs, certificates and "
                "the kubelet's --node-ip cannot name the interface it needs")
    if ip.version == 4 and ip.is_reserved:
        return "is in the reserved range 240.0.0.0/4, which hosts cannot use"
    return None


def _host_ip(v: str) -> str:
    ip = _parse_ip(v)
    why = _unusable(ip)
    if why:
        raise PydanticCustomError("ip", "{value} {why}", {"value": quoted(v), "why": why})
    return str(ip)


def _cidr(v: str) -> str:
    try:
        return str(ipaddress.ip_network(v, strict=True))
    except ValueError:
        raise PydanticCustomError(
            "cidr", "{value} is not a network in CIDR notation with host bits zero "
            "(for example 10.244.0.0/16)", {"value": quoted(v)}) from None


def _ip_or_name(v: str) -> str:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        if DNS1123_SUBDOMAIN.fullmatch(v):
            return v
        raise PydanticCustomError("host", "{value} is neither an IP address nor a DNS name",
                                  {"value": quoted(v)}) from None
    return _ip(v)


def _reachable_ip_or_name(v: str) -> str:
    v = _ip_or_name(v)
    return _host_ip(v) if as_ip(v) is not None else v


def _login(v: str) -> str:
    if not LOGIN_NAME.fullmatch(v):
        raise PydanticCustomError(
            "login", "{value} is not a user name (a letter or '_', then letters, digits, '_', '.', '-'; "
            "at most 32 characters)", {"value": quoted(v)})
    return v


def _path_text(v: str) -> str:
    if not v or len(v) > MAX_PATH or re.search(r"[\x00-\x1f\x7f]", v):
        raise PydanticCustomError(
            "path", "{value} is not a usable path (empty, longer than {n} characters, or with a "
            "control character such as a newline)", {"value": quoted(v), "n": MAX_PATH})
    return v


def version_field(v: str) -> str:
    # versions.parse matches with `$`, which also takes "v1.36.5\n"
    parsed = versions.parse(v) if versions.VERSION_RE.fullmatch(v) else None
    if parsed is None:
        raise PydanticCustomError(
            "version", "{value} is not a version of the form vMAJOR.MINOR.PATCH (for example {d})",
            {"value": quoted(v), "d": versions.DEFAULT_KUBERNETES_VERSION})
    if not versions.is_supported(parsed):
        raise PydanticCustomError(
            "version", "{value} is outside the supported range {r}",
            {"value": quoted(v), "r": versions.supported_range_text()})
    return v


def semver(v: str) -> str:
    if not re.fullmatch(r"v?\d+\.\d+\.\d+", v):
        raise PydanticCustomError("version", "{value} is not a version MAJOR.MINOR.PATCH", {"value": quoted(v)})
    return v


def _role(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in BOTH_ROLES:
        raise PydanticCustomError("role", HIDDEN_MSG)
    return v


def _port(v: int) -> int:
    if not 1 <= v <= 65535:
        raise PydanticCustomError("port", "{value} is not a TCP port (1-65535)", {"value": v})
    return v


# Strict: pydantic's lax mode takes `true` as 1 (and "22" as 22); YAML already types numbers
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Label = Annotated[str, AfterValidator(_label)]
Subdomain = Annotated[str, AfterValidator(_subdomain)]
IP = Annotated[str, AfterValidator(_ip)]
HostIP = Annotated[str, AfterValidator(_host_ip)]
CIDR = Annotated[str, AfterValidator(_cidr)]
IPOrName = Annotated[str, AfterValidator(_ip_or_name)]
ReachableIPOrName = Annotated[str, AfterValidator(_reachable_ip_or_name)]
Login = Annotated[str, AfterValidator(_login)]
PathText = Annotated[str, AfterValidator(_path_text)]
Port = Annotated[int, Strict(), AfterValidator(_port)]
Role = Annotated[Literal["control", "worker"], BeforeValidator(_role)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def apiserver_san_values(domain: str, service_ip: str | None, endpoint: str | None, extra_sans,
                         controls) -> list[str]:
    """Every name and address the apiserver's certificate holds (pki/specs.py issues it with
    these), from plain values (``controls``: (name, address) pairs). Here, below both the
    certificate table and the inventory rules, so that the rule refusing a worker named or
    addressed like the API (inventory_rules.py, on the raw document) reads the same list."""
    values = [
        "kubernetes", "kubernetes.default", "kubernetes.default.svc",
        f"kubernetes.default.svc.{domain}", "localhost",
        # control-plane components on the same host dial the apiserver on loopback
        "127.0.0.1",
        *([service_ip] if service_ip else []), *([endpoint] if endpoint else []), *extra_sans,
    ]
    for name, address in controls:
        values += [name, address]
    return values
