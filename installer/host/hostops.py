"""Turn HostChanges into one shell script plus one tar stream: a single round trip per change.

The script carries no secret (file contents travel in the tar on stdin). Each file is
installed next to its target and renamed over it, so a host never holds a half-written file
even if the installer is killed; a step that fails (a full disk) removes its temporary file.
A file the installer did not write is backed up once per distinct content, however many
attempts fail. Units to restart are recorded on the host before any file is
replaced and cleared only after the restart, so a run interrupted in between still restarts
them next time.

The tar of a large change (binaries) is built once per distinct content and shared by every
host that needs the same bytes (20 workers: one tar, not 20), and compressed when the host has
the tool to unpack it (zstd, else gzip): the upload is what a cold run spends its time on.
"""

from __future__ import annotations

import io
import shlex
import shutil
import subprocess
import tarfile
import threading
import time
import zlib
from concurrent.futures import Future

from installer.core import components
from installer.core.diff import HostChanges
from installer.core.facts import MANIFEST, PENDING, STATE_DIR
from installer.core.shellfiles import shell_file

BACKUP_INFIX = ".hiddenplane-backup-"   # a replaced file's backup: PATH.hiddenplane-backup-STAMP

_PRELUDE = shell_file("apply-prelude.sh", STATE_DIR=STATE_DIR, BACKUP_INFIX=BACKUP_INFIX)


def q(*parts: object) -> str:
    """``parts`` as shell words, each quoted (str() first)."""
    return " ".join(shlex.quote(str(p)) for p in parts)


# tars from this size up are shared between hosts and compressed; smaller ones (configs,
# certificates) are cheaper to send as they are
LARGE = 1 << 20
# what the host needs on its PATH to unpack, best first, and the `tar -x` option that uses it
CODECS = {"zstd": "--zstd", "gzip": "-z"}
MOVE_FROM = 1 << 20             # files from this size up are moved out of the stage, not copied


def codec_for(changes: HostChanges, host_tools: set[str]) -> str | None:
    """How ``changes``' tar travels to a host with ``host_tools``: None (as it is) for a small
    change; zstd when both ends have it, else gzip (in Debian's essential set)."""
    if changes.upload_bytes < LARGE:
        return None
    if "zstd" in host_tools and shutil.which("zstd"):
        return "zstd"
    return "gzip" if "gzip" in host_tools else None


def compress(data: bytes, codec: str | None) -> bytes:
    if codec == "zstd":
        # level 1 on every core: 97 MiB of binaries -> 37 MiB in under half a second
        return subprocess.run(["zstd", "-1", "-T0", "-q", "-c"], input=data, capture_output=True,
                              check=True).stdout
    if codec == "gzip":
        z = zlib.compressobj(1, zlib.DEFLATED, 31)         # wbits 31: the gzip format
        return z.compress(data) + z.flush()
    return data


class Payloads:
    """Each change's stdin (tar, compressed per ``codec``), built once per distinct content:
    hosts getting the same files in the same order share the bytes, and a thread asking for a
    payload another thread is building waits for it instead of building it again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[tuple, Future] = {}

    def get(self, changes: HostChanges, codec: str | None) -> bytes:
        if changes.upload_bytes < LARGE:
            return compress(tarball(changes), codec)
        key = (codec, tuple(f.sha256 for f in changes.write))
        with self._lock:
            fut, mine = self._made.get(key), False
            if fut is None:
                fut, mine = self._made.setdefault(key, Future()), True
        if mine:
            try:
                fut.set_result(compress(tarball(changes), codec))
            except BaseException as e:
                fut.set_exception(e)
        return fut.result()


def tarball(changes: HostChanges) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, f in enumerate(changes.write):
            data = f.data()
            info = tarfile.TarInfo(str(i))
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def script(changes: HostChanges, stamp: str | None = None, no_block: bool = False, codec: str | None = None) -> str:
    """The shell that applies ``changes`` from the tar on stdin (``codec``: how it is compressed)."""
    lines = [f"STAMP={shlex.quote(stamp or time.strftime('%Y%m%dT%H%M%S'))}",
             f"TAR_CODEC={CODECS[codec] if codec else ''}", _PRELUDE]
    for u in changes.users:
        lines.append(f"id -u {q(u.name)} >/dev/null 2>&1 || useradd --system --user-group --no-create-home "
                     f"--home-dir {q(u.home)} --shell /usr/sbin/nologin {q(u.name)}")
    for d in changes.dirs:
        # separate commands, not an && list: `set -e` ignores a failure anywhere but at its end
        lines.append(f"mkdir -p {q(d.path)}; chown {q(f'{d.owner}:{d.group}')} {q(d.path)}; "
                     f"chmod {d.mode:04o} {q(d.path)}")
    units = sorted(set(changes.restart))
    if units or changes.defer:
        lines.append(f"printf '%s\\n' {q(*units, *changes.defer)} >> {PENDING}")
    for i, f in enumerate(changes.write):
        lines.append("put " + q(i, f.path, f"{f.mode:04o}", f.owner, f.group,
                                1 if f.path in changes.backup else 0, f.sha256, 1 if f.size >= MOVE_FROM else 0))
    for p in changes.remove:
        lines.append(f"rm -f {q(p)}")
    for f in changes.fix:
        lines.append(f"chown {q(f'{f.owner}:{f.group}')} {q(f.path)}; chmod {f.mode:04o} {q(f.path)}")
    if changes.write:
        paths = "\n".join(f.path for f in changes.write)
        lines.append(f"printf '%s\\n' {shlex.quote(paths)} | sed 's/$/\\t/' > \"$stage/paths\"")
        lines.append(f"{{ grep -v -F -f \"$stage/paths\" {MANIFEST} 2>/dev/null || true; "
                     f"cat \"$stage/manifest.add\"; }}"
                     f" > {MANIFEST}.new; mv -f {MANIFEST}.new {MANIFEST}")
    if changes.daemon_reload:
        lines.append("systemctl daemon-reload")
    if changes.enable:
        lines.append(f"systemctl enable --quiet {q(*changes.enable)}")
    nb = " --no-block" if no_block else ""
    for verb, units in (("start", changes.start), ("restart", changes.restart)):
        for u in units:
            how = "reload-or-restart" if verb == "restart" and components.reloads(u) else verb
            # one retry after a pause absorbs transient start failures (seen in containers:
            # 219/CGROUP while the host is busy); a unit that still fails says why in the error
            lines.append(f"systemctl {how}{nb} {q(u)} || {{ sleep 3; systemctl {how}{nb} {q(u)}; }} || "
                         f"{{ journalctl -u {q(u)} -n 12 --no-pager -o cat >&2; exit 1; }}")
    done = sorted(set(changes.restart) | set(changes.start))
    if done:
        # a started or restarted unit has read its new inputs; other phases' entries stay
        keep = " ".join(f"-e {shlex.quote(u)}" for u in done)
        lines.append(f"{{ grep -v -x -F {keep} {PENDING} 2>/dev/null || true; }} > {PENDING}.new; "
                     f"mv -f {PENDING}.new {PENDING}")
    return "\n".join(lines) + "\n"
