"""``cni: cilium`` built here (``scripts/build-kubernetes VERSION DIR --only cilium``): the agent
and operator images, the Helm chart and the ``helm`` CLI, all from their Go modules; lab and test
tooling, never built by default.

- ``image-cilium.tar`` is ``quay.io/cilium/cilium:v<CILIUM_VERSION>``, the name the chart renders
  (no digest: ``useDigest`` is false in the module's chart), laid out as upstream's
  images/cilium/Dockerfile lays it out on its runtime image: the binaries in /usr/bin, the CNI
  plugin in /opt/cni/bin, the chart's three scripts at /, the datapath's C sources in
  /var/lib/cilium/bpf (the agent compiles them with clang when it starts and for every endpoint
  template). The base is a Debian minbase tree with what the agent and the chart's init
  containers exec: clang 19 (upstream ships LLVM 19.1.7 and needs >= 18.1; Debian's ``clang-19``
  installs no ``clang``, so a link is added), iptables and ipset (Debian's nft backend, the one
  the workers' kube-proxy uses, so that both write one ruleset), iproute2, bash, util-linux's
  ``mount`` and ``nsenter``, ``/cni/loopback`` from our CNI plugins build.
- Not in it: Envoy (C++, not buildable from a Go module). The chart's values must keep it off
  (``envoy.enabled: false``, ``l7Proxy: false``): render/addons/cilium.py sets both, so no L7
  policy or Ingress is possible with this image. Hubble's CLI and bugtool are left out too.
- ``image-cilium-operator.tar`` is ``quay.io/cilium/operator-generic:v<CILIUM_VERSION>``: the
  binary and the CA bundle, as upstream's images/operator/Dockerfile.
- ``cilium-<CILIUM_VERSION>.tgz``: the module's install/kubernetes/cilium, packed the way ``helm
  package`` lays it out (top directory ``cilium/``, .helmignore honoured) but with fixed times
  and owners, so that its SHA256SUMS line is the same on every machine.
- ``helm``: the CLI the installer runs (build.HELM).
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import tarfile
from pathlib import Path

from buildcache import Built, Component, cached, debian_tree, download_gomod, key_of, log, sha256_file

from installer.core.render.addons.cilium import CILIUM_CHART, CILIUM_VERSION, IMAGES

RECIPE = 1
MODULE = "github.com/cilium/cilium"
CILIUM = "cilium"
HELM = "helm"
HELM_VERSION = "v3.22.0"
_HELM = "helm.sh/helm/v3"
BUILD_DATE = "1970-01-01T00:00:00Z"

# the runtime: what upstream's images/runtime/install-runtime-deps.sh installs that the agent
# or the chart's scripts run (kmod and bash-completion left out: nothing here loads a module)
RUNTIME_PACKAGES = ("clang-19", "iptables", "ipset", "iproute2", "ca-certificates", "libatomic1")
RUNTIME_SKIP = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info",
                "usr/share/locale", "var/log/apt")
CLANG = "/usr/lib/llvm-19/bin/clang"
# upstream's `make install-bpf`: bpf/ without these (Makefile.defs)
BPF_SKIP = ("tests", "complexity-tests", "custom", "test-progs", "Makefile", "Makefile.bpf")
SCRIPTS = {"/init-container.sh": "images/cilium/init-container.sh",
           "/install-plugin.sh": "plugins/cilium-cni/install-plugin.sh",
           "/cni-uninstall.sh": "plugins/cilium-cni/cni-uninstall.sh"}
AGENT_BINARIES = ("cilium-agent", "cilium-dbg", "cilium-health", "cilium-health-responder", "cilium-mount",
                  "cilium-sysctlfix")
OPERATOR = "cilium-operator-generic"


# two of cilium's requirements are not served by the module proxy (403 "not available"):
# - gobgp v4.6.1-0.20260630022313-d6dee8360046, a commit of 30 June 2026; v4.7.0 was tagged
#   that evening (BGP is off here: bgpControlPlane is not enabled);
# - sigs.k8s.io/mcs-api/controllers v0.5.2 (its .info is served, its .zip is not). Cilium's
#   code outside its tests uses one constant of it, the annotation name of the multi-cluster
#   Services API; mcs-api-controllers/ declares that name alone (clustermesh is off here).
REPLACES = {"github.com/osrg/gobgp/v4": "github.com/osrg/gobgp/v4 v4.7.0",
            "sigs.k8s.io/mcs-api/controllers": "./mcs-api-controllers"}


def components() -> list[Component]:
    """The agent's and operator's binaries from one wrapper module (the ipam_provider_operator
    tag only adds the operator's cluster-pool IPAM, unused with ipam.mode kubernetes but part of
    upstream's operator-generic; CGO off and osusergo as upstream's Makefile.defs), and helm.
    The version string is what pkg/version.FromString parses ("VERSION REVISION DATE"). Helm
    without its Makefile's ldflags calls itself v3.22 and renders offline for Kubernetes 1.20,
    which Cilium's chart refuses; 1.37 is what its Makefile derives from client-go v0.37.0."""
    stamp = f"{CILIUM_VERSION} hiddenplane {BUILD_DATE}"
    return [
        Component(CILIUM, "v" + CILIUM_VERSION, (MODULE,),
                  {"cilium-agent": f"{MODULE}/daemon", "cilium-dbg": f"{MODULE}/cilium-dbg",
                   "cilium-health": f"{MODULE}/cilium-health",
                   "cilium-health-responder": f"{MODULE}/cilium-health/responder",
                   "cilium-mount": f"{MODULE}/tools/mount", "cilium-sysctlfix": f"{MODULE}/tools/sysctlfix",
                   "cilium-cni": f"{MODULE}/plugins/cilium-cni", OPERATOR: f"{MODULE}/operator"},
                  lambda v: [f"-X '{MODULE}/pkg/version.ciliumVersion={stamp}'"],
                  tags="osusergo ipam_provider_operator", replaces=REPLACES),
        Component(HELM, HELM_VERSION, (_HELM,), {"helm": f"{_HELM}/cmd/helm"},
                  lambda v: [f"-X {_HELM}/internal/version.version={v}",
                             *(f"-X {_HELM}/pkg/{pkg}.k8sVersion{part}={n}"
                               for pkg in ("chartutil", "lint/rules") for part, n in (("Major", 1), ("Minor", 37)))]),
    ]


