"""The rendered cluster against its contracts.

1. Flags and config fields: tests/test_real_flags.py has the real binaries (the default version,
   built by tools/kubebuild) check every rendered flag and config file; the parsers it reads the
   units with are checked here. No longer checked: the flags and fields against the other
   supported minors (1.35 and 1.37, installer/core/versions.py). Their lists were upstream doc pages
   kept outside the repository, and no binary of those minors is built here; the API objects are
   still validated per target version (kubernetes-validate, tests/test_addons.py).
2. CIS (the CIS Kubernetes Benchmark): each rule is a row of a table below, so a failure names
   its rule ID.
3. The hidden control plane: control hosts get nothing of a node, workers get nothing of the
   control plane and no key that could mint or read cluster credentials.

Each test runs over two clusters: the example (1 control, 2 workers) and a 3-control variant.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from installer.core.network import REPAIR_SERVICE, REPAIR_TIMER, ROUTES_UNIT
from installer.core.pki import issue
from installer.core.pki.specs import CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA
from installer.core.render.files import HostDir, HostFile, HostPlan

from . import reference as ref
from .rendered import Cluster

UNIT_DIR = "/etc/systemd/system"
PKI_DIR = "/etc/kubernetes/pki"
CONTROL_UNITS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
WORKER_UNITS = ("containerd", "kubelet", "kube-proxy")
ROLE_OF = {**{u: "control" for u in CONTROL_UNITS}, **{u: "worker" for u in WORKER_UNITS}}


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


def unit_file(plan: HostPlan, component: str) -> HostFile | None:
    return plan.files.get(f"{UNIT_DIR}/{component}.service")


def flags_of(plan: HostPlan, component: str) -> dict[str, str | None]:
    f = unit_file(plan, component)
    assert f is not None, f"{plan.name}: no {component}.service"
    return ref.unit_flags(f.content)


def file_of(plan: HostPlan, path: str | None, what: str) -> HostFile:
    assert path, f"{plan.name}: {what} names no file"
    assert path in plan.files, f"{plan.name}: {what} names {path}, which the host does not get"
    return plan.files[path]


def yaml_of(plan: HostPlan, path: str | None, what: str) -> dict:
    return yaml.safe_load(file_of(plan, path, what).content)


def cert_of(plan: HostPlan, path: str | None, what: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(file_of(plan, path, what).content)


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except Exception:   # ValueError (names differ), InvalidSignature, TypeError
        return False


def component_config(plan: HostPlan, component: str) -> dict:
    """The document a component reads through its --config flag."""
    return yaml_of(plan, flags_of(plan, component).get("--config"), f"{component} --config")


def documents(plan: HostPlan) -> list[tuple[str, dict]]:
    out = []
    for f in plan.files.values():
        if f.path.endswith((".yaml", ".yml", ".conf")) and not f.path.startswith("/etc/modules-load.d") \
                and not f.path.startswith("/etc/sysctl.d"):
            doc = yaml.safe_load(f.content)
            if isinstance(doc, dict) and "kind" in doc:
                out.append((f.path, doc))
    return out


def get_path(doc: dict, dotted: str):
    cur = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return ABSENT
        cur = cur[part]
    return cur


def mode_at_most(mode: int, limit: int) -> bool:
    return mode & 0o7777 & ~limit == 0


def public_der(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# ---------------------------------------------------------------------------------------------
# 1. the unit parsers the flag checks rely on


def test_unit_parsers_read_what_systemd_reads():
    """The flag checks (here and in tests/test_real_flags.py) are only as good as these: a
    continued line, a comment inside it and a repeated flag must be read as systemd reads them."""
    unit = "[Service]\nExecStart=/bin/x \\\n  --a=1 \\\n# comment\n  --b=x,y \\\n  --c\nRestart=always\n"
    assert ref.exec_start(unit) == ["/bin/x", "--a=1", "--b=x,y", "--c"]
    assert ref.unit_flags(unit) == {"--a": "1", "--b": "x,y", "--c": None}
    assert ref.unit_values(unit, "Service", "Restart") == ["always"]
    with pytest.raises(ValueError):
        ref.parse_flags(["--a=1", "--a=2"])


# ---------------------------------------------------------------------------------------------
# 2. CIS: flags


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


@dataclass(frozen=True)
class Expect:
    text: str
    ok: Callable[[object], bool]


def _items(v) -> list[str]:
    return v.split(",") if isinstance(v, str) else []


def is_(x) -> Expect:
    return Expect(f"= {x!r}", lambda v: type(v) is type(x) and v == x)


def absent_or(x) -> Expect:
    return Expect(f"absent or {x!r}", lambda v: v is ABSENT or (type(v) is type(x) and v == x))


def set_() -> Expect:
    return Expect("set", lambda v: v not in (ABSENT, None, "", []))


def absent() -> Expect:
    return Expect("absent", lambda v: v is ABSENT)


def includes(x: str) -> Expect:
    return Expect(f"includes {x}", lambda v: x in _items(v))


def excludes(x: str) -> Expect:
    return Expect(f"absent or without {x}", lambda v: v is ABSENT or (isinstance(v, str) and x not in _items(v)))


def at_least(n: int) -> Expect:
    return Expect(f">= {n}", lambda v: isinstance(v, str) and v.isdigit() and int(v) >= n)


def first_item(x: str) -> Expect:
    return Expect(f"starts with {x}", lambda v: _items(v)[:1] == [x])


def gate_not_false(gate: str) -> Expect:
    return Expect(f"never {gate}=false",
                  lambda v: v is ABSENT or (isinstance(v, str) and f"{gate}=false" not in _items(v)))


def six_suites() -> Expect:
    def ok(v) -> bool:
        got = _items(v) if isinstance(v, str) else v if isinstance(v, list) else []
        return len(got) == len(set(got)) == 6 and set(got) == ref.CIS_CIPHER_SUITES
    return Expect("exactly the six CIS cipher suites", ok)


API, CM, SCHED, ETCD, KUBELET = "kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kubelet"

FLAG_RULES = [
    ("1.2.1", API, "--anonymous-auth", is_("false")),
    ("1.2.2", API, "--token-auth-file", absent()),
    ("1.2.3", API, "--enable-admission-plugins", includes("DenyServiceExternalIPs")),
    ("1.2.4", API, "--kubelet-client-certificate", set_()),
    ("1.2.4", API, "--kubelet-client-key", set_()),
    ("1.2.5", API, "--kubelet-certificate-authority", set_()),
    ("1.2.6", API, "--authorization-mode", excludes("AlwaysAllow")),
    ("1.2.7", API, "--authorization-mode", includes("Node")),
    ("1.2.8", API, "--authorization-mode", includes("RBAC")),
    ("1.2.9", API, "--enable-admission-plugins", includes("EventRateLimit")),
    ("1.2.9", API, "--admission-control-config-file", set_()),
    ("1.2.10", API, "--enable-admission-plugins", excludes("AlwaysAdmit")),
    ("1.2.11", API, "--enable-admission-plugins", includes("AlwaysPullImages")),   # the default
    ("1.2.12", API, "--disable-admission-plugins", excludes("ServiceAccount")),
    ("1.2.13", API, "--disable-admission-plugins", excludes("NamespaceLifecycle")),
    ("1.2.14", API, "--enable-admission-plugins", includes("NodeRestriction")),
    ("1.2.15", API, "--profiling", is_("false")),
    ("1.2.16", API, "--audit-log-path", set_()),
    ("1.2.17", API, "--audit-log-maxage", at_least(30)),
    ("1.2.18", API, "--audit-log-maxbackup", at_least(10)),
    ("1.2.19", API, "--audit-log-maxsize", at_least(100)),
    ("1.2.21", API, "--service-account-lookup", absent_or("true")),
    ("1.2.22", API, "--service-account-key-file", set_()),
    ("1.2.23-26", API, "--etcd-certfile", set_()),
    ("1.2.23-26", API, "--etcd-keyfile", set_()),
    ("1.2.23-26", API, "--tls-cert-file", set_()),
    ("1.2.23-26", API, "--tls-private-key-file", set_()),
    ("1.2.23-26", API, "--client-ca-file", set_()),
    ("1.2.23-26", API, "--etcd-cafile", set_()),
    ("1.2.27", API, "--encryption-provider-config", set_()),
    ("1.2.29", API, "--tls-cipher-suites", six_suites()),
    ("1.2.30", API, "--service-account-extend-token-expiration", is_("false")),
    ("3.2.1", API, "--audit-policy-file", set_()),
    ("hidden-plane", API, "--kubelet-preferred-address-types", first_item("InternalIP")),
    ("1.3.1", CM, "--terminated-pod-gc-threshold", at_least(1)),
    ("1.3.2", CM, "--profiling", is_("false")),
    ("1.3.3", CM, "--use-service-account-credentials", is_("true")),
    ("1.3.4", CM, "--service-account-private-key-file", set_()),
    ("1.3.5", CM, "--root-ca-file", set_()),
    ("1.3.6", CM, "--feature-gates", gate_not_false("RotateKubeletServerCertificate")),
    ("1.3.7", CM, "--bind-address", is_("127.0.0.1")),
    ("ciphers", CM, "--tls-cipher-suites", six_suites()),
    ("1.4.1", SCHED, "--profiling", absent_or("false")),      # deprecated flag: see the config rule
    ("1.4.2", SCHED, "--bind-address", is_("127.0.0.1")),
    ("ciphers", SCHED, "--tls-cipher-suites", six_suites()),
    ("2.1", ETCD, "--cert-file", set_()),
    ("2.1", ETCD, "--key-file", set_()),
    ("2.2", ETCD, "--client-cert-auth", is_("true")),
    ("2.3", ETCD, "--auto-tls", absent_or("false")),
    ("2.4", ETCD, "--peer-cert-file", set_()),
    ("2.4", ETCD, "--peer-key-file", set_()),
    ("2.5", ETCD, "--peer-client-cert-auth", is_("true")),
    ("2.6", ETCD, "--peer-auto-tls", absent_or("false")),
    ("2.7", ETCD, "--trusted-ca-file", set_()),
    ("ciphers", ETCD, "--cipher-suites", six_suites()),
    ("4.2.7", KUBELET, "--hostname-override", absent()),
    ("4.2.11", KUBELET, "--feature-gates", gate_not_false("RotateKubeletServerCertificate")),
]


@pytest.mark.parametrize("rule,component,flag,expect",
                         [pytest.param(*r, id=f"{r[0]} {r[1]} {r[2]}") for r in FLAG_RULES])
def test_cis_flag(cluster, rule, component, flag, expect):
    hosts = cluster.hosts(ROLE_OF[component])
    bad = []
    for plan in hosts:
        value = flags_of(plan, component).get(flag, ABSENT)
        if not expect.ok(value):
            bad.append(f"{plan.name}: {flag}={value!r}")
    assert not bad, f"CIS {rule}: {component} {flag} must be {expect.text}; " + "; ".join(bad)


# ---------------------------------------------------------------------------------------------
# 2. CIS: config files a component reads through --config


def metrics_on_loopback() -> Expect:
    return Expect("127.0.0.1:<port>", lambda v: isinstance(v, str) and v.rsplit(":", 1)[0] == "127.0.0.1")


def positive_int() -> Expect:
    return Expect("a positive integer", lambda v: type(v) is int and v > 0)


def not_zero_duration() -> Expect:
    return Expect("absent or not 0", lambda v: v is ABSENT or v not in (0, "0", "0s"))


CONFIG_RULES = [
    ("4.2.1", KUBELET, "authentication.anonymous.enabled", is_(False)),
    ("4.2.2", KUBELET, "authorization.mode", is_("Webhook")),
    ("4.2.3", KUBELET, "authentication.x509.clientCAFile", set_()),
    ("4.2.4", KUBELET, "readOnlyPort", is_(0)),
    ("4.2.5", KUBELET, "streamingConnectionIdleTimeout", not_zero_duration()),
    ("4.2.6", KUBELET, "makeIPTablesUtilChains", absent_or(True)),
    ("4.2.9", KUBELET, "tlsCertFile", set_()),
    ("4.2.9", KUBELET, "tlsPrivateKeyFile", set_()),
    ("4.2.11", KUBELET, "featureGates.RotateKubeletServerCertificate", absent_or(True)),
    ("4.2.12", KUBELET, "tlsCipherSuites", six_suites()),
    ("4.2.13", KUBELET, "podPidsLimit", positive_int()),
    ("4.2.14", KUBELET, "seccompDefault", is_(True)),
    ("hidden-plane", KUBELET, "authentication.webhook.enabled", is_(True)),
    ("4.3.1", "kube-proxy", "metricsBindAddress", metrics_on_loopback()),
    ("1.4.1", SCHED, "enableProfiling", is_(False)),
    ("1.4.1", SCHED, "clientConnection.kubeconfig", set_()),
]


@pytest.mark.parametrize("rule,component,path,expect",
                         [pytest.param(*r, id=f"{r[0]} {r[1]} {r[2]}") for r in CONFIG_RULES])
def test_cis_config(cluster, rule, component, path, expect):
    bad = []
    for plan in cluster.hosts(ROLE_OF[component]):
        value = get_path(component_config(plan, component), path)
        if not expect.ok(value):
            bad.append(f"{plan.name}: {path}={value!r}")
    assert not bad, f"CIS {rule}: {component} config {path} must be {expect.text}; " + "; ".join(bad)


def test_cis_4_2_10_client_rotation_is_on_once_the_kubelet_joined(prepared):
    """CIS 4.2.10 for every joined kubelet; off only while it bootstraps, so that its first
    request's key is on disk for the installer to compare (installer/host/csr_approval.py)."""
    from installer.core.render.worker import HostFacts, kubelet_config
    inv = prepared.inventory
    assert kubelet_config(inv, HostFacts(kubelet_joined=True))["rotateCertificates"] is True
    assert kubelet_config(inv, HostFacts(kubelet_joined=False))["rotateCertificates"] is False


