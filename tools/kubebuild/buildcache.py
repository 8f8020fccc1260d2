"""The build cache the builders share (build.py, e2e.py, sources.py): what a component is, its
Go module's source, a cache entry's key, its cached outputs, and the log.

In a module of its own so that e2e.py and sources.py import this and not build.py, which
imports them: build.py is the root of the import graph and nothing imports it.

An entry is the directory ``<label>-<key>`` under ``$HIDDENPLANE_CACHE_DIR/build`` (default
``/var/cache/hiddenplane/build``), with a ``SHA256SUMS`` and, once complete, ``.complete``.
What goes into a key is each builder's own (build.build_key, sources.build_source, ...);
key_of only hashes it, so changing key_of invalidates every cached build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from installer.core.artifacts import read_sums, write_sums
from installer.core.digests import Digests

PINS = Path(__file__).resolve().parent     # the wrapper modules, tools/kubebuild/<name>-<version>


def cache_root() -> Path:
    return Path(os.environ.get("HIDDENPLANE_CACHE_DIR", "/var/cache/hiddenplane")) / "build"


# a warm run checks every cached file and every copy against its SHA256SUMS (1.1 GB with the
# hosted control plane's images: 17 s); a file whose identity (device, inode, size, mtime,
# ctime) is unchanged since it was hashed is not hashed again (installer/core/digests.py)
_DIGESTS: Digests | None = None


def sha256_file(path: Path) -> str:
    global _DIGESTS
    if _DIGESTS is None:
        _DIGESTS = Digests(cache_root() / ".digests.json")
    return _DIGESTS.sha256(path)


def save_digests() -> None:
    """Keep the digests this run computed for the next one (nothing when it hashed nothing)."""
    if _DIGESTS is not None:
        _DIGESTS.save()


def log(msg: str) -> None:
    print(msg, flush=True)


# --- a component and its Go module ------------------------------------------------------------

@dataclass(frozen=True)
class Component:
    """One wrapper module and the binaries built from it.

    ``modules`` are required at ``version``; ``binaries`` maps each output name to its main
    package; ``ldflags(version)`` stamps the version the way the project's own build does.
    """
    name: str
    version: str
    modules: tuple[str, ...]
    binaries: dict[str, str]
    ldflags: Callable[[str], list[str]]
    tags: str = ""
    cgo: bool = False
    staging: bool = False       # k8s.io/kubernetes: pin its staging modules
    apt: tuple[str, ...] = ()   # Debian packages the build needs (headers)
    # test binaries (`go test -c`): output name -> package, e.g. e2e.test (tools/kubebuild/e2e.py)
    tests: dict[str, str] = field(default_factory=dict)
    # files built in place of a dependency's: "module:path in it" -> a file in the wrapper's
    # directory (tools/kubebuild/<name>-<version>) that says why (build.override_modules)
    overlays: dict[str, str] = field(default_factory=dict)
    # replace lines of the wrapper module, each saying why: "module" -> "module version" (a
    # version the proxy serves in place of one it does not) or "./dir" (a module of our own in
    # the wrapper's directory, its files part of the build key)
    replaces: dict[str, str] = field(default_factory=dict)

    @property
    def pin_dir(self) -> Path:
        return PINS / f"{self.name}-{self.version}"


def go_env() -> dict[str, str]:
    # GOTOOLCHAIN=local: never fetch another toolchain behind the user's back; GOFLAGS is ours
    env = {**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local"), "GOFLAGS": "-mod=readonly"}
    env.pop("GOWORK", None)
    return env


def go(args: list[str], cwd: Path, env: dict | None = None, what: str = "") -> str:
    proc = subprocess.run(["go", *args], cwd=cwd, env=env or go_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build-kubernetes: {what or 'go ' + ' '.join(args)} failed (exit {proc.returncode}):\n"
                         + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:]))
    return proc.stdout


def download_gomod(module: str, version: str, cwd: Path) -> tuple[str, Path]:
    """The upstream go.mod text and the module's unpacked source directory."""
    info = json.loads(go(["mod", "download", "-json", f"{module}@{version}"], cwd,
                         {**go_env(), "GOFLAGS": ""}, f"go mod download {module}@{version}"))
    return Path(info["GoMod"]).read_text(), Path(info["Dir"])


# --- the cache ------------------------------------------------------------------------------------

@dataclass
class Built:
    name: str
    files: dict[str, Path]          # artifact name -> cached file
    cached: bool
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    notes: list[str] = field(default_factory=list)


def _cached_dir(label: str, key: str) -> Path:
    return cache_root() / f"{label}-{key}"


def _complete(d: Path) -> bool:
    return (d / ".complete").is_file()


def _verify_cached(d: Path) -> dict[str, Path]:
    sums = read_sums(d)
    for name, digest in sums.items():
        if sha256_file(d / name) != digest:
            raise SystemExit(f"build-kubernetes: cached {d / name} does not match its SHA256SUMS; "
                             f"delete {d} and run again")
    return {n: d / n for n in sums}


def _finish(tmp: Path, final: Path) -> dict[str, Path]:
    write_sums(tmp, {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()})
    (tmp / ".complete").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return {n: final / n for n in read_sums(final)}


def key_of(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update((part.encode() if isinstance(part, str) else part) + b"\0")
    return h.hexdigest()[:16]


def cached(name: str, label: str, key: str, make: Callable[[Path], float | None]) -> Built:
    """The cache entry ``label-key``; when missing, ``make(tmp)`` writes its files into a fresh
    directory that becomes the entry once complete (an interrupted build leaves nothing).
    ``make`` may return the peak RSS (MiB) of what it ran."""
    final = _cached_dir(label, key)
    if _complete(final):
        return Built(name, _verify_cached(final), cached=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=final.parent))
    start = time.monotonic()
    try:
        rss = make(tmp)
        files = _finish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Built(name, files, cached=False, seconds=time.monotonic() - start, peak_rss_mib=rss or 0.0)


@contextlib.contextmanager
def debian_tree(tmp: Path, prefix: str, packages: tuple[str, ...], what: str) -> Iterator[Path]:
    """A Debian minbase tree (the lab's suite and mirror) with ``packages``, debootstrapped into a
    scratch directory beside the cache entry ``tmp`` and removed on leaving; debootstrap's and
    dpkg's logs are dropped. ``what`` names it in messages (the e2e images, the cilium image)."""
    from installer.lab.images import DEBIAN_MIRROR
    from installer.lab.model import DEBIAN_SUITE
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp.parent))
    try:
        log(f"==> {what}: debootstrap {DEBIAN_SUITE} minbase + {', '.join(packages)}")
        proc = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                               DEBIAN_SUITE, str(root), DEBIAN_MIRROR], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"build-kubernetes: debootstrap for the {what} failed:\n"
                             + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:]))
        for log_file in (root / "var/log").glob("*.log"):
            log_file.unlink()
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
