"""The workers' API balancer (spec.apiServer.balancer): when it is on, what every worker and
control host gets, the kubernetes Service's endpoints, the artifacts it needs, and the
installer's own failover across control hosts. The balancer itself is proven on the real lab
(tests/test_real_day2.py: a control host lost); here its configuration is checked by the real
haproxy binary."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from installer import api
from installer.core import components
from installer.core.artifacts import ArtifactError, write_sums
from installer.core.diff import HostChanges
from installer.core.inventory import InventoryError, parse
from installer.core.render.balancer import BALANCER_CONFIG, FALLBACK, HOSTED_READYZ, haproxy_config, server_lines
from installer.core.render.control import AUTHN_CONFIG
from installer.core.render.manifests import bootstrap_objects, kubernetes_endpoints
from installer.core.render.worker import BOOTSTRAP_KUBECONFIG, KUBELET_KUBECONFIG, HostFacts, render_worker
from installer.host import apireach, fetch, hostops
from installer.host.kube_objects import validate_objects

from .conftest import write_inventory

UNIT = components.unit("api-balancer")
CONTROLS = [{"name": f"cp{i}", "address": f"192.168.56.24{i}", "role": "control"} for i in (1, 2, 3)]


def _ha(doc: dict, **api_server) -> dict:
    d = copy.deepcopy(doc)
    d["spec"]["hosts"] = copy.deepcopy(CONTROLS) + [h for h in d["spec"]["hosts"] if h["role"] == "worker"]
    d["spec"]["apiServer"].pop("endpoint", None)
    d["spec"]["apiServer"].update(api_server)
    return d


@pytest.fixture(scope="module")
def ha(tmp_path_factory, example_doc):
    tmp = tmp_path_factory.mktemp("ha")
    return api.prepare(write_inventory(tmp, _ha(example_doc)), tmp / "state")


@pytest.mark.parametrize("controls, endpoint, mode, on", [
    (1, None, "auto", False), (3, None, "auto", True), (3, "10.1.2.3", "auto", False),
    (1, None, "local", True), (3, None, "none", False), (3, "10.1.2.3", "local", True)])
def test_auto_means_more_than_one_control_host_and_no_endpoint(doc, controls, endpoint, mode, on):
    d = _ha(doc, balancer=mode)
    d["spec"]["hosts"] = d["spec"]["hosts"][:controls] + d["spec"]["hosts"][3:]
    if endpoint:
        d["spec"]["apiServer"]["endpoint"] = endpoint
    inv = parse(d)
    assert inv.local_balancer is on
    assert inv.worker_api_url == ("https://127.0.0.1:6443" if on else inv.api_url)


def test_a_worker_reaches_the_api_through_its_own_balancer(ha):
    inv, plan = ha.inventory, ha.plans["node2"]
    # started before the units that use it (and after the routes unit and its repair timer)
    assert plan.units == ["hiddenplane-routes.service", "hiddenplane-routes-repair.timer", UNIT, "containerd.service",
                          "kubelet.service", "kube-proxy.service"]
    for path in (BOOTSTRAP_KUBECONFIG, "/etc/kubernetes/kube-proxy.conf"):
        assert yaml.safe_load(plan.files[path].content)["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    cfg = plan.files[BALANCER_CONFIG].content.decode()
    assert cfg == haproxy_config(inv) and plan.files[BALANCER_CONFIG].restarts == (UNIT,)
    servers = [line.split()[1:] for line in cfg.splitlines() if line.strip().startswith("server ")]
    # each checked, then each again as an unchecked backup: tried when every check fails
    assert servers == ([[c["name"], f"{c['address']}:6443"] for c in CONTROLS]
                       + [[f"{c['name']}{FALLBACK}", f"{c['address']}:6443", "backup", "no-check"] for c in CONTROLS])
    assert "option allbackups" in cfg
    assert "bind 127.0.0.1:6443" in cfg and "bind 172.20.0.1:6443" in cfg
    # a control host's apiserver checked with its etcd member (it uses that one alone)
    assert "uri /readyz ver" in cfg and "verify required ca-file /etc/kubernetes/pki/ca.crt" in cfg
    assert "inter 1s fall 2 rise 1 on-marked-down shutdown-sessions" in cfg
    # a new cluster CA (ca rotate) reloads the balancer, whose checks verify with it
    assert plan.files["/etc/kubernetes/pki/ca.crt"].restarts == ("kubelet.service", UNIT)
    unit = plan.files[f"/etc/systemd/system/{UNIT}"].content.decode()
    assert "ExecStartPre=/sbin/ip address replace 172.20.0.1/32 dev lo" in unit
    assert "Before=containerd.service kubelet.service kube-proxy.service" in unit
    assert f"-Ws -f {BALANCER_CONFIG}" in unit and "ExecReload=/bin/kill -USR2 $MAINPID" in unit
    # a joined kubelet's kubeconfig is ours: it names the balancer, and the kubelet's own pair
    joined = render_worker(inv, inv.host("node2"), ha.material, HostFacts(kubelet_joined=True))
    kc = yaml.safe_load(joined.files[KUBELET_KUBECONFIG].content)
    assert kc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert kc["users"][0]["user"] == {"client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem",
                                      "client-key": "/var/lib/kubelet/pki/kubelet-client-current.pem"}
    assert BOOTSTRAP_KUBECONFIG in joined.absent


def test_without_the_balancer_workers_are_as_before(prepared):
    plan = prepared.plans["node2"]
    assert UNIT not in plan.units and BALANCER_CONFIG not in plan.files
    cp = prepared.plans["cp1"].files["/etc/systemd/system/kube-apiserver.service"].content.decode()
    assert "--anonymous-auth=false" in cp and "--endpoint-reconciler-type" not in cp
    assert kubernetes_endpoints(prepared.inventory) == []


def test_apiservers_leave_endpoints_to_the_installer_and_open_only_health_to_anonymous(ha):
    for c in CONTROLS:
        plan = ha.plans[c["name"]]
        unit = plan.files["/etc/systemd/system/kube-apiserver.service"].content.decode()
        assert "--endpoint-reconciler-type=none" in unit and f"--authentication-config={AUTHN_CONFIG}" in unit
        assert "--shutdown-delay-duration=5s" in unit
        # the flag and the config's anonymous section may not both be set (the apiserver refuses)
        assert "--anonymous-auth" not in unit
        authn = yaml.safe_load(plan.files[AUTHN_CONFIG].content)
        assert authn["anonymous"] == {"enabled": True, "conditions": [{"path": "/livez"}, {"path": "/readyz"},
                                                                      {"path": "/healthz"}]}


def test_the_kubernetes_service_endpoints_name_the_balancer_address(ha, doc):
    objs = kubernetes_endpoints(ha.inventory)
    assert [o["kind"] for o in objs] == ["Endpoints", "EndpointSlice"]
    assert objs[0]["subsets"] == [{"addresses": [{"ip": "172.20.0.1"}],
                                   "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}]
    assert objs[1]["endpoints"] == [{"addresses": ["172.20.0.1"], "conditions": {"ready": True}}]
    assert objs[1]["addressType"] == "IPv4"
    assert objs[0]["metadata"]["labels"] == {"endpointslice.kubernetes.io/skip-mirror": "true"}
    assert all(o in bootstrap_objects(ha.inventory, ha.material) for o in objs)
    validate_objects(objs, ha.inventory.spec.kubernetes.version)        # kubernetes-validate, strict
    # an IPv6 cluster gets the IPv6 default
    d = _ha(doc)
    d["spec"]["network"] = {"podCIDR": "fd10:244::/56", "serviceCIDR": "fd10:96::/108", "clusterDNS": "fd10:96::a"}
    for i, h in enumerate(d["spec"]["hosts"]):
        h["address"] = f"fd00::{i + 1}"
    v6 = parse(d)
    assert v6.balancer_address == "fd72:20::1" and kubernetes_endpoints(v6)[1]["addressType"] == "IPv6"


@pytest.mark.parametrize("address, message", [
    ("127.0.0.2", "is a loopback, link-local, multicast or unspecified address"),
    ("169.254.20.10", "is a loopback, link-local, multicast or unspecified address"),
    ("10.244.3.1", "lies inside spec.network.podCIDR 10.244.0.0/16"),
    ("10.96.0.7", "lies inside spec.network.serviceCIDR 10.96.0.0/12"),
    ("192.168.56.242", "is the address of spec.hosts[1]"),
    ("fd00::1", "is IPv6 but spec.network.serviceCIDR 10.96.0.0/12 is IPv4"),
])
def test_a_bad_balancer_address_is_named(doc, address, message):
    with pytest.raises(InventoryError) as e:
        parse(_ha(doc, balancerAddress=address))
    assert f"spec.apiServer.balancerAddress: '{address}' {message}" in str(e.value)


def test_a_change_reloads_the_balancer_and_restarts_the_rest():
    text = hostops.script(HostChanges("w1", restart=[UNIT, "kubelet.service"]))
    assert f"systemctl reload-or-restart {UNIT} ||" in text
    assert "systemctl restart kubelet.service ||" in text and f"systemctl restart {UNIT}" not in text


def test_haproxy_and_socat_come_from_the_artifacts_or_are_asked_for(ha, tmp_path):
    import hashlib
    inv = ha.inventory
    for b in ("haproxy", "socat"):
        assert b in fetch.cluster_binaries(inv) and b in fetch.role_binaries("worker", inv)
        assert b not in fetch.role_binaries("control", inv)
    # source: download: neither has a release binary; the cache directory may hold them
    d = yaml.safe_load(Path(inv.base_dir / "inventory.yaml").read_text())
    d["spec"]["artifacts"] = {"source": "download", "cacheDir": str(tmp_path / "cache")}
    dl = api.validate(write_inventory(tmp_path, d))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "haproxy").write_bytes(b"\x7fELF")
    write_sums(tmp_path / "cache", {"haproxy": hashlib.sha256(b"\x7fELF").hexdigest()})
    with pytest.raises(ArtifactError) as e:
        fetch._balancer_from_cache(dl, None)
    # the one missing is named, and the command that builds both
    assert str(e.value).startswith("socat: the workers' API balancer")
    assert "--only haproxy --only socat` (they land in that directory's SHA256SUMS)" in str(e.value)
    (tmp_path / "cache" / "socat").write_bytes(b"\x7fELF socat")
    write_sums(tmp_path / "cache", {"haproxy": hashlib.sha256(b"\x7fELF").hexdigest(),
                                    "socat": hashlib.sha256(b"\x7fELF socat").hexdigest()})
    got = fetch._balancer_from_cache(dl, None)
    assert {b: a.path for b, a in got.items()} == {b: tmp_path / "cache" / b for b in ("haproxy", "socat")}


def test_the_real_haproxy_accepts_the_rendered_config(ha, tmp_path):
    """haproxy -c (the unit's ExecStartPre does the same) on the rendered config, its paths moved
    under tmp_path, with no warning either (-dW); with the binary scripts/build-kubernetes made
    (CI has it)."""
    artifacts = os.environ.get("HIDDENPLANE_TEST_ARTIFACTS")
    binary = Path(artifacts or "/nonexistent") / "haproxy"
    if not binary.is_file():
        pytest.skip("no haproxy in $HIDDENPLANE_TEST_ARTIFACTS (scripts/build-kubernetes builds it)")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(ha.plans["node2"].files["/etc/kubernetes/pki/ca.crt"].content)
    cfg = (haproxy_config(ha.inventory).replace("/etc/kubernetes/pki/ca.crt", str(ca))
           .replace("/run/hiddenplane-api-balancer/", f"{tmp_path}/").replace("bind 127.0.0.1:6443\n", "")
           .replace("172.20.0.1:6443", f"127.0.0.1:{_free_port()}"))
    (tmp_path / "haproxy.cfg").write_text(cfg)
    r = subprocess.run([str(binary), "-c", "-dW", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "static" in subprocess.run(["file", str(binary)], capture_output=True, text=True).stdout


def test_the_installer_fails_over_to_the_first_apiserver_that_answers():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    try:
        # 127.0.0.2 refuses (nothing listens there): the next one in order answers
        assert apireach.first_reachable(["127.0.0.2", "127.0.0.1"], port, 1.0) == "127.0.0.1"
        assert apireach.first_reachable(["127.0.0.1", "127.0.0.3"], port, 1.0) == "127.0.0.1"
        assert apireach.first_reachable(["127.0.0.2", "127.0.0.3"], port, 1.0) is None
        assert apireach.first_reachable([], port, 1.0) is None
    finally:
        listening.close()


# --- the real haproxy's health checks against an imposter ------------------------------------

def _pair(name: str, issuer=None, sans: tuple[str, ...] = ()):
    """An EC key and its certificate: a CA when ``issuer`` is None, else a server certificate
    signed by ``issuer`` (cert, key) with DNS ``sans`` and IP 127.0.0.1."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    b = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(hours=1)))
    if issuer is None:
        b = b.issuer_name(subject).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        return b.sign(key, hashes.SHA256()), key
    import ipaddress
    b = b.issuer_name(issuer[0].subject).add_extension(x509.SubjectAlternativeName(
        [*(x509.DNSName(s) for s in sans), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer[1], hashes.SHA256()), key


class _Apiserver:
    """An HTTPS server on 127.0.0.1 like an apiserver for the balancer, presenting ``pair``:
    /readyz 200 while ``ready``, else 500 (as SIGTERM makes it, while it still serves); /slow
    answers after 3 s (a request in flight); any other GET 200 with its name.

    ``close()`` stops it when its test ends. Its threads never write to stderr: a check
    connection HAProxy drops without TLS close_notify (every one, when it is stopped) raises in a
    handler thread, and socketserver's default prints that traceback to whatever sys.stderr is
    then, which was once the next test's CliRunner capture (test_certs' JSON had one appended).
    The errors are kept in ``errors`` instead."""

    def __init__(self, tmp: Path, name: str, pair):
        import http.server
        import ssl
        import threading

        from cryptography.hazmat.primitives import serialization
        crt, key = tmp / f"{name}.crt", tmp / f"{name}.key"
        crt.write_bytes(pair[0].public_bytes(serialization.Encoding.PEM))
        key.write_bytes(pair[1].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        self.ready = True
        self.paths: list[str] = []                  # every path asked, in order
        self.errors: list[BaseException] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 30                            # a silent peer holds its thread this long at most

            def do_GET(self):                       # noqa: N802 - the stdlib's name
                outer.paths.append(self.path)
                if self.path == "/slow":
                    time.sleep(3)
                code = 500 if self.path == "/readyz" and not outer.ready else 200
                body = name.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                import sys
                outer.errors.append(sys.exc_info()[1])

        self.server = Server(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _admin(tmp: Path, command: str) -> str:
    """``command``'s answer on the admin socket of a balancer configured under ``tmp``."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(tmp / "admin.sock"))
        s.sendall(command.encode() + b"\n")
        return s.makefile().read()


def _states(tmp: Path) -> dict[str, str]:
    """server -> operational state (0 DOWN, 2 UP: HAProxy's management guide) of the balancer
    configured under ``tmp``."""
    return {f[3]: f[5] for f in (line.split() for line in _admin(tmp, "show servers state apiservers").splitlines())
            if len(f) > 5 and f[1] == "apiservers"}


def _get(tmp: Path, front: int, path: str) -> str:
    """GET ``path`` through the balancer on 127.0.0.1:``front`` on a new connection, the server
    verified against ``tmp``/ca.crt: the answering server's name, or what went wrong."""
    import ssl
    client = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
    client.check_hostname = False
    try:
        with socket.create_connection(("127.0.0.1", front), timeout=10) as raw, client.wrap_socket(raw) as t:
            t.sendall(f"GET {path} HTTP/1.1\r\nHost: kubernetes\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := t.recv(4096):
                data += chunk
        return data.split(b"\r\n\r\n", 1)[1].decode() if data.split(b" ", 2)[1:2] == [b"200"] else f"bad: {data!r}"
    except (OSError, ssl.SSLError) as e:
        return f"failed: {e!r}"


def _haproxy() -> Path:
    """The haproxy binary scripts/build-kubernetes made (CI has it), or the test is skipped."""
    binary = Path(os.environ.get("HIDDENPLANE_TEST_ARTIFACTS") or "/nonexistent") / "haproxy"
    if not binary.is_file():
        pytest.skip("no haproxy in $HIDDENPLANE_TEST_ARTIFACTS (scripts/build-kubernetes builds it)")
    return binary


def _configure(inv, tmp: Path, ca, servers: list[tuple[str, int]], balance: str = "balance leastconn",
               fallback: bool = True) -> int:
    """The rendered balancer config in ``tmp``/haproxy.cfg for ``servers`` (name, port on
    127.0.0.1), ``ca`` in ``tmp``/ca.crt, its admin socket in ``tmp``; without the unchecked
    ``fallback`` entries if asked. Returns the port it listens on."""
    from cryptography.hazmat.primitives import serialization
    (tmp / "ca.crt").write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    front = _free_port()
    lines = [line for line in haproxy_config(inv).splitlines() if not line.startswith("    server ")]
    lines += [line for line in server_lines([(n, "127.0.0.1", port) for n, port in servers])
              if fallback or " backup " not in line]
    cfg = ("\n".join(lines) + "\n").replace("/etc/kubernetes/pki/ca.crt", str(tmp / "ca.crt")).replace(
        "/run/hiddenplane-api-balancer/", f"{tmp}/").replace("bind 127.0.0.1:6443\n", "").replace(
        "172.20.0.1:6443", f"127.0.0.1:{front}").replace("balance leastconn", balance)
    assert balance in cfg
    (tmp / "haproxy.cfg").write_text(cfg)
    return front


def test_the_real_haproxy_never_marks_up_a_server_that_is_not_an_apiserver_of_the_cluster(ha, tmp_path):
    """Three servers answer /readyz 200 at the addresses the balancer checks: the apiserver (the
    cluster CA, the name 'kubernetes'), an imposter (the name 'kubernetes' under another CA),
    and root on a worker with what it holds (a certificate of the cluster CA, its kubelet serving
    one: its own name, not 'kubernetes'). From its first check on, only the first is up.

    Before its first check (at most one interval, 1 s, after a start or a reload) HAProxy 3.0
    counts every server up (3.1's ``init-state`` is what would change that): the imposter may be
    handed connections then, whose TLS the kubelet and kube-proxy verify end to end and refuse.
    docs/ha.md lists it among the limits."""
    artifacts = os.environ.get("HIDDENPLANE_TEST_ARTIFACTS")
    binary = Path(artifacts or "/nonexistent") / "haproxy"
    if not binary.is_file():
        pytest.skip("no haproxy in $HIDDENPLANE_TEST_ARTIFACTS (scripts/build-kubernetes builds it)")
    from cryptography.hazmat.primitives import serialization
    cluster, other = _pair("kubernetes-ca"), _pair("attacker-ca")
    servers = {"apiserver": _Apiserver(tmp_path, "apiserver", _pair("kube-apiserver", cluster, ("kubernetes",))),
               "imposter": _Apiserver(tmp_path, "imposter", _pair("kube-apiserver", other, ("kubernetes",))),
               "worker": _Apiserver(tmp_path, "worker", _pair("w1", cluster, ("w1",)))}
    ports = {name: server.port for name, server in servers.items()}
    ca = tmp_path / "ca.crt"
    ca.write_bytes(cluster[0].public_bytes(serialization.Encoding.PEM))
    lines = [line for line in haproxy_config(ha.inventory).splitlines() if not line.startswith("    server ")]
    lines += server_lines([(name, "127.0.0.1", port) for name, port in ports.items()])
    cfg = ("\n".join(lines) + "\n").replace("/etc/kubernetes/pki/ca.crt", str(ca)).replace(
        "/run/hiddenplane-api-balancer/", f"{tmp_path}/").replace("bind 127.0.0.1:6443\n", "").replace(
        "172.20.0.1:6443", f"127.0.0.1:{_free_port()}")
    (tmp_path / "haproxy.cfg").write_text(cfg)
    proc = subprocess.Popen([str(binary), "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[dict[str, str]] = []
        time.sleep(3)                           # the first checks of each server made (fall 2)
        for _ in range(5):                      # then five check intervals
            time.sleep(1)
            assert proc.poll() is None, proc.communicate()[0]
            seen.append({name: st for name, st in _states(tmp_path).items() if not name.endswith(FALLBACK)})
    finally:
        proc.terminate()
        log = proc.communicate(timeout=10)[0]
        for server in servers.values():
            server.close()
    # operational state 2 = UP, 0 = DOWN (HAProxy's management guide)
    assert seen[-1] == {"apiserver": "2", "imposter": "0", "worker": "0"}, (seen, log[-2000:])
    assert all(view["imposter"] == "0" and view["worker"] == "0" for view in seen), seen


@pytest.mark.parametrize("cluster, dry_run, state, aside", [
    ("ha", False, "active", True),           # another apiserver serves meanwhile
    ("ha", True, "active", False),           # a dry run changes nothing
    ("ha", False, "inactive", False),        # nothing to take out: it is not running
    ("prepared", False, "active", False),    # one control host: nobody to hand over to
])
def test_an_apiserver_steps_aside_while_its_etcd_member_restarts_only_when_another_serves(
        request, cluster, dry_run, state, aside):
    from types import SimpleNamespace

    from installer.core.facts import HostFacts
    from installer.host import handover
    inv = request.getfixturevalue(cluster).inventory
    host = inv.controls[0].name
    facts = HostFacts(units={handover.APISERVER: (state, "enabled")})
    ctx = SimpleNamespace(inv=inv, options=SimpleNamespace(dry_run=dry_run), facts={host: facts})
    assert handover.needed(ctx, host) is aside


# --- a planned stop: the apiserver leaves the balancers before it stops ----------------------

def _ctl_commands(action: str) -> list[str]:
    """The runtime API commands the shipped ctl script sends for ``action`` (server cp)."""
    import re

    from installer.core.render.balancer import ctl_script
    text = ctl_script().decode()
    body = text[text.index(f"  {action})"):]
    body = body[:body.index(";;")]
    return [c.replace("$backend", "apiservers").replace("$server", "cp")
            for c in re.findall(r'^\s*api "([^"]+)"$', body, re.M)]


def test_the_ctl_script_names_the_balancer_and_sends_the_commands(tmp_path):
    from installer.core.render.balancer import ADMIN_SOCKET, CTL, LEAVE_EXPIRY_SECONDS, SOCAT, ctl_script
    text = ctl_script().decode()
    assert f"socket={ADMIN_SOCKET}\n" in text and f"{SOCAT} -t 5" in text and f"#   {CTL} leave" in text
    assert f"seconds=${{3:-{LEAVE_EXPIRY_SECONDS}}}" in text
    assert _ctl_commands("leave") == ["set server apiservers/cp state drain", "disable health apiservers/cp"]
    assert _ctl_commands("back") == ["enable health apiservers/cp", "set server apiservers/cp state ready"]
    # shellcheck reads it in tests/test_lint.py


def test_the_real_haproxy_asks_a_hosted_tenants_replicas_readyz_without_etcd(tmp_path):
    """A hosted tenant's balancer, rendered and run: its checks reach the replica as
    ``HOSTED_READYZ``, the query whole (what the apiserver reads, not what our config reads),
    and the replica is up on them."""
    from .test_hosted import TENANT, parse
    binary = _haproxy()
    ca = _pair("kubernetes-ca")
    replica = _Apiserver(tmp_path, "replica", _pair("kube-apiserver", ca, ("kubernetes",)))
    _configure(parse(copy.deepcopy(TENANT), tmp_path), tmp_path, ca, [("api-0", replica.port)])
    proc = subprocess.Popen([str(binary), "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.5)
        states = _states(tmp_path)
    finally:
        proc.terminate()
        log = proc.communicate(timeout=10)[0]
        replica.close()
    assert replica.paths and set(replica.paths) == {HOSTED_READYZ}, (replica.paths, log[-2000:])
    assert HOSTED_READYZ == "/readyz?exclude=etcd&exclude=etcd-readiness"
    assert states["api-0"] == "2", states


@pytest.mark.parametrize("fallback", [True, False])
def test_the_real_haproxy_still_tries_the_apiservers_when_every_check_fails(ha, tmp_path, fallback):
    """Two apiservers behind the real haproxy with the rendered backend: one lost (nothing
    answers at its address), the other failing /readyz (500) while it serves. Both are down by
    their checks, and every request is still answered by the one that serves: each apiserver is
    also an unchecked backup. Without those entries (``fallback`` False: the config before) the
    balancer has no server and closes every connection unanswered, what a tenant worker's
    kubelet saw in the CI of 4c772a4 while a hosting node was lost and its one replica left
    failed two checks."""
    import ssl
    binary = _haproxy()
    ca = _pair("kubernetes-ca")
    serving = _Apiserver(tmp_path, "serving", _pair("kube-apiserver", ca, ("kubernetes",)))
    serving.ready = False
    lost = _free_port()                               # nothing listens there: every connect fails
    front = _configure(ha.inventory, tmp_path, ca, [("lost", lost), ("serving", serving.port)], fallback=fallback)
    proc = subprocess.Popen([str(binary), "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)                                 # two checks of each failed: both down
        states = _states(tmp_path)
        answers = []
        for _ in range(6):
            answers.append(_get(tmp_path, front, "/"))
            time.sleep(0.5)
        after = _states(tmp_path)
        closed, back = False, {}
        if fallback:
            # a connection made on a backup (idle: the server would keep it 30 s) is closed once
            # a checked server is up again, so that its client reconnects there
            client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
            client.check_hostname = False
            held = client.wrap_socket(socket.create_connection(("127.0.0.1", front), timeout=10))
            serving.ready = True
            time.sleep(2.5)                           # a check passed: up
            held.settimeout(3)
            try:
                closed = held.recv(1) == b""
            except TimeoutError:                      # still open
                closed = False
            except (OSError, ssl.SSLError):
                closed = True
            held.close()
            back = _states(tmp_path)
    finally:
        proc.terminate()
        log = proc.communicate(timeout=10)[0]
        serving.close()
    assert states["lost"] == "0" and states["serving"] == "0", (states, log[-2000:])   # 0: DOWN
    if fallback:
        assert answers == ["serving"] * 6, (answers, log[-2000:])
        # connections refused by the lost one's backup do not mark it down: with no checks,
        # nothing would ever mark it up again (observe needs checks)
        assert after[f"lost{FALLBACK}"] == "2" and after[f"serving{FALLBACK}"] == "2", after
        assert back["serving"] == "2" and closed, (back, closed)
    else:
        assert all(a.startswith("failed") for a in answers), answers


@pytest.mark.parametrize("leave", [True, False])
def test_the_real_haproxy_keeps_a_request_in_flight_when_its_apiserver_left_before_stopping(
        ha, tmp_path, leave):
    """Two apiservers behind the real haproxy with the rendered backend; a request in flight on
    one (3 s to answer) when that one stops (its /readyz fails, as at SIGTERM). After the ctl's
    ``leave`` (the commands it sends, on the admin socket) the request is answered, a new one
    goes to the other apiserver, and ``back`` puts it in service again. Without the leave, the
    failed checks mark it down and shutdown-sessions cuts the request: what CI saw once in
    `certs renew`, and why the leave exists."""
    import threading

    binary = _haproxy()
    ca = _pair("kubernetes-ca")
    servers = {n: _Apiserver(tmp_path, n, _pair("kube-apiserver", ca, ("kubernetes",))) for n in ("cp", "other")}
    # cp first: "balance first" hands it every new connection while it is in service
    front = _configure(ha.inventory, tmp_path, ca, [(n, s.port) for n, s in servers.items()], "balance first")

    def admin(command: str) -> str:
        return _admin(tmp_path, command)

    def get(path: str) -> str:
        return _get(tmp_path, front, path)

    proc = subprocess.Popen([str(binary), "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.5)                                 # the first checks made: both up
        assert get("/") == "cp"
        inflight: dict[str, str] = {}
        t = threading.Thread(target=lambda: inflight.setdefault("answer", get("/slow")))
        t.start()
        time.sleep(0.3)                                 # the request is on cp
        if leave:
            for command in _ctl_commands("leave"):
                assert admin(command).strip() == "", command
        servers["cp"].ready = False                     # SIGTERM: /readyz fails, requests still served
        time.sleep(2.5)                                 # two check intervals and more
        during = get("/")
        t.join(timeout=10)
        if leave:
            assert inflight["answer"] == "cp" and during == "other", (inflight, during)
            servers["cp"].ready = True                  # started again, ready
            for command in _ctl_commands("back"):
                assert admin(command).strip() == "", command
            time.sleep(1.5)
            assert get("/") == "cp"                     # in service again
        else:
            assert inflight["answer"].startswith("failed") or inflight["answer"].startswith("bad"), inflight
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
        for server in servers.values():
            server.close()


def test_a_worker_that_cannot_be_told_is_named_and_the_restart_goes_on(ha, tmp_path, monkeypatch):
    """A planned apiserver restart while one worker is unreachable (a real SSH connection to a
    port nothing listens on): the others are told, the unreachable one is named with why, the
    restart is done, and it is told again `back` on the way out (its checks decide meanwhile)."""
    import socket
    from types import SimpleNamespace

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from installer.core.inventory_model import HostSSHSpec
    from installer.engine.session import Session
    from installer.host import handover
    from installer.host.ssh import Remote, Result
    monkeypatch.setattr(handover, "LEAVE_GRACE", 0)
    monkeypatch.setattr(handover, "SETTLE_SECONDS", 0)
    key = tmp_path / "id_ed25519"
    key.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    key.chmod(0o600)
    with socket.socket() as s:                       # a port that was free a moment ago: refused
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    told, gone = (w.name for w in ha.inventory.workers[:2])
    hosts = [h.model_copy(update={"address": "127.0.0.1", "ssh": HostSSHSpec(port=closed, keyPath=str(key),
                                                                           knownHosts=str(tmp_path / "kh"))})
             if h.name == gone else h for h in ha.inventory.spec.hosts]
    inv = ha.inventory.model_copy(update={"spec": ha.inventory.spec.model_copy(update={"hosts": hosts})})

    class Worker:
        def __init__(self):
            self.commands = []

        def run(self, command, **kw):
            self.commands.append(command)
            return Result("", "", 0)

        def close(self):
            pass
    worker = Worker()
    made = {}

    def remote(h, inv):
        made[h.name] = worker if h.name == told else Remote(h, inv)
        return made[h.name]
    waited, logged, restarted = [], [], []
    ctx = SimpleNamespace(inv=inv, options=SimpleNamespace(dry_run=False, wait_timeout=5), facts={},
                          log=logged.append, session=Session(inv, remote=remote),
                          plane=SimpleNamespace(wait=lambda ctx, h, u, after="": waited.append((h, u))))
    cp = inv.controls[0].name
    with ctx.session, handover.restarting(ctx, cp):
        restarted.append(cp)
    assert restarted == [cp] and waited == [(cp, handover.APISERVER)]
    assert [re.search(r"-ctl ((leave|back) [^;]*);", c).group(1) for c in worker.commands] == [
        f"leave {cp} {handover.LEAVE_EXPIRY_SECONDS}", f"back {cp}"]
    assert isinstance(made[gone], Remote)            # a real connection, refused
    assert f"{cp}: kube-apiserver left the API balancers of {len(inv.workers) - 1} worker(s) (drained, checks paused)" \
        in logged, logged
    warnings = [m for m in logged if m.startswith(f"  warning: {gone}: its balancer was not told (")]
    assert len(warnings) == 2 and "refused" in warnings[0].lower(), logged