# ---------------------------------------------------------------------------------------------
# 2. CIS: file modes and ownership

CERT_SUFFIXES = (".crt", ".pub", ".pem")


def _is_key(f: HostFile) -> bool:
    return f.path.endswith(".key") or b"PRIVATE KEY" in f.content


def _is_kubeconfig(f: HostFile) -> bool:
    if not f.path.endswith((".conf", ".yaml", ".kubeconfig")):
        return False
    try:
        doc = yaml.safe_load(f.content)
    except yaml.YAMLError:
        return False
    return isinstance(doc, dict) and doc.get("kind") == "Config"


# etcd runs as its dedicated user and must read its own CA, serving and peer pairs: they live
# in /etc/etcd/pki, etcd:etcd, so that /etc/kubernetes/pki stays root:root (CIS 1.1.19).
ETCD_PKI = "/etc/etcd/pki"
ETCD_OWNED = {f"{ETCD_PKI}/{n}" for n in ("ca.crt", "server.crt", "server.key", "peer.crt", "peer.key")}


@dataclass(frozen=True)
class FileRule:
    id: str
    text: str
    role: str | None                                   # None: every host
    select: Callable[[HostPlan], list[HostFile]]
    ok: Callable[[HostFile], bool]
    expected: Callable[[HostPlan], int] | None = None  # how many files the rule must select


