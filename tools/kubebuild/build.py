"""Build the real cluster binaries and lab images from their Go modules (lab and test tooling).

Nothing here ships in the wheel. ``scripts/build-kubernetes VERSION DIR`` runs it: every
component of COMPONENTS is built from a small wrapper module under ``tools/kubebuild/`` (its
``go.mod``/``go.sum`` committed, generated from the upstream go.mod by ``--pin``), and the
images the lab needs (pause, CoreDNS, busybox) are wrapped as OCI archives; haproxy (the
workers' API balancer) is built from its C release (sources.py). DIR gets the files plus a
``SHA256SUMS`` in the format ``source: dir`` verifies.

``hosted`` (docs/hosted.md): the images a hosted control plane runs, under the official names
``installer.core.inventory_hosted.hosted_images`` gives (kube-apiserver, kube-controller-manager,
kube-scheduler and etcd from the same builds as the binaries; the konnectivity server and agent
from sigs.k8s.io/apiserver-network-proxy), the hosting cluster's volume provisioner
(local-path-provisioner) and NetworkPolicy enforcer (kube-network-policies, one file of a
dependency built over: ``Component.overlays``), one ``image-<name>.tar`` each
(hosted_image_plan), and the konnectivity server binary that control hosts with
``egress: konnectivity`` run.

Built outputs are cached per component under ``$HIDDENPLANE_CACHE_DIR/build`` (default
``/var/cache/hiddenplane/build``), keyed by everything that goes into them: the wrapper
module, the Go version, flags, tags and this recipe. A warm call only copies files. The cache
itself is buildcache.py, shared with e2e.py and sources.py, which do not import this module.

k8s.io/kubernetes requires each of its staging modules (k8s.io/api, client-go, ...) at
v0.0.0 and replaces them with ./staging/...: a dependency's replace lines do not apply to
us and v0.0.0 is not served, so the wrapper pins every staging module the downloaded go.mod
names at v0.MINOR.PATCH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# the modules beside this one by name (e2e.py: the conformance suite and its images; sources.py:
# C release tarballs; buildcache.py), also when this file is loaded by its path (the tests)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(1, str(Path(__file__).resolve().parent))

import cilium  # noqa: E402
import e2e  # noqa: E402
import sources  # noqa: E402
from buildcache import (  # noqa: E402
    Built,
    Component,
    cache_root,
    cached,
    download_gomod,
    go,
    go_env,
    key_of,
    log,
    save_digests,
    sha256_file,
)

from installer.core import versions  # noqa: E402
from installer.core.artifacts import SUMS_FILE, read_sums, write_sums  # noqa: E402
from installer.core.inventory_hosted import KONNECTIVITY_IMAGE_VERSION, hosted_images  # noqa: E402
from installer.core.inventory_model import SANDBOX_IMAGE  # noqa: E402
from installer.core.render.addons.coredns import COREDNS_IMAGE, COREDNS_VERSION  # noqa: E402
from installer.core.render.addons.konnectivity import SERVER_BINARY as KONNECTIVITY_SERVER  # noqa: E402
from installer.core.render.addons.netpol import NETPOL, NETPOL_BINARY, NETPOL_IMAGE, NETPOL_VERSION  # noqa: E402

RECIPE = 1                      # bump when how a component's binaries are built changes
IMAGE_RECIPE = 2                # bump when how an image archive is made changes
BUILD_DATE = "1970-01-01T00:00:00Z"     # reproducible: no wall-clock time in a binary
LAB_BUSYBOX_IMAGE = "localhost/hiddenplane/busybox:lab"


# --- the component table ---------------------------------------------------------------------

def _k8s_ldflags(version: str) -> list[str]:
    major, minor, _ = version.lstrip("v").split(".")
    out = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        out += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor={major}", f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean", f"-X {pkg}.buildDate={BUILD_DATE}"]
    return out


def kubernetes(version: str) -> Component:
    cmd = "k8s.io/kubernetes/cmd/"
    return Component(
        "kubernetes", version, ("k8s.io/kubernetes",),
        {b: cmd + b for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet",
                              "kube-proxy", "kubectl")},
        _k8s_ldflags, tags="selinux,notest,grpcnotrace", staging=True)


def others(etcd: str | None = None) -> list[Component]:
    """``etcd``: another etcd than the default (tests/test_real_upgrade.py rolls a patch)."""
    d = versions.DEFAULT_COMPONENTS
    containerd, runc, cni = "v" + d["containerd"].lstrip("v"), d["runc"], d["cni"]
    etcd = etcd or d["etcd"]
    return [
        Component("etcd", etcd,
                  ("go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/etcdctl/v3", "go.etcd.io/etcd/etcdutl/v3"),
                  {"etcd": "go.etcd.io/etcd/server/v3", "etcdctl": "go.etcd.io/etcd/etcdctl/v3",
                   "etcdutl": "go.etcd.io/etcd/etcdutl/v3"},
                  lambda v: [f"-X go.etcd.io/etcd/api/v3/version.GitSHA=v{v.lstrip('v')}"]),
        Component("containerd", containerd, ("github.com/containerd/containerd/v2",),
                  {b: f"github.com/containerd/containerd/v2/cmd/{b}"
                   for b in ("containerd", "containerd-shim-runc-v2", "ctr")},
                  lambda v: [f"-X github.com/containerd/containerd/v2/version.Version={v}",
                             "-X github.com/containerd/containerd/v2/version.Revision=hiddenplane-kubebuild"],
                  tags="no_btrfs no_devmapper no_zfs"),
        # runc needs cgo (its nsenter is C) and libseccomp; linked statically like its releases
        Component("runc", runc, ("github.com/opencontainers/runc",), {"runc": "github.com/opencontainers/runc"},
                  lambda v: [f"-X main.version={v.lstrip('v')}", "-linkmode external", "-extldflags -static"],
                  tags="seccomp netgo osusergo", cgo=True, apt=("libseccomp-dev", "pkg-config")),
        Component("cni", cni, ("github.com/containernetworking/plugins",),
                  {p: f"github.com/containernetworking/plugins/plugins/{kind}/{p}"
                   for kind, p in (("main", "bridge"), ("ipam", "host-local"), ("main", "loopback"),
                                   ("meta", "portmap"))},
                  lambda v: [f"-X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion={v}"]),
        Component("cri-tools", CRICTL_VERSION, ("sigs.k8s.io/cri-tools",),
                  {"crictl": "sigs.k8s.io/cri-tools/cmd/crictl"},
                  lambda v: [f"-X sigs.k8s.io/cri-tools/pkg/version.Version={v}"]),
        Component("coredns", COREDNS_VERSION, ("github.com/coredns/coredns",),
                  {"coredns": "github.com/coredns/coredns"},
                  lambda v: [f"-X github.com/coredns/coredns/coremain.GitCommit={v}"]),
    ]


# cri-tools has no v1.36 on the module proxy; crictl is skew-tolerant within a few minors
CRICTL_VERSION = "v1.37.0"

# hosted: the konnectivity server and agent (the module proxy serves v0.36.0, not v0.35.0) and
# the hosting cluster's volume provisioner
LOCAL_PATH_VERSION = "v0.0.37"
LOCAL_PATH_IMAGE = f"docker.io/rancher/local-path-provisioner:{LOCAL_PATH_VERSION}"
_ANP = "sigs.k8s.io/apiserver-network-proxy"


def hosted_components() -> list[Component]:
    """What ``hosted`` builds beside the Kubernetes and etcd binaries. apiserver-network-proxy's
    go.mod replaces its konnectivity-client module with ./konnectivity-client (not inherited by
    a dependent): the wrapper requires the published konnectivity-client of the same version.
    Upstream builds both without version stamps (artifacts/images/*-build.Dockerfile)."""
    return [
        Component("konnectivity", KONNECTIVITY_IMAGE_VERSION, (_ANP, f"{_ANP}/konnectivity-client"),
                  {KONNECTIVITY_SERVER: f"{_ANP}/cmd/server", "proxy-agent": f"{_ANP}/cmd/agent"},
                  lambda v: []),
        Component("local-path-provisioner", LOCAL_PATH_VERSION, ("github.com/rancher/local-path-provisioner",),
                  {"local-path-provisioner": "github.com/rancher/local-path-provisioner"},
                  lambda v: [f"-X main.VERSION={v}"]),     # as its scripts/build (the git tag)
        # the hosting cluster's NetworkPolicy enforcer (installer/core/render/addons/netpol.py):
        # its verdict rule queues through nft_compat's NFQUEUE target (the overlay says why)
        Component(NETPOL, NETPOL_VERSION, ("sigs.k8s.io/kube-network-policies",),
                  {NETPOL: "sigs.k8s.io/kube-network-policies/cmd"}, lambda v: [],
                  overlays={"github.com/google/nftables:expr/queue.go": "nftables-queue.go.overlay"}),
    ]


# --- go helpers --------------------------------------------------------------------------------

def go_version() -> str:
    return subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()


_STAGING = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", re.M)
_GO_LINE = re.compile(r"^go\s+(\S+)", re.M)


def staging_modules(gomod: str) -> list[str]:
    """Every module k8s.io/kubernetes replaces with its own staging directory."""
    return sorted(set(_STAGING.findall(gomod)))


def _ver_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def wrapper_gomod(c: Component, upstream: dict[str, str]) -> str:
    go_line = max((m[1] for text in upstream.values() if (m := _GO_LINE.search(text))), key=_ver_key,
                  default="1.26.0")
    lines = [f"// Generated by tools/kubebuild/build.py --pin: build {c.name} {c.version} as a dependency.",
             "// Regenerate rather than edit.", f"module hiddenplane.local/kubebuild/{c.name}", "",
             f"go {go_line}", "", "require ("]
    lines += [f"\t{m} {c.version}" for m in c.modules] + [")"]
    if c.staging:
        _, minor, patch = c.version.lstrip("v").split(".")
        staging = staging_modules(upstream["k8s.io/kubernetes"])
        lines += ["", "// k8s.io/kubernetes requires these at v0.0.0 (not served) and replaces them with",
                  "// ./staging/...; the same code is published as v0.MINOR.PATCH", "replace ("]
        lines += [f"\t{m} => {m} v0.{minor}.{patch}" for m in staging] + [")"]
    if c.replaces:
        lines += ["", "// what the module proxy does not serve (tools/kubebuild says why, at the component)",
                  "replace ("]
        lines += [f"\t{m} => {to}" for m, to in sorted(c.replaces.items())] + [")"]
    return "\n".join(lines) + "\n"


def test_imports(src: Path, pkg: str, module: str) -> set[str]:
    """The non-standard packages the ``_test.go`` files of ``pkg`` (in ``module``'s source at
    ``src``) import: a wrapper's tools.go names them, so that go mod tidy keeps what `go test -c`
    of a dependency's package needs (tidy keeps only the main module's own test imports)."""
    found: set[str] = set()
    for f in (src / pkg.removeprefix(module).lstrip("/")).glob("*_test.go"):
        for block in re.findall(r"^import\s*\((.*?)^\)", f.read_text(), re.M | re.S):
            found.update(m for m in re.findall(r'^\s*(?:[\w.]+\s+)?"([^"]+)"', block, re.M)
                         if "." in m.split("/")[0])
    return found


def tools_go(c: Component, extra: set[str] = frozenset()) -> str:
    imports = "\n".join(f'\t_ "{p}"' for p in sorted(set(c.binaries.values()) | set(c.tests.values()) | extra))
    return ("//go:build tools\n\n// Package tools names the main packages this wrapper module builds, so that\n"
            f"// go mod tidy keeps their dependencies.\npackage tools\n\nimport (\n{imports}\n)\n")


def pin(c: Component) -> Path:
    """(Re)generate the wrapper module of ``c`` from the upstream go.mod files."""
    c.pin_dir.mkdir(parents=True, exist_ok=True)
    downloaded = {m: download_gomod(m, c.version, c.pin_dir) for m in c.modules}
    upstream = {m: text for m, (text, _) in downloaded.items()}
    extra = {i for pkg in c.tests.values() for m, (_, src) in downloaded.items() if pkg.startswith(m + "/")
             for i in test_imports(src, pkg, m)}
    (c.pin_dir / "go.mod").write_text(wrapper_gomod(c, upstream))
    (c.pin_dir / "tools.go").write_text(tools_go(c, extra))
    (c.pin_dir / "go.sum").unlink(missing_ok=True)
    log(f"==> pinning {c.name} {c.version} in {c.pin_dir.relative_to(ROOT)} (go mod tidy)")
    go(["mod", "tidy"], c.pin_dir, {**go_env(), "GOFLAGS": "-mod=mod"}, f"go mod tidy ({c.name})")
    return c.pin_dir


# --- building ------------------------------------------------------------------------------------

def build_env(c: Component) -> dict[str, str]:
    return {**go_env(), "CGO_ENABLED": "1" if c.cgo else "0"}


def build_key(c: Component, gover: str) -> str:
    # (tests only when there are any: the keys of the components without stay what they were)
    return key_of(f"recipe={RECIPE}", c.name, c.version, gover, f"cgo={c.cgo}", c.tags,
                  json.dumps(c.binaries, sort_keys=True), *([json.dumps(c.tests, sort_keys=True)] if c.tests else []),
                  " ".join(c.ldflags(c.version)),
                  *((c.pin_dir / f).read_text() for f in ("go.mod", "go.sum")),
                  *(f"{target}={(c.pin_dir / ours).read_text()}" for target, ours in sorted(c.overlays.items())),
                  *(f"{f.relative_to(c.pin_dir)}={f.read_text()}" for to in sorted(c.replaces.values())
                    if to.startswith("./") for f in sorted((c.pin_dir / to).rglob("*")) if f.is_file()))


class Heartbeat:
    """Prints progress of a long build every ``every`` seconds: packages compiled, time spent."""

    def __init__(self, label: str, every: float = 60.0, packages: bool = True):
        self.label, self.every, self.count, self.packages = label, every, 0, packages
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            done = f"{self.count} packages compiled, " if self.packages else ""
            log(f"    {self.label}: {done}{fmt_secs(time.monotonic() - self.start)}")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def fmt_secs(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.1f}s"


def go_build(c: Component, out: Path) -> float:
    """Build ``c``'s binaries into ``out``; returns the peak RSS (MiB) of the largest process
    of the build (the go command and every compile and link it ran)."""
    flags = ["-v", "-trimpath", "-p", str(os.cpu_count() or 2),
             "-ldflags", " ".join(["-s", "-w", *c.ldflags(c.version)])]
    if c.tags:
        flags += ["-tags", c.tags.replace(" ", ",")]
    if c.overlays:
        flags.append(f"-modfile={override_modules(c, out)}")
    # one go command for all of a component's binaries: shared packages compile once
    runs = [["go", "build", *flags, "-o", f"{out}/", *sorted(set(c.binaries.values()))]] if c.binaries else []
    runs += [["go", "test", "-c", *[f for f in flags if f != "-v"], "-o", str(out / name), pkg]
             for name, pkg in sorted(c.tests.items())]
    peak = 0.0
    for cmd in runs:
        peak = max(peak, _go_run(c, cmd))
    # a main package named like its directory lands under that name; rename to ours
    for name, pkg in c.binaries.items():
        built = out / pkg.rstrip("/").rsplit("/", 1)[-1]
        if built.name in ("v2", "v3"):
            built = out / pkg.rstrip("/").rsplit("/", 2)[-2]
        if built != out / name:
            built.rename(out / name)
    for scratch in (".build.mod", ".build.sum"):
        (out / scratch).unlink(missing_ok=True)
    shutil.rmtree(out / ".src", ignore_errors=True)
    return peak


def module_dir(c: Component, module: str) -> Path:
    """Where the go command of ``c``'s wrapper module reads ``module``'s source from."""
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", module], cwd=c.pin_dir, env=build_env(c),
                         capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"build-kubernetes: {c.name}: go list -m {module} failed: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def override_modules(c: Component, out: Path) -> Path:
    """A go.mod for building ``c`` with its overlays (returned; beside it its go.sum): each
    overlaid module copied from the module cache into ``out`` (which the go command forbids
    overlaying in place), our file written over its own, and replaced by that copy. The
    committed wrapper go.mod and go.sum are the rest; all of it is removed after the build."""
    src = out / ".src"
    replaces = []
    for module in sorted({t.partition(":")[0] for t in c.overlays}):
        copy = src / module.replace("/", "_")
        shutil.copytree(module_dir(c, module), copy)
        for f in [copy, *copy.rglob("*")]:
            f.chmod(0o755 if f.is_dir() else 0o644)      # the module cache's files are read-only
        replaces.append(f"replace {module} => {copy}")
    for target, ours in sorted(c.overlays.items()):
        module, _, path = target.partition(":")
        original = src / module.replace("/", "_") / path
        if not original.is_file():
            raise SystemExit(f"build-kubernetes: {c.name}: {module} has no {path} to build over")
        original.write_bytes((c.pin_dir / ours).read_bytes())
    modfile = out / ".build.mod"
    modfile.write_text((c.pin_dir / "go.mod").read_text() + "\n" + "\n".join(replaces) + "\n")
    shutil.copyfile(c.pin_dir / "go.sum", out / ".build.sum")
    return modfile


def _go_run(c: Component, cmd: list[str]) -> float:
    """Run one go build/test command of ``c``, with a heartbeat; the peak RSS (MiB) of its tree."""
    # `go test -c` lists no packages (-v is a test flag there): only the time
    label = f"{c.name} {c.version}" + (f": go test -c {cmd[-1]}" if cmd[1] == "test" else "")
    with Heartbeat(label, packages=cmd[1] != "test") as hb, \
            subprocess.Popen(cmd, cwd=c.pin_dir, env=build_env(c), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) as proc:
        tail: list[str] = []
        for line in proc.stdout:
            hb.count += 1
            tail = (tail + [line.rstrip()])[-25:]
        # wait4: the rusage of this build's process tree alone
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"build-kubernetes: go {cmd[1]} of {c.name} {c.version} failed (exit {rc}):\n"
                         + "\n".join(tail))
    return usage.ru_maxrss / 1024


def build_component(c: Component, gover: str) -> Built:
    if not (c.pin_dir / "go.sum").is_file():
        log(f"note: no wrapper module for {c.name} {c.version} in tools/kubebuild: generating one "
            "(commit it to pin its dependencies)")
        pin(c)

    def make(tmp: Path) -> float:
        missing_apt = [p for p in c.apt if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
        if missing_apt:
            raise SystemExit(f"build-kubernetes: {c.name} needs Debian packages: "
                             f"apt-get install {' '.join(missing_apt)}")
        log(f"==> building {c.name} {c.version}: {', '.join(c.binaries)}")
        return go_build(c, tmp)

    built = cached(c.name, f"{c.name}-{c.version}", build_key(c, gover), make)
    if not built.cached:
        log(f"    {c.name} {c.version}: built in {fmt_secs(built.seconds)} (largest process "
            f"{built.peak_rss_mib:.0f} MiB)")
    return built


# --- images ---------------------------------------------------------------------------------------

def _oci():
    from installer.lab.archives import build_image_archive
    return build_image_archive


def pause_image(k8s: Component) -> Built:
    """pause from k8s.io/kubernetes' own build/pause/linux/pause.c (gcc -static), tagged as the
    installer's default sandbox image."""
    _, src = download_gomod("k8s.io/kubernetes", k8s.version, k8s.pin_dir)
    source = (src / "build/pause/linux/pause.c").read_bytes()
    tag = SANDBOX_IMAGE.rsplit(":", 1)[1]
    gcc = "".join(subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1])

    def make(tmp: Path) -> None:
        log(f"==> building image {SANDBOX_IMAGE} (pause.c from k8s.io/kubernetes {k8s.version})")
        (tmp / "pause.c").write_bytes(source)
        proc = subprocess.run(["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{tag}-hiddenplane",
                               "-o", str(tmp / "pause"), str(tmp / "pause.c")], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"build-kubernetes: gcc -static pause.c failed (libc6-dev installed?):\n{proc.stderr}")
        subprocess.run(["strip", str(tmp / "pause")], check=True)
        _oci()(tmp / "image-pause.tar", SANDBOX_IMAGE, {"/pause": ((tmp / "pause").read_bytes(), 0o755)}, [],
               entrypoint=["/pause"])
        for scratch in ("pause", "pause.c"):
            (tmp / scratch).unlink()

    return cached("pause", "image-pause", key_of(f"recipe={IMAGE_RECIPE}", source, SANDBOX_IMAGE, gcc), make)


def coredns_image(coredns: Built) -> Built:
    binary = coredns.files["coredns"]

    def make(tmp: Path) -> None:
        log(f"==> image {COREDNS_IMAGE}")
        _oci()(tmp / "image-coredns.tar", COREDNS_IMAGE, {"/coredns": (binary.read_bytes(), 0o755)}, [],
               entrypoint=["/coredns"])

    return cached("coredns-image", "image-coredns",
                  key_of(f"recipe={IMAGE_RECIPE}", COREDNS_IMAGE, sha256_file(binary)), make)


# rm, chmod: local-path-provisioner's helper pods (/script/setup, /script/teardown) run in this image
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "sleep", "wget", "nc", "nslookup", "hostname", "httpd", "ip",
                   "ping", "env", "mkdir", "true", "false", "id", "ps", "grep", "timeout", "rm", "chmod")


def busybox_image() -> Built:
    """A shell for test pods: Debian's busybox-static, with the applets tests call as links."""
    from installer.lab.archives import deb_tree
    binary = deb_tree("busybox-static", log) / "bin/busybox"

    def make(tmp: Path) -> None:
        _oci()(tmp / "image-busybox.tar", LAB_BUSYBOX_IMAGE, {"/bin/busybox": (binary.read_bytes(), 0o755)},
               ["/bin/sh"], links={f"/bin/{a}": "busybox" for a in BUSYBOX_APPLETS})

    return cached("busybox-image", "image-busybox",
                  key_of(f"recipe={IMAGE_RECIPE}", LAB_BUSYBOX_IMAGE, sha256_file(binary), " ".join(BUSYBOX_APPLETS)),
                  make)


# --- the hosted control plane's images --------------------------------------------------------------

# what installer/sh/etcd-member-start.sh runs beside etcd, etcdctl and etcdutl: busybox's sh,
# awk, sleep, cat, mv, rm; printf, echo and [ are builtins of its sh, linked too so as not to
# depend on that. `etcd snapshot save|restore` of a tenant (engine/planes/etcd_pods.py) execs
# cat, mkdir, mv and rm in a member's container; apply's NetworkPolicy probe execs nc
# (render/tenant_network.py).
ETCD_APPLETS = ("sh", "awk", "sleep", "printf", "echo", "[", "cat", "mv", "rm", "mkdir", "nc")
BUSYBOX = "busybox"     # the source of /bin/busybox in hosted_image_plan


@dataclass(frozen=True)
class BinaryImage:
    """An image of built binaries: ``files`` maps a path in the image to (the component that
    built it, its file name there; BUSYBOX: Debian's busybox-static); ``links`` are busybox
    applets in /bin."""
    archive: str            # image-<archive>.tar
    ref: str
    files: dict[str, tuple[str, str]]
    entrypoint: str
    links: tuple[str, ...] = ()


def hosted_image_plan(kubernetes_version: str, etcd_version: str) -> list[BinaryImage]:
    """The images a hosted control plane and its hosting cluster run, one archive each; the
    entrypoints are where upstream's images have their binaries."""
    refs = hosted_images("registry.k8s.io", kubernetes_version, etcd_version)
    bin_dir = "/usr/local/bin"
    k8s = [BinaryImage(c, refs[c], {f"{bin_dir}/{c}": ("kubernetes", c)}, f"{bin_dir}/{c}")
           for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")]
    etcd = BinaryImage("etcd", refs["etcd"],
                       {**{f"{bin_dir}/{b}": ("etcd", b) for b in ("etcd", "etcdctl", "etcdutl")},
                        "/bin/busybox": (BUSYBOX, "busybox")},
                       f"{bin_dir}/etcd", ETCD_APPLETS)
    return [*k8s, etcd,
            BinaryImage("konnectivity-server", refs["konnectivity-server"],
                        {"/proxy-server": ("konnectivity", KONNECTIVITY_SERVER)}, "/proxy-server"),
            BinaryImage("konnectivity-agent", refs["konnectivity-agent"],
                        {"/proxy-agent": ("konnectivity", "proxy-agent")}, "/proxy-agent"),
            BinaryImage("local-path-provisioner", LOCAL_PATH_IMAGE,
                        {"/usr/bin/local-path-provisioner": ("local-path-provisioner", "local-path-provisioner")},
                        "/usr/bin/local-path-provisioner"),
            BinaryImage(NETPOL, NETPOL_IMAGE, {NETPOL_BINARY: (NETPOL, NETPOL)}, NETPOL_BINARY)]


def binary_image(img: BinaryImage, built_files: dict[str, dict[str, Path]]) -> Built:
    """``img`` as ``image-<archive>.tar``; ``built_files``: component -> its built files."""
    files = {path: built_files[comp][name] for path, (comp, name) in sorted(img.files.items())}

    def make(tmp: Path) -> None:
        log(f"==> image {img.ref}")
        _oci()(tmp / f"image-{img.archive}.tar", img.ref, {p: (f.read_bytes(), 0o755) for p, f in files.items()},
               [], links={f"/bin/{a}": "busybox" for a in img.links}, entrypoint=[img.entrypoint])

    return cached(f"{img.archive}-image", f"image-{img.archive}",
                  key_of(f"recipe={IMAGE_RECIPE}", img.ref, img.entrypoint, " ".join(img.links),
                         *(f"{p}={sha256_file(f)}" for p, f in files.items())), make)


def hosted_images_built(kubernetes_version: str, etcd_version: str, by_name: dict[str, Built]) -> list[Built]:
    from installer.lab.archives import deb_tree
    built_files = {name: b.files for name, b in by_name.items()}
    built_files[BUSYBOX] = {"busybox": deb_tree("busybox-static", log) / "bin/busybox"}
    return [binary_image(img, built_files) for img in hosted_image_plan(kubernetes_version, etcd_version)]


# --- output ---------------------------------------------------------------------------------------

def install(dest: Path, built: list[Built]) -> dict[str, str]:
    """Copy every built file into ``dest`` and record it in ``dest/SHA256SUMS`` (other lines kept)."""
    dest.mkdir(parents=True, exist_ok=True)
    sums = read_sums(dest)
    for b in built:
        cached = read_sums(next(iter(b.files.values())).parent)
        for name, path in b.files.items():
            target = dest / name
            if not (target.is_file() and sums.get(name) == cached[name] and sha256_file(target) == cached[name]):
                tmp = dest / f".{name}.tmp"
                shutil.copyfile(path, tmp)
                tmp.chmod(0o644 if name.endswith((".tar", ".json", ".tgz")) else 0o755)
                tmp.rename(target)
            sums[name] = cached[name]
    write_sums(dest, sums)
    return sums


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build-kubernetes", description=__doc__.split("\n\n")[0])
    p.add_argument("version", help=f"Kubernetes version, e.g. {versions.DEFAULT_KUBERNETES_VERSION} "
                   "('default': the installer's default)")
    p.add_argument("dir", type=Path, help="artifacts directory to fill (created; SHA256SUMS updated)")
    p.add_argument("--pin", action="store_true", help="regenerate the wrapper modules (go.mod, go.sum) and exit")
    p.add_argument("--etcd", metavar="VERSION", help=f"etcd version (default {versions.DEFAULT_COMPONENTS['etcd']})")
    p.add_argument("--only", action="append", default=[],
                   help="build only these components (kubernetes, etcd, containerd, runc, cni, cri-tools, coredns, "
                   "images, haproxy, socat, konnectivity, local-path-provisioner, kube-network-policies; "
                   "hosted: the images of a hosted control plane, local-path-provisioner's, "
                   "kube-network-policies' and the konnectivity-server binary; "
                   "e2e: the conformance suite and its images, tools/kubebuild/e2e.py; "
                   "cilium: cni: cilium's images, its chart and the helm CLI; these two never by default)")
    args = p.parse_args(argv)
    version = versions.DEFAULT_KUBERNETES_VERSION if args.version == "default" else args.version
    if versions.parse(version) is None:
        p.error(f"VERSION: '{version}' is not vMAJOR.MINOR.PATCH")
    if shutil.which("go") is None:
        raise SystemExit("build-kubernetes: no `go` on PATH (Go 1.26 or newer is needed)")
    k8s = kubernetes(version)
    if args.etcd and versions.parse(args.etcd) is None:
        p.error(f"--etcd: '{args.etcd}' is not vMAJOR.MINOR.PATCH")
    hosted = hosted_components()
    hosted_names = {c.name for c in hosted}
    cilium_parts = cilium.components()
    components = [k8s, *others(args.etcd), *hosted]
    shipped_sources = ("haproxy", "socat")  # built from C, shipped to hosts (busybox is the e2e images')
    wanted = set(args.only) or {c.name for c in components} | {"images", "hosted", *shipped_sources}
    components += cilium_parts      # only when named: --only cilium (its images, chart and helm)
    if cilium.CILIUM in wanted:
        wanted.add(cilium.HELM)
    unknown = wanted - {c.name for c in components} - {"images", "hosted", "e2e", *shipped_sources}
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}")
    # built for an image, shipped only when named: CoreDNS (images), and what the hosted images hold
    needed = {"coredns"} if "images" in wanted else set()
    if "hosted" in wanted:
        needed |= {"kubernetes", "etcd", *hosted_names}
    if "e2e" in wanted:
        components.append(e2e.e2e(k8s))
    if args.pin:
        for c in components:
            if c.name in wanted or (c.name == "kubernetes-e2e" and "e2e" in wanted) or \
                    (c.name in hosted_names and "hosted" in wanted):
                pin(c)
        return 0
    gover = go_version()
    start = time.monotonic()
    log(f"build-kubernetes {version} -> {args.dir} ({gover}; cache {cache_root()})")
    built: list[Built] = []
    by_name: dict[str, Built] = {}
    for c in components:
        if c.name == "kubernetes-e2e":
            # the etcd of the aggregator test's image is the cluster's own build
            etcd = by_name.get("etcd") or build_component(next(o for o in components if o.name == "etcd"), gover)
            built += e2e.build_e2e(c, build_component(c, gover), etcd)
        elif c.name in wanted or c.name in needed:
            b = build_component(c, gover)
            by_name[c.name] = b
            if c.name == cilium.CILIUM:
                built += cilium.build_cilium(c, b, by_name.get("cni") or build_component(
                    next(o for o in components if o.name == "cni"), gover))
            elif c.name == "konnectivity":
                # the server's binary is for control hosts (egress: konnectivity); the agent runs as a pod
                built.append(replace(b, files={KONNECTIVITY_SERVER: b.files[KONNECTIVITY_SERVER]}))
            elif c.name in wanted and c.name not in ("coredns", "local-path-provisioner", NETPOL):
                built.append(b)           # these run as pods: only their images go out
    if "images" in wanted:
        built += [pause_image(k8s), coredns_image(by_name["coredns"]), busybox_image()]
    if "hosted" in wanted:
        etcd_version = next(c.version for c in components if c.name == "etcd")
        built += hosted_images_built(version, etcd_version, by_name)
    built += [sources.build_source(n) for n in shipped_sources if n in wanted]
    sums = install(args.dir, built)
    fresh = [b for b in {b.name: b for b in [*by_name.values(), *built]}.values() if not b.cached and b.seconds]
    summary = ", ".join(f"{b.name} {fmt_secs(b.seconds)}" for b in fresh) or "everything from the cache"
    save_digests()
    log(f"==> {args.dir}: {len(sums)} files in {SUMS_FILE}; {fmt_secs(time.monotonic() - start)} ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