def _archives():
    from installer.lab import archives
    return archives


def runtime_layer() -> Built:
    """Debian minbase with RUNTIME_PACKAGES, one layer (cached apart from the binaries: a new
    Cilium build does not debootstrap again)."""
    from installer.lab.model import DEBIAN_SUITE

    def make(tmp: Path) -> None:
        with debian_tree(tmp, "cilium-runtime-", RUNTIME_PACKAGES, "cilium image") as root:
            if not (root / CLANG.lstrip("/")).is_file():
                raise SystemExit(f"build-kubernetes: the cilium runtime has no {CLANG}")
            (root / "usr/local/bin/clang").symlink_to(CLANG)
            (tmp / "layer-cilium-runtime.tar").write_bytes(_archives().tree_layer(root, RUNTIME_SKIP))

    return cached("cilium-runtime-layer", "cilium-runtime-layer",
                  key_of(f"recipe={RECIPE}", DEBIAN_SUITE, " ".join(RUNTIME_PACKAGES), " ".join(RUNTIME_SKIP), CLANG),
                  make)


def _bpf_files(src: Path) -> dict[str, tuple[bytes, int]]:
    bpf = src / "bpf"
    out = {}
    for f in sorted(bpf.rglob("*")):
        rel = f.relative_to(bpf)
        if f.is_file() and rel.parts[0] not in BPF_SKIP:
            out[f"/var/lib/cilium/bpf/{rel.as_posix()}"] = (f.read_bytes(), 0o644)
    return out


def _skipped(rel: str, patterns: list[str]) -> bool:
    """Helm's .helmignore, for the patterns the module's chart has: names, globs, dir/."""
    parts = rel.split("/")
    for p in patterns:
        if p.endswith("/"):
            if p.rstrip("/") in parts[:-1] or p.rstrip("/") == parts[-1]:
                return True
        elif any(fnmatch.fnmatch(part, p) for part in parts):
            return True
    return False