def _units(names):
    return lambda p: [f for n in names if (f := unit_file(p, n))]


def _paths(*paths):
    return lambda p: [p.files[x] for x in paths if x in p.files]


def _root_owned(limit: int):
    return lambda f: mode_at_most(f.mode, limit) and (f.owner, f.group) == ("root", "root")


FILE_RULES = [
    FileRule("1.1.1/3/5/7", "control-plane and etcd unit files <= 0600 root:root", "control",
             _units(CONTROL_UNITS), _root_owned(0o600), lambda p: len(CONTROL_UNITS)),
    FileRule("4.1.1/2", "kubelet unit file <= 0600 root:root", "worker",
             _units(["kubelet"]), _root_owned(0o600), lambda p: 1),
    FileRule("units", "every unit file <= 0600 root:root", None,
             lambda p: [f for f in p.files.values() if f.path.startswith(UNIT_DIR + "/")], _root_owned(0o600),
             # each unit started, and the service each timer among them starts
             lambda p: len(p.units) + sum(u.endswith(".timer") for u in p.units)),
    FileRule("1.1.13-18", "admin, controller-manager and scheduler kubeconfigs <= 0600 root:root", "control",
             _paths(*(f"/etc/kubernetes/{n}.conf" for n in ("admin", "controller-manager", "scheduler"))),
             _root_owned(0o600), lambda p: 3),
    FileRule("4.1.3-6", "kube-proxy and kubelet (bootstrap) kubeconfigs <= 0600 root:root", "worker",
             _paths("/etc/kubernetes/kube-proxy.conf", "/etc/kubernetes/bootstrap-kubelet.conf"),
             _root_owned(0o600), lambda p: 2),
    FileRule("kubeconfigs", "every kubeconfig is exactly 0600", None,
             lambda p: [f for f in p.files.values() if _is_kubeconfig(f)], lambda f: f.mode == 0o600,
             lambda p: 3 if p.role == "control" else 2),
    FileRule("4.1.7/8", "the kubelet's client CA file <= 0644 root:root", "worker",
             lambda p: _paths(get_path(component_config(p, KUBELET), "authentication.x509.clientCAFile"))(p),
             _root_owned(0o644), lambda p: 1),
    FileRule("4.1.9/10", "kubelet config file <= 0600 root:root", "worker",
             lambda p: _paths(flags_of(p, KUBELET).get("--config"))(p), _root_owned(0o600), lambda p: 1),
    FileRule("1.1.20", "certificates <= 0644", None,
             lambda p: [f for f in p.files.values() if f.path.endswith(CERT_SUFFIXES)],
             lambda f: mode_at_most(f.mode, 0o644)),
    FileRule("1.1.21", "private keys exactly 0600", None,
             lambda p: [f for f in p.files.values() if _is_key(f)], lambda f: f.mode == 0o600),
    FileRule("1.1.19", "every file under /etc/kubernetes/pki is root:root", None,
             lambda p: [f for f in p.files.values() if f.path.startswith(PKI_DIR + "/")],
             lambda f: (f.owner, f.group) == ("root", "root")),
    FileRule("etcd-pki", "etcd's own CA cert and member pairs: etcd:etcd, keys 0600", "control",
             lambda p: [f for f in p.files.values() if f.path.startswith(ETCD_PKI + "/")],
             lambda f: f.path in ETCD_OWNED and (f.owner, f.group) == ("etcd", "etcd")
             and (f.mode == 0o600 if f.path.endswith(".key") else mode_at_most(f.mode, 0o644)),
             lambda p: len(ETCD_OWNED)),
    FileRule("secrets", "every file marked secret <= 0600", None,
             lambda p: [f for f in p.files.values() if f.secret], lambda f: mode_at_most(f.mode, 0o600)),
]


