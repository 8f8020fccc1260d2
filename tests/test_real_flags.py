"""Every flag and config field the installer renders, checked by the real binaries (Kubernetes
v1.36, etcd 3.6, built from their Go modules: the ``built_artifacts`` fixture), for the example
cluster and the 3-control variant; the kubelet's and kube-proxy's configs also for workers with
``spec.workerHosts`` all true (``container_workers``: failCgroupV1, conntrack).

What the binaries told us, and what each check relies on:

- **Names.** ``--help`` lists every flag a binary accepts except hidden ones. pflag hides a flag
  marked deprecated (``MarkDeprecated``: kube-apiserver ``--apiserver-count``, kube-proxy
  ``--healthz-port``, ...) yet still accepts it, printing ``Flag --x has been deprecated`` on
  stderr. Flags deprecated in their text stay listed: the kubelet's flags that belong in
  KubeletConfiguration and kube-apiserver ``--admission-control`` say ``(DEPRECATED: ...)``,
  the scheduler's pre-config flags start with ``DEPRECATED:``. etcd (Go's flag package and a
  hand-written usage) says "Deprecated in v3.6" or "Will be deprecated" in the text. So a
  rendered flag must be listed by ``--help``, without such a marker, and be accepted with no
  deprecation warning. A flag missing from ``--help`` fails even when the binary accepts it.
- **Values, by type.** Every one of these binaries parses all flag values before it acts on
  ``--help`` (``--secure-port=abc --help`` exits 1), so ``<binary> --flag=value --help`` exiting
  0 proves the value parses as the flag's type.
- **Values, by meaning, and the config files.** Each binary's own validation runs after the
  point where ``--help`` stops it. So the real binary is started with the rendered ExecStart
  unchanged (same paths, same flags) in a sandbox: a chroot of a copy of the host's rendered
  tree, in new mount, network, PID, UTS and IPC namespaces (loopback only), with an empty
  environment. It stops by itself right after its validation:

  - kube-scheduler and kube-proxy: ``--write-config-to`` (decode, default, validate, write the
    file, exit 0); the written file must hold every rendered value at its place.
  - kubelet: ``--lock-file`` in a directory that does not exist. The kubelet decodes and
    validates its config and flags (``ValidateKubeletConfiguration``, ``ValidateKubeletServer``)
    and fails taking the lock, before it builds any client, cAdvisor or container manager. It
    also sees no /proc, no /run (no containerd socket, no D-Bus) and a read-only cgroup2 mount
    (1.36 refuses cgroup v1 hosts; the workers are cgroup v2), so it could not manage
    containers or cgroups even if it went further. ``--v=5`` makes it log the decoded config.
  - kube-controller-manager: the file of ``--requestheader-client-ca-file`` is withheld; it
    fails loading it, after validating its options, reading its kubeconfig and applying its
    serving options (TLS version and cipher suites).
  - kube-apiserver: a real etcd runs in the sandbox, started with the first control host's
    rendered etcd flags (the single member of the cluster: ``--initial-cluster`` narrowed to it
    for the 3-control variant, whose three members would all bind 127.0.0.1:2379 in one network
    namespace; etcd itself is proven in tests/test_etcd.py). The file of
    ``--proxy-client-cert-file`` is withheld: the apiserver completes and validates its options,
    connects to etcd, decodes EncryptionConfiguration, the audit Policy and
    AdmissionConfiguration with EventRateLimit's Configuration, and fails when the aggregator
    loads that certificate, before serving.

  Values a binary only checks later than that point are not checked here (kube-controller-manager
  accepts ``--terminated-pod-gc-threshold=-1`` at this point; the kubelet does not parse
  ``--node-ip`` before it runs). Decoding: kube-scheduler, EncryptionConfiguration and
  AdmissionConfiguration are strict (unknown or duplicate fields are errors); the kubelet,
  kube-proxy and the audit Policy fall back to lenient decoding and log the strict error,
  which fails the check here. EventRateLimit's Configuration ignores unknown fields silently,
  so each rendered EventRateLimit field is shown to be read by giving it an invalid value.

Each negative test gives a deliberately wrong flag, field or value to the same check and shows
the real binary refusing or warning, so the checks are not vacuous. The sandbox needs root
(unshare, mount, chroot), as CI has; the ``--help`` checks do not.

Not here: containerd (its one flag, ``--config``, and its config are read by the real
containerd in tests/test_images.py), the routes unit (ip(8) commands, run on the lab), and
konnectivity-server (see NOT_CHECKED).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import yaml

from installer import api
from installer.core.render.files import HostPlan
from installer.lab.lab import LAB_EVICTION_HARD

from . import reference as ref
from .conftest import write_inventory
from .rendered import Cluster, write

UNIT_DIR = "/etc/systemd/system"
COMPONENTS = {                         # component (= binary) -> the role of the hosts running it
    "etcd": "control",
    "kube-apiserver": "control",
    "kube-controller-manager": "control",
    "kube-scheduler": "control",
    "kubelet": "worker",
    "kube-proxy": "worker",
}
NOT_CHECKED = {
    "containerd.service": "its --config and the config itself: the real containerd in tests/test_images.py",
    "hiddenplane-routes.service": "ip(8) commands, run by the lab",
    "hiddenplane-routes-repair.timer": "a timer running a shell script, run by the lab (tests/test_real_cluster.py)",
    # The artifacts hold no konnectivity-server binary (scripts/build-kubernetes builds none), so
    # there is nothing real to ask. These clusters use egress: routes and render none; with
    # egress: konnectivity its flags are checked against upstream's option names in test_addons.
    "konnectivity-server.service": "no real binary in the artifacts",
}
PROBE_TIMEOUT = 60          # a hang guard, not a measurement: --help answers at once
SANDBOX_TIMEOUT = 300

PFLAG_DEPRECATION = re.compile(r"Flag --\S+ has been deprecated.*")


# ---------------------------------------------------------------------------------------------
# the clusters


@pytest.fixture(scope="module")
def example(prepared, tmp_path_factory) -> Cluster:
    """The example cluster alone, for the runs with a deliberately wrong flag or file."""
    return write("example", prepared, tmp_path_factory)


def unit(plan: HostPlan, component: str) -> str:
    f = plan.files.get(f"{UNIT_DIR}/{component}.service")
    assert f is not None, f"{plan.name}: no {component}.service"
    return f.content.decode()


def argv_of(plan: HostPlan, component: str) -> list[str]:
    return ref.exec_start(unit(plan, component))


def flags_of(plan: HostPlan, component: str) -> dict[str, str | None]:
    return ref.unit_flags(unit(plan, component))


def token(name: str, value: str | None) -> str:
    return name if value is None else f"{name}={value}"


# ---------------------------------------------------------------------------------------------
# the real binaries and what --help says


@dataclass(frozen=True)
class Real:
    component: str
    path: Path
    version: str                 # as the binary reports it
    listed: dict[str, str]       # --flag -> the text of its --help entry

    @property
    def who(self) -> str:
        return f"{self.component} ({self.version})"

    def deprecated_text(self, name: str) -> str | None:
        mark = ref.deprecated_mark(self.component)
        text = self.listed[name]
        m = mark.search(text)
        return text[max(0, m.start() - 20):m.end() + 80].strip() if m else None


def _run(argv: list[str], timeout: int = PROBE_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


@pytest.fixture(scope="session")
def real(built_artifacts) -> dict[str, Real]:
    out = {}
    for component in COMPONENTS:
        path = built_artifacts / component
        version = _run([str(path), "--version"]).stdout.strip().splitlines()[0]
        helped = _run([str(path), "--help"])
        assert helped.returncode == 0, f"{component} --help: {helped.stderr[-500:]}"
        listed = ref.listed_flags(helped.stdout + helped.stderr)
        # a parser that found nothing would fail every flag for the wrong reason
        assert len(listed) > 20, f"{component}: --help parsed into {listed}"
        out[component] = Real(component, path, version, listed)
    return out


@lru_cache(maxsize=None)
def probe(path: Path, tok: str) -> tuple[int, str]:
    """``<binary> <tok> --help``: exit status and everything it printed except the usage."""
    proc = _run([str(path), tok, "--help"])
    # the usage goes to stdout; parse errors and deprecation warnings to stderr (etcd: both)
    return proc.returncode, proc.stderr.strip()


def _said(text: str) -> str:
    """The binary's complaint, out of the usage that cobra and Go's flag print after it."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (r"^Error:", r"invalid|unknown flag|not defined|failed", r"has been deprecated"):
        for line in lines:
            if re.search(pattern, line, re.I):
                return line
    return lines[0] if lines else "(nothing)"


