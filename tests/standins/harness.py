"""Test-side helpers (never embedded into a stand-in): run the stand-ins and a real etcd from
the rendered units of a host tree, on loopback.

A rendered host tree (``rendered/<host>/<absolute path>``) is copied per test, so tests may
break files freely, and localized with one explicit substitution per kind:

    /etc/kubernetes/ /etc/etcd/ /var/lib/kubelet/ /var/lib/kube-proxy/  ->  <copy>/<same path>

applied to every ExecStart argument and to every string of every ``*.yaml`` document in the copy
(the component configs name host paths). Ports and bind addresses are remapped by the test, flag
by flag or field by field (``set_flag``, ``edit_yaml``), to 127.0.0.1 and free ports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import reference as ref

HOST_PREFIXES = ("/etc/kubernetes/", "/etc/etcd/", "/var/lib/kubelet/", "/var/lib/kube-proxy/")
_PREFIX_RE = re.compile(r"(^|[=,])(" + "|".join(re.escape(p) for p in HOST_PREFIXES) + ")")
UNIT_DIR = "etc/systemd/system"


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _walk_strings(doc, fn):
    if isinstance(doc, dict):
        return {k: _walk_strings(v, fn) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_walk_strings(v, fn) for v in doc]
    return fn(doc) if isinstance(doc, str) else doc


@dataclass
class HostTree:
    """A private, localized copy of one rendered host."""

    root: Path
    name: str

    @classmethod
    def copy(cls, rendered: Path, host: str, dest: Path) -> "HostTree":
        root = dest / host
        shutil.copytree(rendered / host, root, symlinks=True)
        tree = cls(root, host)
        for doc_path in sorted(root.rglob("*.yaml")):
            tree.edit_yaml(doc_path, lambda d: _walk_strings(d, tree.localize))
        return tree

    def localize(self, value: str) -> str:
        return _PREFIX_RE.sub(lambda m: f"{m[1]}{self.root}{m[2]}", value)

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def edit_yaml(self, path: Path | str, fn) -> None:
        """Replace a YAML document by ``fn(doc)`` (or by ``doc`` edited in place if fn returns None)."""
        path = self.path(path) if isinstance(path, str) else path
        doc = yaml.safe_load(path.read_text())
        new = fn(doc)
        path.write_text(yaml.safe_dump(doc if new is None else new, sort_keys=False))

    def unit_argv(self, unit: str, binary_dir: Path) -> list[str]:
        """The unit's ExecStart, its binary taken from ``binary_dir``, its paths localized."""
        argv = ref.exec_start(self.path(f"/{UNIT_DIR}/{unit}").read_bytes())
        return [str(binary_dir / Path(argv[0]).name)] + [self.localize(a) for a in argv[1:]]


def set_flag(argv: list[str], name: str, value: str | None) -> list[str]:
    """Replace ``--name=...`` (or append it); ``value=None`` removes the flag."""
    out = [a for a in argv if a != name and not a.startswith(f"{name}=")]
    if value is not None:
        out.append(f"{name}={value}")
    return out


# ---------------------------------------------------------------------------------------------
# processes


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path
    argv: list[str]
    marker: str = "ready:"

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.marker in self.stderr:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv[0]} exited with {self.proc.returncode} before it was ready:\n"
                                     f"{self.stderr[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{self.argv[0]} not ready after {timeout}s:\n{self.stderr[-4000:]}")

    def terminate(self) -> int:
        """SIGTERM, then SIGKILL after 5 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def start(argv: list[str], log: Path, env: dict | None = None, marker: str = "ready:") -> Proc:
    with open(log, "wb") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})}, start_new_session=True)
    return Proc(p, log, argv, marker)


def run(argv: list[str], env: dict | None = None, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run a stand-in expected to exit on its own (killed at ``timeout``)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


# ---------------------------------------------------------------------------------------------
# a real etcd from the rendered etcd.service


@dataclass
class Etcd:
    proc: Proc
    tree: HostTree
    client_url: str            # https://127.0.0.1:<port>
    metrics_url: str           # http://127.0.0.1:<port>

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_etcd(tree: HostTree, host_address: str, data_dir: Path, log: Path, etcd: str,
               timeout: float = 15.0) -> Etcd:
    """The rendered etcd ExecStart with, besides the path substitution: ``etcd`` (the built
    binary) for /usr/local/bin/etcd, the host address -> 127.0.0.1 (the member's certificates name
    127.0.0.1 too), ports 2379/2380/2381 -> free ones, --data-dir -> ``data_dir``, and the
    client URL list deduplicated (host address and 127.0.0.1 became the same URL)."""
    if not os.access(etcd, os.X_OK):
        raise AssertionError(f"{etcd} is missing: scripts/build-kubernetes builds it")
    rendered = ref.exec_start(tree.path(f"/{UNIT_DIR}/etcd.service").read_bytes())
    assert rendered[0] == "/usr/local/bin/etcd"
    ports = dict(zip((2379, 2380, 2381), free_ports(3)))

    def localize(arg: str) -> str:
        arg = tree.localize(arg).replace(host_address, "127.0.0.1")
        arg = re.sub(r"^--data-dir=.*$", f"--data-dir={data_dir}", arg)
        arg = re.sub(r":(2379|2380|2381)(?=$|[,/])", lambda m: f":{ports[int(m[1])]}", arg)
        if arg.startswith("--listen-client-urls="):
            name, urls = arg.split("=", 1)
            arg = f"{name}={','.join(dict.fromkeys(urls.split(',')))}"
        return arg

    argv = [etcd] + [localize(a) for a in rendered[1:]]
    data_dir.mkdir(mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    with open(log, "wb") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                             cwd=data_dir.parent, start_new_session=True)
    etcd = Etcd(Proc(p, log, argv), tree, f"https://127.0.0.1:{ports[2379]}", f"http://127.0.0.1:{ports[2381]}")
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            raise AssertionError(f"etcd exited with {p.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if b'"health":"true"' in urllib.request.urlopen(f"{etcd.metrics_url}/health", timeout=1).read():
                return etcd
        except OSError:
            pass
        if time.monotonic() > deadline:
            etcd.proc.terminate()
            raise AssertionError(f"etcd not healthy after {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