def chart_tgz(src: Path) -> bytes:
    chart = src / "install/kubernetes/cilium"
    ignore = [line.strip() for line in (chart / ".helmignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in sorted(chart.rglob("*")):
            rel = f.relative_to(chart).as_posix()
            if not f.is_file() or rel == ".helmignore" or _skipped(rel, ignore):
                continue
            info = tarfile.TarInfo(f"cilium/{rel}")
            data = f.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def build_cilium(c: Component, progs: Built, cni: Built) -> list[Built]:
    """The two images and the chart from ``progs`` (the built binaries) and the module's source."""
    _, src = download_gomod(MODULE, c.version, c.pin_dir)
    runtime = runtime_layer()
    agent_ref, operator_ref = IMAGES["agent"], IMAGES["operator"]
    binaries = {f"/usr/bin/{b}": progs.files[b] for b in AGENT_BINARIES}
    binaries["/opt/cni/bin/cilium-cni"] = progs.files["cilium-cni"]
    binaries["/cni/loopback"] = cni.files["loopback"]

    def make_agent(tmp: Path) -> None:
        log(f"==> image {agent_ref}")
        a = _archives()
        files = {p: (f.read_bytes(), 0o755) for p, f in binaries.items()}
        files.update({p: ((src / rel).read_bytes(), 0o755) for p, rel in SCRIPTS.items()})
        files.update(_bpf_files(src))
        layer = a.files_layer(files, {"/usr/bin/cilium": "cilium-dbg"}, {"/home/cilium": 0o755})
        img = a.Image(agent_ref, ((runtime.files["layer-cilium-runtime.tar"]).read_bytes(), layer),
                      cmd=("/usr/bin/cilium-dbg",), workdir="/home/cilium",
                      env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                           "INITSYSTEM=SYSTEMD", "HUBBLE_SERVER=unix:///var/run/cilium/hubble.sock"))
        a.oci_archive(tmp / "image-cilium.tar", [img])

    def make_operator(tmp: Path) -> None:
        log(f"==> image {operator_ref}")
        ca = runtime_ca(runtime)
        _archives().build_image_archive(
            tmp / "image-cilium-operator.tar", operator_ref,
            {f"/usr/bin/{OPERATOR}": (progs.files[OPERATOR].read_bytes(), 0o755),
             "/etc/ssl/certs/ca-certificates.crt": (ca, 0o644)}, [],
            env=["PATH=/usr/bin:/bin"], entrypoint=[f"/usr/bin/{OPERATOR}"])

    def make_chart(tmp: Path) -> None:
        (tmp / CILIUM_CHART).write_bytes(chart_tgz(src))

    sums = [f"{p}={sha256_file(f)}" for p, f in sorted(binaries.items())]
    agent = cached("cilium-image", "image-cilium",
                   key_of(f"recipe={RECIPE}", agent_ref, sha256_file(runtime.files["layer-cilium-runtime.tar"]),
                          *sums, *(f"{p}={rel}" for p, rel in SCRIPTS.items()), " ".join(BPF_SKIP), c.version),
                   make_agent)
    operator = cached("cilium-operator-image", "image-cilium-operator",
                      key_of(f"recipe={RECIPE}", operator_ref, sha256_file(progs.files[OPERATOR]),
                             sha256_file(runtime.files["layer-cilium-runtime.tar"])), make_operator)
    chart = cached("cilium-chart", CILIUM_CHART.removesuffix(".tgz"), key_of(f"recipe={RECIPE}", c.version),
                   make_chart)
    return [agent, operator, chart]


def runtime_ca(runtime: Built) -> bytes:
    """The CA bundle of the runtime layer (the operator image's only file beside its binary)."""
    with tarfile.open(runtime.files["layer-cilium-runtime.tar"]) as tar:
        member = tar.getmember("etc/ssl/certs/ca-certificates.crt")
        f = tar.extractfile(member)
        if f is None:
            raise SystemExit("build-kubernetes: the cilium runtime layer has no CA bundle")
        return f.read()
