"""A real etcd (3.6, built from its Go module: the ``built_artifacts`` fixture) started with the
flags of the rendered etcd.service, and a real etcdctl talking to it with the certificates the
installer hands out; a snapshot saved from it and restored with the etcdutl command lines the
installer renders.

The control host of the rendered cluster has the loopback address 127.0.0.2, so etcd listens
on the "host address" (127.0.0.2) and on 127.0.0.1 like on a real host, and the rendered
certificates' SANs are exercised on both. The rendered ExecStart is used as is except for one
substitution per kind, applied to every argument:

    /etc/kubernetes/...  ->  <rendered tree>/cp1/etc/kubernetes/...
    /var/lib/etcd        ->  <tmp data dir>
    :2379 :2380 :2381    ->  free ports (client, peer, metrics)

and /usr/local/bin/etcd is the built etcd. The apiserver's view of etcd (--etcd-servers,
--etcd-cafile, --etcd-certfile, --etcd-keyfile) comes from the rendered kube-apiserver.service
with the same substitution, and so do the etcdutl command lines of a restore.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import re
import socket
import ssl
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from installer import api
from installer.core.etcd_rules import RESTORE_REVISION_BUMP, EtcdOpError
from installer.core.inventory import Inventory
from installer.engine.planes.etcd_hosts import ETCDUTL, snapshot_info, snapshot_restore_argv, snapshot_status_argv
from installer.host import probes

from . import reference as ref
from .conftest import write_inventory

pytestmark = pytest.mark.etcd

HOST_ADDRESS = "127.0.0.2"
RENDERED_PORTS = (2379, 2380, 2381)          # client, peer, metrics
PKI = "/etc/kubernetes/pki"
START_TIMEOUT = 10.0


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("0.0.0.0", 0))           # free on every address, 127.0.0.2 included
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Rendered:
    """The rendered control host: its tree, etcd's ExecStart, the apiserver's flags."""
    inventory: Inventory
    host: Path
    exec_start: list[str]
    apiserver_flags: dict[str, str]
    bin: Path                        # the built etcd, etcdctl, etcdutl

    def localizer(self, data_dir: Path, ports: dict[int, int]) -> Callable[[str], str]:
        host = self.host

        def localize(arg: str) -> str:
            arg = arg.replace("/etc/kubernetes/", f"{host}/etc/kubernetes/").replace("/etc/etcd/", f"{host}/etc/etcd/")
            arg = re.sub(r"=/var/lib/etcd$", f"={data_dir}", arg)
            return re.sub(r":(2379|2380|2381)(?=$|[,/])", lambda m: f":{ports[int(m[1])]}", arg)
        return localize


@dataclass
class Etcd:
    proc: subprocess.Popen
    host: Path                       # the rendered tree of the control host
    argv: list[str]                  # what was started
    rendered: list[str]              # the rendered ExecStart
    ports: dict[int, int]            # rendered -> actual
    log: Path
    apiserver: dict[str, str]        # the apiserver's etcd flags, localized
    bin: Path

    def pki(self, rel: str) -> str:
        return str(self.host / PKI.lstrip("/") / rel)

    @property
    def client_port(self) -> int:
        return self.ports[2379]


@pytest.fixture(scope="module")
def cluster(example_doc, tmp_path_factory, built_artifacts) -> Rendered:
    tmp = tmp_path_factory.mktemp("etcd")
    doc = copy.deepcopy(example_doc)
    doc["spec"]["hosts"][0]["address"] = HOST_ADDRESS
    doc["spec"]["apiServer"]["endpoint"] = HOST_ADDRESS
    # one machine: every host on loopback (the inventory refuses one loopback host among others)
    for i, h in enumerate(doc["spec"]["hosts"][1:], start=3):
        h["address"] = f"127.0.0.{i}"
    assert doc["spec"]["hosts"][0]["role"] == "control"
    name = doc["spec"]["hosts"][0]["name"]
    p = api.render(api.resolve(write_inventory(tmp, doc), tmp / "state"), tmp / "out")
    assert [h.name for h in p.inventory.controls] == [name]
    host = tmp / "out" / name
    rendered = ref.exec_start((host / "etc/systemd/system/etcd.service").read_bytes())
    assert rendered[0] == "/usr/local/bin/etcd"
    api_flags = ref.unit_flags((host / "etc/systemd/system/kube-apiserver.service").read_bytes())
    return Rendered(p.inventory, host, rendered, api_flags, built_artifacts)


@contextlib.contextmanager
def running(cluster: Rendered, data_dir: Path, ports: dict[int, int], log: Path) -> Iterator[Etcd]:
    """The built etcd with the rendered flags on ``data_dir`` and ``ports``, until healthy;
    stopped on exit."""
    localize = cluster.localizer(data_dir, ports)
    argv = [str(cluster.bin / "etcd")] + [localize(a) for a in cluster.exec_start[1:]]
    apiserver = {k: localize(cluster.apiserver_flags[k])
                 for k in ("--etcd-servers", "--etcd-cafile", "--etcd-certfile", "--etcd-keyfile")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                start_new_session=True)
    server = Etcd(proc, cluster.host, argv, cluster.exec_start, ports, log, apiserver, cluster.bin)
    try:
        _wait_healthy(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def etcd(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etcd-run")
    data_dir = tmp / "data"
    data_dir.mkdir(mode=0o700)
    with running(cluster, data_dir, dict(zip(RENDERED_PORTS, _free_ports(3))), tmp / "etcd.log") as server:
        yield server


def _wait_healthy(server: Etcd) -> None:
    """Until the metrics listener (plain http on loopback, as rendered) reports health."""
    url = f"http://127.0.0.1:{server.ports[2381]}/health"
    deadline = time.monotonic() + START_TIMEOUT
    last = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"etcd exited with {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    return
        except OSError as e:
            last = e
        time.sleep(0.1)
    pytest.fail(f"etcd not healthy after {START_TIMEOUT}s ({last}):\n{server.log.read_text()[-3000:]}")


def etcdctl(server: Etcd, *args: str, endpoints: str | None = None, cert: str | None = None,
            key: str | None = None, cacert: str | None = None, timeout: str = "3s") -> subprocess.CompletedProcess:
    """etcdctl (API v3). A refused request only fails at the deadline: callers that expect a
    refusal pass a short ``timeout``."""
    cmd = [str(server.bin / "etcdctl"), f"--endpoints={endpoints or server.apiserver['--etcd-servers']}",
           f"--cacert={cacert or server.pki('etcd/ca.crt')}", "--dial-timeout=2s", f"--command-timeout={timeout}"]
    if cert:
        cmd += [f"--cert={cert}", f"--key={key}"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(server.host)}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=30, env=env)


def _apiserver_creds(server: Etcd) -> dict:
    a = server.apiserver
    return {"endpoints": a["--etcd-servers"], "cacert": a["--etcd-cafile"],
            "cert": a["--etcd-certfile"], "key": a["--etcd-keyfile"]}


# ---------------------------------------------------------------------------------------------


def test_etcd_runs_the_rendered_flags(etcd):
    """Every rendered flag, and nothing else, is on the running process's command line; values
    differ from the rendered ones only by the path and port substitution."""
    running = (Path(f"/proc/{etcd.proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0"))
    assert [a.decode() for a in running] == etcd.argv
    rendered, started = ref.parse_flags(etcd.rendered[1:]), ref.parse_flags(etcd.argv[1:])
    assert list(rendered) == list(started)
    changed = {k for k in rendered if rendered[k] != started[k]}
    assert changed <= {"--data-dir", "--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                       "--initial-advertise-peer-urls", "--initial-cluster", "--listen-metrics-urls",
                       "--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
                       "--peer-trusted-ca-file"}
    assert rendered["--client-cert-auth"] == started["--client-cert-auth"] == "true"
    assert rendered["--listen-client-urls"].split(",") == [f"https://{HOST_ADDRESS}:2379", "https://127.0.0.1:2379"]


def test_apiserver_credentials_reach_etcd(etcd):
    """With the apiserver's own --etcd-* flags: the member it uses, its own host's on loopback
    (render/control.LOCAL_ETCD), is healthy."""
    r = etcdctl(etcd, "endpoint", "health", **_apiserver_creds(etcd))
    assert r.returncode == 0, r.stderr
    assert "is healthy" in r.stdout + r.stderr
    assert f"127.0.0.1:{etcd.client_port}" in r.stdout + r.stderr


def test_put_get_round_trip_on_both_listeners(etcd):
    creds = _apiserver_creds(etcd)
    key, value = f"/hiddenplane-test/{uuid.uuid4()}", f"value-{uuid.uuid4()}"
    put = etcdctl(etcd, "put", key, value, **creds)
    assert put.returncode == 0 and put.stdout.strip() == "OK", put.stderr
    for address in (HOST_ADDRESS, "127.0.0.1"):       # the server cert's SANs cover both
        got = etcdctl(etcd, "get", key, "--print-value-only",
                      **{**creds, "endpoints": f"https://{address}:{etcd.client_port}"})
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip() == value


def test_healthcheck_client_cert_works(etcd):
    cert, key = etcd.pki("etcd/healthcheck-client.crt"), etcd.pki("etcd/healthcheck-client.key")
    loopback = f"https://127.0.0.1:{etcd.client_port}"
    r = etcdctl(etcd, "endpoint", "health", endpoints=loopback, cert=cert, key=key)
    assert r.returncode == 0 and "is healthy" in r.stdout + r.stderr, r.stderr
    r = etcdctl(etcd, "get", "--prefix", "/", "--keys-only", "--limit=1", endpoints=loopback, cert=cert, key=key)
    assert r.returncode == 0, r.stderr


def test_the_day2_probes_parse_what_the_real_etcdctl_prints(etcd):
    """host/probes.py's parsers on the real etcdctl's JSON: the member list, and endpoint health
    with one endpoint answering and one (a closed port) not, which etcdctl reports with exit 1."""
    creds = _apiserver_creds(etcd)
    listed = etcdctl(etcd, "member", "list", "-w", "json", **creds)
    [m] = probes.parse_member_list(probes.Answer("cp1", listed.stdout, listed.stderr, listed.returncode))
    assert m.name == "cp1" and not m.learner and m.client_urls, listed.stdout
    live, dead = f"https://127.0.0.1:{etcd.client_port}", f"https://127.0.0.1:{_free_ports(1)[0]}"
    r = etcdctl(etcd, "endpoint", "health", "-w", "json", **{**creds, "endpoints": f"{live},{dead}"})
    assert r.returncode != 0
    assert probes.parse_health(probes.Answer("cp1", r.stdout, r.stderr, r.returncode)) == {live: True, dead: False}
    failed = etcdctl(etcd, "member", "list", "-w", "json", **{**creds, "endpoints": dead}, timeout="1s")
    with pytest.raises(EtcdOpError, match="cp1: etcdctl member list failed"):
        probes.parse_member_list(probes.Answer("cp1", failed.stdout, failed.stderr, failed.returncode))


def _secret_value(etcd: Etcd) -> tuple[str, str]:
    key, value = f"/hiddenplane-test/{uuid.uuid4()}", f"secret-{uuid.uuid4()}"
    assert etcdctl(etcd, "put", key, value, **_apiserver_creds(etcd)).returncode == 0
    return key, value


def _refusals(etcd: Etcd, offset: int) -> str:
    """etcd's log lines about refused TLS connections since ``offset``."""
    return "\n".join(line for line in etcd.log.read_text()[offset:].splitlines() if "rejected connection" in line)


