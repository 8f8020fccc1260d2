"""A session-scoped local lab and testinfra hosts built from its inventory, by role.

The lab is real: systemd-nspawn machines with their own systemd and sshd, in network namespaces
on a private bridge. Tests reach them over SSH with the lab's key, verifying host keys against
the lab's known_hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import testinfra
import yaml

from installer.lab import lab as lab_mod
from installer.lab.model import LabPaths, LabSpec

from .builtfixtures import artifacts_dir, binaries_only

ROOT = Path(__file__).resolve().parent.parent
LAB_NAME = "ci"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # a run stopped with SIGTERM or SIGHUP (`timeout`, `kill`, a closed terminal) ends like
    # Ctrl-C: pytest tears its fixtures down, so the labs it started (nspawn hosts, qemu VMs,
    # network namespaces) are taken down instead of left running
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
LAB_SUBNET = "10.213.200.0/24"


@dataclass
class Lab:
    spec: LabSpec
    paths: LabPaths
    inventory: Path
    ssh_config: Path

    def host(self, name: str):
        return testinfra.get_host(f"ssh://{name}", ssh_config=str(self.ssh_config))

    def hosts(self, role: str | None = None):
        return {h.name: self.host(h.name) for h in self.spec.hosts if role in (None, h.role)}


def require_lab_tools() -> None:
    if os.geteuid() != 0:
        pytest.fail("the lab tests need root (CI runs as root)")
    missing = [t for t in ("systemd-nspawn", "debootstrap", "ssh") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing {missing}: apt-get install systemd-container debootstrap openssh-client")


def write_ssh_config(paths: LabPaths, spec: LabSpec, dest: Path) -> Path:
    """Host aliases by lab host name; strict host key checking against the lab's known_hosts."""
    dest.write_text(lab_mod.ssh_config(spec.name))
    dest.chmod(0o600)
    return dest


def start_lab(name: str, subnet: str, tmp: Path, controls=1, workers=2, vm_workers=0, *,
              images: bool = False, artifacts: Path | None = None, hosting: bool = False) -> Lab:
    """A lab with the built binaries (etcd 3.6, containerd 2.x, runc, CNI plugins, and the real
    Kubernetes binaries unless stand-ins replace them); ``images``: the built image archives its
    workers run too (``hosting``: every one, those of hosted control planes included);
    ``artifacts``: another built directory than the default one."""
    require_lab_tools()
    lab_mod.down(name, log=lambda *_: None)          # a previous run that died mid-way
    built = artifacts or artifacts_dir()
    inv = lab_mod.up(name, controls, workers, vm_workers, subnet, tmp / f"{name}.inventory.yaml",
                     log=lambda *_: None, artifacts=built if images else binaries_only(built), hosting=hosting)
    paths = LabPaths.of(name)
    spec = lab_mod.load_spec(paths)
    return Lab(spec, paths, inv, write_ssh_config(paths, spec, tmp / "ssh_config"))


def install_standins(artifacts: Path) -> None:
    """The contract stand-ins for the five Kubernetes binaries, put in the lab's artifacts."""
    subprocess.run([sys.executable, "-m", "tests.standins", "install", str(artifacts)], cwd=ROOT, check=True,
                   capture_output=True)


@contextlib.contextmanager
def standin_lab(name: str, subnet: str, tmp: Path, *, controls=1, workers=2, vm_workers=0):
    """A started lab with the contract stand-ins installed and ``lab.state`` set to ``tmp / "state"``
    (not created: the first apply makes it); torn down on leaving, however that happens."""
    the_lab = start_lab(name, subnet, tmp, controls, workers, vm_workers)
    try:
        install_standins(the_lab.paths.artifacts)
        if controls > 1:
            # the stand-ins serve no API for the workers' balancer to route to: these labs test
            # the single-endpoint path (a user's own VIP or load balancer), cp1 standing in for it
            doc = yaml.safe_load(the_lab.inventory.read_text())
            doc["spec"]["apiServer"]["endpoint"] = the_lab.spec.hosts[0].address
            the_lab.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        the_lab.state = tmp / "state"
        yield the_lab
    finally:
        lab_mod.down(name, log=lambda *_: None)


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A 1 control + 2 worker nspawn lab for the whole session; torn down at the end."""
    tmp = tmp_path_factory.mktemp("lab")
    the_lab = start_lab(LAB_NAME, LAB_SUBNET, tmp)
    yield the_lab
    lab_mod.down(LAB_NAME, log=lambda *_: None)


@pytest.fixture(scope="session")
def lab_inventory(lab) -> dict:
    return yaml.safe_load(lab.inventory.read_text())


def wait_for(what: str, fn, timeout: float = 300, interval: float = 2.0):
    """Poll ``fn`` until it returns something true; fail naming ``what`` and its last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"{what}: not after {timeout:g}s (last: {last!r})")