@pytest.mark.parametrize("rule", [pytest.param(r, id=f"{r.id} {r.text}") for r in FILE_RULES])
def test_cis_file(cluster, rule):
    bad, selected = [], 0
    for plan in cluster.plans.values():
        if rule.role and plan.role != rule.role:
            continue
        files = rule.select(plan)
        selected += len(files)
        if rule.expected is not None:
            assert len(files) == rule.expected(plan), \
                f"CIS {rule.id}: {plan.name}: selected {[f.path for f in files]}"
        bad += [f"{plan.name}:{f.path} {f.mode:04o} {f.owner}:{f.group}" for f in files if not rule.ok(f)]
    assert selected, f"CIS {rule.id}: the rule selects no file: it checks nothing"
    assert not bad, f"CIS {rule.id}: {rule.text}; violations: " + "; ".join(bad)


def test_cis_1_1_19_pki_directories_are_root_owned(cluster):
    for plan in cluster.plans.values():
        pki_dirs = [d for d in plan.dirs.values() if d.path == PKI_DIR or d.path.startswith(PKI_DIR + "/")]
        assert any(d.path == PKI_DIR for d in pki_dirs), f"{plan.name}: {PKI_DIR} is not managed"
        for d in pki_dirs:
            assert (d.owner, d.group) == ("root", "root"), f"CIS 1.1.19: {plan.name}:{d.path} {d.owner}:{d.group}"
            assert mode_at_most(d.mode, 0o755), f"{plan.name}:{d.path} is {d.mode:04o}"
    # the etcd-owned exception stays exactly that: control hosts only, and the key is the etcd member's
    for plan in cluster.hosts("worker"):
        assert not [f.path for f in plan.files.values() if f.owner != "root" or f.group != "root"]