def test_request_without_client_certificate_is_refused(etcd):
    key, value = _secret_value(etcd)
    offset = len(etcd.log.read_text())
    r = etcdctl(etcd, "get", key, "--print-value-only", timeout="1s")
    assert r.returncode != 0
    assert value not in r.stdout
    # refused by etcd's client-cert-auth, not by a connection problem
    assert "didn't provide a certificate" in _refusals(etcd, offset)


def _kubeconfig_pair(etcd: Etcd, conf: str, tmp_path: Path) -> tuple[str, str]:
    doc = yaml.safe_load((etcd.host / "etc/kubernetes" / conf).read_text())
    user = doc["users"][0]["user"]
    cert, key = tmp_path / f"{conf}.crt", tmp_path / f"{conf}.key"
    cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
    key.write_bytes(base64.b64decode(user["client-key-data"]))
    key.chmod(0o600)
    return str(cert), str(key)


@pytest.mark.parametrize("identity", ["admin.conf", "apiserver-kubelet-client", "front-proxy-client"])
def test_certificates_of_other_cas_are_refused(etcd, identity, tmp_path):
    """A valid client certificate from the cluster CA (admin, the apiserver's kubelet client) or
    the front-proxy CA is no key to etcd: only the etcd CA is trusted."""
    if identity.endswith(".conf"):
        cert, key = _kubeconfig_pair(etcd, identity, tmp_path)
    else:
        cert, key = etcd.pki(f"{identity}.crt"), etcd.pki(f"{identity}.key")
    key_name, value = _secret_value(etcd)
    offset = len(etcd.log.read_text())
    r = etcdctl(etcd, "get", key_name, "--print-value-only", cert=cert, key=key, timeout="1s")
    assert r.returncode != 0, f"etcd accepted {identity}"
    assert value not in r.stdout
    assert "certificate signed by unknown authority" in _refusals(etcd, offset)


