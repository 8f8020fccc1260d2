"""The binaries a cluster needs, resolved to verified local files.

``source: dir`` takes them from an artifacts directory (air-gapped installs): every file must be
listed in its ``SHA256SUMS`` and match it. ``source: download`` fetches the official release
files for the pinned versions into a local cache (``host/download.py``). With either source,
``spec.artifacts.checksums`` pins digests on top.

With ``egress: konnectivity`` (the default with ``cni: cilium``) control hosts also get
``konnectivity-server``. kubernetes-sigs/apiserver-network-proxy publishes no release binary
(only the container images), so it is taken only from an artifacts directory (``source: dir``,
listed in ``SHA256SUMS``): ``source: download`` with konnectivity is an error saying so.

Container image archives (``image-<name>.tar``: OCI layout or ``docker save`` tars, e.g. pause,
CoreDNS, the konnectivity agent, Cilium) are taken only from an artifacts directory, recorded in
its ``SHA256SUMS`` like the binaries: with ``source: dir`` from ``spec.artifacts.path``, with
``source: download`` from the cache directory's top level (nothing is downloaded for them).
Workers get them in ``/var/lib/hiddenplane/images`` and the workers phase imports them into
containerd's ``k8s.io`` namespace, so a cluster needs no registry.
"""

from __future__ import annotations

import os
from pathlib import Path

from installer.core import components
from installer.core.artifacts import (
    ARTIFACTS_ARCH,
    CNI_PLUGINS,
    CONTROL_BINARIES,
    SUMS_FILE,
    WORKER_BINARIES,
    ArtifactError,
    ResolvedArtifact,
    read_sums,
    verify,
)
from installer.core.digests import Digests
from installer.core.egress import egress_mode
from installer.core.render.addons.konnectivity import KONNECTIVITY_VERSION
from installer.core.render.addons.konnectivity import SERVER_BINARY as KONNECTIVITY_SERVER
from installer.core.render.files import BIN_DIR, CNI_BIN_DIR, HostFile
from installer.host import download
from installer.host.download import ALL_BINARIES, WHERE_FROM, Log, component_versions

IMAGE_DIR = "/var/lib/hiddenplane/images"      # image archives on workers
IMAGE_PREFIX, IMAGE_SUFFIX = "image-", ".tar"
DIGESTS_FILE = "sha256-by-identity.json"       # in the download cache directory
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

# the unit to restart when a binary changes (others are picked up on next use)
RESTARTS = components.restarts()
# haproxy and its runtime API's client (socat)
BALANCER_BINARIES = components.binaries_of("api-balancer")




# --- public API ----------------------------------------------------------------------------

def cache_dir(inv) -> Path:
    """spec.artifacts.cacheDir (relative to the inventory), else $XDG_CACHE_HOME/hiddenplane/artifacts."""
    configured = inv.spec.artifacts.cacheDir
    if configured:
        return (inv.base_dir / Path(configured).expanduser()).resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "hiddenplane" / "artifacts"


def konnectivity(inv) -> bool:
    """Whether the control hosts run konnectivity-server (``egress: konnectivity``)."""
    return inv is not None and egress_mode(inv) == "konnectivity"


def balancer(inv) -> bool:
    """Whether the workers run the API balancer (``spec.apiServer.balancer``, auto resolved)."""
    return inv is not None and inv.local_balancer


def cluster_binaries(inv) -> tuple[str, ...]:
    """ALL_BINARIES, plus konnectivity-server with ``egress: konnectivity`` and haproxy and socat
    with the workers' balancer."""
    return (ALL_BINARIES + ((KONNECTIVITY_SERVER,) if konnectivity(inv) else ())
            + (BALANCER_BINARIES if balancer(inv) else ()))


def digest_record(inv) -> Digests:
    """The digests of local artifacts remembered by the last runs (core/digests.py), kept next
    to the download cache; ``save()`` it after resolving."""
    return Digests(cache_dir(inv) / DIGESTS_FILE)


def resolve(inv, log: Log = print, arch: str = ARTIFACTS_ARCH, digests: Digests | None = None
            ) -> dict[str, ResolvedArtifact]:
    """Every binary the cluster needs (control, worker and CNI; konnectivity-server with
    ``egress: konnectivity``), verified, as local files."""
    if arch not in ARCHES.values():
        raise ArtifactError(f"unsupported architecture {arch!r}")
    if inv.spec.artifacts.source == "dir":
        out = _resolve_dir(inv, digests)
    else:
        if konnectivity(inv):
            raise ArtifactError(
                f"{KONNECTIVITY_SERVER}: egress: konnectivity (the default with cni: cilium) needs it on the "
                "control hosts, and kubernetes-sigs/apiserver-network-proxy publishes no release binary to "
                f"download: build its proxy-server ({KONNECTIVITY_VERSION}, `make bin/proxy-server`) and "
                f"provide it with spec.artifacts.source: dir, named {KONNECTIVITY_SERVER} in the artifacts "
                f"directory and listed in its {SUMS_FILE} with every other binary")
        out = download.resolve(cache_dir(inv), component_versions(inv), log, arch, digests)
        if balancer(inv):
            out.update(_balancer_from_cache(inv, digests))
    _check_pinned(inv, out)
    return out


