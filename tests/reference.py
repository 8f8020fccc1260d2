"""Loaders for the upstream reference data in ../shared/reference (see its README.md), and
helpers that read what the installer renders: systemd unit files and config documents.

The real binaries (tests/test_real_flags.py) are the check for the version they are built at;
the lists stay for the other supported minors they describe (tests/test_contract.py says which),
for what no real binary checks yet (tests/test_addons.py: the egress flags and
EgressSelectorConfiguration of the konnectivity variants) and for the stand-ins.

Nothing here is a test; test modules import these helpers.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

from .conftest import reference_dir
from .standins.runtime import flatten

# components whose flags are listed in flags/<component>.txt (test_contract checks only some)
FLAG_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")

_API_VERSION_RE = re.compile(r"^#\s*apiVersion:\s*(\S+)")
_K8S_VERSION_RE = re.compile(r"^#\s*kubernetes-version:\s*(.*)$")


def _data_lines(path: Path) -> list[str]:
    return [s for s in (line.strip() for line in path.read_text().splitlines()) if s and not s.startswith("#")]


def flags_file(component: str) -> Path:
    return reference_dir() / "flags" / f"{component}.txt"


def config_file(kind: str) -> Path:
    return reference_dir() / "config" / f"{kind}.txt"


@lru_cache(maxsize=None)
def load_flags(component: str) -> dict[str, bool]:
    """``{"--flag": deprecated}`` for one component, from flags/<component>.txt."""
    out: dict[str, bool] = {}
    for line in _data_lines(flags_file(component)):
        name, *rest = line.split()
        if rest not in ([], ["deprecated"]):
            raise ValueError(f"{flags_file(component)}: unexpected line {line!r}")
        out[name] = rest == ["deprecated"]
    if not out:
        raise ValueError(f"{flags_file(component)}: no flags")
    return out


@lru_cache(maxsize=None)
def load_paths(kind: str) -> frozenset[str]:
    """Every documented dotted field path of a config Kind, from config/<Kind>.txt."""
    paths = frozenset(_data_lines(config_file(kind)))
    if not paths:
        raise ValueError(f"{config_file(kind)}: no paths")
    return paths


@lru_cache(maxsize=None)
def opaque_prefixes(kind: str) -> frozenset[str]:
    """Paths of ``kind`` below which content is free-form (config/opaque-fields.txt)."""
    out = set()
    for line in _data_lines(reference_dir() / "config" / "opaque-fields.txt"):
        k, path, *_why = line.split()
        if k == kind:
            out.add(path)
    return frozenset(out)


def api_version(kind: str) -> str:
    """The apiVersion named on line 1 of config/<Kind>.txt."""
    first = config_file(kind).read_text().splitlines()[0]
    m = _API_VERSION_RE.match(first)
    if not m:
        raise ValueError(f"{config_file(kind)}: line 1 names no apiVersion: {first!r}")
    return m[1]


def kubernetes_version(path: Path) -> str:
    """Line 2 of a reference file: which Kubernetes version it describes (for messages)."""
    second = path.read_text().splitlines()[1]
    m = _K8S_VERSION_RE.match(second)
    return m[1] if m else second


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


# ---------------------------------------------------------------------------------------------
# config documents


def undocumented_paths(doc: dict, kind: str) -> set[str]:
    """Rendered paths of ``doc`` that config/<kind>.txt does not list."""
    return flatten(doc, opaque_prefixes(kind)) - load_paths(kind)


@lru_cache(maxsize=1)
def cis_cipher_suites() -> frozenset[str]:
    """The six cipher suites cis.md accepts (the TLS_* names it lists)."""
    suites = frozenset(re.findall(r"\bTLS_[A-Z0-9_]+\b", (reference_dir() / "cis.md").read_text()))
    if len(suites) != 6:
        raise ValueError(f"cis.md: expected six cipher suites, found {sorted(suites)}")
    return suites