def flag_problems(r: Real, flags: dict[str, str | None]) -> list[str]:
    tokens = [token(n, v) for n, v in flags.items()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = dict(zip(tokens, pool.map(lambda t: probe(r.path, t), tokens)))
    problems = []
    for name, value in flags.items():
        rc, said = answers[token(name, value)]
        where = f"{r.who}: {name}"
        warned = PFLAG_DEPRECATION.search(said)
        if name not in r.listed:
            if rc != 0:
                problems.append(f"{where} is not a flag of the real binary: {_said(said)}")
            elif warned:
                problems.append(f"{where} is deprecated (hidden from --help): {warned[0]}")
            else:
                problems.append(f"{where} is accepted but hidden from --help")
            continue
        if (text := r.deprecated_text(name)) is not None:
            problems.append(f"{where} is deprecated: ...{text}...")
        if rc != 0:
            problems.append(f"{where}: the value {value!r} is refused: {_said(said)}")
        elif warned:
            problems.append(f"{where}: {warned[0]}")
    return problems


# ---------------------------------------------------------------------------------------------
# 1. flag names and values by type


def test_every_rendered_unit_is_checked_or_says_why_not(cluster):
    for plan in cluster.prepared.plans.values():
        for name in plan.units:
            component = name.removesuffix(".service")
            assert component in COMPONENTS or name in NOT_CHECKED, f"{plan.name}: {name} is checked nowhere"
            if component in COMPONENTS:
                assert COMPONENTS[component] == plan.role, f"{plan.name} ({plan.role}) runs {component}"
    for component, role in COMPONENTS.items():
        assert all(f"{component}.service" in p.units for p in cluster.hosts(role)), component


@pytest.mark.parametrize("component", COMPONENTS)
def test_rendered_flags_are_real_and_not_deprecated(cluster, real, component):
    problems = []
    for plan in cluster.hosts(COMPONENTS[component]):
        flags = flags_of(plan, component)
        assert flags, f"{plan.name}: {component} has no flags at all"
        problems += [f"{plan.name}: {p}" for p in flag_problems(real[component], flags)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("component,flags,expected", [
    ("kube-apiserver", {"--hiddenplane-no-such-flag": "1"}, "is not a flag of the real binary"),
    ("kube-apiserver", {"--apiserver-count": "1"}, "is deprecated (hidden from --help): Flag --apiserver-count"),
    ("kube-apiserver", {"--admission-control": "NodeRestriction"}, "is deprecated: "),
    ("kube-apiserver", {"--secure-port": "abc"}, "the value 'abc' is refused: Error: invalid argument"),
    ("kube-proxy", {"--healthz-port": "10256"}, "is deprecated (hidden from --help)"),
    ("kube-scheduler", {"--profiling": "false"}, "is deprecated: "),
    ("kubelet", {"--read-only-port": "0"}, "is deprecated: "),
    ("kubelet", {"--maximum-dead-containers": "1"}, "has been deprecated"),
    ("kubelet", {"--healthz-port": "x"}, "the value 'x' is refused"),
    ("kube-controller-manager", {"--leader-elect": "maybe"}, "the value 'maybe' is refused"),
    ("etcd", {"--max-snapshots": "5"}, "is deprecated: "),
    ("etcd", {"--enable-v2": "true"}, "is not a flag of the real binary: flag provided but not defined"),
    ("etcd", {"--client-cert-auth": "maybe"}, "the value 'maybe' is refused"),
])
def test_the_flag_check_catches_what_it_should(real, component, flags, expected):
    problems = flag_problems(real[component], flags)
    assert any(expected in p for p in problems), problems
    assert all(real[component].version in p and next(iter(flags)) in p for p in problems), problems


def test_the_help_parser_reads_both_usage_formats(real):
    # one flag of each kind, so a change in either format shows here and not as a flood above
    assert "--etcd-servers" in real["kube-apiserver"].listed
    assert real["kube-apiserver"].deprecated_text("--etcd-servers") is None
    assert "--tls-cipher-suites" in real["kubelet"].listed and real["kubelet"].deprecated_text("--tls-cipher-suites")
    assert real["kubelet"].deprecated_text("--config") is None
    assert real["etcd"].deprecated_text("--peer-client-cert-auth") is None
    assert real["etcd"].deprecated_text("--max-snapshots")


# ---------------------------------------------------------------------------------------------
# the sandbox


@dataclass
class Proc:
    root: Path                  # the host root it runs in (chroot)
    argv: list[str]             # argv[0]: the rendered binary path inside that root


@dataclass
class Result:
    returncode: int
    output: str

    def failure(self) -> str:
        """The error a Kubernetes component exits with (klog ``"command failed" err=...``)."""
        m = re.search(r'"command failed" err=(.*)', self.output, re.S)
        return m[1].strip() if m else self.output.strip()[-800:]


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("running the real binaries in their sandbox needs root (CI runs as root)")


def host_root(cluster: Cluster, host: str, dest: Path) -> Path:
    """A fresh copy of a host's rendered tree to chroot into."""
    root = dest / host
    shutil.copytree(cluster.tree / host, root, symlinks=True)
    (root / "tmp").mkdir(exist_ok=True)
    (root / "sys/fs/cgroup").mkdir(parents=True, exist_ok=True)
    return root


def sandbox(artifacts: Path, runs: list[Proc], daemons: list[Proc] = (), addresses: list[str] = ()) -> list[Result]:
    """Start ``daemons`` in the background, then each of ``runs`` in turn, all in one set of new
    namespaces; when the last run ends, PID 1 of the namespace exits and the kernel kills the
    rest. Each binary is the built one, bind-mounted at its rendered path."""
    require_root()
    q = shlex.quote
    lines = ["set -e", "ip link set lo up"] + [f"ip addr add {q(a)}/32 dev lo" for a in addresses]
    mounted: set[Path] = set()
    for p in [*daemons, *runs]:
        if p.root not in mounted:
            lines.append(f"mount -t cgroup2 -o ro,nosuid,nodev,noexec cgroup2 {q(str(p.root / 'sys/fs/cgroup'))}")
            mounted.add(p.root)
        exe = p.root / p.argv[0].lstrip("/")
        if exe not in mounted:
            exe.parent.mkdir(parents=True, exist_ok=True)
            exe.touch()
            lines.append(f"mount --bind {q(str(artifacts / Path(p.argv[0]).name))} {q(str(exe))}")
            mounted.add(exe)
    chroot = shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin")

    def cmd(p):
        return f"env -i {q(chroot)} {q(str(p.root))} {' '.join(map(q, p.argv))}"

    for i, d in enumerate(daemons):
        lines.append(f"{cmd(d)} >{q(str(d.root / 'tmp' / f'daemon-{i}.log'))} 2>&1 &")
    lines.append("set +e")
    for i, r in enumerate(runs):
        log = r.root / "tmp" / f"run-{i}"
        lines.append(f"{cmd(r)} >{q(str(log))}.log 2>&1; echo $? >{q(str(log))}.rc")
    proc = _run(["unshare", "--mount", "--net", "--pid", "--uts", "--ipc", "--fork", "--kill-child",
                 "sh", "-c", "\n".join(lines)], timeout=SANDBOX_TIMEOUT)
    assert proc.returncode == 0, f"the sandbox failed: {proc.stdout}{proc.stderr}"
    out = []
    for i, r in enumerate(runs):
        log = r.root / "tmp" / f"run-{i}"
        out.append(Result(int((log.with_suffix(".rc")).read_text()), log.with_suffix(".log").read_text()))
    return out


# what a run must not print: the strict error a lenient fallback logs, a deprecated flag
BAD_SIGNS = [re.compile(r"strict decoding error"), PFLAG_DEPRECATION, re.compile(r"Audit policy contains errors")]


def bad_signs(output: str) -> list[str]:
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if any(s.search(line) for s in BAD_SIGNS):
            found.append(" / ".join(ln.strip() for ln in lines[max(0, i - 1):i + 3]))
    return found


def leaves(doc, prefix: tuple = ()) -> dict[tuple, object]:
    if isinstance(doc, dict) and doc:
        out = {}
        for k, v in doc.items():
            out.update(leaves(v, prefix + (k,)))
        return out
    return {prefix: doc}


def lookup(doc, path: tuple, rename: dict[str, str] | None = None, fold_case: bool = False):
    cur = doc
    for part in path:
        part = (rename or {}).get(part, part)
        if not isinstance(cur, dict):
            return KeyError
        keys = {k.lower(): k for k in cur} if fold_case else {k: k for k in cur}
        key = keys.get(part.lower() if fold_case else part)
        if key is None:
            return KeyError
        cur = cur[key]
    return cur


def misplaced(rendered: dict, decoded: dict, rename=None, fold_case=False, skip=()) -> list[str]:
    """Rendered leaf values the real decoder did not put at the same place."""
    bad = []
    for path, value in leaves(rendered).items():
        if path[0] in skip:
            continue
        got = lookup(decoded, path, rename, fold_case)
        if got != value:
            has = "nothing" if got is KeyError else repr(got)
            bad.append(f"{'.'.join(path)}: rendered {value!r}, the binary has {has}")
    return bad


def config_path(plan: HostPlan, component: str) -> str:
    path = flags_of(plan, component).get("--config")
    assert path and path in plan.files, f"{plan.name}: {component} --config names {path!r}"
    return path


# ---------------------------------------------------------------------------------------------
# 2. the components that decode their config and stop: kube-scheduler, kube-proxy, kubelet

WRITTEN = "/tmp/hiddenplane-written.yaml"
LOCK = "/hiddenplane-test-stop/kubelet.lock"         # its directory exists in no host root
KUBELET_RENAMED = {"resolvConf": "ResolverConfig"}   # internal field names the kubelet logs


def run_decoders(cluster: Cluster, artifacts: Path, component: str, tmp: Path,
                 mutate: Callable[[bytes], bytes] | None = None,
                 first_only: bool = False) -> list[tuple[HostPlan, Path, Result]]:
    """The rendered ExecStart of ``component`` on each of its hosts, plus the flag that makes it
    stop after decoding (``mutate`` edits the config file first)."""
    out = []
    hosts = cluster.hosts(COMPONENTS[component])
    for plan in hosts[:1] if first_only else hosts:
        root = host_root(cluster, plan.name, tmp)
        if mutate:
            cfg = root / config_path(plan, component).lstrip("/")
            cfg.write_bytes(mutate(cfg.read_bytes()))
        extra = [f"--lock-file={LOCK}", "--v=5"] if component == "kubelet" else [f"--write-config-to={WRITTEN}"]
        (result,) = sandbox(artifacts, [Proc(root, argv_of(plan, component) + extra)])
        out.append((plan, root, result))
    return out


def decoder_problems(component: str, plan: HostPlan, root: Path, result: Result) -> list[str]:
    problems = [f"{plan.name}: {component} warned: {s}" for s in bad_signs(result.output)]
    rendered = yaml.safe_load(plan.files[config_path(plan, component)].content)
    if component == "kubelet":
        if result.returncode == 0 or f'unable to acquire file lock on \\"{LOCK}\\"' not in result.failure():
            return problems + [f"{plan.name}: kubelet stopped before its lock file: {result.failure()}"]
        m = re.search(r'"KubeletConfiguration" configuration=<\n(.*?)\n >', result.output, re.S)
        assert m, f"{plan.name}: the kubelet logged no decoded configuration at --v=5"
        decoded = json.loads("\n".join(ln[1:] for ln in m[1].splitlines()))
        # the kubelet logs its internal type: Go field names, which match the YAML names but
        # for their case (and the renames above); apiVersion and kind are gone after decoding
        problems += [f"{plan.name}: kubelet {p}" for p in
                     misplaced(rendered, decoded, KUBELET_RENAMED, fold_case=True, skip=("apiVersion", "kind"))]
    else:
        if result.returncode != 0 or "Wrote configuration" not in result.output:
            return problems + [f"{plan.name}: {component} refused its config: {result.failure()}"]
        decoded = yaml.safe_load((root / WRITTEN.lstrip("/")).read_text())
        problems += [f"{plan.name}: {component} {p}" for p in misplaced(rendered, decoded)]
    return problems


def test_misplaced_names_a_value_the_binary_does_not_hold():
    rendered = {"authentication": {"x509": {"clientCAFile": "/a"}}, "resolvConf": "/r", "readOnlyPort": 0}
    decoded = {"Authentication": {"X509": {"ClientCAFile": "/a"}}, "ResolverConfig": "/r", "ReadOnlyPort": 10255}
    assert misplaced(rendered, decoded, KUBELET_RENAMED, fold_case=True) == [
        "readOnlyPort: rendered 0, the binary has 10255"]
    assert misplaced({"mode": "iptables"}, {"Mode": "iptables"}) == [
        "mode: rendered 'iptables', the binary has nothing"]


DECODERS = ("kube-scheduler", "kube-proxy", "kubelet")


@pytest.mark.parametrize("component", DECODERS)
def test_the_real_component_decodes_and_validates_the_rendered_config(cluster, built_artifacts, component,
                                                                      tmp_path):
    problems = []
    for plan, root, result in run_decoders(cluster, built_artifacts, component, tmp_path):
        problems += decoder_problems(component, plan, root, result)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def container_workers(example_doc, tmp_path_factory) -> Cluster:
    """The example with spec.workerHosts as the lab's nspawn workers on cgroup v1 have it: only
    the worker configs differ, so only the worker components are run for it."""
    doc = copy.deepcopy(example_doc)
    doc["spec"]["workerHosts"] = {"cgroupV1": True, "inContainer": True, "evictionHard": LAB_EVICTION_HARD}
    tmp = tmp_path_factory.mktemp("container-workers")
    return write("container_workers", api.prepare(write_inventory(tmp, doc), tmp / "state"), tmp_path_factory)


@pytest.mark.parametrize("component", ("kubelet", "kube-proxy"))
def test_the_real_component_decodes_the_config_of_container_workers(container_workers, built_artifacts, component,
                                                                     tmp_path):
    problems = []
    for plan, root, result in run_decoders(container_workers, built_artifacts, component, tmp_path):
        rendered = yaml.safe_load(plan.files[config_path(plan, component)].content)
        # not vacuous: the fields' keys are in the file the binary reads (and misplaced checks each)
        assert {"failCgroupV1", "evictionHard"} <= set(rendered) if component == "kubelet" else "conntrack" in rendered
        problems += decoder_problems(component, plan, root, result)
    assert not problems, "\n".join(problems)


def _append(text: str) -> Callable[[bytes], bytes]:
    return lambda b: b.rstrip(b"\n") + b"\n" + text.encode() + b"\n"


def _replace(old: str, new: str) -> Callable[[bytes], bytes]:
    def edit(b: bytes) -> bytes:
        assert old.encode() in b, f"{old!r} is not in the rendered config"
        return b.replace(old.encode(), new.encode())
    return edit


WRONG_CONFIGS = [
    # (component, how the config is spoiled, what the real binary says)
    ("kube-scheduler", _append("hiddenplaneBogus: 1"), 'strict decoding error: unknown field \\"hiddenplaneBogus\\"'),
    ("kube-scheduler", _append("enableProfiling: true"), 'key \\"enableProfiling\\" already set in map'),
    ("kube-scheduler", _append("parallelism: -1"), "parallelism: Invalid value: -1"),
    ("kube-proxy", _append("hiddenplaneBogus: 1"), 'strict decoding error: unknown field \\"hiddenplaneBogus\\"'),
    ("kube-proxy", _append("mode: ipvs"), 'key \\"mode\\" already set in map'),
    ("kube-proxy", _replace("mode: iptables", "mode: bogus"), 'Invalid value: \\"bogus\\"'),
    ("kubelet", _append("hiddenplaneBogus: 1"), 'strict decoding error: unknown field \\"hiddenplaneBogus\\"'),
    ("kubelet", _append("readOnlyPort: 10255"), 'key \\"readOnlyPort\\" already set in map'),
    ("kubelet", _replace("healthzPort: 10248", "healthzPort: 99999"), "healthzPort (--healthz-port) 99999 must be"),
]


@pytest.mark.parametrize("component,spoil,says", [pytest.param(*w, id=f"{w[0]}-{i}") for i, w in
                                                  enumerate(WRONG_CONFIGS)])
def test_the_real_component_refuses_or_warns_about_a_wrong_config(example, built_artifacts, component, spoil,
                                                                 says, tmp_path):
    ((plan, root, result),) = run_decoders(example, built_artifacts, component, tmp_path, spoil, first_only=True)
    problems = decoder_problems(component, plan, root, result)
    assert problems, f"{component} took the spoiled config without a word:\n{result.output[-2000:]}"
    # klog quotes the error inside err="..."; the unquoted form shows in multi-line err=<...>
    assert any(says in p or says.replace('\\"', '"') in p for p in problems), problems


# ---------------------------------------------------------------------------------------------
# 3. kube-controller-manager and kube-apiserver: validated, then stopped at a withheld file


def withhold(root: Path, path: str) -> None:
    (root / path.lstrip("/")).unlink()


def controller_manager_results(cluster: Cluster, artifacts: Path, tmp: Path,
                               flags: Callable[[list[str]], list[str]] = lambda a: a) -> list[tuple[str, str, Result]]:
    out = []
    for plan in cluster.hosts("control"):
        root = host_root(cluster, plan.name, tmp)
        held = flags_of(plan, "kube-controller-manager")["--requestheader-client-ca-file"]
        withhold(root, held)
        (result,) = sandbox(artifacts, [Proc(root, flags(argv_of(plan, "kube-controller-manager")))])
        out.append((plan.name, held, result))
    return out


def stopped_at(result: Result, held: str) -> bool:
    return result.returncode != 0 and f"open {held}: no such file or directory" in result.failure()


def test_the_real_controller_manager_validates_the_rendered_flags(cluster, built_artifacts, tmp_path):
    problems = []
    for host, held, result in controller_manager_results(cluster, built_artifacts, tmp_path):
        problems += [f"{host}: {s}" for s in bad_signs(result.output)]
        if not stopped_at(result, held):
            problems.append(f"{host}: kube-controller-manager failed before loading {held}: {result.failure()}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("old,new,says", [
    ("--controllers=*,bootstrapsigner,tokencleaner", "--controllers=*,hiddenplanebogus",
     '\\"hiddenplanebogus\\" is not in the list of known controllers'),
    ("--tls-min-version=VersionTLS12", "--tls-min-version=VersionTLS99", 'unknown tls version \\"VersionTLS99\\"'),
])
def test_the_real_controller_manager_refuses_a_wrong_value(example, built_artifacts, tmp_path, old, new, says):
    def spoil(argv: list[str]) -> list[str]:
        assert old in argv
        return [new if a == old else a for a in argv]
    ((_, held, result),) = controller_manager_results(example, built_artifacts, tmp_path, spoil)
    assert not stopped_at(result, held) and says in result.failure(), result.output[-2000:]


def apiserver_results(cluster: Cluster, artifacts: Path, tmp: Path,
                      variants: dict[str, Callable[[Path], None]] | None = None) -> dict[str, Result]:
    """kube-apiserver with its rendered ExecStart on each control host (``variants``: runs of the
    first host's, each with its root edited first), all against one real etcd member."""
    controls = cluster.hosts("control")
    first = controls[0]
    etcd_root = host_root(cluster, first.name, tmp / "etcd")
    etcd = argv_of(first, "etcd")
    # one member: the three of the 3-control variant would all bind 127.0.0.1:2379 here
    etcd = [f"--initial-cluster={first.name}={flags_of(first, 'etcd')['--initial-advertise-peer-urls']}"
            if a.startswith("--initial-cluster=") else a for a in etcd]
    runs, names = [], []
    plans = [(p.name, p, None) for p in controls] + [(n, first, edit) for n, edit in (variants or {}).items()]
    for name, plan, edit in plans:
        root = host_root(cluster, plan.name, tmp / name)
        withhold(root, flags_of(plan, "kube-apiserver")["--proxy-client-cert-file"])
        if edit:
            edit(root)
        runs.append(Proc(root, argv_of(plan, "kube-apiserver")))
        names.append(name)
    results = sandbox(artifacts, runs, daemons=[Proc(etcd_root, etcd)],
                      addresses=[cluster.address(p.name) for p in controls])
    return dict(zip(names, results))


def apiserver_problems(name: str, plan: HostPlan, result: Result) -> list[str]:
    held = flags_of(plan, "kube-apiserver")["--proxy-client-cert-file"]
    problems = [f"{name}: {s}" for s in bad_signs(result.output)]
    if not stopped_at(result, held):
        problems.append(f"{name}: kube-apiserver failed before the aggregator loads {held}: {result.failure()}")
    elif not re.search(r"Loaded \d+ validating admission controller\(s\) successfully.*EventRateLimit", result.output):
        problems.append(f"{name}: kube-apiserver did not load EventRateLimit")
    return problems


def test_the_real_apiserver_validates_its_flags_and_decodes_its_config_files(cluster, built_artifacts, tmp_path):
    results = apiserver_results(cluster, built_artifacts, tmp_path)
    problems = []
    for plan in cluster.hosts("control"):
        problems += apiserver_problems(plan.name, plan, results[plan.name])
    assert not problems, "\n".join(problems)


K8S = "/etc/kubernetes"


def _edit(path: str, spoil: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        f = root / path.lstrip("/")
        f.write_bytes(spoil(f.read_bytes()))
    return edit


def _erl(old: str, new: str) -> Callable[[Path], None]:
    return _edit(f"{K8S}/admission-config.yaml", _replace(old, new))


APISERVER_WRONG = {
    # name: (how the first control host's root is spoiled, what kube-apiserver says)
    "encryption-unknown-field": (_edit(f"{K8S}/encryption-config.yaml", _append("hiddenplaneBogus: 1")),
                                 'strict decoding error: unknown field \\"hiddenplaneBogus\\"'),
    "audit-unknown-field": (_edit(f"{K8S}/audit-policy.yaml", _append("hiddenplaneBogus: 1")),
                            'Audit policy contains errors, falling back to lenient decoding'),
    "admission-unknown-field": (_edit(f"{K8S}/admission-config.yaml", _append("hiddenplaneBogus: 1")),
                                'failed to read plugin config: strict decoding error'),
    # EventRateLimit ignores unknown fields: an invalid value shows each rendered field is read
    "eventratelimit-qps": (_erl("qps: 50", "qps: 0"), "limits[0].qps: Invalid value: 0"),
    "eventratelimit-burst": (_erl("burst: 100", "burst: 0"), "limits[0].burst: Invalid value: 0"),
    "eventratelimit-cacheSize": (_erl("cacheSize: 2000", "cacheSize: -1"), "limits[1].cacheSize: Invalid value: -1"),
    "eventratelimit-type": (_erl("type: Namespace", "type: Bogus"), 'limits[1].type: Unsupported value: \\"Bogus\\"'),
    "flag-value": (None, 'authorization-mode \\"Bogus\\" is not a valid mode'),
}


def test_the_real_apiserver_refuses_or_warns_about_a_wrong_file_or_value(example, built_artifacts, tmp_path):
    first = example.hosts("control")[0]
    spoiled_files = {n: edit for n, (edit, _) in APISERVER_WRONG.items() if edit}
    results = apiserver_results(example, built_artifacts, tmp_path, spoiled_files)
    # the wrong flag value: validation refuses it before the apiserver needs etcd
    argv = argv_of(first, "kube-apiserver")
    assert "--authorization-mode=Node,RBAC" in argv
    argv = [a.replace("=Node,RBAC", "=Node,RBAC,Bogus") if a.startswith("--authorization-mode=") else a for a in argv]
    (results["flag-value"],) = sandbox(built_artifacts, [Proc(host_root(example, first.name, tmp_path / "flag"), argv)])
    for name, (_, says) in APISERVER_WRONG.items():
        problems = apiserver_problems(name, first, results[name])
        assert problems, f"{name}: kube-apiserver took it without a word:\n{results[name].output[-2000:]}"
        assert any(says in p or says.replace('\\"', '"') in p for p in problems), (name, problems)