def test_cis_1_1_11_12_etcd_data_dir(cluster):
    for plan in cluster.hosts("control"):
        data_dir = flags_of(plan, ETCD)["--data-dir"]
        d: HostDir | None = plan.dirs.get(data_dir)
        assert d is not None, f"{plan.name}: etcd --data-dir {data_dir} is not a managed directory"
        assert mode_at_most(d.mode, 0o700), f"CIS 1.1.11: {data_dir} is {d.mode:04o}"
        assert (d.owner, d.group) == ("etcd", "etcd"), f"CIS 1.1.12: {data_dir} is {d.owner}:{d.group}"
        assert "etcd" in [u.name for u in plan.users], "the dedicated etcd user is not created"
        unit = unit_file(plan, ETCD).content
        assert ref.unit_values(unit, "Service", "User") == ["etcd"]
        assert ref.unit_values(unit, "Service", "Group") == ["etcd"]
        # the unit's sandbox must leave the data dir writable
        assert data_dir in " ".join(ref.unit_values(unit, "Service", "ReadWritePaths")).split()


# ---------------------------------------------------------------------------------------------
# 2. CIS: rules that join a flag to the file it names


def test_cis_1_2_27_28_encryption_first_provider_is_secretbox(cluster):
    for plan in cluster.hosts("control"):
        doc = yaml_of(plan, flags_of(plan, API)["--encryption-provider-config"], "--encryption-provider-config")
        assert doc["kind"] == "EncryptionConfiguration"
        covering = [r for r in doc["resources"] if "secrets" in r["resources"] or "*.*" in r["resources"]]
        assert covering, "CIS 1.2.27: secrets are not covered by the encryption config"
        providers = covering[0]["providers"]
        first = next(iter(providers[0]))
        assert first == "secretbox", f"CIS 1.2.28: first provider is {first}, not secretbox"
        key = base64.b64decode(providers[0]["secretbox"]["keys"][0]["secret"], validate=True)
        assert len(key) == 32, "secretbox needs a 32-byte key"
        assert key == cluster.prepared.material.encryption_key