def _balancer_from_cache(inv, digests: Digests | None) -> dict[str, ResolvedArtifact]:
    """haproxy and socat with ``source: download``: both publish sources only, so the binaries
    come from the download cache directory, put there with their SHA256SUMS lines (as image
    archives are)."""
    directory = cache_dir(inv)
    missing = [b for b in BALANCER_BINARIES if b not in read_sums(directory)]
    if missing:
        raise ArtifactError(
            f"{', '.join(missing)}: the workers' API balancer (spec.apiServer.balancer: "
            f"{inv.spec.apiServer.balancer}, {len(inv.controls)} control hosts) needs haproxy and socat, and "
            f"neither publishes a release binary to download: build static ones with `scripts/build-kubernetes "
            f"{inv.spec.kubernetes.version} {directory} {' '.join(f'--only {b}' for b in BALANCER_BINARIES)}` "
            f"(they land in that directory's {SUMS_FILE}), or use spec.artifacts.source: dir, or set "
            "spec.apiServer.balancer: none and give spec.apiServer.endpoint (a VIP or load balancer)")
    found = verify(directory, list(BALANCER_BINARIES), digests)
    return {b: ResolvedArtifact(b, directory / b, found[b]) for b in BALANCER_BINARIES}


def is_image(name: str) -> bool:
    return (name.startswith(IMAGE_PREFIX) and name.endswith(IMAGE_SUFFIX)
            and len(name) > len(IMAGE_PREFIX + IMAGE_SUFFIX))


def resolve_images(inv, digests: Digests | None = None) -> dict[str, ResolvedArtifact]:
    """The image archives (``image-*.tar``) listed in the artifacts directory's SHA256SUMS,
    verified. ``source: dir``: ``spec.artifacts.path``; ``source: download``: the cache
    directory, if it has a SHA256SUMS (none are downloaded). A listed archive that is missing
    or does not match is an error."""
    if inv.spec.artifacts.source == "dir":
        directory = inv.artifacts_dir()
        if directory is None:
            raise ArtifactError("spec.artifacts.path: required when spec.artifacts.source is 'dir'")
    else:
        directory = cache_dir(inv)
    names = sorted(n for n in read_sums(directory) if is_image(n))
    found = verify(directory, names, digests) if names else {}
    return {n: ResolvedArtifact(n, Path(directory) / n, d) for n, d in found.items()}


def image_files(resolved: dict[str, ResolvedArtifact]) -> list[HostFile]:
    """The image archives among ``resolved`` as worker files in IMAGE_DIR."""
    return [HostFile(f"{IMAGE_DIR}/{name}", b"", 0o644, source=art.path, digest=art.sha256)
            for name, art in sorted(resolved.items()) if is_image(name)]


def role_binaries(role: str, inv=None) -> tuple[str, ...]:
    """The binaries a host of ``role`` holds. Control hosts get no runtime, kubelet or CNI;
    given the inventory, they also get konnectivity-server with ``egress: konnectivity``."""
    if role == "control":
        return CONTROL_BINARIES + ((KONNECTIVITY_SERVER,) if konnectivity(inv) else ())
    if role == "worker":
        return WORKER_BINARIES + CNI_PLUGINS + (BALANCER_BINARIES if balancer(inv) else ())
    raise ValueError(f"unknown role {role!r}")


def binary_path(name: str) -> str:
    """Where a binary is installed on a host: CNI plugins where containerd looks for them."""
    return f"{CNI_BIN_DIR if name in CNI_PLUGINS else BIN_DIR}/{name}"


def binary_files(resolved: dict[str, ResolvedArtifact], role: str, inv=None) -> list[HostFile]:
    """The binaries of one role as HostFiles that point at the local copy (``source``) and carry
    its verified ``digest``, so a host is compared and uploaded to without reading the file.
    Workers also get the image archives among ``resolved`` (resolve_images).

    konnectivity-server goes to control hosts when the inventory says ``egress: konnectivity``;
    without ``inv``, when ``resolved`` holds it (``resolve`` resolves it in that mode only)."""
    names = role_binaries(role, inv)
    if inv is None and role == "control" and KONNECTIVITY_SERVER in resolved:
        names += (KONNECTIVITY_SERVER,)
    if inv is None and role == "worker" and BALANCER_BINARIES[0] in resolved:
        names += BALANCER_BINARIES
    missing = [n for n in names if n not in resolved]
    if missing:
        raise ArtifactError(f"artifacts: not resolved: {', '.join(missing)}")
    out = []
    for name in names:
        art = resolved[name]
        restarts = (RESTARTS[name],) if name in RESTARTS else ()
        out.append(HostFile(binary_path(name), b"", 0o755, restarts=restarts,
                            source=art.path, digest=art.sha256))
    if role == "worker":
        out += image_files(resolved)       # image archives travel with the worker's binaries
    return out


# --- source: dir ---------------------------------------------------------------------------

def _resolve_dir(inv, digests: Digests | None = None) -> dict[str, ResolvedArtifact]:
    directory = inv.artifacts_dir()
    if directory is None:
        raise ArtifactError("spec.artifacts.path: required when spec.artifacts.source is 'dir'")
    names = cluster_binaries(inv)
    try:
        found = verify(directory, names, digests)
    except ArtifactError as e:
        sums = read_sums(directory)
        absent = [n for n in names if n in WHERE_FROM and (n not in sums or not (directory / n).is_file())]
        if not absent:
            raise
        raise ArtifactError("; ".join([str(e), *(WHERE_FROM[n] for n in absent)])) from None
    return {n: ResolvedArtifact(n, directory / n, d) for n, d in found.items()}


def _check_pinned(inv, out: dict[str, ResolvedArtifact]) -> None:
    problems = []
    for name, want in inv.spec.artifacts.checksums.items():
        if name not in out:
            problems.append(f"spec.artifacts.checksums.{name}: not a binary the cluster uses "
                            f"(known: {', '.join(cluster_binaries(inv))})")
        elif out[name].sha256 != want:
            problems.append(f"{name}: sha256 {out[name].sha256} ({out[name].path}) does not match "
                            f"the pinned spec.artifacts.checksums.{name} ({want})")
    if problems:
        raise ArtifactError("artifacts: " + "; ".join(problems))


