"""`installer verify`: the hidden control plane and the lock-down of every secret, checked on the
live hosts with testinfra, any time.

Each host is reached with testinfra's ``ssh://`` backend (the OpenSSH client) through an
ssh_config generated into a private temporary directory (0700) from the inventory: the
inventory's key only, host keys **verified** against the inventory's known_hosts
(``StrictHostKeyChecking yes``: an unknown or changed key is refused, never recorded), no
prompts (``BatchMode yes``), and ``sudo`` for a login user other than root. One SSH connection
per host is shared by every check (ControlMaster, closed at the end).

What is checked (one :class:`CheckResult` each):

- control hosts: no kubelet, containerd, crio or dockerd binary (on PATH or in
  /usr/local/bin), no kubelet/containerd/crio/docker unit file, no containerd socket, no node
  credential (kubelet.conf, bootstrap-kubelet.conf, /var/lib/kubelet); etcd, kube-apiserver,
  kube-controller-manager and kube-scheduler running and enabled;
- workers: containerd, kubelet and kube-proxy running and enabled; no etcd binary or unit, no
  cluster signing key (the CA keys, sa.key); no bootstrap credential once the kubelet joined;
- every host: each private file and private directory of the rendered plan (keys, kubeconfigs,
  configs, unit files, the etcd data dir...) with its planned mode and owner, plus every other
  ``*.key`` and kubeconfig actually found under the Kubernetes, etcd and kubelet directories
  (0600, root or etcd).

With ``api=True`` the API is asked (directly or through an SSH tunnel via the first control
host) whether any Node is named like a control host.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from installer.core import components
from installer.core.cluster import Cluster
from installer.core.components import BALANCER_UNIT, ETCD_UNIT, WORKER_UNITS
from installer.core.components import CONTROL_UNITS as CONTROL_PLANE_UNITS
from installer.core.errors import InstallerError
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import ensure
from installer.core.render.files import HostPlan
from installer.core.render.plan import render_cluster
from installer.core.render.worker import BOOTSTRAP_KUBECONFIG, KUBELET_CLIENT_PEM
from installer.engine.run import open_run
from installer.host import apireach

RUNTIME_BINARIES = ("kubelet", "containerd", "crio", "dockerd")
RUNTIME_UNITS = (*components.units("kubelet", "containerd"), "crio.service", "docker.service")
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
NODE_CREDENTIALS = ("/etc/kubernetes/kubelet.conf", BOOTSTRAP_KUBECONFIG, "/var/lib/kubelet")
# the units apply starts (and waits for) on each role
CONTROL_UNITS = (ETCD_UNIT, *CONTROL_PLANE_UNITS)
# a worker never holds what signs cluster identities
SIGNING_KEYS = ("/etc/kubernetes/pki/ca.key", "/etc/kubernetes/pki/front-proxy-ca.key",
                "/etc/kubernetes/pki/etcd/ca.key", "/etc/kubernetes/pki/sa.key")
KUBELET_CLIENT_CERT = KUBELET_CLIENT_PEM        # the kubelet's rotating pair (render/worker.py)
# files found on the host (not only the planned ones) that must be private: (find arguments, owner)
KEYS = ("-type", "f", "-name", "*.key")
KUBECONFIGS = ("-maxdepth", "1", "-type", "f", "-name", "*.conf")
FOUND_SECRETS = {
    "control": (("/etc/kubernetes/pki", KEYS, "root:root"), ("/etc/kubernetes", KUBECONFIGS, "root:root"),
                ("/etc/etcd/pki", KEYS, "etcd:etcd")),
    "worker": (("/etc/kubernetes", KUBECONFIGS, "root:root"), ("/etc/kubernetes/pki", KEYS, "root:root"),
               ("/var/lib/kubelet/pki", ("-type", "f", "(", "-name", "*.key", "-o", "-name", "kubelet-client-*.pem",
                                         ")"), "root:root")),
}


class VerifyError(InstallerError):
    """A host could not be checked at all (unreachable, unknown host key, no sudo)."""

    exit_code = 3


@dataclass(frozen=True)
class CheckResult:
    host: str
    check: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.host}  {self.check}" + (f": {self.detail}" if self.detail else "")

    def as_dict(self) -> dict:
        return asdict(self)


# --- SSH ------------------------------------------------------------------------------------

def _bastion_alias(host: HostSpec) -> str:
    return f"hiddenplane-bastion-for-{host.name}"


def ssh_config(inv: Inventory, control_dir: Path) -> str:
    """One ``Host <name>`` block per inventory host (and one per bastion), verifying host keys."""
    blocks = []
    for h in inv.spec.hosts:
        ssh = inv.ssh_for(h)
        common = (f"  IdentitiesOnly yes\n  UserKnownHostsFile {_q(ssh.knownHosts)}\n  GlobalKnownHostsFile none\n"
                  "  StrictHostKeyChecking yes\n  UpdateHostKeys no\n  BatchMode yes\n  ConnectTimeout 10\n"
                  "  ForwardAgent no\n  ClearAllForwardings yes\n")
        bastion = getattr(ssh, "bastion", None)
        block = (f"Host {h.name}\n  HostName {h.address}\n  User {ssh.user}\n  Port {ssh.port}\n"
                 f"  IdentityFile {_q(ssh.keyPath)}\n{common}  ControlPath {_q(str(control_dir))}/%C\n")
        if bastion is not None:
            alias = _bastion_alias(h)
            block += f"  ProxyJump {alias}\n"
            blocks.append(f"Host {alias}\n  HostName {bastion.address}\n  User {bastion.user or ssh.user}\n"
                          f"  Port {bastion.port}\n  IdentityFile {_q(bastion.keyPath or ssh.keyPath)}\n{common}")
        blocks.append(block)
    return "\n".join(blocks)


def _q(path: str) -> str:
    return f'"{path}"' if any(c.isspace() for c in path) else path


class _Session:
    """The generated ssh_config in a private directory, testinfra hosts over it, and cleanup."""

    def __init__(self, inv: Inventory):
        self.inv = inv
        self.dir = Path(tempfile.mkdtemp(prefix="hiddenplane-verify-"))     # 0700
        os.chmod(self.dir, 0o700)
        (self.dir / "cm").mkdir(mode=0o700)
        self.config = self.dir / "ssh_config"
        fd = os.open(self.config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(ssh_config(inv, self.dir / "cm"))

    def host(self, h: HostSpec):
        import testinfra
        sudo = self.inv.ssh_for(h).user != "root"
        return testinfra.get_host(f"ssh://{h.name}", ssh_config=str(self.config), sudo=sudo)

    def close(self) -> None:
        for h in self.inv.spec.hosts:      # stop the shared connections (ControlPersist)
            if any((self.dir / "cm").iterdir()):
                subprocess.run(["ssh", "-F", str(self.config), "-O", "exit", h.name],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def _connection_problem(inv: Inventory, h: HostSpec, stderr: str) -> str:
    ssh = inv.ssh_for(h)
    text = stderr.strip()
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or ("Host key for" in text and "has changed" in text):
        return (f"host key CHANGED for {h.address} ({ssh.knownHosts} has another): refusing to connect; "
                "if the host was reinstalled, remove its old line")
    if "Host key verification failed" in text or "host key is known" in text:
        return (f"host key of {h.address} is not in {ssh.knownHosts}: refusing to connect (nothing was "
                "accepted); add it, verified out of band")
    last = ([line for line in text.splitlines() if line.strip()][-1:] or ["ssh failed"])[0]
    if "connect to host" in last or "timed out" in last or "resolve" in last:
        return f"cannot reach {h.address}:{ssh.port}: {last}"
    return f"SSH to {ssh.user}@{h.address}:{ssh.port} failed: {last}"


def _probe(session: _Session, h: HostSpec) -> str | None:
    """None when ``h`` answers (as root, through sudo if needed); else why not."""
    host = session.host(h)
    try:
        out = host.run("id -u")
    except RuntimeError as e:                   # testinfra: ssh exited 255
        result = e.args[0] if e.args else None
        return _connection_problem(session.inv, h, getattr(result, "stderr", str(e)))
    if out.rc != 0 or out.stdout.strip() != "0":
        why = (out.stderr.strip().splitlines() or [f"exit {out.rc}"])[-1]
        return f"cannot run commands as root (passwordless sudo needed): {why}"
    return None


# --- the checks -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Stat:
    kind: str           # find(1)-style: f file, d directory, l symlink, s socket, ...
    mode: int
    owner: str         # user:group


# one round trip for every path of a host (lstat: a symlink is reported as itself)
STAT = "for p in \"$@\"; do if [ -e \"$p\" ] || [ -L \"$p\" ]; then printf '%s\\t' \"$p\"; " \
       "stat -c '%F\t%a\t%U:%G' -- \"$p\"; fi; done"
KINDS = {"regular file": "f", "regular empty file": "f", "directory": "d", "symbolic link": "l", "socket": "s"}


def _stat(host, paths: list[str]) -> dict[str, _Stat]:
    out = host.run("sh -c %s stat " + " ".join(["%s"] * len(paths)), STAT, *paths)
    if out.rc != 0:
        raise _HostProblem(f"stat failed (exit {out.rc}): {out.stderr.strip()[-300:]}")
    found = {}
    for line in out.stdout.splitlines():
        path, kind, mode, owner = line.split("\t")
        found[path] = _Stat(KINDS.get(kind, kind), int(mode, 8), owner)
    return found


class _HostProblem(Exception):
    """A host answered, but a command every check depends on failed."""


def _mode_check(name: str, stats: dict[str, _Stat], path: str, mode: int, owner: str, kind: str,
                required: bool = True) -> CheckResult:
    check = f"{path} {mode:04o} {owner}"
    have = stats.get(path)
    if have is None:
        return CheckResult(name, check, not required, "missing" if required else "absent")
    if have.kind != kind:
        return CheckResult(name, check, False, f"is a {have.kind!r}, not {'a directory' if kind == 'd' else 'a file'}")
    if (have.mode, have.owner) != (mode, owner):
        return CheckResult(name, check, False, f"is {have.mode:04o} {have.owner}")
    return CheckResult(name, check, True)


def _absent_check(name: str, stats: dict[str, _Stat], check: str, paths, on_path: dict[str, str] | None = None,
                  commands=()) -> CheckResult:
    found = [p for p in paths if p in stats]
    found += [f"{on_path[c]} (on PATH)" for c in commands if c in (on_path or {}) and on_path[c] not in found]
    return CheckResult(name, check, not found, ("found " + ", ".join(found)) if found else "")


# one round trip for every command of a host: the name and what `command -v` says, for those found
ON_PATH = "for c in \"$@\"; do p=$(command -v \"$c\") && printf '%s\\t%s\\n' \"$c\" \"$p\"; done; true"


def _on_path(host, commands: tuple[str, ...]) -> dict[str, str]:
    """command -> where it resolves, for those of ``commands`` that do (testinfra's Host.exists, batched)."""
    if not commands:
        return {}
    out = host.run("sh -c %s on_path " + " ".join(["%s"] * len(commands)), ON_PATH, *commands)
    if out.rc != 0:
        raise _HostProblem(f"command -v failed (exit {out.rc}): {out.stderr.strip()[-300:]}")
    return dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)


