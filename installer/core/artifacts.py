"""Artifact directories and their checksum file.

An artifacts directory holds the binaries hosts need, flat, plus ``SHA256SUMS`` in the format
``sha256sum`` writes and ``sha256sum -c`` reads: one ``<hex digest>  <file name>`` per line.
Downloads are verified into the same layout, so ``source: dir`` and ``source: download`` look
alike to everything after them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from installer.core.components import CONTROL, WORKER, installed_binaries
from installer.core.digests import Digests, sha256_file
from installer.core.errors import InstallerError

SUMS_FILE = "SHA256SUMS"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *]([^/\s][^/]*)$")

# what each role needs on its hosts (control hosts: no container runtime, by design; etcdutl
# because etcd 3.6's etcdctl no longer checks or restores snapshots)
CONTROL_BINARIES = installed_binaries(CONTROL)
WORKER_BINARIES = installed_binaries(WORKER)
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# the release architecture binaries are resolved for; preflight refuses hosts of another
ARTIFACTS_ARCH = "amd64"


class ArtifactError(InstallerError):
    pass


def read_sums(directory: Path) -> dict[str, str]:
    path = Path(directory) / SUMS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    sums = {}
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ArtifactError(f"{path}:{n}: not a '<sha256>  <file>' line")
        sums[m[2]] = m[1]
    return sums


def write_sums(directory: Path, sums: dict[str, str]) -> None:
    text = "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    (Path(directory) / SUMS_FILE).write_text(text)


def add_files(directory: Path, names: list[str]) -> dict[str, str]:
    """Record the current digests of ``names`` (files in ``directory``) in its SHA256SUMS."""
    directory = Path(directory)
    sums = read_sums(directory)
    for name in names:
        sums[name] = sha256_file(directory / name)
    write_sums(directory, sums)
    return sums


def verify(directory: Path, names: list[str] | tuple[str, ...], digests: Digests | None = None) -> dict[str, str]:
    """Check that each named file exists and matches SHA256SUMS; return their digests.
    ``digests``: remembered digests of unchanged files (see core/digests.py)."""
    directory = Path(directory)
    digests = digests or Digests()
    sums = read_sums(directory)
    problems, out = [], {}
    for name in names:
        if name not in sums:
            problems.append(f"{name}: no entry in {directory / SUMS_FILE}")
        elif not (directory / name).is_file():
            problems.append(f"{name}: missing from {directory}")
        elif (digest := digests.sha256(directory / name)) != sums[name]:
            problems.append(f"{name}: sha256 {digest} does not match {SUMS_FILE} ({sums[name]})")
        else:
            out[name] = digest
    if problems:
        raise ArtifactError("artifacts: " + "; ".join(problems))
    return out


@dataclass(frozen=True)
class ResolvedArtifact:
    """A binary or image archive verified against its checksum, as a local file."""
    name: str
    path: Path
    sha256: str