AUDIT_TARGETS = [("", "secrets"), ("", "configmaps"), ("authentication.k8s.io", "tokenreviews")]
AUDIT_CONDITIONS = ("users", "userGroups", "verbs", "namespaces")


def _audit_rule_matches(rule: dict, group: str, resource: str) -> bool:
    if "resources" not in rule:
        return "nonResourceURLs" not in rule          # neither: matches every request
    return any(gr.get("group", "") == group and (not gr.get("resources") or resource in gr["resources"]
                                                  or "*" in gr["resources"])
               for gr in rule["resources"])


def test_cis_3_2_1_audit_policy_keeps_secret_payloads_out(cluster):
    """Audit rules are first-match. Every rule that can catch a request on secrets, configmaps or
    tokenreviews, up to the first that catches all of them, logs at most Metadata; that one
    logs exactly Metadata."""
    for plan in cluster.hosts("control"):
        policy = yaml_of(plan, flags_of(plan, API)["--audit-policy-file"], "--audit-policy-file")
        assert policy["kind"] == "Policy" and policy["rules"], "CIS 3.2.1: the policy needs a rule"
        for group, resource in AUDIT_TARGETS:
            levels, final = [], None
            for rule in policy["rules"]:
                if not _audit_rule_matches(rule, group, resource):
                    continue
                levels.append(rule["level"])
                if not any(rule.get(c) for c in AUDIT_CONDITIONS):
                    final = rule["level"]
                    break
            what = f"{group or 'core'}/{resource}"
            assert final == "Metadata", f"CIS 3.2.1: {what} is finally logged at {final}, not Metadata"
            assert set(levels) <= {"None", "Metadata"}, f"CIS 3.2.1: {what} may be logged at {levels}"


def test_cis_2_7_etcd_trusts_only_the_etcd_ca(cluster):
    m = cluster.prepared.material
    etcd_ca, cluster_ca, fp_ca = (m.pair(n).cert for n in (ETCD_CA, CLUSTER_CA, FRONT_PROXY_CA))
    for plan in cluster.hosts("control"):
        ef, af = flags_of(plan, ETCD), flags_of(plan, API)
        for flag in ("--trusted-ca-file", "--peer-trusted-ca-file"):
            ca = cert_of(plan, ef[flag], f"etcd {flag}")
            assert ca == etcd_ca, f"CIS 2.7: etcd {flag} is not the etcd CA"
            assert ca != cluster_ca and ca != fp_ca
            assert ca.subject != cluster_ca.subject
        assert cert_of(plan, af["--etcd-cafile"], "--etcd-cafile") == etcd_ca
        for cert_flag in ("--cert-file", "--peer-cert-file"):
            assert issued_by(cert_of(plan, ef[cert_flag], cert_flag), etcd_ca)
        client = cert_of(plan, af["--etcd-certfile"], "--etcd-certfile")
        assert issued_by(client, etcd_ca) and not issued_by(client, cluster_ca)


