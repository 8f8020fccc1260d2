"""The contract stand-ins (tests/standins) run for real: installed with
``python -m tests.standins install DIR``, executed through their ``#!/usr/bin/python3`` shebang
with the flags of the rendered units of the example cluster, against the rendered files, with a
real etcd (3.6, built from its module) for kube-apiserver.

Each host's rendered tree is copied per test and localized (tests/standins/harness.py): host
paths point into the copy, and listeners are moved to 127.0.0.1 and free ports, one explicit
flag or config field each:

    kube-apiserver           --bind-address=127.0.0.1 --secure-port=<free> --etcd-servers=<test etcd>
    kube-controller-manager  --secure-port=<free>            (rendered: default 10257, 127.0.0.1)
    kube-scheduler           --secure-port=<free>            (rendered: default 10259, 127.0.0.1)
    kubelet                  config address=127.0.0.1 port=<free> healthzPort=<free>
    kube-proxy               config healthzBindAddress / metricsBindAddress = 127.0.0.1:<free>

Everything else is exactly what the installer rendered.
"""

from __future__ import annotations

import ast
import base64
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from installer.core import artifacts
from installer.core.render.plan import write_tree

from .conftest import ROOT
from .reference import REFDATA
from .standins import COMPONENTS, reference_data
from .standins.harness import HostTree, free_ports, run, set_flag, start, start_etcd

SYSTEM_PYTHON = "/usr/bin/python3"
PKI = "/etc/kubernetes/pki"
UNITS = {"kube-apiserver": "kube-apiserver.service", "kube-controller-manager": "kube-controller-manager.service",
         "kube-scheduler": "kube-scheduler.service", "kubelet": "kubelet.service", "kube-proxy": "kube-proxy.service"}
HOSTS = {"kube-apiserver": "cp1", "kube-controller-manager": "cp1", "kube-scheduler": "cp1",
         "kubelet": "node2", "kube-proxy": "node2"}
CONTRACT, RUNTIME = 2, 1          # the stand-ins' exit codes (tests/standins/runtime.py)


def _install(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.standins", "install", str(directory)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    """The five stand-ins, installed the documented way."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import yaml"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"{SYSTEM_PYTHON} with PyYAML is needed to run the stand-ins as the lab hosts do "
                    f"(Debian packages python3, python3-yaml): {probe.stderr.strip()}")
    if not shutil.which("openssl"):
        pytest.fail("openssl is needed (Debian package openssl)")
    d = tmp_path_factory.mktemp("standins")
    r = _install(d)
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def etcd(rendered, prepared, tmp_path_factory, built_artifacts):
    """A real etcd (3.6, built) from the rendered cp1 etcd.service (see harness.start_etcd)."""
    tmp = tmp_path_factory.mktemp("standin-etcd")
    tree = HostTree.copy(rendered, "cp1", tmp)
    server = start_etcd(tree, prepared.inventory.controls[0].address, tmp / "data", tmp / "etcd.log",
                        str(built_artifacts / "etcd"))
    try:
        yield server
    finally:
        server.proc.terminate()         # SIGTERM, SIGKILL after 5 s: it never outlives the run


def localized_argv(tree: HostTree, component: str, bin_dir: Path, etcd_url: str | None = None) -> list[str]:
    """The rendered ExecStart, localized, listeners moved to 127.0.0.1 and free ports (the
    table in this module's docstring)."""
    argv = tree.unit_argv(UNITS[component], bin_dir)
    p = free_ports(3)
    if component == "kube-apiserver":
        argv = set_flag(argv, "--bind-address", "127.0.0.1")
        argv = set_flag(argv, "--secure-port", str(p[0]))
        # no etcd unless the test starts one: a closed port (the stand-in then exits 1, not 2)
        argv = set_flag(argv, "--etcd-servers", etcd_url or f"https://127.0.0.1:{p[1]}")
    elif component in ("kube-controller-manager", "kube-scheduler"):
        argv = set_flag(argv, "--secure-port", str(p[0]))
    elif component == "kubelet":
        tree.edit_yaml("/var/lib/kubelet/config.yaml",
                       lambda d: d.update(address="127.0.0.1", port=p[0], healthzPort=p[1]))
    elif component == "kube-proxy":
        tree.edit_yaml("/var/lib/kube-proxy/config.yaml",
                       lambda d: d.update(healthzBindAddress=f"127.0.0.1:{p[0]}",
                                          metricsBindAddress=f"127.0.0.1:{p[1]}"))
    return argv


