"""The real binaries, built from their Go modules by scripts/build-kubernetes (cached).

``scripts/test`` builds them before pytest starts (progress on the terminal) and exports
``HIDDENPLANE_TEST_ARTIFACTS`` (the upgrade's version it builds beside the tests); run alone,
the fixture builds them itself (from the cache in seconds once built). Every test that runs a
real component takes them from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from installer.core import versions
from installer.core.artifacts import read_sums, verify
from installer.lab.tenant import linked_dir

ROOT = Path(__file__).resolve().parent.parent
ENV = "HIDDENPLANE_TEST_ARTIFACTS"


# the version tests/test_real_upgrade.py upgrades the default one to (the next minor the module
# proxy serves); scripts/test builds it beside the default
UPGRADE_TO = "v1.37.2"
UPGRADE_ENV = "HIDDENPLANE_TEST_UPGRADE_ARTIFACTS"


def default_dir(version: str = versions.DEFAULT_KUBERNETES_VERSION) -> Path:
    cache = Path(os.environ.get("HIDDENPLANE_CACHE_DIR", "/var/cache/hiddenplane"))
    return cache / "build" / f"artifacts-{version}"


def build(dest: Path, version: str = "default", *options: str) -> None:
    """scripts/build-kubernetes ``version`` ``dest`` ``options`` (from the cache in seconds once built)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools/kubebuild/build.py"), version, str(dest), *options],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"scripts/build-kubernetes {version} {' '.join(options)} failed:\n"
                    f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def artifacts_dir() -> Path:
    """The built artifacts (building them when missing), each file verified."""
    dest = Path(os.environ.get(ENV) or default_dir())
    if not (dest / "kube-apiserver").is_file():
        build(dest)
    verify(dest, sorted(read_sums(dest)))
    return dest


# scripts/test builds UPGRADE_TO in the background while the tests run: this directory holds
# its log, and its exit status in upgrade.rc once it ends
BUILDING_ENV = "HIDDENPLANE_TEST_BUILDING"
WAIT_REPORT_S = 60
_config: pytest.Config | None = None      # to report a wait live, past pytest's capture


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def _say(message: str) -> None:
    capture = _config.pluginmanager.getplugin("capturemanager") if _config else None
    if capture is None:
        print(message, flush=True)
        return
    with capture.global_and_fixture_disabled():
        print(message, flush=True)


def wait_for_background_build(name: str, label: str) -> None:
    """Wait for scripts/test's background build ``name`` (nothing to wait for when the tests run
    alone); a failed one fails the test with its log's end."""
    building = os.environ.get(BUILDING_ENV)
    if not building or not Path(building, f"{name}.log").exists():
        return
    rc, log = Path(building, f"{name}.rc"), Path(building, f"{name}.log")
    start = last = time.monotonic()
    waited = False
    while not rc.exists():
        if not waited or time.monotonic() - last >= WAIT_REPORT_S:
            lines = log.read_text(errors="replace").splitlines()
            _say(f"\n==> waiting for the background build of {label} ({time.monotonic() - start:.0f} s; "
                 f"{lines[-1].strip() if lines else 'starting'})")
            waited, last = True, time.monotonic()
        time.sleep(2)
    if waited:
        _say(f"==> the background build of {label} ended after {time.monotonic() - start:.0f} s of waiting")
    if rc.read_text().strip() != "0":
        pytest.fail(f"scripts/build-kubernetes {label} (in the background) failed:\n"
                    f"{log.read_text(errors='replace')[-3000:]}")


def upgrade_artifacts_dir() -> Path:
    """The built artifacts of UPGRADE_TO (building them when missing), each file verified."""
    wait_for_background_build("upgrade", UPGRADE_TO)
    dest = Path(os.environ.get(UPGRADE_ENV) or default_dir(UPGRADE_TO))
    if not (dest / "kube-apiserver").is_file():
        build(dest, UPGRADE_TO)
    verify(dest, sorted(read_sums(dest)))
    return dest


E2E_ENV = "HIDDENPLANE_TEST_E2E"


def e2e_dir() -> Path:
    """e2e.test, ginkgo and image-e2e.tar of the default version (tools/kubebuild/e2e.py),
    built when missing; scripts/test builds them first and exports HIDDENPLANE_TEST_E2E."""
    dest = Path(os.environ.get(E2E_ENV) or default_dir().parent / f"e2e-{versions.DEFAULT_KUBERNETES_VERSION}")
    if not (dest / "e2e.test").is_file():
        build(dest, "default", "--only", "e2e")
    verify(dest, sorted(read_sums(dest)))
    return dest


# the etcd the etcd-roll test starts from: the default etcd is the next patch
ETCD_FROM = "v3.6.15"


def etcd_dir(version: str) -> Path:
    """etcd, etcdctl and etcdutl of ``version``, built (when missing) into a directory of their own."""
    dest = default_dir().parent / f"etcd-{version}"
    if not (dest / "etcd").is_file():
        build(dest, "default", "--etcd", version, "--only", "etcd")
    return dest


def hosted_etcd_image(version: str = ETCD_FROM) -> Path:
    """The image archive of a hosted control plane's etcd at ``version`` (image-etcd.tar,
    registry.k8s.io/etcd:<version>-0), built when missing: tests/test_real_hosted.py's tenant
    starts on it, and its upgrade rolls etcd to the default one member at a time."""
    dest = default_dir().parent / f"hosted-etcd-{version}"
    if not (dest / "image-etcd.tar").is_file():
        build(dest, "default", "--etcd", version, "--only", "hosted")
    verify(dest, ["image-etcd.tar"])
    return dest / "image-etcd.tar"


_linked_dir = linked_dir      # installer/lab/tenant.py: one way to make a linked artifacts dir


def with_etcd(src: Path, version: str) -> Path:
    """``src`` with the etcd binaries of ``version`` in place of its own (hard links, its own
    SHA256SUMS): a cluster that starts on another etcd patch."""
    other = etcd_dir(version)
    extra = read_sums(other)
    sums = {**{n: d for n, d in read_sums(src).items() if n not in extra}, **extra}
    dest = _linked_dir(src.with_name(f"{src.name}-etcd-{version}"),
                       {n: (other if n in extra else src) / n for n in sums}, sums)
    verify(dest, sorted(sums))
    return dest


def binaries_only(src: Path) -> Path:
    """``src`` without the image archives (hard links, its own SHA256SUMS): what the labs of
    the stand-in tests import, so their workers are not sent images nothing runs there."""
    sums = {n: d for n, d in read_sums(src).items() if not n.endswith(".tar")}
    return _linked_dir(src.with_name(src.name + "-binaries"), {n: src / n for n in sums}, sums)


@pytest.fixture(scope="session")
def built_artifacts() -> Path:
    """A verified artifacts directory: the five Kubernetes binaries and kubectl at the default
    version, etcd/etcdctl/etcdutl, containerd, runc, the CNI plugins, crictl, and the image
    archives (pause, CoreDNS, busybox)."""
    return artifacts_dir()


@pytest.fixture(scope="session")
def kubectl(built_artifacts) -> str:
    """The real kubectl of the default version (built with the components)."""
    return str(built_artifacts / "kubectl")
