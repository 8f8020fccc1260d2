"""Contract stand-in runtime: the body of every generated stand-in script.

NOT Kubernetes. `python -m tests.standins install DIR` copies this module's source, verbatim,
into five scripts (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
kube-proxy) and appends the reference lists each one needs (tests/refdata) plus a call to ``main``.
The scripts run on Debian 12 lab hosts whose root holds only python3, python3-yaml and
openssl, so this module may import the standard library, ``yaml`` and nothing else, and does
all its certificate work through the ``openssl`` command line.

What a stand-in does, started by the real rendered systemd unit:

1. checks its command line against flags/<component>.txt (unknown or deprecated: refused);
2. checks every config file a flag names against config/<Kind>.txt (unknown fields, wrong
   apiVersion or kind: refused), every file a flag or config field names (exists, readable,
   parses), every certificate against the CA its flag implies (``openssl verify -CAfile``), and
   every key against its certificate (public keys compared);
3. kube-apiserver only: reaches the first --etcd-servers URL over TLS and GETs /health;
4. serves health endpoints only (never an API call) until SIGTERM, then exits 0.

Exit codes: 2 = the command line or a file breaks the contract (every problem is printed, one
per line, naming the flag or field); 1 = the environment failed (etcd unreachable, a port
already in use, openssl missing). Everything is logged to stderr (journald); no key, token
or secret is ever printed, only paths, subjects and token IDs.
"""

from __future__ import annotations

import base64
import binascii
import copy
import http.client
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

EXIT_CONTRACT = 2
EXIT_RUNTIME = 1
VERSION_ENV = "HIDDENPLANE_STANDIN_VERSION"          # what /version and --version report
ETCD_WAIT_ENV = "HIDDENPLANE_STANDIN_ETCD_WAIT"      # seconds to keep retrying etcd (default 30)
DEFAULT_VERSION = "v0.0.0-standin"
DEFAULT_ETCD_WAIT = 30.0

# Go's crypto/tls names (what --tls-cipher-suites and tlsCipherSuites accept) -> OpenSSL's.
# None: a name Go accepts that has no TLS 1.2 OpenSSL equivalent here (RC4, TLS 1.3 suites).
GO_CIPHERS = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": "ECDHE-RSA-DES-CBC3-SHA",
    "TLS_RSA_WITH_RC4_128_SHA": None,
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA": None,
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA": None,
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
GO_TLS_VERSIONS = {"VersionTLS10": ssl.TLSVersion.TLSv1, "VersionTLS11": ssl.TLSVersion.TLSv1_1,
                   "VersionTLS12": ssl.TLSVersion.TLSv1_2, "VersionTLS13": ssl.TLSVersion.TLSv1_3}
GO_DURATION = re.compile(r"^(0|([0-9]+(\.[0-9]+)?(ns|us|\u00b5s|ms|s|m|h))+)$")
BOOTSTRAP_TOKEN = re.compile(r"^([a-z0-9]{6})\.([a-z0-9]{16})$")
SECRET_KEY_BYTES = {"secretbox": (32,), "aescbc": (16, 24, 32), "aesgcm": (16, 24, 32)}


# ---------------------------------------------------------------------------------------------
# the reference lists (embedded into the script at install time)


def _data_lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]


def _version_line(text: str) -> str:
    lines = text.splitlines()
    m = re.match(r"^#\s*kubernetes-version:\s*(.*)$", lines[1]) if len(lines) > 1 else None
    return m[1].split(" (")[0].strip() if m else "unknown version"


class Reference:
    def __init__(self, component: str, data: dict):
        self.component = component
        self.flags_text = data["flags"]
        self.flags: dict[str, bool] = {}
        for line in _data_lines(self.flags_text):
            name, *rest = line.split()
            self.flags[name] = rest == ["deprecated"]
        self.flags_version = _version_line(self.flags_text)
        self.configs: dict[str, str] = dict(data.get("configs", {}))
        self.opaque: dict[str, set[str]] = {}
        for line in _data_lines(data.get("opaque", "")):
            kind, path, *_why = line.split()
            self.opaque.setdefault(kind, set()).add(path)

    def kind(self, kind: str) -> tuple[str, frozenset[str], frozenset[str], str]:
        """(apiVersion on line 1, documented paths, opaque prefixes, Kubernetes version)."""
        text = self.configs[kind]
        m = re.match(r"^#\s*apiVersion:\s*(\S+)", text.splitlines()[0])
        return (m[1] if m else "?", frozenset(_data_lines(text)), frozenset(self.opaque.get(kind, ())),
                _version_line(text))


# ---------------------------------------------------------------------------------------------
# the report: every problem is collected, then the stand-in refuses to start


class Report:
    def __init__(self, component: str):
        self.component = component
        self.problems: list[str] = []

    def log(self, msg: str) -> None:
        print(f"{self.component} stand-in: {msg}", file=sys.stderr, flush=True)

    def ok(self, msg: str) -> None:
        self.log(f"ok: {msg}")

    def fail(self, msg: str) -> None:
        self.problems.append(msg)
        self.log(f"error: {msg}")

    def stop_if_problems(self) -> None:
        if self.problems:
            self.log(f"refusing to start: {len(self.problems)} contract problem(s) above "
                     "(this is a contract stand-in, not Kubernetes)")
            sys.exit(EXIT_CONTRACT)

    def fatal(self, msg: str, code: int = EXIT_RUNTIME) -> None:
        self.log(f"fatal: {msg}")
        sys.exit(code)


# ---------------------------------------------------------------------------------------------
# the command line


class Flags:
    def __init__(self, values: dict[str, list[str | None]]):
        self.values = values

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default: str | None = None) -> str | None:
        """The last value given (pflag: the last one wins)."""
        v = self.values.get(name)
        return v[-1] if v else default

    def all(self, name: str) -> list[str]:
        """Every value of a flag given once or more; comma lists split."""
        out: list[str] = []
        for v in self.values.get(name, []):
            out += [s for s in (v or "").split(",") if s]
        return out

    def files(self, name: str) -> list[str]:
        return [v for v in self.values.get(name, []) if v is not None]


def parse_command_line(r: Report, ref: Reference, argv: list[str]) -> Flags:
    values: dict[str, list[str | None]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "-v") or arg.startswith("-v="):      # the two documented shorthands
            arg = "-" + arg
        if not arg.startswith("--") or arg == "--":
            r.fail(f"unexpected argument {arg!r}: {ref.component} takes flags only")
            i += 1
            continue
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name, value = arg, argv[i + 1]
            i += 1
        else:
            name, value = arg, None
        values.setdefault(name, []).append(value)
        i += 1
    where = f"flags/{ref.component}.txt, Kubernetes {ref.flags_version}"
    for name in values:
        if name not in ref.flags:
            r.fail(f"unknown flag: {name} (not in {where})")
        elif ref.flags[name]:
            r.fail(f"flag {name} is deprecated upstream ({where})")
    return Flags(values)


