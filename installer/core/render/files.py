"""What a host must hold: files, directories and system users, plus the jinja2 environment."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jinja2
import yaml

from installer.core.errors import RenderError

BIN_DIR = "/usr/local/bin"
K8S_DIR = "/etc/kubernetes"
PKI_DIR = f"{K8S_DIR}/pki"
SYSTEMD_DIR = "/etc/systemd/system"
CNI_BIN_DIR = "/opt/cni/bin"          # the CNI plugins (containerd's bin_dir)


@dataclass(frozen=True)
class HostFile:
    path: str
    content: bytes
    mode: int
    owner: str = "root"
    group: str = "root"
    secret: bool = False                 # never shown in diffs or logs
    trust: bool = False                  # a CA certificate (bundle) the host trusts: see installer/core/trust.py
    restarts: tuple[str, ...] = ()       # units to restart when this file changes
    # large files (binaries) are not held in memory: read from ``source`` when uploaded,
    # with the digest taken from the artifacts' checksum file
    source: Path | None = None
    digest: str | None = None

    @property
    def sha256(self) -> str:
        return self.digest or hashlib.sha256(self.content).hexdigest()

    def data(self) -> bytes:
        return self.source.read_bytes() if self.source is not None else self.content

    @property
    def size(self) -> int:
        return self.source.stat().st_size if self.source is not None else len(self.content)


@dataclass(frozen=True)
class HostDir:
    path: str
    mode: int
    owner: str = "root"
    group: str = "root"


@dataclass(frozen=True)
class SystemUser:
    name: str
    home: str


@dataclass
class HostPlan:
    name: str
    role: str
    files: dict[str, HostFile] = field(default_factory=dict)
    dirs: dict[str, HostDir] = field(default_factory=dict)
    users: list[SystemUser] = field(default_factory=list)
    units: list[str] = field(default_factory=list)     # enabled and started, in this order
    absent: list[str] = field(default_factory=list)    # paths that must not exist

    def add(self, f: HostFile) -> None:
        if f.path in self.files:
            raise RenderError(f"{self.name}: {f.path} rendered twice")
        self.files[f.path] = f

    def mkdir(self, d: HostDir) -> None:
        self.dirs[d.path] = d


def _units_dir() -> Path:
    here = Path(__file__).resolve().parents[2]        # the installer package
    for candidate in (here / "units", here.parent / "units"):   # installed wheel, then source tree
        if candidate.is_dir():
            return candidate
    raise RenderError("unit templates not found (expected installer/units or ./units)")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_units_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_template(template: str, **values) -> bytes:
    try:
        return environment().get_template(template).render(**values).encode()
    except jinja2.UndefinedError as e:
        raise RenderError(f"template {template}: {e.message}") from None


def flags(values: dict[str, object]) -> list[str]:
    """``{"--a": 1, "--b": True}`` -> ``["--a=1", "--b=true"]``; order kept, None dropped."""
    out = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        out.append(f"{name}={value}")
    return out


# libyaml's emitter writes the same bytes as PyYAML's pure-Python one (tests/test_render.py
# compares them on a whole cluster), about 7x faster: rendering 3+50 spent most of its time here
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def to_yaml(doc: dict) -> bytes:
    return yaml.dump(doc, Dumper=_DUMPER, sort_keys=False, default_flow_style=False).encode()


def unit_file(name: str, template: str, **values) -> HostFile:
    # CIS 1.1.1-7 and 4.1.1: unit files 0600 root:root
    return HostFile(f"{SYSTEMD_DIR}/{name}", render_template(template, name=name.removesuffix(".service"), **values),
                    0o600, restarts=(name,))