@dataclass
class Lab:
    cp1: HostTree
    node2: HostTree
    bin: Path
    tmp: Path

    def tree(self, component: str) -> HostTree:
        return self.cp1 if HOSTS[component] == "cp1" else self.node2

    def argv(self, component: str, etcd_url: str | None = None) -> list[str]:
        return localized_argv(self.tree(component), component, self.bin, etcd_url)

    def config(self, component: str) -> dict:
        path = {"kubelet": "/var/lib/kubelet/config.yaml", "kube-proxy": "/var/lib/kube-proxy/config.yaml"}
        return yaml.safe_load(self.node2.path(path[component]).read_text())


@pytest.fixture
def lab(rendered, standins, tmp_path) -> Lab:
    return Lab(HostTree.copy(rendered, "cp1", tmp_path), HostTree.copy(rendered, "node2", tmp_path), standins,
               tmp_path)


def _flag(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{name}="))


def _port(argv: list[str], name: str = "--secure-port") -> int:
    return int(_flag(argv, name))


def _kubeconfig_pair(path: Path, tmp: Path, label: str) -> tuple[str, str]:
    user = yaml.safe_load(path.read_text())["users"][0]["user"]
    crt, key = tmp / f"{label}.crt", tmp / f"{label}.key"
    crt.write_bytes(base64.b64decode(user["client-certificate-data"]))
    key.write_bytes(base64.b64decode(user["client-key-data"]))
    key.chmod(0o600)
    return str(crt), str(key)


def _client(ca: Path | str | None, cert: tuple[str, str] | None = None, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cafile=str(ca))
    if cert:
        ctx.load_cert_chain(*cert)
    if tls12:     # a refused client certificate then fails the handshake itself
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _get(port: int, path: str, ctx: ssl.SSLContext | None = None, host: str = "127.0.0.1",
         server_hostname: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    if ctx is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
    else:
        conn = http.client.HTTPSConnection(host, port, timeout=5, context=ctx)
        if server_hostname:      # verify the certificate for this name while dialing 127.0.0.1
            sock = socket.create_connection((host, port), timeout=5)
            conn.sock = ctx.wrap_socket(sock, server_hostname=server_hostname)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _secrets(lab: Lab) -> list[str]:
    """Values that must never appear in a stand-in's log."""
    out = ["PRIVATE KEY"]
    for conf in ("admin.conf", "controller-manager.conf", "scheduler.conf"):
        out.append(yaml.safe_load(lab.cp1.path(f"/etc/kubernetes/{conf}").read_text())
                   ["users"][0]["user"]["client-key-data"][:40])
    enc = yaml.safe_load(lab.cp1.path("/etc/kubernetes/encryption-config.yaml").read_text())
    out.append(enc["resources"][0]["providers"][0]["secretbox"]["keys"][0]["secret"])
    token = yaml.safe_load(lab.node2.path("/etc/kubernetes/bootstrap-kubelet.conf").read_text())
    out.append(token["users"][0]["user"]["token"].split(".")[1])
    return out


def _assert_no_secrets(log: str, lab: Lab) -> None:
    for secret in _secrets(lab):
        assert secret not in log


# ---------------------------------------------------------------------------------------------
# install


def test_install_writes_five_self_contained_scripts_and_their_sums(tmp_path):
    d = tmp_path / "artifacts"
    d.mkdir()
    (d / "etcd").write_bytes(b"not really etcd\n")
    artifacts.add_files(d, ["etcd"])                     # an existing entry must survive
    r = _install(d)
    assert r.returncode == 0, r.stderr
    for name in COMPONENTS:
        script = d / name
        assert script.is_file() and os.access(script, os.X_OK), name
        text = script.read_text()
        assert text.splitlines()[0] == "#!/usr/bin/python3"
        assert "CONTRACT STAND-IN" in text.splitlines()[1]
        tree = ast.parse(text)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert imported - set(sys.stdlib_module_names) == {"yaml"}, name
        embedded = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                        and getattr(n.targets[0], "id", None) == "REFERENCE")
        assert embedded == reference_data(name, REFDATA)      # the lists of the checkout, verbatim
        assert embedded["flags"] == (REFDATA / "flags" / f"{name}.txt").read_text()
    # no etcdutl in the directory: one that says why it is missing (Debian's etcd has none)
    assert set(artifacts.read_sums(d)) == {*COMPONENTS, "etcd", "etcdutl"}
    assert set(artifacts.verify(d, [*COMPONENTS, "etcd"])) == {*COMPONENTS, "etcd"}
    missing = subprocess.run([str(d / "etcdutl"), "snapshot", "status", "x"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no real etcdutl" in missing.stderr
    # re-installing is idempotent; a modified script no longer verifies
    assert _install(d).returncode == 0
    artifacts.verify(d, COMPONENTS)
    with open(d / "kubelet", "a") as f:
        f.write("# tampered\n")
    with pytest.raises(artifacts.ArtifactError, match="kubelet: sha256"):
        artifacts.verify(d, COMPONENTS)


def test_version_and_help(standins):
    for name in COMPONENTS:
        v = run([str(standins / name), "--version"], env={"HIDDENPLANE_STANDIN_VERSION": "v1.36.4"})
        assert (v.returncode, v.stdout.strip()) == (0, "Kubernetes v1.36.4")
        h = run([str(standins / name), "--help"])
        assert h.returncode == 0 and "not Kubernetes" in h.stdout


# ---------------------------------------------------------------------------------------------
# the rendered units are accepted, health is served


@pytest.mark.etcd
def test_apiserver_accepts_rendered_unit_reaches_etcd_and_serves_health_only(lab, etcd, prepared):
    argv = lab.argv("kube-apiserver", etcd.client_url)
    port = _port(argv)
    version = prepared.inventory.spec.kubernetes.version
    before = etcd.metric("etcd_server_health_success")
    proc = start(argv, lab.tmp / "apiserver.log", env={"HIDDENPLANE_STANDIN_VERSION": version})
    try:
        proc.wait_ready()
        # it really asked the real etcd (with the rendered --etcd-* credentials)
        assert etcd.metric("etcd_server_health_success") >= before + 1
        ca = lab.cp1.path(f"{PKI}/ca.crt")
        admin = _client(ca, _kubeconfig_pair(lab.cp1.path("/etc/kubernetes/admin.conf"), lab.tmp, "admin"))
        assert _get(port, "/livez", admin) == (200, b"ok")
        assert _get(port, "/readyz", admin) == (200, b"ok")
        status, body = _get(port, "/version", admin)
        assert status == 200 and json.loads(body)["gitVersion"] == version
        # never an API call
        for method, path in (("GET", "/api/v1/namespaces"), ("GET", "/apis"), ("POST", "/api/v1/namespaces")):
            status, body = _get(port, path, admin, method=method)
            assert status == 404 and b"never answers API calls" in body
        # client certificates are required and must come from --client-ca-file
        with pytest.raises(ssl.SSLError):
            _get(port, "/livez", _client(ca, tls12=True))
        etcd_client = (str(lab.cp1.path(f"{PKI}/etcd/healthcheck-client.crt")),
                       str(lab.cp1.path(f"{PKI}/etcd/healthcheck-client.key")))
        with pytest.raises(ssl.SSLError):
            _get(port, "/livez", _client(ca, etcd_client, tls12=True))
        # only the rendered CIS suites (TLS 1.2): a CBC suite is refused
        cbc = _client(ca, _kubeconfig_pair(lab.cp1.path("/etc/kubernetes/admin.conf"), lab.tmp, "admin"), tls12=True)
        cbc.set_ciphers("ECDHE-ECDSA-AES128-SHA")
        with pytest.raises(ssl.SSLError):
            _get(port, "/livez", cbc)
    finally:
        rc = proc.terminate()
    log = proc.stderr
    assert rc == 0 and "SIGTERM: exiting 0" in log
    assert f"ok: etcd {etcd.client_url}/health: HTTP 200" in log
    assert "--etcd-certfile" in log and "chains to --etcd-cafile" in log
    assert "TLS handshake from 127.0.0.1 refused" in log
    _assert_no_secrets(log, lab)


def test_apiserver_fails_clearly_when_etcd_is_down(lab):
    argv = lab.argv("kube-apiserver")              # --etcd-servers: a closed port
    url = _flag(argv, "--etcd-servers")
    r = run(argv, env={"HIDDENPLANE_STANDIN_ETCD_WAIT": "2"})
    assert r.returncode == RUNTIME, r.stderr
    assert f"fatal: etcd {url}/health is not healthy after 2s" in r.stderr
    assert "ConnectionRefusedError" in r.stderr
    assert "ready:" not in r.stderr


@pytest.mark.etcd
def test_apiserver_fails_when_etcd_refuses_its_client_certificate(lab, etcd, tmp_path):
    """A CA file that vouches for a cluster-CA client certificate passes the static checks, but
    the real etcd trusts only its own CA: the handshake is refused and the stand-in says so."""
    cluster = tmp_path / "cluster-ca.crt"
    shutil.copy(lab.cp1.path(f"{PKI}/ca.crt"), cluster)
    bundle = tmp_path / "etcd-and-cluster-ca.crt"
    bundle.write_bytes(lab.cp1.path(f"{PKI}/etcd/ca.crt").read_bytes() + cluster.read_bytes())
    argv = lab.argv("kube-apiserver", etcd.client_url)
    argv = set_flag(argv, "--etcd-cafile", str(bundle))
    argv = set_flag(argv, "--etcd-certfile", str(lab.cp1.path(f"{PKI}/apiserver-kubelet-client.crt")))
    argv = set_flag(argv, "--etcd-keyfile", str(lab.cp1.path(f"{PKI}/apiserver-kubelet-client.key")))
    offset = len(etcd.proc.stderr)
    r = run(argv, env={"HIDDENPLANE_STANDIN_ETCD_WAIT": "3"})
    assert r.returncode == RUNTIME, r.stderr
    assert "ok: --etcd-certfile" in r.stderr          # the static checks passed...
    assert f"fatal: etcd {etcd.client_url}/health" in r.stderr       # ...the real etcd said no
    assert "ready:" not in r.stderr
    assert "rejected connection" in etcd.proc.stderr[offset:]


def test_controller_manager_and_scheduler_accept_rendered_units(lab):
    for component in ("kube-controller-manager", "kube-scheduler"):
        argv = lab.argv(component)
        port = _port(argv)
        assert _flag(argv, "--bind-address") == "127.0.0.1"           # as rendered
        proc = start(argv, lab.tmp / f"{component}.log")
        try:
            proc.wait_ready()
            assert _get(port, "/healthz", _client(None)) == (200, b"ok")
            assert _get(port, "/api/v1/pods", _client(None))[0] == 404
            # no --tls-cert-file is rendered: a self-signed serving certificate, as upstream
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                with _client(None).wrap_socket(sock) as tls:
                    cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
            assert cert.issuer == cert.subject
        finally:
            rc = proc.terminate()
        assert rc == 0, proc.stderr
        assert "chains to" in proc.stderr and "self-signed" in proc.stderr
        _assert_no_secrets(proc.stderr, lab)
    assert "--cluster-signing-cert-file" in (lab.tmp / "kube-controller-manager.log").read_text()


def test_kubelet_accepts_rendered_unit_before_tls_bootstrapping(lab):
    argv = lab.argv("kubelet")
    cfg = lab.config("kubelet")
    assert not Path(_flag(argv, "--kubeconfig")).exists()       # written by the kubelet itself later
    proc = start(argv, lab.tmp / "kubelet.log")
    try:
        proc.wait_ready()
        ca = lab.node2.path(f"{PKI}/ca.crt")
        apiserver = (str(lab.cp1.path(f"{PKI}/apiserver-kubelet-client.crt")),
                     str(lab.cp1.path(f"{PKI}/apiserver-kubelet-client.key")))
        # the apiserver's kubelet client, verifying the serving certificate as node2
        assert _get(cfg["port"], "/healthz", _client(ca, apiserver), server_hostname="node2") == (200, b"ok")
        assert _get(cfg["port"], "/pods", _client(ca, apiserver), server_hostname="node2")[0] == 404
        with pytest.raises(ssl.SSLError):
            _get(cfg["port"], "/healthz", _client(ca, tls12=True), server_hostname="node2")
        assert _get(cfg["healthzPort"], "/healthz") == (200, b"ok")          # plain HTTP
    finally:
        rc = proc.terminate()
    assert rc == 0
    log = proc.stderr
    assert "does not exist yet: the kubelet writes it after TLS bootstrapping" in log
    assert "bootstrap token" in log and "IP 192.168.56.231" in log
    _assert_no_secrets(log, lab)
    # a --cert-dir that does not exist yet is fine too (the kubelet creates it)
    argv = set_flag(argv, "--cert-dir", str(lab.tmp / "no-cert-dir-yet"))
    proc = start(argv, lab.tmp / "kubelet2.log")
    try:
        proc.wait_ready()
    finally:
        assert proc.terminate() == 0
    assert "does not exist yet: the kubelet creates it" in proc.stderr


def test_kube_proxy_accepts_rendered_unit(lab):
    argv = lab.argv("kube-proxy")
    cfg = lab.config("kube-proxy")
    healthz, metrics = (int(cfg[k].rsplit(":", 1)[1]) for k in ("healthzBindAddress", "metricsBindAddress"))
    proc = start(argv, lab.tmp / "kube-proxy.log")
    try:
        proc.wait_ready()
        status, body = _get(healthz, "/healthz")
        assert status == 200 and "lastUpdated" in json.loads(body)
        status, body = _get(metrics, "/metrics")
        assert status == 200 and b"stand-in" in body
        assert _get(healthz, "/api/v1/services")[0] == 404
    finally:
        rc = proc.terminate()
    assert rc == 0
    assert "chains to" in proc.stderr
    _assert_no_secrets(proc.stderr, lab)


def test_every_host_of_a_three_control_cluster_is_accepted(three_controls, standins, tmp_path):
    """Per-host material (each control's apiserver pairs, each worker's serving certificate
    and bootstrap token) passes every static check; the apiserver then stops at etcd (none is
    running here), every other stand-in gets ready."""
    out = tmp_path / "out"
    write_tree(three_controls.plans, out, three_controls.inventory, three_controls.material)
    checked = []
    for host in three_controls.inventory.spec.hosts:
        tree = HostTree.copy(out, host.name, tmp_path / "trees")
        components = (("kube-apiserver", "kube-controller-manager", "kube-scheduler") if host.role == "control"
                      else ("kubelet", "kube-proxy"))
        for component in components:
            argv = localized_argv(tree, component, standins)
            if component == "kube-apiserver":
                r = run(argv, env={"HIDDENPLANE_STANDIN_ETCD_WAIT": "0"})
                assert r.returncode == RUNTIME and " error: " not in r.stderr, r.stderr
                assert "fatal: etcd https://127.0.0.1:" in r.stderr
            else:
                proc = start(argv, tmp_path / f"{host.name}-{component}.log")
                try:
                    proc.wait_ready()
                finally:
                    assert proc.terminate() == 0, proc.stderr
                if component == "kubelet":
                    assert f"and IP {host.address}" in proc.stderr
            checked.append((host.name, component))
    assert len(checked) == 3 * 3 + 2 * 2


# ---------------------------------------------------------------------------------------------
# what each stand-in refuses


def _pki(tree: HostTree, name: str) -> str:
    return str(tree.path(f"{PKI}/{name}"))


def _set_config(lab: Lab, component: str, dotted: str, value) -> None:
    path = {"kube-scheduler": lab.cp1.path("/etc/kubernetes/kube-scheduler.yaml"),
            "kubelet": lab.node2.path("/var/lib/kubelet/config.yaml"),
            "kube-proxy": lab.node2.path("/var/lib/kube-proxy/config.yaml")}[component]

    def edit(doc):
        *parents, last = dotted.split(".")
        cur = doc
        for p in parents:
            cur = cur[p][0] if isinstance(cur[p], list) else cur[p]
        cur[last] = value
    lab.tree(component).edit_yaml(path, edit)


def _edit_kubeconfig(tree: HostTree, conf: str, **user_or_cluster) -> None:
    def edit(doc):
        for k, v in user_or_cluster.items():
            section = doc["clusters"][0]["cluster"] if k == "certificate-authority-data" else doc["users"][0]["user"]
            section[k] = v
    tree.edit_yaml(tree.path(f"/etc/kubernetes/{conf}"), edit)


def _b64file(path: Path | str) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def _admin_key(lab: Lab) -> str:
    return yaml.safe_load(lab.cp1.path("/etc/kubernetes/admin.conf").read_text())["users"][0]["user"]["client-key-data"]


def _copy_into_node(lab: Lab, cp1_path: str, name: str) -> str:
    dest = lab.node2.path(f"/var/lib/kubelet/pki/{name}")
    shutil.copy(lab.cp1.path(cp1_path), dest)
    return str(dest)


def _flags(**kv):
    """A mutation setting flags (``etcd_certfile=`` is ``--etcd-certfile``); values may be lab -> str."""
    def mutate(lab: Lab, argv: list[str]) -> list[str]:
        for k, v in kv.items():
            argv = set_flag(argv, "--" + k.replace("_", "-"), v(lab) if callable(v) else v)
        return argv
    return mutate


def _then(fn):
    """A mutation of the tree only (argv unchanged)."""
    def mutate(lab, argv):
        fn(lab)
        return argv
    return mutate


CASES = [
    # (component, id, mutation(lab, argv) -> argv, substrings stderr must hold)
    *[(c, "unknown-flag", lambda lab, argv: argv + ["--no-such-flag=1"],
       ["error: unknown flag: --no-such-flag", f"flags/{c}.txt"]) for c in COMPONENTS],
    ("kube-apiserver", "deprecated-flag", _flags(admission_control="AlwaysAdmit"),
     ["flag --admission-control is deprecated upstream"]),
    ("kube-scheduler", "deprecated-flag",
     _flags(kubeconfig=lambda lab: str(lab.cp1.path("/etc/kubernetes/scheduler.conf"))),
     ["flag --kubeconfig is deprecated upstream"]),
    ("kubelet", "deprecated-flag", _flags(address="127.0.0.1"), ["flag --address is deprecated upstream"]),
    ("kube-apiserver", "missing-file",
     _flags(audit_policy_file=lambda lab: str(lab.cp1.path("/etc/kubernetes/no-such-policy.yaml"))),
     ["--audit-policy-file", "no-such-policy.yaml: no such file"]),
    ("kube-controller-manager", "missing-file",
     _flags(cluster_signing_key_file=lambda lab: _pki(lab.cp1, "no-such-ca.key")),
     ["--cluster-signing-key-file", "no-such-ca.key: no such file"]),
    ("kube-scheduler", "missing-file",
     _then(lambda lab: _set_config(lab, "kube-scheduler", "clientConnection.kubeconfig",
                                   "/nonexistent/scheduler.conf")),
     ["--config clientConnection.kubeconfig /nonexistent/scheduler.conf: no such file"]),
    ("kubelet", "missing-file",
     _flags(bootstrap_kubeconfig=lambda lab: str(lab.node2.path("/etc/kubernetes/no-such-bootstrap.conf"))),
     ["--bootstrap-kubeconfig", "no-such-bootstrap.conf: no such file"]),
    ("kube-proxy", "missing-file",
     _then(lambda lab: _set_config(lab, "kube-proxy", "clientConnection.kubeconfig", "/nonexistent/kube-proxy.conf")),
     ["clientConnection.kubeconfig /nonexistent/kube-proxy.conf: no such file"]),
    ("kubelet", "missing-tls-cert",
     _then(lambda lab: _set_config(lab, "kubelet", "tlsCertFile", "/nonexistent/kubelet.crt")),
     ["tlsCertFile /nonexistent/kubelet.crt: no such file"]),
    # certificates from the wrong CA
    ("kube-apiserver", "etcd-cert-from-cluster-ca",
     _flags(etcd_certfile=lambda lab: _pki(lab.cp1, "apiserver-kubelet-client.crt"),
            etcd_keyfile=lambda lab: _pki(lab.cp1, "apiserver-kubelet-client.key")),
     ["--etcd-certfile", "(CN=kube-apiserver-kubelet-client) does not chain to --etcd-cafile"]),
    ("kube-apiserver", "proxy-client-from-cluster-ca",
     _flags(proxy_client_cert_file=lambda lab: _pki(lab.cp1, "apiserver-kubelet-client.crt"),
            proxy_client_key_file=lambda lab: _pki(lab.cp1, "apiserver-kubelet-client.key")),
     ["--proxy-client-cert-file", "does not chain to --requestheader-client-ca-file",
      "is not in --requestheader-allowed-names"]),
    ("kube-apiserver", "serving-cert-from-etcd-ca",
     _flags(tls_cert_file=lambda lab: _pki(lab.cp1, "etcd/healthcheck-client.crt"),
            tls_private_key_file=lambda lab: _pki(lab.cp1, "etcd/healthcheck-client.key")),
     ["--tls-cert-file", "does not chain to --client-ca-file"]),
    ("kube-controller-manager", "signing-cert-not-a-ca",
     _flags(cluster_signing_cert_file=lambda lab: _pki(lab.cp1, "apiserver.crt"),
            cluster_signing_key_file=lambda lab: _pki(lab.cp1, "apiserver.key")),
     ["--cluster-signing-cert-file", "not a CA certificate (CN=kube-apiserver"]),
    ("kube-controller-manager", "kubeconfig-ca-mismatch",
     _then(lambda lab: _edit_kubeconfig(lab.cp1, "controller-manager.conf", **{
         "certificate-authority-data": _b64file(lab.cp1.path(f"{PKI}/front-proxy-ca.crt"))})),
     ["--kubeconfig", "(CN=system:kube-controller-manager) does not chain to --kubeconfig's certificate-authority"]),
    ("kube-scheduler", "kubeconfig-ca-mismatch",
     _then(lambda lab: _edit_kubeconfig(lab.cp1, "scheduler.conf", **{
         "certificate-authority-data": _b64file(lab.cp1.path(f"{PKI}/etcd/ca.crt"))})),
     ["clientConnection.kubeconfig", "(CN=system:kube-scheduler) does not chain"]),
    ("kubelet", "serving-cert-vs-client-ca",
     _then(lambda lab: _set_config(lab, "kubelet", "authentication.x509.clientCAFile",
                                   _copy_into_node(lab, f"{PKI}/front-proxy-ca.crt", "other-ca.crt"))),
     ["tlsCertFile", "does not chain to authentication.x509.clientCAFile"]),
    ("kube-proxy", "kubeconfig-ca-mismatch",
     _then(lambda lab: _edit_kubeconfig(lab.node2, "kube-proxy.conf", **{
         "certificate-authority-data": _b64file(lab.cp1.path(f"{PKI}/etcd/ca.crt"))})),
     ["(CN=hiddenplane:kube-proxy:node2) does not chain"]),
    # keys that do not match their certificates
    ("kube-apiserver", "key-mismatch",
     _flags(tls_private_key_file=lambda lab: _pki(lab.cp1, "apiserver-kubelet-client.key")),
     ["--tls-private-key-file", "private key does not match --tls-cert-file"]),
    ("kube-apiserver", "sa-key-mismatch", _flags(service_account_key_file=lambda lab: _pki(lab.cp1, "ca.crt")),
     ["--service-account-signing-key-file", "its public key is in no --service-account-key-file"]),
    ("kube-controller-manager", "key-mismatch",
     _flags(cluster_signing_key_file=lambda lab: _pki(lab.cp1, "front-proxy-client.key")),
     ["--cluster-signing-key-file", "private key does not match --cluster-signing-cert-file"]),
    ("kube-scheduler", "key-mismatch",
     _then(lambda lab: _edit_kubeconfig(lab.cp1, "scheduler.conf", **{"client-key-data": _admin_key(lab)})),
     ["client-key-data: private key does not match"]),
    ("kubelet", "key-mismatch",
     _then(lambda lab: _set_config(lab, "kubelet", "tlsPrivateKeyFile",
                                   _copy_into_node(lab, f"{PKI}/front-proxy-client.key", "other.key"))),
     ["tlsPrivateKeyFile", "private key does not match tlsCertFile"]),
    ("kube-proxy", "key-mismatch",
     _then(lambda lab: _edit_kubeconfig(lab.node2, "kube-proxy.conf", **{"client-key-data": _admin_key(lab)})),
     ["client-key-data: private key does not match"]),
    # config fields upstream does not document
    ("kube-apiserver", "unknown-field-encryption",
     _then(lambda lab: lab.cp1.edit_yaml("/etc/kubernetes/encryption-config.yaml", lambda d: d.update(bogusField=1))),
     ["--encryption-provider-config", "unknown field 'bogusField'", "config/EncryptionConfiguration.txt"]),
    ("kube-apiserver", "unknown-field-audit",
     _then(lambda lab: lab.cp1.edit_yaml("/etc/kubernetes/audit-policy.yaml",
                                         lambda d: d["rules"][0].update(bogusRule=1))),
     ["--audit-policy-file", "unknown field 'rules.bogusRule'", "config/Policy.txt"]),
    ("kube-apiserver", "unknown-field-admission",
     _then(lambda lab: lab.cp1.edit_yaml("/etc/kubernetes/admission-config.yaml",
                                         lambda d: d["plugins"][0].update(bogus=1))),
     ["--admission-control-config-file", "unknown field 'plugins.bogus'"]),
    ("kube-apiserver", "wrong-apiversion",
     _then(lambda lab: lab.cp1.edit_yaml("/etc/kubernetes/encryption-config.yaml",
                                         lambda d: d.update(apiVersion="apiserver.config.k8s.io/v1beta1"))),
     ["apiVersion is 'apiserver.config.k8s.io/v1beta1', expected 'apiserver.config.k8s.io/v1'"]),
    ("kube-apiserver", "short-secretbox-key",
     _then(lambda lab: lab.cp1.edit_yaml("/etc/kubernetes/encryption-config.yaml", lambda d: d["resources"][0]
                                         ["providers"][0]["secretbox"]["keys"][0].update(secret="c2hvcnQ="))),
     ["secretbox key 'key1' is 5 bytes, expected 32"]),
    ("kube-scheduler", "unknown-field", _then(lambda lab: _set_config(lab, "kube-scheduler", "bogusField", 1)),
     ["unknown field 'bogusField'", "config/KubeSchedulerConfiguration.txt"]),
    ("kubelet", "unknown-field", _then(lambda lab: _set_config(lab, "kubelet", "bogusField", 1)),
     ["--config", "unknown field 'bogusField'", "config/KubeletConfiguration.txt"]),
    ("kubelet", "unknown-nested-field", _then(lambda lab: _set_config(lab, "kubelet", "authentication.x509.bogus", 1)),
     ["unknown field 'authentication.x509.bogus'"]),
    ("kube-proxy", "unknown-field", _then(lambda lab: _set_config(lab, "kube-proxy", "bogusField", 1)),
     ["unknown field 'bogusField'", "config/KubeProxyConfiguration.txt"]),
    # the kubelet joins with a bootstrap token, nothing else
    ("kubelet", "bootstrap-kubeconfig-without-token",
     _flags(bootstrap_kubeconfig=lambda lab: str(lab.node2.path("/etc/kubernetes/kube-proxy.conf"))),
     ["--bootstrap-kubeconfig", "holds no token"]),
]


@pytest.mark.parametrize("component,mutate,expected", [pytest.param(c, m, e, id=f"{c}-{i}") for c, i, m, e in CASES])
def test_standin_refuses(lab, component, mutate, expected):
    argv = mutate(lab, lab.argv(component))
    r = run(argv, env={"HIDDENPLANE_STANDIN_ETCD_WAIT": "1"}, timeout=10)
    assert r.returncode == CONTRACT, f"exit {r.returncode}, expected {CONTRACT}:\n{r.stderr}"
    errors = "\n".join(line for line in r.stderr.splitlines() if " error: " in line)
    for text in expected:
        assert text in errors, f"{text!r} not in the errors:\n{r.stderr}"
    assert "refusing to start" in r.stderr and "ready:" not in r.stderr
    _assert_no_secrets(r.stderr, lab)


def test_every_component_and_kind_of_refusal_is_covered():
    ids = {(c, i) for c, i, _, _ in CASES}
    for c in COMPONENTS:
        assert (c, "unknown-flag") in ids and (c, "missing-file") in ids and (c, "key-mismatch") in ids
    for c in ("kube-apiserver", "kube-scheduler", "kubelet"):          # the ones with deprecated flags
        assert (c, "deprecated-flag") in ids
    for c in ("kube-scheduler", "kubelet", "kube-proxy"):               # the ones with a --config
        assert (c, "unknown-field") in ids