# ---------------------------------------------------------------------------------------------
# files, YAML documents, config kinds


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (the real components decode strictly)."""


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate field {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def flatten(doc, opaque: frozenset[str] | set[str] = frozenset(), prefix: str = "") -> set[str]:
    """Dotted paths of every key in ``doc``; list indices are dropped (a list's items hang off
    the list's own path) and descent stops at any path in ``opaque``."""
    out: set[str] = set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            if path not in opaque:
                out |= flatten(value, opaque, path)
    elif isinstance(doc, list):
        for item in doc:
            out |= flatten(item, opaque, prefix)
    return out


class Files:
    """Reads each file once; every problem names the flag or field that named the file."""

    def __init__(self, r: Report):
        self.r = r
        self._data: dict[str, bytes | None] = {}
        self.kubeconfigs: dict[tuple, tuple] = {}     # (path, want) -> (first label, result)

    def read(self, label: str, path: str | None) -> bytes | None:
        if not path:
            self.r.fail(f"{label}: empty path")
            return None
        if path in self._data:
            return self._data[path]
        data = None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.r.fail(f"{label} {path}: no such file")
        except IsADirectoryError:
            self.r.fail(f"{label} {path}: is a directory, not a file")
        except PermissionError:
            self.r.fail(f"{label} {path}: not readable by uid {os.getuid()}")
        except OSError as e:
            self.r.fail(f"{label} {path}: cannot read: {e.strerror}")
        self._data[path] = data
        return data

    def yaml_doc(self, label: str, path: str | None):
        data = self.read(label, path)
        if data is None:
            return None
        try:
            doc = yaml.load(data, Loader=_StrictLoader)
        except yaml.YAMLError as e:
            self.r.fail(f"{label} {path}: not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            return None
        if not isinstance(doc, dict):
            self.r.fail(f"{label} {path}: not a YAML mapping")
            return None
        return doc


def check_config(r: Report, ref: Reference, files: Files, label: str, path: str | None, kind: str) -> dict | None:
    """A config file of ``kind``: kind, apiVersion (line 1 of config/<Kind>.txt) and every field."""
    doc = files.yaml_doc(label, path)
    if doc is None:
        return None
    api_version, paths, opaque, version = ref.kind(kind)
    before = len(r.problems)
    if doc.get("kind") != kind:
        r.fail(f"{label} {path}: kind is {doc.get('kind')!r}, expected {kind!r}")
    if doc.get("apiVersion") != api_version:
        r.fail(f"{label} {path}: apiVersion is {doc.get('apiVersion')!r}, expected {api_version!r} "
               f"(config/{kind}.txt)")
    unknown = flatten(doc, opaque) - paths
    # name only the topmost unknown field of each subtree
    for p in sorted(unknown):
        parts = p.split(".")
        if any(".".join(parts[:n]) in unknown for n in range(1, len(parts))):
            continue
        r.fail(f"{label} {path}: unknown field {p!r} (not in config/{kind}.txt, Kubernetes {version})")
    if len(r.problems) == before:
        r.ok(f"{label} {path}: {kind} {api_version}, every field documented")
    return doc


def resolve(path: str, relative_to: str) -> str:
    """Paths inside a config file are relative to that file's directory (as upstream)."""
    return path if os.path.isabs(path) else os.path.join(os.path.dirname(os.path.abspath(relative_to)), path)


def dig(doc: dict, dotted: str):
    cur = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


# ---------------------------------------------------------------------------------------------
# certificates and keys, through the openssl CLI


class OpenSSL:
    def __init__(self, r: Report):
        self.r = r
        self.exe = shutil.which("openssl") or "/usr/bin/openssl"
        if not os.access(self.exe, os.X_OK):
            r.fatal("the openssl command is missing (Debian package: openssl)")
        self.tmp = tempfile.mkdtemp(prefix="standin-")          # CA certificates only, never keys

    def run(self, args: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe] + args, input=stdin if stdin is not None else b"",
                              capture_output=True, timeout=30)

    def ca_file(self, pem: bytes) -> str:
        fd, path = tempfile.mkstemp(dir=self.tmp, suffix=".crt")
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return path

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _first_line(data: bytes) -> str:
    for line in data.decode(errors="replace").splitlines():
        if line.strip() and "verification failed" not in line:
            return line.strip()
    return "(no message)"


def _verify_reason(out: bytes) -> str:
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("error ") and "verification failed" not in line:
            return line.strip()
    return _first_line(out)


class Cert:
    def __init__(self, where: str, pem: bytes, path: str | None, subject: str, is_ca: bool, pubkey: str,
                 not_before: float, not_after: float):
        self.where, self.pem, self.path = where, pem, path
        self.subject, self.is_ca, self.pubkey = subject, is_ca, pubkey
        self.not_before, self.not_after = not_before, not_after

    @property
    def cn(self) -> str | None:
        for part in re.split(r"(?<!\\),", self.subject):
            if part.startswith("CN="):
                return part[3:]
        return None


class Key:
    def __init__(self, where: str, pubkey: str):
        self.where, self.pubkey = where, pubkey


def _renamed(obj, where: str):
    """A cached certificate or key, named by the flag or field asking for it this time."""
    if obj is None:
        return None
    obj = copy.copy(obj)
    obj.where = where
    return obj


_PUBKEY = re.compile(r"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.S)


class PKI:
    def __init__(self, r: Report, files: Files):
        self.r, self.files = r, files
        self.ossl = OpenSSL(r)
        self._certs: dict[str, Cert | None] = {}
        self._keys: dict[str, Key | None] = {}

    # -- loading

    def cert(self, label: str, path: str | None = None, pem: bytes | None = None) -> Cert | None:
        """A certificate from a file (``path``) or from embedded data (``pem``, ``label`` names it)."""
        cache = path if path is not None else None
        where = f"{label} {path}" if path else label
        if cache is not None and cache in self._certs:
            return _renamed(self._certs[cache], where)
        if path is not None:
            pem = self.files.read(label, path)
        cert = None
        if pem is not None:
            p = self.ossl.run(["x509", "-noout", "-subject", "-nameopt", "RFC2253", "-startdate", "-enddate",
                               "-ext", "basicConstraints", "-pubkey"], pem)
            if p.returncode != 0:
                self.r.fail(f"{where}: not a PEM certificate ({_first_line(p.stderr)})")
            else:
                out = p.stdout.decode()
                subject = re.search(r"^subject=(.*)$", out, re.M)
                nb = re.search(r"^notBefore=(.*)$", out, re.M)
                na = re.search(r"^notAfter=(.*)$", out, re.M)
                key = _PUBKEY.search(out)
                cert = Cert(where, pem, path, subject[1].strip() if subject else "",
                            bool(re.search(r"\bCA:TRUE\b", out)), key[0] if key else "",
                            ssl.cert_time_to_seconds(nb[1].strip()) if nb else 0,
                            ssl.cert_time_to_seconds(na[1].strip()) if na else 0)
                now = time.time()
                if now > cert.not_after:
                    self.r.fail(f"{where}: certificate ({cert.subject}) expired on {na[1].strip()}")
                elif now < cert.not_before:
                    self.r.fail(f"{where}: certificate ({cert.subject}) not valid before {nb[1].strip()}")
        if cache is not None:
            self._certs[cache] = cert
        return cert

    def key(self, label: str, path: str | None = None, pem: bytes | None = None) -> Key | None:
        """A private key: only its public half is kept, nothing of it is ever printed."""
        where = f"{label} {path}" if path else label
        if path is not None and path in self._keys:
            return _renamed(self._keys[path], where)
        if path is not None:
            pem = self.files.read(label, path)
        key = None
        if pem is not None:
            p = self.ossl.run(["pkey", "-pubout", "-passin", "pass:"], pem)
            m = _PUBKEY.search(p.stdout.decode(errors="replace")) if p.returncode == 0 else None
            if not m:
                self.r.fail(f"{where}: not an unencrypted PEM private key")
            else:
                key = Key(where, m[0])
        if path is not None:
            self._keys[path] = key
        return key

    def public_key(self, label: str, path: str) -> str | None:
        """A PEM public key, or the public key of a PEM certificate (--service-account-key-file)."""
        pem = self.files.read(label, path)
        if pem is None:
            return None
        if b"CERTIFICATE" in pem:
            c = self.cert(label, path)
            return c.pubkey if c else None
        p = self.ossl.run(["pkey", "-pubin", "-pubout"], pem)
        m = _PUBKEY.search(p.stdout.decode(errors="replace")) if p.returncode == 0 else None
        if not m:
            self.r.fail(f"{label} {path}: not a PEM public key or certificate")
            return None
        return m[0]

    # -- checks

    def ca(self, label: str, path: str | None) -> Cert | None:
        c = self.cert(label, path)
        if c and not c.is_ca:
            self.r.fail(f"{label} {path}: not a CA certificate ({c.subject}, CA:FALSE)")
            return None
        if c:
            self.r.ok(f"{label} {path}: CA certificate {c.subject}")
        return c

    def matches(self, cert: Cert | None, key: Key | None, cert_label: str, key_label: str) -> bool:
        if cert is None or key is None:
            return False
        if " ".join(cert.pubkey.split()) != " ".join(key.pubkey.split()):
            self.r.fail(f"{key.where}: private key does not match {cert.where} ({cert.subject}): "
                        f"set {key_label} to the key of {cert_label}")
            return False
        self.r.ok(f"{key.where} matches {cert.where}")
        return True

    def chains(self, leaf: Cert | None, ca: Cert | None, ca_label: str, purpose: str | None = None,
               ip: str | None = None) -> bool:
        """``openssl verify -CAfile`` (with the purpose and the IP SAN if given)."""
        if leaf is None or ca is None:
            return False
        ca_path = ca.path or self.ossl.ca_file(ca.pem)
        args = ["verify", "-CAfile", ca_path]
        if purpose:
            args += ["-purpose", purpose]
        if ip:
            args += ["-verify_ip", ip]
        p = self.ossl.run(args + ([leaf.path] if leaf.path else []), None if leaf.path else leaf.pem)
        extra = (f" for {purpose}" if purpose else "") + (f" and IP {ip}" if ip else "")
        if p.returncode != 0 or b": OK" not in p.stdout:
            self.r.fail(f"{leaf.where} ({leaf.subject}) does not chain to {ca_label} ({ca.path or 'embedded'}, "
                        f"{ca.subject}){extra}: openssl verify: {_verify_reason(p.stderr + p.stdout)}")
            return False
        self.r.ok(f"{leaf.where} ({leaf.subject}) chains to {ca_label}{extra}")
        return True

    def pair(self, cert_label: str, cert_path: str | None, key_label: str, key_path: str | None,
             ca: Cert | None = None, ca_label: str = "", purpose: str | None = None,
             ip: str | None = None) -> Cert | None:
        """A certificate and its key given by two flags: both or neither, matching, chaining."""
        if cert_path is None and key_path is None:
            return None
        if cert_path is None or key_path is None:
            given, missing = (cert_label, key_label) if cert_path else (key_label, cert_label)
            self.r.fail(f"{given} is set but {missing} is not")
            return None
        cert = self.cert(cert_label, cert_path)
        key = self.key(key_label, key_path)
        self.matches(cert, key, cert_label, key_label)
        if ca is not None:
            self.chains(cert, ca, ca_label, purpose, ip)
        return cert


# ---------------------------------------------------------------------------------------------
# kubeconfigs


def _named(doc: dict, section: str, name: str | None, inner: str) -> dict | None:
    for item in doc.get(section) or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(inner)
            return value if isinstance(value, dict) else {}
    return None


def _b64(r: Report, where: str, value) -> bytes | None:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        r.fail(f"{where}: not valid base64")
        return None


def check_kubeconfig(r: Report, files: Files, pki: PKI, label: str, path: str | None, want: str) -> dict | None:
    """``want``: "cert" (client certificate that chains to the cluster's CA), "token", or
    "any" (whatever the user holds is checked). Returns {"server", "user", "token_id"}."""
    seen = files.kubeconfigs.get((path, want))
    if seen is not None:
        r.ok(f"{label} {path}: same kubeconfig as {seen[0]}, checked above")
        return seen[1]
    doc = files.yaml_doc(label, path)
    if doc is None:
        return None
    before = len(r.problems)
    where = f"{label} {path}"
    out = _check_kubeconfig(r, files, pki, label, path, want, doc, where)
    if len(r.problems) == before and out is not None:
        who = (f"client certificate {out['client']}" if out["client"]
               else f"bootstrap token {out['token_id']}" if out["token_id"] else "credentials")
        r.ok(f"{where}: server {out['server']}, user {out['user']!r} with {who}")
    files.kubeconfigs[(path, want)] = (label, out)
    return out


def _check_kubeconfig(r: Report, files: Files, pki: PKI, label: str, path: str, want: str, doc: dict,
                      where: str) -> dict | None:
    if doc.get("kind", "Config") != "Config" or doc.get("apiVersion", "v1") != "v1":
        r.fail(f"{where}: not a kubeconfig (kind {doc.get('kind')!r}, apiVersion {doc.get('apiVersion')!r})")
        return None
    ctx_name = doc.get("current-context")
    ctx = _named(doc, "contexts", ctx_name, "context")
    if not ctx_name or ctx is None:
        r.fail(f"{where}: current-context {ctx_name!r} names no context")
        return None
    cluster = _named(doc, "clusters", ctx.get("cluster"), "cluster")
    user = _named(doc, "users", ctx.get("user"), "user")
    if cluster is None:
        r.fail(f"{where}: context {ctx_name!r} names cluster {ctx.get('cluster')!r}, which is not defined")
        return None
    if user is None:
        r.fail(f"{where}: context {ctx_name!r} names user {ctx.get('user')!r}, which is not defined")
        return None
    server = str(cluster.get("server") or "")
    u = urllib.parse.urlsplit(server)
    if u.scheme != "https" or not u.hostname:
        r.fail(f"{where}: cluster server {server!r} is not an https:// URL")
    if cluster.get("insecure-skip-tls-verify"):
        r.fail(f"{where}: cluster {ctx.get('cluster')!r} sets insecure-skip-tls-verify")
    ca = None
    if "certificate-authority-data" in cluster:
        pem = _b64(r, f"{where}: certificate-authority-data", cluster["certificate-authority-data"])
        if pem is not None:
            ca = pki.cert(f"{label} certificate-authority-data", pem=pem)
            if ca and not ca.is_ca:
                r.fail(f"{where}: certificate-authority-data is not a CA certificate ({ca.subject})")
                ca = None
    elif cluster.get("certificate-authority"):
        ca = pki.ca(f"{label} certificate-authority", resolve(str(cluster["certificate-authority"]), path))
    else:
        r.fail(f"{where}: cluster {ctx.get('cluster')!r} has no certificate-authority(-data): "
               "the server could not be verified")

    out = {"server": server, "user": ctx.get("user"), "token_id": None, "client": None, "has_token": False}
    has_cert = any(k in user for k in ("client-certificate-data", "client-certificate"))
    has_token = any(k in user for k in ("token", "tokenFile"))
    if want == "cert" and not has_cert:
        r.fail(f"{where}: user {ctx.get('user')!r} holds no client certificate")
    if want == "token" and not has_token:
        r.fail(f"{where}: user {ctx.get('user')!r} holds no token")
    if has_cert:
        uwhere = f"{label} users[{ctx.get('user')}]"
        if "client-certificate-data" in user:
            pem = _b64(r, f"{uwhere}.client-certificate-data", user["client-certificate-data"])
            cert = pki.cert(f"{uwhere}.client-certificate-data", pem=pem) if pem is not None else None
        else:
            cert = pki.cert(f"{uwhere}.client-certificate", resolve(str(user["client-certificate"]), path))
        if "client-key-data" in user:
            pem = _b64(r, f"{uwhere}.client-key-data", user["client-key-data"])
            key = pki.key(f"{uwhere}.client-key-data", pem=pem) if pem is not None else None
        elif user.get("client-key"):
            key = pki.key(f"{uwhere}.client-key", resolve(str(user["client-key"]), path))
        else:
            r.fail(f"{uwhere}: client certificate without client-key(-data)")
            key = None
        pki.matches(cert, key, "the client certificate", "the client key")
        if ca is not None:
            pki.chains(cert, ca, f"{label}'s certificate-authority", "sslclient")
        out["client"] = cert.subject if cert else None
    if has_token:
        token = user.get("token")
        if token is None:
            tdata = files.read(f"{label} users[{ctx.get('user')}].tokenFile",
                               resolve(str(user["tokenFile"]), path))
            token = tdata.decode(errors="replace").strip() if tdata is not None else ""
        m = BOOTSTRAP_TOKEN.match(str(token))
        out["token_id"], out["has_token"] = (m[1] if m else None), bool(token)
    return out


# ---------------------------------------------------------------------------------------------
# small value checks


def check_ip(r: Report, label: str, value: str | None, allow_empty: bool = False) -> None:
    if value is None or (allow_empty and value == ""):
        return
    for part in value.split(","):
        try:
            ipaddress.ip_address(part)
        except ValueError:
            r.fail(f"{label}={value}: {part!r} is not an IP address")


def check_cidrs(r: Report, label: str, value: str | None) -> None:
    if not value:
        return
    for part in str(value).split(","):
        try:
            ipaddress.ip_network(part.strip(), strict=True)
        except ValueError as e:
            r.fail(f"{label}={value}: {e}")


def check_port(r: Report, label: str, value, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        port = int(value)
    except (TypeError, ValueError):
        r.fail(f"{label}={value}: not a port number")
        return default
    if not 0 <= port <= 65535:
        r.fail(f"{label}={value}: out of range 0-65535")
        return default
    return port


def check_duration(r: Report, label: str, value: str | None) -> None:
    if value is not None and not GO_DURATION.match(str(value)):
        r.fail(f"{label}={value}: not a Go duration (e.g. 24h0m0s)")


def host_port(r: Report, label: str, value: str) -> tuple[str, int] | None:
    m = re.match(r"^\[?([^\]]*?)\]?:([0-9]+)$", value)
    if not m:
        r.fail(f"{label} {value!r}: not HOST:PORT")
        return None
    check_ip(r, label, m[1])
    return m[1], check_port(r, label, m[2], 0)


def tls_settings(r: Report, label_version: str, version: str | None, label_ciphers: str,
                 ciphers: list[str]) -> tuple[ssl.TLSVersion | None, list[str]]:
    minimum = None
    if version:
        if version not in GO_TLS_VERSIONS:
            r.fail(f"{label_version}={version}: not one of {', '.join(GO_TLS_VERSIONS)}")
        else:
            minimum = GO_TLS_VERSIONS[version]
    mapped = []
    for name in ciphers:
        if name not in GO_CIPHERS:
            r.fail(f"{label_ciphers}: unknown cipher suite {name!r}")
        elif GO_CIPHERS[name]:
            mapped.append(GO_CIPHERS[name])
    return minimum, mapped


# ---------------------------------------------------------------------------------------------
# serving


class Endpoint:
    """One listener: (host, port) plus TLS settings (None: plain HTTP) and its routes."""

    def __init__(self, name: str, host: str, port: int, routes: dict, tls: ssl.SSLContext | None = None):
        self.name, self.host, self.port, self.routes, self.tls = name, host, port, routes, tls

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{h}:{self.port}"


def server_tls(r: Report, cert_file: str, key_file: str, client_ca: str | None, require: bool,
               minimum: ssl.TLSVersion | None, ciphers: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_file, key_file)
        if client_ca:
            ctx.load_verify_locations(cafile=client_ca)
    except (ssl.SSLError, OSError) as e:
        r.fatal(f"TLS setup with {cert_file}: {e}")
    ctx.verify_mode = ssl.CERT_REQUIRED if require else (ssl.CERT_OPTIONAL if client_ca else ssl.CERT_NONE)
    if minimum is not None:
        ctx.minimum_version = minimum
    if ciphers:
        ctx.set_ciphers(":".join(ciphers))
    return ctx


def self_signed(r: Report, ossl: OpenSSL, component: str, host: str) -> ssl.SSLContext:
    """What the real controller-manager and scheduler do without --tls-cert-file: a
    self-signed serving certificate (here from ``openssl req -x509``, in a private temp dir
    that is removed as soon as the certificate is loaded)."""
    d = tempfile.mkdtemp(prefix="standin-serving-")
    try:
        crt, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        name = host if host not in ("", "0.0.0.0", "::") else "localhost"
        san = "DNS:localhost,IP:127.0.0.1" + (f",IP:{name}" if name != "localhost" and name != "127.0.0.1" else "")
        p = ossl.run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                      "-keyout", key, "-out", crt, "-days", "365", "-subj", f"/CN={name}@{int(time.time())}",
                      "-addext", f"subjectAltName={san}"])
        if p.returncode != 0:
            r.fatal(f"openssl req -x509 failed: {_first_line(p.stderr)}")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        r.ok(f"no --tls-cert-file: serving a self-signed certificate (CN={name}@...), as {component} does")
        return ctx
    finally:
        shutil.rmtree(d, ignore_errors=True)


class _Handler(BaseHTTPRequestHandler):
    server_version = "hiddenplane-contract-standin"
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        route = self.server.endpoint.routes.get(path) if self.command in ("GET", "HEAD") else None
        if route is None:
            status, ctype, body = 404, "text/plain; charset=utf-8", (
                b"404 page not found: this is a contract stand-in, it never answers API calls\n")
        else:
            status, ctype, body = route() if callable(route) else route
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, fmt: str, *args) -> None:
        who = self.client_address[0]
        if isinstance(self.connection, ssl.SSLSocket):
            peer = self.connection.getpeercert() or {}
            cn = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
            if cn:
                who += f" (CN={cn[0]})"
        self.server.report.log(f"{self.server.endpoint.name}: {who} {fmt % args}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, endpoint: Endpoint, report: Report):
        self.endpoint, self.report = endpoint, report
        self.address_family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        super().__init__((endpoint.host, endpoint.port), _Handler)

    def server_bind(self) -> None:          # no reverse DNS lookup (HTTPServer does getfqdn)
        import socketserver
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.endpoint.host, self.server_address[1]

    def finish_request(self, request, client_address) -> None:
        if self.endpoint.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(30)
        try:
            tls = self.endpoint.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            self.report.log(f"{self.endpoint.name}: TLS handshake from {client_address[0]} refused: "
                            f"{getattr(e, 'reason', None) or e}")
            return
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            try:
                tls.close()
            except OSError:
                pass


def serve(r: Report, endpoints: list[Endpoint]) -> None:
    servers = []
    for ep in endpoints:
        try:
            srv = _Server(ep, r)
        except OSError as e:
            r.fatal(f"cannot listen on {ep.url} ({ep.name}): {e.strerror or e}")
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, name=ep.name, daemon=True).start()
    r.log("ready: serving " + ", ".join(f"{ep.name} on {ep.url} ({', '.join(sorted(ep.routes))})"
                                        for ep in endpoints)
          + "; nothing else, no API (contract stand-in)")
    while True:
        signal.pause()


