"""Container image archives the lab builds locally (OCI layout tars), and Debian package trees
unpacked for their files."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

from installer.lab.images import cache_lock
from installer.lab.model import LabError
from installer.lab.debian_artifacts import debs_dir, download
from installer.lab.vm_image import run_checked

def _tar_bytes(entries: list[tuple[str, bytes | None, int, str | None]]) -> bytes:
    """A reproducible tar: (path, content or None for a directory, mode, symlink target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content, mode, link in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime, info.uid, info.gid = mode, 0, 0, 0
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def build_image_archive(out: Path, name: str, files: dict[str, tuple[bytes, int]],
                        cmd: list[str], env: list[str] | None = None,
                        links: dict[str, str] | None = None, entrypoint: list[str] | None = None) -> str:
    """Write an OCI image layout tar (one uncompressed layer holding ``files``, and ``links``:
    symlink path -> target) that ``ctr images import`` and ``podman load`` accept; returns the
    image's manifest digest.

    ``name`` is the full reference (e.g. ``localhost/hiddenplane/busybox:lab``).
    """
    links = links or {}
    dirs = set()
    for path in [*files, *links]:
        parts = path.strip("/").split("/")[:-1]
        dirs.update("/".join(parts[:i + 1]) for i in range(len(parts)))
    dirs.update({"tmp", "proc", "sys", "dev", "etc"})
    entries = [(d, None, 0o1777 if d == "tmp" else 0o755, None) for d in sorted(dirs)]
    entries += [(p.strip("/"), content, mode, None) for p, (content, mode) in sorted(files.items())]
    entries += [(p.strip("/"), None, 0o777, target) for p, target in sorted(links.items())]
    layer = _tar_bytes(entries)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": env or ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "Cmd": cmd,
                   **({"Entrypoint": entrypoint} if entrypoint else {})},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hiddenplane lab"}],
    }, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": len(manifest),
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}],
    }, sort_keys=True).encode()
    blobs = [(d.split(":")[1], b) for d, b in ((layer_digest, layer), (config_digest, config),
                                              (manifest_digest, manifest))]
    archive = _tar_bytes([("blobs", None, 0o755, None), ("blobs/sha256", None, 0o755, None)] +
                         [(f"blobs/sha256/{h}", b, 0o644, None) for h, b in blobs] +
                         [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644, None),
                          ("index.json", index, 0o644, None)])
    out.write_bytes(archive)
    return manifest_digest


def busybox_image_archive(out: Path, name: str, busybox: bytes) -> str:
    """An image whose only program is a static busybox (Debian ``busybox-static``)."""
    files = {"/bin/busybox": (busybox, 0o755)}
    return build_image_archive(out, name, files, ["/bin/busybox", "sh"])


def deb_tree(package: str, log=print) -> Path:
    """A Debian package's files, unpacked (``dpkg-deb -x``, nothing installed) into the cache
    once per package version; returns the tree's root (e.g. ``root/usr/bin/ctr``)."""
    deb = download([package], log)[package]
    if deb is None:
        raise LabError(f"apt-get download {package}: no .deb")
    tree = debs_dir() / "unpacked" / deb.name.removesuffix(".deb")
    if (tree / ".complete").is_file():
        return tree
    with cache_lock("deb-trees"):
        if (tree / ".complete").is_file():
            return tree
        return _unpack(deb, tree)


def _unpack(deb: Path, tree: Path) -> Path:
    tmp = tree.with_name(tree.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    run_checked(["dpkg-deb", "-x", str(deb), str(tmp)], f"dpkg-deb -x {deb.name}")
    (tmp / ".complete").write_text(f"{deb.name}\n")
    shutil.rmtree(tree, ignore_errors=True)
    tmp.rename(tree)
    return tree
