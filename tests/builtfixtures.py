"""The real binaries, built from their Go modules by scripts/build-kubernetes (cached).

``scripts/test`` builds them before pytest starts (progress on the terminal) and exports
``HIDDENPLANE_TEST_ARTIFACTS``; run alone, the fixture builds them itself (from the cache in
seconds once built). Every test that runs a real component takes them from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from installer import versions
from installer.artifacts import read_sums, verify

ROOT = Path(__file__).resolve().parent.parent
ENV = "HIDDENPLANE_TEST_ARTIFACTS"


def default_dir() -> Path:
    cache = Path(os.environ.get("HIDDENPLANE_CACHE_DIR", "/var/cache/hiddenplane"))
    return cache / "build" / f"artifacts-{versions.DEFAULT_KUBERNETES_VERSION}"


def build(dest: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools/kubebuild/build.py"), "default", str(dest)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"scripts/build-kubernetes failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


@pytest.fixture(scope="session")
def built_artifacts() -> Path:
    """A verified artifacts directory: the five Kubernetes binaries and kubectl at the default
    version, etcd/etcdctl/etcdutl, containerd, runc, the CNI plugins, crictl, and the image
    archives (pause, CoreDNS, busybox)."""
    dest = Path(os.environ.get(ENV) or default_dir())
    if not (dest / "kube-apiserver").is_file():
        build(dest)
    verify(dest, sorted(read_sums(dest)))
    return dest
