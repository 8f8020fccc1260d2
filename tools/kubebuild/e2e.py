"""The Kubernetes e2e conformance suite and the images its tests run, built from the Go modules
(``scripts/build-kubernetes VERSION DIR --only e2e``): lab and test tooling, never shipped.

DIR gets ``e2e.test`` (``go test -c k8s.io/kubernetes/test/e2e``, the binary Sonobuoy and
upstream CI run), ``ginkgo`` (the same ginkgo v2 release, for parallel runs), and
``image-e2e.tar``: one OCI archive with every image this module knows how to make, under the
exact names ``e2e.test --list-images`` prints, plus ``e2e-images.json`` saying which of the
listed images it made and which it did not (``scripts/conformance`` skips the tests of those).
``image-agnhost.tar`` holds agnhost alone (the reference of imageutils.Agnhost, the same image as
in image-e2e.tar), for a test that needs only agnhost on a few nodes.

No registry is reachable here, so the images are made from what is: Go programs from their
modules (agnhost, sample-apiserver, etcd), Debian packages for the tools the tests exec inside
them (``sh``, ``curl``, ``nc``, ``dig``, ``ip``, nginx) where upstream's use Alpine's, and
Debian's static busybox. Layers the images share (the Debian tree, agnhost) are stored once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import sources
from buildcache import Built, Component, cached, debian_tree, download_gomod, key_of, log, sha256_file

from installer.core.inventory_model import SANDBOX_IMAGE

RECIPE = 1          # bump when how the e2e images are made changes
BASE_PACKAGES = ("bash", "curl", "wget", "bind9-dnsutils", "netcat-openbsd", "iproute2", "iperf", "iputils-ping",
                 "util-linux", "procps", "ca-certificates", "nginx")
# left out of the Debian layer: caches, package lists, documentation
BASE_SKIP = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info",
             "usr/share/locale", "var/log/apt")
# what upstream's agnhost Dockerfile adds to Alpine: a user and a group the tests look for
IMAGE_USERS = ("user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n",
               "user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n")
AGNHOST = "k8s.io/kubernetes/test/images/agnhost"
AGNHOST_ARCHIVE = "image-agnhost.tar"


def e2e(k8s: Component) -> Component:
    """e2e.test, ginkgo and the Go programs of the images, from the k8s.io/kubernetes module of
    ``k8s`` (build.kubernetes) and stamped like its binaries (its own ginkgo release;
    sample-apiserver is one of its staging modules)."""
    return Component("kubernetes-e2e", k8s.version, ("k8s.io/kubernetes",),
                     {"ginkgo": "github.com/onsi/ginkgo/v2/ginkgo", "agnhost": AGNHOST,
                      "sample-apiserver": "k8s.io/sample-apiserver",
                      "nnp": "k8s.io/kubernetes/test/images/nonewprivs"},
                     k8s.ldflags, staging=True, tests={"e2e.test": "k8s.io/kubernetes/test/e2e"})


def list_images(e2e_test: Path) -> list[str]:
    proc = subprocess.run([str(e2e_test), "--list-images"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"build-kubernetes: e2e.test --list-images failed: {proc.stderr.strip()[-400:]}")
    return sorted({line.strip() for line in proc.stdout.splitlines() if line.strip()})


def repo_of(image: str) -> str:
    """registry.k8s.io/e2e-test-images/agnhost:2.66.1 -> agnhost"""
    return image.rsplit(":", 1)[0].split("/", 1)[1].removeprefix("e2e-test-images/")


def agnhost_ref(names: list[str]) -> str:
    """The agnhost reference the tests use (imageutils.Agnhost) among the listed ``names``: the
    newest tag; the older one is AgnhostPrev, for the few tests of an upgrade."""
    tags = {n: tuple(int(x) if x.isdigit() else -1 for x in n.rsplit(":", 1)[1].split("."))
            for n in names if repo_of(n) == "agnhost" and n != SANDBOX_IMAGE}
    if not tags:
        raise SystemExit("build-kubernetes: e2e.test --list-images names no agnhost image")
    return max(tags, key=tags.__getitem__)


# --- the layers ---------------------------------------------------------------------------------

def _archives():
    from installer.lab import archives
    return archives


def debian_layer() -> Built:
    """A Debian (the lab's suite) minbase tree with BASE_PACKAGES and the image users, as one
    layer: the tools upstream's Alpine-based images give the tests."""
    from installer.lab.model import DEBIAN_SUITE

    def make(tmp: Path) -> None:
        with debian_tree(tmp, "e2e-base-", BASE_PACKAGES, "e2e images") as root:
            passwd, group = IMAGE_USERS
            with open(root / "etc/passwd", "a") as f:
                f.write(passwd)
            with open(root / "etc/group", "a") as f:
                f.write(group)
            (root / "home/user-defined-in-image").mkdir(parents=True, exist_ok=True)
            os_chown(root / "home/user-defined-in-image", 1000, 1000)
            _nginx_like_upstream(root)
            _busybox_applets(root)
            (tmp / "layer-debian.tar").write_bytes(_archives().tree_layer(root, BASE_SKIP))

    return cached("e2e-debian-layer", "e2e-debian-layer",
                  key_of(f"recipe={RECIPE}", "busybox applets", DEBIAN_SUITE, " ".join(BASE_PACKAGES),
                         " ".join(BASE_SKIP), *IMAGE_USERS, NGINX_SITE), make)


def os_chown(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)


# upstream's nginx images serve /usr/share/nginx/html on port 80 and log to the container's output
NGINX_SITE = """server {
    listen 80 default_server;
    listen [::]:80 default_server;
    root /usr/share/nginx/html;
    index index.html;
    location / { try_files $uri $uri/ =404; }
}
"""


def _nginx_like_upstream(root: Path) -> None:
    enabled = root / "etc/nginx/sites-enabled/default"
    enabled.unlink(missing_ok=True)
    enabled.write_text(NGINX_SITE)
    html = root / "usr/share/nginx/html"
    html.mkdir(parents=True, exist_ok=True)
    (html / "index.html").write_text("<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head>"
                                     "<body><h1>Welcome to nginx!</h1></body></html>\n")
    logs = root / "var/log/nginx"
    logs.mkdir(parents=True, exist_ok=True)
    for name, target in (("access.log", "/dev/stdout"), ("error.log", "/dev/stderr")):
        (logs / name).unlink(missing_ok=True)
        (logs / name).symlink_to(target)


def _busybox_applets(root: Path) -> None:
    """What Alpine's busybox gives upstream's images beside their packages (``netstat``,
    ``nslookup`` and the rest the tests exec): Debian's static busybox, linked as every applet
    no package of the tree already provides."""
    from installer.lab.archives import deb_tree
    binary = deb_tree("busybox-static", log) / "bin/busybox"
    shutil.copy2(binary, root / "bin/busybox")
    applets = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True).stdout.split()
    have = {p.name for d in ("bin", "sbin", "usr/bin", "usr/sbin") for p in (root / d).iterdir()}
    for applet in applets:
        if applet not in have:
            (root / "usr/bin" / applet).symlink_to("/bin/busybox")


