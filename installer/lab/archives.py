"""Container image archives the lab builds locally (OCI layout tars), and Debian package trees
unpacked for their files."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from installer.lab.debian_artifacts import debs_dir, download
from installer.lab.images import cache_lock
from installer.lab.model import LabError
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


@dataclass(frozen=True)
class Image:
    """One image of an OCI archive: its full reference, its layers (uncompressed tars, bottom
    first; a layer shared by several images is stored once) and its run configuration."""
    name: str
    layers: tuple[bytes, ...]
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/bin:/usr/bin:/sbin:/usr/sbin",)
    workdir: str = ""


def files_layer(files: dict[str, tuple[bytes, int]], links: dict[str, str] | None = None,
                dirs: dict[str, int] | None = None) -> bytes:
    """A layer holding ``files`` (path -> (content, mode)), ``links`` (symlink path -> target) and
    ``dirs`` (path -> mode), with every parent directory and the usual mount points."""
    links, modes = links or {}, {d.strip("/"): m for d, m in (dirs or {}).items()}
    names = set(modes)
    for path in [*files, *links, *modes]:
        parts = path.strip("/").split("/")[:-1]
        names.update("/".join(parts[:i + 1]) for i in range(len(parts)))
    names.update({"tmp", "proc", "sys", "dev", "etc"})
    entries = [(d, None, modes.get(d, 0o1777 if d == "tmp" else 0o755), None) for d in sorted(names)]
    entries += [(p.strip("/"), content, mode, None) for p, (content, mode) in sorted(files.items())]
    entries += [(p.strip("/"), None, 0o777, target) for p, target in sorted(links.items())]
    return _tar_bytes(entries)


def tree_layer(root: Path, skip: tuple[str, ...] = ()) -> bytes:
    """A reproducible layer of the directory tree at ``root`` as it is (modes, owners, symlinks;
    a hard link stored as another copy); device nodes, sockets and whatever is under a ``skip``
    path (relative, e.g. ``var/cache/apt``) are left out, the directories themselves kept."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).parts):
            rel = path.relative_to(root).as_posix()
            if any(rel.startswith(s + "/") for s in skip):
                continue
            info = tar.gettarinfo(str(path), arcname=rel)
            if info.type not in (tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE):
                continue
            if info.type == tarfile.LNKTYPE:        # the first copy may sit under a skipped path
                info.type, info.linkname, info.size = tarfile.REGTYPE, "", path.stat().st_size
            info.mtime, info.uname, info.gname = 0, "", ""
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def oci_archive(out: Path, images: list[Image]) -> dict[str, str]:
    """Write one OCI image layout tar holding ``images`` (``ctr images import`` and ``podman
    load`` accept it; a layer two images share is one blob); returns name -> manifest digest."""
    blobs: dict[str, bytes] = {}
    manifests, digests = [], {}
    for img in images:
        layers = [_blob(layer) for layer in img.layers]
        config = json.dumps({
            "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
            "config": {"Env": list(img.env), "Cmd": list(img.cmd),
                       **({"Entrypoint": list(img.entrypoint)} if img.entrypoint else {}),
                       **({"WorkingDir": img.workdir} if img.workdir else {})},
            "rootfs": {"type": "layers", "diff_ids": [d for d, _ in layers]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hiddenplane lab"} for _ in layers],
        }, sort_keys=True).encode()
        config_digest, _ = _blob(config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": len(b)}
                       for d, b in layers],
        }, sort_keys=True).encode()
        manifest_digest, _ = _blob(manifest)
        blobs.update(layers)
        blobs.update([(config_digest, config), (manifest_digest, manifest)])
        digests[img.name] = manifest_digest
        manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": manifest_digest, "size": len(manifest),
                          "annotations": {"io.containerd.image.name": img.name,
                                          "org.opencontainers.image.ref.name": img.name.rsplit(":", 1)[-1]}})
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": manifests}, sort_keys=True).encode()
    with open(out, "wb") as f:
        f.write(_tar_bytes([("blobs", None, 0o755, None), ("blobs/sha256", None, 0o755, None)] +
                           [(f"blobs/sha256/{d.split(':')[1]}", b, 0o644, None) for d, b in blobs.items()] +
                           [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644, None),
                            ("index.json", index, 0o644, None)]))
    return digests


def build_image_archive(out: Path, name: str, files: dict[str, tuple[bytes, int]],
                        cmd: list[str], env: list[str] | None = None,
                        links: dict[str, str] | None = None, entrypoint: list[str] | None = None) -> str:
    """Write an OCI image layout tar of one image with one layer (``files``, and ``links``:
    symlink path -> target); returns the image's manifest digest.

    ``name`` is the full reference (e.g. ``localhost/hiddenplane/busybox:lab``).
    """
    img = Image(name, (files_layer(files, links),), tuple(cmd), tuple(entrypoint or ()),
                tuple(env or Image.env))
    return oci_archive(out, [img])[name]


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
