"""Programs built from C release tarballs (gcc, make, static libc), cached like the Go components.

Each is a row of SOURCES: the tarball (as Debian's pool serves it: the unpatched upstream
``.orig``, the one mirror reachable from an air-gapped build host here), its sha256, and how
to configure and make it. The build runs in a scratch directory next to the cache entry and
leaves nothing when it fails.

- busybox: upstream's e2e busybox image is busybox built with its defconfig (e2e.py).
- haproxy: the node-local API balancer on every worker (installer/core/components.py). Static,
  so it runs on any glibc or musl host as the Go binaries do: no host library is needed.
- socat: the client of that balancer's runtime API (a root-only unix socket) on every worker:
  the installer drains an apiserver from the balancers before it stops it (host/handover.py).
  Static and without OpenSSL, readline or libwrap: a plain unix-socket client.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from buildcache import Built, cached, key_of, log

RECIPE = 1          # bump when how a source build is made changes (busybox's key kept since e2e.py)
POOL = "http://deb.debian.org/debian/pool/main"


@dataclass(frozen=True)
class Source:
    name: str
    version: str
    url: str
    sha256: str
    # make arguments: defconfig-style targets run first (``configure``), then ``make`` with these
    make: tuple[str, ...]
    configure: tuple[str, ...] = ()                               # make targets that configure
    configure_script: tuple[str, ...] = ()                        # or arguments of ./configure
    config: dict[str, str | None] = field(default_factory=dict)   # .config lines after ``configure``
    binary: str = ""                                              # the built file, relative to the tree
    strip: bool = False
    apt: tuple[str, ...] = ("gcc", "make", "libc6-dev")          # Debian packages the build needs

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"


SOURCES = {
    # static like upstream's; tc does not build against current kernel headers (CBQ was removed);
    # checked against busybox.net's sha256
    "busybox": Source("busybox", "1.37.0", f"{POOL}/b/busybox/busybox_1.37.0.orig.tar.bz2",
                      "3311dff32e746499f4df0d5df04d7eb396382d7e108bb9250e7b519b837043a4",
                      make=("busybox",), configure=("defconfig",),
                      config={"CONFIG_STATIC": "y", "CONFIG_TC": None}, binary="busybox"),
    # HAProxy 3.0, the LTS branch maintained until 2029. TLS from OpenSSL (libssl-dev's static
    # libraries: health checks verify the apiserver's certificate); no Lua, PCRE, zlib or dlopen;
    # USE_SYSTEMD is haproxy's own sd_notify (no libsystemd), for Type=notify and reloads
    "haproxy": Source("haproxy", "3.0.11", f"{POOL}/h/haproxy/haproxy_3.0.11.orig.tar.gz",
                      "a133e2d550c5fd9a849b5c7ab17bb945bcdad209ca140d41f45ebf31943ae783",
                      make=("TARGET=linux-glibc", "USE_OPENSSL=1", "USE_SYSTEMD=1", "USE_LUA=", "USE_PCRE2=",
                            "USE_ZLIB=", "USE_DL=", "USE_LIBCRYPT=", "USE_NS=", "USE_PROMEX=",
                            "LDFLAGS=-static", "ADDLIB=-lpthread", "haproxy"),
                      binary="haproxy", strip=True, apt=("gcc", "make", "libc6-dev", "libssl-dev")),
    # socat 1.8 (Debian's orig is upstream's tarball): only its unix-socket and stdio addresses
    # are used; everything that links a library is off so that it links statically
    "socat": Source("socat", "1.8.0.3", f"{POOL}/s/socat/socat_1.8.0.3.orig.tar.bz2",
                    "01eb017361d95bb3a6941e840b59e4463a3fabf92df4154ed02b16a2ed6a0095",
                    make=("socat",), configure_script=("--disable-openssl", "--disable-readline",
                                                       "--disable-libwrap", "--disable-fips", "--disable-sctp",
                                                       "LDFLAGS=-static"),
                    binary="socat", strip=True),
}


def _toolchain(src: Source) -> list[str]:
    """What the binary depends on besides the tarball: gcc's version and the static libraries'
    Debian versions (a new libssl-dev is a new haproxy)."""
    out = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    for pkg in src.apt:
        if pkg.endswith("-dev") and pkg != "libc6-dev":
            v = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True, text=True)
            out.append(f"{pkg}={v.stdout.strip()}")
    return out


def build_source(name: str) -> Built:
    """The cached binary of SOURCES[name], built when missing."""
    src = SOURCES[name]
    missing = [p for p in src.apt if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if missing:
        raise SystemExit(f"build-kubernetes: {name} needs Debian packages: apt-get install {' '.join(missing)}")
    # busybox keeps the key it had in e2e.py (its recipe there was 1, the same parts)
    parts = [f"recipe={RECIPE}", src.url, src.sha256, json.dumps(src.config, sort_keys=True), *_toolchain(src)]
    if name != "busybox":
        parts += list(src.make) + list(src.configure_script)

    def make(tmp: Path) -> None:
        log(f"==> building {name} {src.version} from {src.url.rsplit('/', 1)[1]}")
        with urllib.request.urlopen(src.url, timeout=120) as r:
            data = r.read()
        got = hashlib.sha256(data).hexdigest()
        if got != src.sha256:
            raise SystemExit(f"build-kubernetes: {src.url}: sha256 {got}, expected {src.sha256}")
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp.parent))
        try:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tar.extractall(work, filter="data")
            tree = next(work.iterdir())
            for target in src.configure:
                _make(name, tree, [target])
            if src.configure_script:
                _run(name, tree, ["./configure", *src.configure_script])
            if src.config:
                config = tree / ".config"
                lines = [line for line in config.read_text().splitlines()
                         if not any(line.startswith((f"{k}=", f"# {k} is not set")) for k in src.config)]
                lines += [f"{k}={v}" if v else f"# {k} is not set" for k, v in src.config.items()]
                config.write_text("\n".join(lines) + "\n")
                _make(name, tree, ["oldconfig"], stdin="\n" * 50)
            _make(name, tree, [f"-j{os.cpu_count() or 2}", *src.make])
            shutil.copy2(tree / src.binary, tmp / src.binary)
            if src.strip:
                subprocess.run(["strip", str(tmp / src.binary)], check=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    built = cached(name, src.label, key_of(*parts), make)
    if not built.cached:
        log(f"    {name} {src.version}: built in {built.seconds:.0f} s")
    return built


def _make(name: str, tree: Path, args: list[str], stdin: str | None = None) -> None:
    _run(name, tree, ["make", *args], stdin)


def _run(name: str, tree: Path, argv: list[str], stdin: str | None = None) -> None:
    proc = subprocess.run(argv, cwd=tree, capture_output=True, text=True, input=stdin)
    if proc.returncode != 0:
        raise SystemExit(f"build-kubernetes: {name}: {' '.join(argv)} failed:\n"
                         + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