def _tls_context(etcd: Etcd, cert: str | None, key: str | None, ciphers: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(etcd.pki("etcd/ca.crt"))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2      # cipher choice and client-cert failures show in the handshake
    if ciphers:
        ctx.set_ciphers(ciphers)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def _handshake(ctx: ssl.SSLContext, port: int, address: str = "127.0.0.1") -> str:
    with socket.create_connection((address, port), timeout=3) as sock:
        with ctx.wrap_socket(sock, server_hostname=address) as tls:
            return tls.cipher()[0]


def test_only_cis_cipher_suites_are_offered(etcd):
    cert, key = etcd.pki("apiserver-etcd-client.crt"), etcd.pki("apiserver-etcd-client.key")
    assert _handshake(_tls_context(etcd, cert, key, "ECDHE-ECDSA-AES128-GCM-SHA256"), etcd.client_port) \
        == "ECDHE-ECDSA-AES128-GCM-SHA256"
    for weak in ("ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384"):   # CBC: not among the six
        with pytest.raises(ssl.SSLError):
            _handshake(_tls_context(etcd, cert, key, weak), etcd.client_port)


def test_peer_port_requires_an_etcd_peer_certificate(etcd):
    peer = etcd.ports[2380]
    assert _handshake(_tls_context(etcd, str(etcd.host / "etc/etcd/pki/peer.crt"),
                                   str(etcd.host / "etc/etcd/pki/peer.key")),
                      peer, HOST_ADDRESS)
    with pytest.raises(ssl.SSLError):
        _handshake(_tls_context(etcd, None, None), peer, HOST_ADDRESS)
    with pytest.raises(ssl.SSLError):
        _handshake(_tls_context(etcd, etcd.pki("apiserver-kubelet-client.crt"),
                                etcd.pki("apiserver-kubelet-client.key")), peer, HOST_ADDRESS)
    # the peer listener is on the host address only, as rendered
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", peer), timeout=1).close()



# --- snapshot save, status, restore --------------------------------------------------------

def _localized_etcdutl(cluster: Rendered, argv: list[str], localize: Callable[[str], str]) -> list[str]:
    assert argv[0] == ETCDUTL == "/usr/local/bin/etcdutl"
    return [str(cluster.bin / "etcdutl")] + [localize(a) for a in argv[1:]]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def test_snapshot_restored_with_the_rendered_etcdutl_commands(cluster, etcd, tmp_path):
    """Keys put before `etcdctl snapshot save` are in the member etcdutl restores (with the
    installer's own command lines), keys put after it are not; the restored member runs with
    the unchanged rendered flags (the unit's --initial-cluster* are ignored for a data dir that
    has its membership)."""
    creds = _apiserver_creds(etcd)
    prefix = f"/hiddenplane-test/snapshot-{uuid.uuid4()}"
    before = {f"{prefix}/before-{i}": f"v{i}-{uuid.uuid4()}" for i in range(3)}
    after = {f"{prefix}/after-{i}": f"w{i}-{uuid.uuid4()}" for i in range(2)}
    for k, v in before.items():
        assert etcdctl(etcd, "put", k, v, **creds).returncode == 0
    got = etcdctl(etcd, "get", prefix, "--prefix", "-w", "json", **creds)
    assert got.returncode == 0, got.stderr
    revision = json.loads(got.stdout)["header"]["revision"]

    # as snapshot_save does: etcdctl with the health-check client on the loopback listener
    snap = tmp_path / "etcd.db"
    saved = etcdctl(etcd, "snapshot", "save", str(snap), endpoints=f"https://127.0.0.1:{etcd.client_port}",
                    cert=etcd.pki("etcd/healthcheck-client.crt"), key=etcd.pki("etcd/healthcheck-client.key"),
                    timeout="30s")
    assert saved.returncode == 0, saved.stderr
    for k, v in after.items():
        assert etcdctl(etcd, "put", k, v, **creds).returncode == 0
    # the revision a client of the API last saw before the restore (a watch resumes after it)
    seen = json.loads(etcdctl(etcd, "get", prefix, "--prefix", "-w", "json", **creds).stdout)["header"]["revision"]

    status = _run(_localized_etcdutl(cluster, snapshot_status_argv(str(snap)), lambda a: a))
    assert status.returncode == 0, status.stderr
    info = snapshot_info(json.loads(status.stdout), str(snap), "cp1", snap.stat().st_size)
    assert info.revision == revision
    assert info.hash != 0 and info.total_keys >= len(before) and info.size > 0

    ports = dict(zip(RENDERED_PORTS, _free_ports(3)))
    data_dir = tmp_path / "restored"
    localize = cluster.localizer(data_dir, ports)
    host = cluster.inventory.controls[0]
    argv = snapshot_restore_argv(cluster.inventory, host, str(snap), "20260101000000")
    assert f"--initial-cluster-token={cluster.inventory.metadata.name}-etcd-restore-20260101000000" in argv
    restored = _run(_localized_etcdutl(cluster, argv, localize))
    assert restored.returncode == 0, restored.stderr
    assert (data_dir / "member").is_dir()

    with running(cluster, data_dir, ports, tmp_path / "restored.log") as member:
        creds = _apiserver_creds(member)
        for k, v in before.items():
            got = etcdctl(member, "get", k, "--print-value-only", **creds)
            assert got.returncode == 0 and got.stdout.strip() == v, (k, got.stderr)
        for k in after:
            got = etcdctl(member, "get", k, "--print-value-only", **creds)
            assert got.returncode == 0 and got.stdout.strip() == "", k
        members = json.loads(etcdctl(member, "member", "list", "-w", "json", **creds).stdout)["members"]
        assert [(m["name"], m["peerURLs"]) for m in members] == \
            [(host.name, [f"https://{HOST_ADDRESS}:{ports[2380]}"])]
        assert etcdctl(member, "put", f"{prefix}/written-after-restore", "x", **creds).stdout.strip() == "OK"
        # every revision a client held before is below the restored cluster's and compacted: a
        # watch resumed from one is refused (the API's clients list again) instead of waiting,
        # blind, until the revision passes it again
        now = json.loads(etcdctl(member, "get", prefix, "--prefix", "-w", "json", **creds).stdout)["header"]
        assert now["revision"] > RESTORE_REVISION_BUMP > seen, (now, seen)
        watch = etcdctl(member, "watch", prefix, "--prefix", f"--rev={seen + 1}", **creds, timeout="5s")
        assert "compacted" in watch.stdout + watch.stderr, (watch.returncode, watch.stdout, watch.stderr)