def test_front_proxy_ca_differs_from_client_ca(cluster):
    for plan in cluster.hosts("control"):
        for component in (API, CM):
            f = flags_of(plan, component)
            client_ca = cert_of(plan, f["--client-ca-file"], f"{component} --client-ca-file")
            fp_ca = cert_of(plan, f["--requestheader-client-ca-file"], f"{component} --requestheader-client-ca-file")
            assert client_ca != fp_ca and client_ca.subject != fp_ca.subject
            assert public_der(client_ca) != public_der(fp_ca)
        f = flags_of(plan, API)
        fp_ca = cert_of(plan, f["--requestheader-client-ca-file"], "--requestheader-client-ca-file")
        proxy = cert_of(plan, f["--proxy-client-cert-file"], "--proxy-client-cert-file")
        client_ca = cert_of(plan, f["--client-ca-file"], "--client-ca-file")
        assert issued_by(proxy, fp_ca) and not issued_by(proxy, client_ca)
        cn = proxy.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
        assert cn in _items(f["--requestheader-allowed-names"])


def test_cis_4_2_9_kubelet_serving_cert_is_verifiable_by_the_apiserver(cluster):
    controls = cluster.hosts("control")
    apiserver_kubelet_ca = {cert_of(p, flags_of(p, API)["--kubelet-certificate-authority"], "ca") for p in controls}
    assert len(apiserver_kubelet_ca) == 1
    (kubelet_ca,) = apiserver_kubelet_ca
    for plan in cluster.hosts("worker"):
        cfg = component_config(plan, KUBELET)
        cert = cert_of(plan, cfg["tlsCertFile"], "tlsCertFile")
        key = serialization.load_pem_private_key(file_of(plan, cfg["tlsPrivateKeyFile"], "tlsPrivateKeyFile").content,
                                                 None)
        assert public_der(key) == cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        assert issued_by(cert, kubelet_ca), f"{plan.name}: serving cert not signed by the apiserver's kubelet CA"
        assert cert_of(plan, cfg["authentication"]["x509"]["clientCAFile"], "clientCAFile") == kubelet_ca
        address = next(h.address for h in cluster.prepared.inventory.spec.hosts if h.name == plan.name)
        ips = [str(i) for i in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
               .value.get_values_for_type(x509.IPAddress)]
        assert address in ips, f"{plan.name}: the apiserver dials {address} (InternalIP) but the SANs are {ips}"


FILE_FLAG = re.compile(r"(-file|-cafile|-certfile|-keyfile|kubeconfig|^--config)$")
WRITTEN_BY_KUBELET = {"/etc/kubernetes/kubelet.conf"}    # written after TLS bootstrapping


def test_every_file_a_flag_or_config_names_is_rendered(cluster):
    missing = []
    for plan in cluster.plans.values():
        for component in CONTROL_UNITS + WORKER_UNITS:
            if not unit_file(plan, component) or component == "containerd":
                continue
            for name, value in flags_of(plan, component).items():
                if FILE_FLAG.search(name) and value not in WRITTEN_BY_KUBELET and value not in plan.files:
                    missing.append(f"{plan.name}: {component} {name}={value}")
        for _, doc in documents(plan):
            for path in ("authentication.x509.clientCAFile", "tlsCertFile", "tlsPrivateKeyFile",
                         "clientConnection.kubeconfig"):
                value = get_path(doc, path)
                if value is not ABSENT and value not in plan.files:
                    missing.append(f"{plan.name}: {doc['kind']} {path}={value}")
    assert not missing, "files named but not rendered: " + "; ".join(missing)


# ---------------------------------------------------------------------------------------------
# 3. the hidden control plane


def _tree_paths(cluster: Cluster, host: str) -> list[str]:
    root = cluster.tree / host
    assert root.is_dir()
    return ["/" + str(p.relative_to(root)) for p in root.rglob("*") if p.name != "MANIFEST"]


NODE_PREFIXES = ("/var/lib/kubelet", "/var/lib/kube-proxy", "/etc/containerd", "/var/lib/containerd",
                 "/run/containerd", "/etc/cni", "/opt/cni", "/var/lib/cni")
NODE_NAME_STARTS = ("kubelet", "kube-proxy", "containerd", "cni", "bootstrap-kubelet")


def _node_thing(path: str) -> bool:
    return path.startswith(NODE_PREFIXES) or any(part.startswith(NODE_NAME_STARTS) for part in path.split("/"))


