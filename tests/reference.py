"""Helpers that read what the installer renders (systemd unit files, flags, config documents)
and what a real binary's ``--help`` says, plus the reference lists the contract stand-ins embed.

The lists live in the repository, in tests/refdata/: tools/refdata/generate.py writes them from
the built binaries (flags: their ``--help``) and from the Go types those binaries decode their
config files into (config fields), so they describe exactly the version tools/kubebuild builds.
The real binaries themselves are the check of what the installer renders (tests/test_real_flags.py,
and tests/test_addons.py for the konnectivity variants); the lists are only for the stand-ins,
which run where the real binaries do not.

Nothing here is a test; test modules import these helpers.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REFDATA = Path(__file__).resolve().with_name("refdata")

# CIS Kubernetes Benchmark 1.2.29 (apiserver) and 4.2.12 (kubelet): the six suites both rules
# accept; the installer offers exactly these everywhere (etcd and konnectivity included). Written
# out here rather than taken from installer/ so a change there cannot move the expectation.
CIS_CIPHER_SUITES = frozenset({
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256", "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
})


# ---------------------------------------------------------------------------------------------
# a real binary's --help

# Kubernetes components mark a flag deprecated in its text (pflag hides the ones deprecated with
# MarkDeprecated); etcd's hand-written usage says "Deprecated in v3.6" or "Will be deprecated".
K8S_DEPRECATED_MARK = re.compile(r"DEPRECATED:")
DEPRECATED_MARK = {"etcd": re.compile(r"deprecated", re.I)}
FLAG_LINE = re.compile(r"^ {1,8}(?:-[A-Za-z], )?(--[A-Za-z0-9][A-Za-z0-9_.-]*)(.*)$")


def listed_flags(help_text: str) -> dict[str, str]:
    """``{--flag: its description}`` from pflag's usage (and etcd's hand-written one). An entry
    is its flag line and the more-indented lines after it; a blank or section line ends it."""
    out: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = FLAG_LINE.match(line)
        if m:
            current = m[1]
            out[current] = m[2].strip()
        elif current and line.startswith(" ") and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def deprecated_mark(component: str) -> re.Pattern:
    return DEPRECATED_MARK.get(component, K8S_DEPRECATED_MARK)


# ---------------------------------------------------------------------------------------------
# systemd unit files


def parse_unit(content: str | bytes) -> dict[str, list[tuple[str, str]]]:
    """``{section: [(key, value), ...]}`` the way systemd reads a unit file: comment lines
    are skipped, and a line ending in a backslash continues on the next one (the backslash
    and newline become a space; comment lines inside a continuation are ignored)."""
    if isinstance(content, bytes):
        content = content.decode()
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending: str | None = None
    for raw in content.splitlines():
        line = raw.strip()
        if pending is not None:
            if line.startswith(("#", ";")):
                continue
            if line.endswith("\\"):
                pending += " " + line[:-1].strip()
                continue
            line, pending = pending + " " + line, None
        elif not line or line.startswith(("#", ";")):
            continue
        elif line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        if current is None or "=" not in line:
            raise ValueError(f"not a unit file line: {line!r}")
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    if pending is not None:
        raise ValueError("unit file ends inside a continued line")
    return sections


def unit_values(content: str | bytes, section: str, key: str) -> list[str]:
    return [v for k, v in parse_unit(content).get(section, []) if k == key]


def exec_start(content: str | bytes) -> list[str]:
    """The argv of the unit's single ExecStart= (prefixes such as ``-`` or ``+`` dropped)."""
    values = [v for v in unit_values(content, "Service", "ExecStart") if v]
    if len(values) != 1:
        raise ValueError(f"expected exactly one ExecStart=, found {len(values)}")
    argv = shlex.split(values[0])
    argv[0] = argv[0].lstrip("-@:+!")
    return argv


def parse_flags(args: list[str]) -> dict[str, str | None]:
    """``["--a=1", "--b", "x", "--c"]`` -> ``{"--a": "1", "--b": "x", "--c": None}``.
    A repeated flag or a positional argument is an error."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"positional argument {arg!r} where a flag was expected")
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            name, value = arg, args[i + 1]
            i += 1
        else:
            name, value = arg, None
        if name in out:
            raise ValueError(f"flag {name} given twice")
        out[name] = value
        i += 1
    return out


def unit_flags(content: str | bytes) -> dict[str, str | None]:
    """The flags of a unit's ExecStart, by name (``--name``)."""
    return parse_flags(exec_start(content)[1:])