def busybox_layer() -> tuple[bytes, str]:
    """busybox 1.37.0 as upstream builds it, with every applet it has as a link, and the
    passwd/group an image's users need; and the binary's digest (part of the cache key)."""
    binary = sources.build_source("busybox").files["busybox"]
    applets = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True).stdout.split()
    links = {f"/bin/{a}": "busybox" for a in applets if a != "busybox"}
    files = {"/bin/busybox": (binary.read_bytes(), 0o755),
             "/etc/passwd": (b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n", 0o644),
             "/etc/group": (b"root:x:0:\nnogroup:x:65534:\n", 0o644)}
    return _archives().files_layer(files, links, dirs={"/root": 0o700, "/home": 0o755}), sha256_file(binary)


# --- the images -----------------------------------------------------------------------------------

def _agnhost_layer(files: dict[str, Path], src: Path) -> bytes:
    porter = src / "test/images/agnhost/porter"
    return _archives().files_layer(
        {"/agnhost": (files["agnhost"].read_bytes(), 0o755),
         "/localhost.crt": ((porter / "localhost.crt").read_bytes(), 0o644),
         "/localhost.key": ((porter / "localhost.key").read_bytes(), 0o644)},
        {"/agnhost-2": "agnhost", "/usr/local/bin/iperf": "/usr/bin/iperf"}, dirs={"/uploads": 0o755})


def agnhost_image(name: str, debian: bytes, agnhost: bytes):
    """agnhost as image-e2e.tar and image-agnhost.tar hold it: on the Debian tools."""
    return _archives().Image(name, (debian, agnhost), ("pause",), ("/agnhost",))


def images(names: list[str], layers: dict[str, bytes], src: Path) -> tuple[list, dict[str, str]]:
    """The images among ``names`` this module makes, and why each other one is not made.
    Each is made from the layers the upstream image's Dockerfile amounts to, as far as the
    tests can tell: agnhost on the Debian tools, kitten and nautilus on agnhost with their
    pictures, nginx serving /usr/share/nginx/html on port 80."""
    Image = _archives().Image
    debian, agnhost, busybox = layers["debian"], layers["agnhost"], layers["busybox"]
    html = src / "test/images"

    def web(name: str, animal: str):
        top = _archives().files_layer(
            {f"/{animal}.jpg": ((html / animal / "html" / f"{animal}.jpg").read_bytes(), 0o644),
             "/data.json": ((html / animal / "html/data.json").read_bytes(), 0o644)})
        return Image(name, (debian, agnhost, top), ("test-webserver",), ("/agnhost",))

    makers = {
        "agnhost": lambda n: agnhost_image(n, debian, agnhost),
        "busybox": lambda n: Image(n, (busybox,), ("sh",)),
        "nginx": lambda n: Image(n, (debian,), ("nginx", "-g", "daemon off;")),
        # upstream: Debian bookworm-slim with dnsutils (the DNS tests' glibc resolver side)
        "glibc-dns-testing": lambda n: Image(n, (debian,), ("bash",)),
        "kitten": lambda n: web(n, "kitten"),
        "nautilus": lambda n: web(n, "nautilus"),
        "sample-apiserver": lambda n: Image(n, (layers["sample-apiserver"],), (), ("/sample-apiserver",)),
        # upstream: Alpine with nnp setuid root (prints the uid it runs with)
        "nonewprivs": lambda n: Image(n, (busybox, layers["nonewprivs"]), ("nnp",),
                                      env=("PATH=/usr/local/bin:/bin:/usr/bin:/sbin:/usr/sbin",)),
        "etcd": lambda n: Image(n, (layers["etcd"],), ("/usr/local/bin/etcd",)),
    }
    made, missing = [], {}
    for name in names:
        repo = repo_of(name)
        if name == SANDBOX_IMAGE:
            missing[name] = "the cluster's sandbox image (spec.artifacts.sandboxImage): every worker has it"
        elif repo in makers:
            made.append(makers[repo](name))
        else:
            missing[name] = "not made here (no recipe for it in tools/kubebuild/e2e.py)"
    return made, missing


def build_e2e(c: Component, progs: Built, etcd: Built) -> list[Built]:
    """e2e.test, ginkgo, image-e2e.tar (+ e2e-images.json) and image-agnhost.tar of ``c``
    (e2e()) from ``progs``, its built programs; ``etcd``: the cluster's etcd build."""
    version = c.version
    _, src = download_gomod("k8s.io/kubernetes", version, c.pin_dir)
    names = list_images(progs.files["e2e.test"])
    base = debian_layer()
    busybox, busybox_digest = busybox_layer()
    agnhost_digest, debian_digest = sha256_file(progs.files["agnhost"]), sha256_file(base.files["layer-debian.tar"])
    key = key_of(f"recipe={RECIPE}", agnhost_digest, sha256_file(progs.files["sample-apiserver"]),
                 sha256_file(progs.files["nnp"]),
                 sha256_file(etcd.files["etcd"]), debian_digest, busybox_digest,
                 *names)

    def make(tmp: Path) -> None:
        log(f"==> e2e images for {version}: {len(names)} listed by e2e.test --list-images")
        layers = {"debian": base.files["layer-debian.tar"].read_bytes(),
                  "agnhost": _agnhost_layer(progs.files, src), "busybox": busybox,
                  "sample-apiserver": _archives().files_layer(
                      {"/sample-apiserver": (progs.files["sample-apiserver"].read_bytes(), 0o755)}),
                  "etcd": _archives().files_layer({"/usr/local/bin/etcd": (etcd.files["etcd"].read_bytes(), 0o755)}),
                  "nonewprivs": _archives().files_layer(
                      {"/usr/local/bin/nnp": (progs.files["nnp"].read_bytes(), 0o4755)})}
        made, missing = images(names, layers, src)
        _archives().oci_archive(tmp / "image-e2e.tar", made)
        (tmp / "e2e-images.json").write_text(json.dumps(
            {"made": sorted(i.name for i in made), "notMade": missing}, indent=2, sort_keys=True) + "\n")
        log(f"    made {len(made)} images; not made: {len(missing)}")

    imgs = cached("e2e-images", f"e2e-images-{version}", key, make)

    # agnhost alone, from the same binary and layers (its own cache entry: image-e2e.tar's stays)
    ref = agnhost_ref(names)

    def make_agnhost(tmp: Path) -> None:
        log(f"==> {AGNHOST_ARCHIVE}: {ref}")
        _archives().oci_archive(tmp / AGNHOST_ARCHIVE, [agnhost_image(
            ref, base.files["layer-debian.tar"].read_bytes(), _agnhost_layer(progs.files, src))])

    agnhost = cached("e2e-agnhost-image", f"e2e-agnhost-image-{version}",
                     key_of(f"recipe={RECIPE}", AGNHOST_ARCHIVE, agnhost_digest, debian_digest, ref), make_agnhost)
    tests = Built("e2e", {n: progs.files[n] for n in ("e2e.test", "ginkgo")}, progs.cached, progs.seconds)
    return [tests, imgs, agnhost]