def test_control_hosts_hold_nothing_of_a_node(cluster):
    for plan in cluster.hosts("control"):
        # the example routes to pods from its control hosts (egress: routes): a route, not a node
        assert plan.units == [f"{u}.service" for u in CONTROL_UNITS] + [ROUTES_UNIT, REPAIR_TIMER], plan.units
        paths = list(plan.files) + list(plan.dirs) + _tree_paths(cluster, plan.name)
        assert not [p for p in paths if _node_thing(p)], f"{plan.name} holds node files"
        units_on_disk = sorted(p.name for p in (cluster.tree / plan.name / UNIT_DIR.lstrip("/")).iterdir())
        assert units_on_disk == sorted([f"{u}.service" for u in CONTROL_UNITS]
                                       + [ROUTES_UNIT, REPAIR_TIMER, REPAIR_SERVICE])
        for u in CONTROL_UNITS:
            binary = Path(ref.exec_start(unit_file(plan, u).content)[0]).name
            assert binary == u
        blob = b"".join(f.content for f in plan.files.values())
        assert b"containerd.sock" not in blob and b"/etc/cni" not in blob


def test_the_node_detector_is_not_fooled():
    assert _node_thing("/var/lib/kubelet/config.yaml")
    assert _node_thing("/etc/systemd/system/kube-proxy.service")
    assert _node_thing("/etc/kubernetes/bootstrap-kubelet.conf")
    assert _node_thing("/etc/cni/net.d/10-bridge.conf")
    assert not _node_thing("/etc/kubernetes/pki/apiserver-kubelet-client.crt")   # the apiserver's own


CONTROL_WORDS = ("etcd", "apiserver", "controller-manager", "scheduler")


def test_workers_hold_nothing_of_the_control_plane(cluster):
    for plan in cluster.hosts("worker"):
        assert plan.units == [ROUTES_UNIT, REPAIR_TIMER] + [f"{u}.service" for u in WORKER_UNITS], plan.units
        assert plan.users == [], "a worker needs no etcd (or other) system user"
        paths = list(plan.files) + list(plan.dirs) + _tree_paths(cluster, plan.name)
        bad = [p for p in paths if any(w in p for w in CONTROL_WORDS)]
        assert not bad, f"{plan.name} holds control-plane files: {bad}"
        assert not (cluster.tree / plan.name / "var/lib/etcd").exists()
        for u in WORKER_UNITS:
            assert Path(ref.exec_start(unit_file(plan, u).content)[0]).name == u


def _private_keys(content: bytes) -> list:
    """Every PEM private key in a file, also those base64-embedded in a kubeconfig."""
    blobs = [content]
    try:
        doc = yaml.safe_load(content)
    except yaml.YAMLError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Config":
        blobs += [base64.b64decode(u["user"]["client-key-data"]) for u in doc.get("users", [])
                  if "client-key-data" in u.get("user", {})]
    keys = []
    for blob in blobs:
        for m in re.finditer(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", blob, re.S):
            keys.append(serialization.load_pem_private_key(m[0], None))
    return keys


def test_no_ca_private_key_reaches_a_worker(cluster):
    m = cluster.prepared.material
    for name in (CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA):
        pem = issue.key_pem(m.pair(name).key)
        body = b"".join(pem.strip().splitlines()[1:-1])     # the key's base64, unwrapped
        for plan in cluster.hosts("worker"):
            for f in plan.files.values():
                flat = b"".join(f.content.split())
                for needle in (pem, base64.b64encode(pem), body):
                    assert needle not in flat and needle not in f.content, f"{name} key in {plan.name}:{f.path}"


def test_workers_get_only_their_own_keys_and_token(cluster):
    m = cluster.prepared.material
    for plan in cluster.hosts("worker"):
        allowed = {public_der(m.pair(f"kubelet/{plan.name}-serving").key): f"kubelet/{plan.name}-serving",
                   public_der(m.pair(f"kube-proxy/{plan.name}").key): f"kube-proxy/{plan.name}"}
        found = {}
        for f in plan.files.values():
            for key in _private_keys(f.content):
                der = public_der(key)
                assert der in allowed, f"{plan.name}:{f.path} holds a private key that is not the node's own"
                found[allowed[der]] = f.path
        assert set(found) == set(allowed.values()), f"{plan.name}: expected its own keys, found {found}"
        blob = b"\n".join(f.content for f in plan.files.values())
        assert public_der(m.sa_key) not in [public_der(k) for f in plan.files.values()
                                            for k in _private_keys(f.content)]
        assert m.encryption_key_b64.encode() not in blob and m.encryption_key not in blob
        for node, token in m.tokens.items():
            assert (token.secret.encode() in blob) == (node == plan.name), \
                f"{plan.name}: bootstrap token of {node} {'missing' if node == plan.name else 'present'}"