def text(body: str, status: int = 200) -> tuple[int, str, bytes]:
    return status, "text/plain; charset=utf-8", body.encode()


def as_json(obj, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", (json.dumps(obj, indent=2) + "\n").encode()


def version() -> str:
    return os.environ.get(VERSION_ENV) or DEFAULT_VERSION


def health_routes(*paths: str) -> dict:
    return {p: text("ok") for p in paths}


# ---------------------------------------------------------------------------------------------
# kube-apiserver

APISERVER_FILES = (   # flags naming files the apiserver reads at start (checked: exist, readable)
    "--client-ca-file", "--tls-cert-file", "--tls-private-key-file", "--etcd-cafile", "--etcd-certfile",
    "--etcd-keyfile", "--kubelet-certificate-authority", "--kubelet-client-certificate", "--kubelet-client-key",
    "--proxy-client-cert-file", "--proxy-client-key-file", "--requestheader-client-ca-file",
    "--service-account-key-file", "--service-account-signing-key-file", "--encryption-provider-config",
    "--audit-policy-file", "--admission-control-config-file", "--authentication-config",
    "--authorization-config", "--egress-selector-config-file", "--oidc-ca-file", "--token-auth-file",
    "--authentication-token-webhook-config-file", "--authorization-webhook-config-file",
    "--tracing-config-file", "--audit-webhook-config-file",
)
APISERVER_CONFIGS = {   # flag -> config Kind it names
    "--encryption-provider-config": "EncryptionConfiguration",
    "--audit-policy-file": "Policy",
    "--admission-control-config-file": "AdmissionConfiguration",
    "--authentication-config": "AuthenticationConfiguration",
    "--authorization-config": "AuthorizationConfiguration",
    "--egress-selector-config-file": "EgressSelectorConfiguration",
}


def _check_encryption(r: Report, doc: dict, where: str) -> None:
    for res in doc.get("resources") or []:
        for prov in (res or {}).get("providers") or []:
            for name, body in (prov or {}).items():
                if name not in SECRET_KEY_BYTES:
                    continue
                keys = (body or {}).get("keys") or []
                if not keys:
                    r.fail(f"{where}: provider {name} has no keys")
                for k in keys:
                    raw = _b64(r, f"{where}: {name} key {k.get('name')!r} secret", k.get("secret", ""))
                    if raw is not None and len(raw) not in SECRET_KEY_BYTES[name]:
                        r.fail(f"{where}: {name} key {k.get('name')!r} is {len(raw)} bytes, "
                               f"expected {' or '.join(map(str, SECRET_KEY_BYTES[name]))}")


def _check_admission(r: Report, files: Files, doc: dict, where: str, path: str, enabled: list[str]) -> None:
    plugins = {p.get("name"): p for p in doc.get("plugins") or [] if isinstance(p, dict)}
    for name, p in plugins.items():
        if p.get("path"):
            files.read(f"{where} plugin {name} path", resolve(str(p["path"]), path))
    if "EventRateLimit" in enabled:
        cfg = (plugins.get("EventRateLimit") or {}).get("configuration")
        if not cfg and not (plugins.get("EventRateLimit") or {}).get("path"):
            r.fail(f"{where}: --enable-admission-plugins has EventRateLimit but the file configures no "
                   "EventRateLimit plugin (the apiserver refuses to start without its limits)")
        elif cfg and (cfg.get("apiVersion") != "eventratelimit.admission.k8s.io/v1alpha1"
                      or cfg.get("kind") != "Configuration" or not cfg.get("limits")):
            r.fail(f"{where}: EventRateLimit configuration must be eventratelimit.admission.k8s.io/v1alpha1 "
                   "Configuration with limits")


def etcd_health(r: Report, flags: Flags) -> None:
    servers = flags.all("--etcd-servers")
    url = servers[0]
    u = urllib.parse.urlsplit(url)
    if u.scheme != "https" or not u.hostname:
        r.fatal(f"--etcd-servers: {url!r} is not an https:// URL (etcd runs with client-cert-auth)", EXIT_CONTRACT)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=flags.get("--etcd-cafile"))
        ctx.load_cert_chain(flags.get("--etcd-certfile"), flags.get("--etcd-keyfile"))
    except (ssl.SSLError, OSError, TypeError) as e:
        r.fatal(f"etcd client TLS setup: {e}", EXIT_CONTRACT)
    wait = float(os.environ.get(ETCD_WAIT_ENV) or DEFAULT_ETCD_WAIT)
    deadline, attempt, last = time.monotonic() + wait, 0, ""
    target = f"{url.rstrip('/')}/health"
    r.log(f"etcd: GET {target} with --etcd-certfile, verifying the server with --etcd-cafile "
          f"(retrying up to {wait:g}s)" + (f"; not checked: {', '.join(servers[1:])}" if servers[1:] else ""))
    while True:
        attempt += 1
        conn = http.client.HTTPSConnection(u.hostname, u.port or 2379, context=ctx, timeout=5)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = resp.read(4096)
            try:
                healthy = resp.status == 200 and json.loads(body).get("health") in ("true", True)
            except ValueError:
                healthy = False
            if healthy:
                r.ok(f"etcd {target}: HTTP {resp.status} {body.decode(errors='replace').strip()} "
                     f"(attempt {attempt})")
                return
            last = f"HTTP {resp.status} {body.decode(errors='replace').strip()[:200]}"
        except ssl.SSLCertVerificationError as e:
            r.fatal(f"etcd {target}: the server's certificate does not verify with --etcd-cafile: "
                    f"{e.verify_message}")
        except ssl.SSLError as e:
            r.fatal(f"etcd {target}: TLS refused ({e.reason or e}): does etcd trust --etcd-certfile?")
        except (OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        if time.monotonic() >= deadline:
            r.fatal(f"etcd {target} is not healthy after {wait:g}s ({attempt} attempts): {last}")
        time.sleep(1)


def run_apiserver(r: Report, ref: Reference, flags: Flags, files: Files, pki: PKI) -> list[Endpoint]:
    for flag in APISERVER_FILES:
        for path in flags.files(flag):
            files.read(flag, path)
    for flag in ("--etcd-servers", "--service-account-issuer", "--service-account-key-file",
                 "--service-account-signing-key-file", "--tls-cert-file", "--tls-private-key-file",
                 "--client-ca-file"):
        if not flags.get(flag):
            r.fail(f"{flag} is required")
    check_ip(r, "--advertise-address", flags.get("--advertise-address"))
    check_ip(r, "--bind-address", flags.get("--bind-address"))
    port = check_port(r, "--secure-port", flags.get("--secure-port"), 6443)
    check_cidrs(r, "--service-cluster-ip-range", flags.get("--service-cluster-ip-range"))

    client_ca = pki.ca("--client-ca-file", flags.get("--client-ca-file")) if flags.get("--client-ca-file") else None
    etcd_ca = pki.ca("--etcd-cafile", flags.get("--etcd-cafile")) if flags.get("--etcd-cafile") else None
    rh_ca = (pki.ca("--requestheader-client-ca-file", flags.get("--requestheader-client-ca-file"))
             if flags.get("--requestheader-client-ca-file") else None)
    if flags.get("--kubelet-certificate-authority"):
        pki.ca("--kubelet-certificate-authority", flags.get("--kubelet-certificate-authority"))
    pki.pair("--tls-cert-file", flags.get("--tls-cert-file"), "--tls-private-key-file",
             flags.get("--tls-private-key-file"), client_ca, "--client-ca-file (the cluster CA)", "sslserver")
    if flags.get("--etcd-servers") and not (flags.get("--etcd-certfile") and flags.get("--etcd-cafile")):
        r.fail("--etcd-servers is set without --etcd-cafile and --etcd-certfile/--etcd-keyfile "
               "(etcd requires client certificates)")
    pki.pair("--etcd-certfile", flags.get("--etcd-certfile"), "--etcd-keyfile", flags.get("--etcd-keyfile"),
             etcd_ca, "--etcd-cafile", "sslclient")
    pki.pair("--kubelet-client-certificate", flags.get("--kubelet-client-certificate"), "--kubelet-client-key",
             flags.get("--kubelet-client-key"), client_ca, "--client-ca-file (the cluster CA the kubelets trust)",
             "sslclient")
    proxy = pki.pair("--proxy-client-cert-file", flags.get("--proxy-client-cert-file"), "--proxy-client-key-file",
                     flags.get("--proxy-client-key-file"), rh_ca, "--requestheader-client-ca-file", "sslclient")
    allowed = flags.all("--requestheader-allowed-names")
    if proxy and allowed and proxy.cn not in allowed:
        r.fail(f"--proxy-client-cert-file CN {proxy.cn!r} is not in --requestheader-allowed-names {allowed}")

    signing = flags.get("--service-account-signing-key-file")
    if signing:
        key = pki.key("--service-account-signing-key-file", signing)
        pubs = [pki.public_key("--service-account-key-file", p) for p in flags.files("--service-account-key-file")]
        if key and pubs and all(pubs):
            norm = {" ".join(p.split()) for p in pubs}
            if " ".join(key.pubkey.split()) not in norm:
                r.fail(f"--service-account-signing-key-file {signing}: its public key is in no "
                       "--service-account-key-file (tokens it signs would not verify)")
            else:
                r.ok("--service-account-signing-key-file's public key is in --service-account-key-file")

    enabled = flags.all("--enable-admission-plugins")
    for flag, kind in APISERVER_CONFIGS.items():
        path = flags.get(flag)
        if path is None:
            continue
        doc = check_config(r, ref, files, flag, path, kind)
        if doc is None:
            continue
        if kind == "EncryptionConfiguration":
            _check_encryption(r, doc, f"{flag} {path}")
        elif kind == "AdmissionConfiguration":
            _check_admission(r, files, doc, f"{flag} {path}", path, enabled)
    if "EventRateLimit" in enabled and not flags.get("--admission-control-config-file"):
        r.fail("--enable-admission-plugins has EventRateLimit but no --admission-control-config-file "
               "configures it")
    minimum, ciphers = tls_settings(r, "--tls-min-version", flags.get("--tls-min-version"),
                                    "--tls-cipher-suites", flags.all("--tls-cipher-suites"))
    r.stop_if_problems()

    etcd_health(r, flags)

    ctx = server_tls(r, flags.get("--tls-cert-file"), flags.get("--tls-private-key-file"),
                     flags.get("--client-ca-file"), True, minimum, ciphers)
    routes = health_routes("/livez", "/readyz", "/healthz")
    routes["/version"] = as_json({"major": "0", "minor": "0", "gitVersion": version(),
                                  "gitCommit": "contract-standin", "gitTreeState": "clean",
                                  "goVersion": "none (hiddenplane contract stand-in)",
                                  "compiler": "none", "platform": "linux/amd64"})
    return [Endpoint("secure port (client certificates from --client-ca-file required)",
                     flags.get("--bind-address", "0.0.0.0"), port, routes, ctx)]


# ---------------------------------------------------------------------------------------------
# kube-controller-manager and kube-scheduler


def _delegated_auth(r: Report, flags: Flags, files: Files, pki: PKI) -> None:
    for flag in ("--authentication-kubeconfig", "--authorization-kubeconfig"):
        if flags.get(flag):
            check_kubeconfig(r, files, pki, flag, flags.get(flag), "cert")
    for flag in ("--client-ca-file", "--requestheader-client-ca-file"):
        if flags.get(flag):
            pki.ca(flag, flags.get(flag))


def _secure_serving(r: Report, flags: Flags, pki: PKI, component: str, default_port: int):
    host = flags.get("--bind-address", "0.0.0.0")
    check_ip(r, "--bind-address", host)
    port = check_port(r, "--secure-port", flags.get("--secure-port"), default_port)
    pki.pair("--tls-cert-file", flags.get("--tls-cert-file"), "--tls-private-key-file",
             flags.get("--tls-private-key-file"))
    if flags.get("--cert-dir") and not os.path.isdir(flags.get("--cert-dir")):
        r.log(f"--cert-dir {flags.get('--cert-dir')} does not exist ({component} creates it)")
    minimum, ciphers = tls_settings(r, "--tls-min-version", flags.get("--tls-min-version"),
                                    "--tls-cipher-suites", flags.all("--tls-cipher-suites"))

    def endpoints() -> list[Endpoint]:
        if port == 0:
            r.log("--secure-port=0: secure serving disabled")
            return []
        if flags.get("--tls-cert-file"):
            ctx = server_tls(r, flags.get("--tls-cert-file"), flags.get("--tls-private-key-file"),
                             flags.get("--client-ca-file"), False, minimum, ciphers)
        else:
            ctx = self_signed(r, pki.ossl, component, host)
            if flags.get("--client-ca-file"):
                ctx.load_verify_locations(cafile=flags.get("--client-ca-file"))
                ctx.verify_mode = ssl.CERT_OPTIONAL
            if minimum is not None:
                ctx.minimum_version = minimum
            if ciphers:
                ctx.set_ciphers(":".join(ciphers))
        return [Endpoint("secure port", host, port, health_routes("/healthz", "/livez", "/readyz"), ctx)]
    return endpoints


SIGNING_PAIRS = (("--cluster-signing-cert-file", "--cluster-signing-key-file"),) + tuple(
    (f"--cluster-signing-{s}-cert-file", f"--cluster-signing-{s}-key-file")
    for s in ("kubelet-client", "kubelet-serving", "kube-apiserver-client", "legacy-unknown"))


def run_controller_manager(r: Report, ref: Reference, flags: Flags, files: Files, pki: PKI) -> list[Endpoint]:
    if not flags.get("--kubeconfig"):
        r.fail("--kubeconfig is required (the controller-manager runs outside the cluster)")
    else:
        check_kubeconfig(r, files, pki, "--kubeconfig", flags.get("--kubeconfig"), "cert")
    _delegated_auth(r, flags, files, pki)
    if flags.get("--root-ca-file"):
        pki.ca("--root-ca-file", flags.get("--root-ca-file"))
    for cert_flag, key_flag in SIGNING_PAIRS:
        cert_path, key_path = flags.get(cert_flag), flags.get(key_flag)
        if cert_path is None and key_path is None:
            continue
        cert = pki.pair(cert_flag, cert_path, key_flag, key_path)
        if cert is not None and not cert.is_ca:
            r.fail(f"{cert_flag} {cert_path}: not a CA certificate ({cert.subject}, CA:FALSE): "
                   "it cannot sign kubelet certificates")
        elif cert is not None:
            r.ok(f"{cert_flag} {cert_path}: CA certificate {cert.subject}")
    if flags.get("--service-account-private-key-file"):
        pki.key("--service-account-private-key-file", flags.get("--service-account-private-key-file"))
    check_duration(r, "--cluster-signing-duration", flags.get("--cluster-signing-duration"))
    check_cidrs(r, "--service-cluster-ip-range", flags.get("--service-cluster-ip-range"))
    check_cidrs(r, "--cluster-cidr", flags.get("--cluster-cidr"))
    endpoints = _secure_serving(r, flags, pki, "kube-controller-manager", 10257)
    r.stop_if_problems()
    return endpoints()


def run_scheduler(r: Report, ref: Reference, flags: Flags, files: Files, pki: PKI) -> list[Endpoint]:
    config = flags.get("--config")
    if not config:
        r.fail("--config is required (its clientConnection.kubeconfig is how the scheduler reaches the API; "
               "--kubeconfig is deprecated)")
    else:
        doc = check_config(r, ref, files, "--config", config, "KubeSchedulerConfiguration")
        if doc is not None:
            kc = dig(doc, "clientConnection.kubeconfig")
            if not kc:
                r.fail(f"--config {config}: clientConnection.kubeconfig is not set")
            else:
                check_kubeconfig(r, files, pki, "--config clientConnection.kubeconfig", resolve(str(kc), config),
                                 "cert")
    _delegated_auth(r, flags, files, pki)
    endpoints = _secure_serving(r, flags, pki, "kube-scheduler", 10259)
    r.stop_if_problems()
    return endpoints()


# ---------------------------------------------------------------------------------------------
# kubelet


def run_kubelet(r: Report, ref: Reference, flags: Flags, files: Files, pki: PKI) -> list[Endpoint]:
    node_ips = flags.all("--node-ip")
    check_ip(r, "--node-ip", flags.get("--node-ip"))
    bootstrap, kubeconfig = flags.get("--bootstrap-kubeconfig"), flags.get("--kubeconfig")
    if bootstrap:
        info = check_kubeconfig(r, files, pki, "--bootstrap-kubeconfig", bootstrap, "token")
        if info is not None and info["has_token"] and info["token_id"] is None:
            r.fail(f"--bootstrap-kubeconfig {bootstrap}: the token is not a bootstrap token "
                   "([a-z0-9]{6}.[a-z0-9]{16})")
        elif info is not None and info["token_id"] and info["user"] != f"system:bootstrap:{info['token_id']}":
            r.log(f"note: --bootstrap-kubeconfig user is {info['user']!r}, not system:bootstrap:{info['token_id']}")
    if kubeconfig:
        if os.path.exists(kubeconfig):
            check_kubeconfig(r, files, pki, "--kubeconfig", kubeconfig, "any")
        elif bootstrap:
            r.log(f"--kubeconfig {kubeconfig} does not exist yet: the kubelet writes it after TLS bootstrapping")
        else:
            r.fail(f"--kubeconfig {kubeconfig}: no such file, and no --bootstrap-kubeconfig to create it from")
    elif not bootstrap:
        r.fail("neither --kubeconfig nor --bootstrap-kubeconfig: the kubelet could not reach the API")
    cert_dir = flags.get("--cert-dir")
    if cert_dir:
        if os.path.exists(cert_dir) and not os.path.isdir(cert_dir):
            r.fail(f"--cert-dir {cert_dir}: exists and is not a directory")
        elif not os.path.exists(cert_dir):
            r.log(f"--cert-dir {cert_dir} does not exist yet: the kubelet creates it")

    config = flags.get("--config")
    doc: dict = {}
    if not config:
        r.fail("--config is required: the kubelet's settings live in its KubeletConfiguration "
               "(most kubelet flags are deprecated)")
    else:
        doc = check_config(r, ref, files, "--config", config, "KubeletConfiguration") or {}

    def field(name: str):
        v = dig(doc, name)
        return resolve(str(v), config) if v else None

    client_ca_path = field("authentication.x509.clientCAFile")
    client_ca = None
    if config and doc:
        if not client_ca_path:
            r.fail(f"--config {config}: authentication.x509.clientCAFile is not set "
                   "(the apiserver's kubelet client certificate could not be verified)")
        else:
            client_ca = pki.ca("authentication.x509.clientCAFile", client_ca_path)
        cert = pki.pair("tlsCertFile", field("tlsCertFile"), "tlsPrivateKeyFile", field("tlsPrivateKeyFile"))
        # the apiserver dials the node's InternalIP (--node-ip) and verifies the serving certificate
        # with --kubelet-certificate-authority, the cluster CA that clientCAFile also names
        for ip in node_ips or [None]:
            if not pki.chains(cert, client_ca, "authentication.x509.clientCAFile", "sslserver", ip):
                break
        resolv = doc.get("resolvConf", "/etc/resolv.conf")
        if resolv:
            if files.read("resolvConf", resolve(str(resolv), config)) is not None:
                r.ok(f"resolvConf {resolv} exists")
        sock = str(doc.get("containerRuntimeEndpoint") or "")
        if sock.startswith("unix://"):
            exists = os.path.exists(sock[len("unix://"):])
            r.log(f"not checked: the container runtime ({sock} {'exists' if exists else 'is absent'}); "
                  "this stand-in runs no pods")
        if doc.get("readOnlyPort"):
            r.log(f"readOnlyPort {doc['readOnlyPort']} is not served by the stand-in")
    address = str(doc.get("address") or "0.0.0.0")
    check_ip(r, "address", address)
    port = check_port(r, "port", doc.get("port"), 10250)
    hz_address = str(doc.get("healthzBindAddress") or "127.0.0.1")
    check_ip(r, "healthzBindAddress", hz_address)
    hz_port = check_port(r, "healthzPort", doc.get("healthzPort"), 10248)
    minimum, ciphers = tls_settings(r, "tlsMinVersion", doc.get("tlsMinVersion"), "tlsCipherSuites",
                                    list(doc.get("tlsCipherSuites") or []))
    r.stop_if_problems()

    cert_path = field("tlsCertFile")
    if cert_path:
        ctx = server_tls(r, cert_path, field("tlsPrivateKeyFile"), client_ca_path, True, minimum, ciphers)
    else:
        ctx = self_signed(r, pki.ossl, "the kubelet", address)
        ctx.load_verify_locations(cafile=client_ca_path)
        ctx.verify_mode = ssl.CERT_REQUIRED
    out = [Endpoint("kubelet API (client certificates from clientCAFile required)", address, port,
                    health_routes("/healthz"), ctx)]
    if hz_port:
        out.append(Endpoint("healthz", hz_address, hz_port, health_routes("/healthz")))
    return out


# ---------------------------------------------------------------------------------------------
# kube-proxy


def run_kube_proxy(r: Report, ref: Reference, flags: Flags, files: Files, pki: PKI) -> list[Endpoint]:
    config = flags.get("--config")
    doc: dict = {}
    if config:
        doc = check_config(r, ref, files, "--config", config, "KubeProxyConfiguration") or {}
    kc = flags.get("--kubeconfig") or (resolve(str(dig(doc, "clientConnection.kubeconfig")), config)
                                       if dig(doc, "clientConnection.kubeconfig") else None)
    label = "--kubeconfig" if flags.get("--kubeconfig") else "--config clientConnection.kubeconfig"
    if not kc:
        r.fail("no kubeconfig: set clientConnection.kubeconfig in --config (or --kubeconfig)")
    else:
        check_kubeconfig(r, files, pki, label, kc, "cert")
    mode = doc.get("mode") or flags.get("--proxy-mode") or ""
    if mode not in ("", "iptables", "ipvs", "nftables", "kernelspace"):
        r.fail(f"mode {mode!r}: not iptables, ipvs, nftables or kernelspace")
    check_cidrs(r, "clusterCIDR", doc.get("clusterCIDR") or flags.get("--cluster-cidr"))
    healthz = str(doc.get("healthzBindAddress") or flags.get("--healthz-bind-address") or "0.0.0.0:10256")
    metrics = str(doc.get("metricsBindAddress") or flags.get("--metrics-bind-address") or "127.0.0.1:10249")
    hz = host_port(r, "healthzBindAddress", healthz)
    mx = host_port(r, "metricsBindAddress", metrics)
    r.stop_if_problems()

    started = time.time()

    def healthz_route():
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return as_json({"lastUpdated": now, "currentTime": now, "nodeEligible": True,
                        "standin": "hiddenplane contract stand-in: no proxying"})

    def metrics_route():
        return text("# hiddenplane contract stand-in: no proxy rules, no metrics\n"
                    f"standin_start_time_seconds {started:.0f}\n")

    out = []
    if hz and hz[1]:
        out.append(Endpoint("healthz", hz[0], hz[1], {"/healthz": healthz_route, "/livez": healthz_route}))
    if mx and mx[1]:
        out.append(Endpoint("metrics", mx[0], mx[1], {"/metrics": metrics_route, "/healthz": text("ok")}))
    return out


# ---------------------------------------------------------------------------------------------

RUNNERS = {
    "kube-apiserver": run_apiserver,
    "kube-controller-manager": run_controller_manager,
    "kube-scheduler": run_scheduler,
    "kubelet": run_kubelet,
    "kube-proxy": run_kube_proxy,
}


_COMPONENT = "stand-in"


def _terminate(signum, _frame) -> None:
    print(f"{_COMPONENT} stand-in: {signal.Signals(signum).name}: exiting 0", file=sys.stderr, flush=True)
    sys.exit(0)


def main(component: str, reference: dict, argv: list[str] | None = None) -> int:
    global _COMPONENT
    _COMPONENT = component
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    argv = sys.argv[1:] if argv is None else argv
    r = Report(component)
    ref = Reference(component, reference)
    if any(a in ("--help", "-h") for a in argv):
        print(f"{component}: hiddenplane CONTRACT STAND-IN, not Kubernetes. It checks its flags against "
              f"flags/{component}.txt (Kubernetes {ref.flags_version}), its files and certificates, then "
              "serves health endpoints only; it never answers API calls.")
        return 0
    if any(a == "--version" or a.startswith("--version=") for a in argv):
        print(f"Kubernetes {version()}")
        return 0
    r.log(f"hiddenplane contract stand-in (not Kubernetes; never answers API calls), pid {os.getpid()}, "
          f"flags/{component}.txt: Kubernetes {ref.flags_version}")
    flags = parse_command_line(r, ref, argv)
    files = Files(r)
    pki = PKI(r, files)
    try:
        endpoints = RUNNERS[component](r, ref, flags, files, pki)
    finally:
        pki.ossl.cleanup()
    r.stop_if_problems()
    if not endpoints:
        r.log("ready: nothing to serve")
        while True:
            signal.pause()
    serve(r, endpoints)
    return 0
