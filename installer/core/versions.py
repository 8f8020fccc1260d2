"""Kubernetes versions this release of the installer can render for.

The range follows what upstream still supports at release time and what the flag/field
reference data in our tests covers (kube-apiserver, -controller-manager, -scheduler up to
v1.37). 1.34 reached end of life in 2026 and is refused.
"""

import re

DEFAULT_KUBERNETES_VERSION = "v1.36.5"
# downloaded with `source: download`; each is checked against its published sha256
DEFAULT_COMPONENTS = {"etcd": "v3.6.16", "containerd": "2.2.9", "runc": "v1.4.4", "cni": "v1.10.0"}
MIN_SUPPORTED = (1, 35)
MAX_SUPPORTED = (1, 37)

VERSION_RE = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


def parse(version: str) -> tuple[int, int, int] | None:
    m = VERSION_RE.match(version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def supported_range_text() -> str:
    lo, hi = MIN_SUPPORTED, MAX_SUPPORTED
    return f"v{lo[0]}.{lo[1]}.x to v{hi[0]}.{hi[1]}.x"


def is_supported(version: tuple[int, int, int]) -> bool:
    return MIN_SUPPORTED <= version[:2] <= MAX_SUPPORTED