def _unit_check(host, name: str, unit: str) -> CheckResult:
    svc = host.service(unit)
    running, enabled = svc.is_running, svc.is_enabled
    problems = [w for w, ok in (("not running", running), ("not enabled", enabled)) if not ok]
    return CheckResult(name, f"{unit} running and enabled", not problems, ", ".join(problems))


def _found(host, top: str, args: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Files under ``top`` matching the find(1) ``args`` (none when ``top`` does not exist),
    and why the listing failed, if it did."""
    d = shlex.quote(top)
    out = host.run(f"if [ -d {d} ]; then find {d} {' '.join(shlex.quote(a) for a in args)}; fi")
    found = sorted(p for p in out.stdout.splitlines() if p.strip())
    return found, None if out.rc == 0 else (out.stderr.strip().splitlines() or [f"exit {out.rc}"])[-1]


def _private_files(plan: HostPlan) -> dict[str, tuple[int, str, bool]]:
    """path -> (mode, owner, required) for every planned file no one else may read."""
    out = {}
    for f in plan.files.values():
        if f.secret or not f.mode & 0o077:
            # bootstrap-kubelet.conf exists only until the kubelet joins (checked separately)
            out[f.path] = (f.mode, f"{f.owner}:{f.group}", f.path != BOOTSTRAP_KUBECONFIG)
    return out


def check_host(host, h: HostSpec, plan: HostPlan) -> list[CheckResult]:
    """Every check of one host, through testinfra ``host`` (about fifteen commands)."""
    name, results = h.name, []
    private = _private_files(plan)
    for top, args, owner in FOUND_SECRETS[h.role]:
        found, error = _found(host, top, args)
        if error:
            results.append(CheckResult(name, f"list private files under {top}", False, error))
        for p in found:
            private.setdefault(p, (0o600, owner, True))
    dirs = [d for d in plan.dirs.values() if not d.mode & 0o077]

    if h.role == "control":
        absent = {f"no {b} binary": ((f"/usr/local/bin/{b}",), (b,)) for b in RUNTIME_BINARIES}
        absent |= {f"no {u} unit": (tuple(f"{d}/{u}" for d in UNIT_DIRS), ()) for u in RUNTIME_UNITS}
        absent["no containerd socket"] = ((CONTAINERD_SOCKET,), ())
        absent |= {f"no node credential {p}": ((p,), ()) for p in NODE_CREDENTIALS}
        units, commands = CONTROL_UNITS, RUNTIME_BINARIES
    else:
        absent = {"no etcd binary": (("/usr/local/bin/etcd",), ("etcd",)),
                  f"no {ETCD_UNIT} unit": (tuple(f"{d}/{ETCD_UNIT}" for d in UNIT_DIRS), ())}
        absent |= {f"no signing key {p}": ((p,), ()) for p in SIGNING_KEYS}
        # the balancer's unit when the plan has it (spec.apiServer.balancer)
        units, commands = tuple(u for u in plan.units if u in (BALANCER_UNIT, *WORKER_UNITS)), ("etcd",)

    paths = sorted({p for ps, _ in absent.values() for p in ps} | set(private) | {d.path for d in dirs}
                   | {KUBELET_CLIENT_CERT})
    stats = _stat(host, paths)
    on_path = _on_path(host, commands)
    if h.role == "worker" and KUBELET_CLIENT_CERT in stats:
        # joined: the bootstrap token's kubeconfig has done its job and must be gone
        absent["no bootstrap credential after join"] = ((BOOTSTRAP_KUBECONFIG,), ())
    for check, (ps, cmds) in absent.items():
        results.append(_absent_check(name, stats, check, ps, on_path, cmds))
    for u in units:
        results.append(_unit_check(host, name, u))
    for d in dirs:
        results.append(_mode_check(name, stats, d.path, d.mode, f"{d.owner}:{d.group}", "d"))
    for p in sorted(private):
        mode, owner, required = private[p]
        results.append(_mode_check(name, stats, p, mode, owner, "f", required))
    return results


def _plans(cluster: Cluster) -> dict[str, HostPlan]:
    """Every host's plan from the state's PKI, without writing to the state (verify changes
    nothing anywhere); a missing state only means fresh key material, same paths and modes."""
    material, _ = ensure(cluster.inv, cluster.material)
    return render_cluster(cluster.inv, material)


def _api_checks(cluster: Cluster) -> list[CheckResult]:
    """The API's Node list: an API that cannot be reached is a host that cannot be checked
    (VerifyError, exit 3); one that answers the list with an error status (a 404 from
    something that is not a kube-apiserver, a 403) fails the check (exit 1), naming the URL."""
    from installer.host import kube
    inv, material = cluster.inv, cluster.material
    via = inv.api_url
    try:
        with open_run(cluster) as run, apireach.api_access(inv, run.session.connect(inv.controls)) as url, \
                kube.api_client(url, material) as client:
            # the apiserver that answered (api_access fails over across control hosts)
            via = (f"{inv.api_url} (through an SSH tunnel to a control host)"
                   if url.startswith("https://127.0.0.1:") else url)
            try:
                listed = kube.rest(client, "GET", kube.NODES, f"the API at {via}")["items"] or []
            except kube.KubeError as e:         # not reached, or TLS failed
                raise VerifyError(str(e)) from None
            except kube.ApiError as e:
                return [CheckResult("cluster", "no Node for a control host", False,
                                    f"GET /api/v1/nodes on {via} answered {kube.status_message(e)}: "
                                    "is the endpoint a kube-apiserver?")]
    except kube.KubeError as e:          # the SSH tunnel did not come up
        raise VerifyError(f"cannot reach the API at {inv.api_url}: {e}") from None
    nodes = sorted(n["metadata"]["name"] for n in listed)
    controls = {h.name for h in inv.controls}
    visible = sorted(controls & set(nodes))
    return [CheckResult("cluster", "no Node for a control host", not visible,
                        ("registered: " + ", ".join(visible)) if visible else f"nodes: {', '.join(nodes) or 'none'}")]


def verify(cluster: Cluster, log: Callable[[str], None] = print, *, api: bool = False,
           parallel: int = 10) -> list[CheckResult]:
    """Run every host check over SSH (testinfra) for every host of the inventory.

    Returns the results (host order, then check order); raises :class:`VerifyError` naming
    each host that could not be checked at all."""
    inv = cluster.inv
    plans = _plans(cluster)
    hosts = inv.spec.hosts
    log(f"verify: checking {len(hosts)} host(s) over SSH")
    session = _Session(inv)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
            problems = dict(zip((h.name for h in hosts), pool.map(lambda h: _probe(session, h), hosts)))
            failed = {n: why for n, why in problems.items() if why}
            if failed:
                raise VerifyError("; ".join(f"{n}: {why}" for n, why in failed.items()))

            def one(h: HostSpec) -> list[CheckResult]:
                try:
                    return check_host(session.host(h), h, plans[h.name])
                except RuntimeError as e:       # the connection dropped mid-way
                    result = e.args[0] if e.args else None
                    raise VerifyError(f"{h.name}: {_connection_problem(inv, h, getattr(result, 'stderr', str(e)))}") \
                        from None
                except _HostProblem as e:
                    raise VerifyError(f"{h.name}: {e}") from None
            results = [r for rs in pool.map(one, hosts) for r in rs]
    finally:
        session.close()
    if api:
        results += _api_checks(cluster)
    return results
