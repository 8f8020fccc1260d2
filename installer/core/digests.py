"""The sha256 of local files, remembered by the file's identity so a re-run does not re-hash.

Every run checks the artifacts (150-300 MiB of binaries) against SHA256SUMS; hashing them took
0.1-0.3 s of each no-op apply. A digest is reused only while the file's device, inode, size,
modification time and change time are all the same: writing, truncating, renaming over or
chmod-ing the file moves its change time, which no ordinary call can set back, so a replaced
binary is hashed again and then fails the check as before. The record lives in the user's
cache directory (0700 directory, 0600 file); a missing or unreadable record only costs the
hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from installer.core.safefs import write_atomic

VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Digests:
    """``sha256(path)``: the file's digest, from the record when its identity is unchanged.
    ``save()`` writes the record back when anything was hashed."""

    def __init__(self, record: Path | None = None):
        self.record = record
        self.hashed = 0                 # files actually read this run (for tests and benchmarks)
        self._seen: dict[str, list] = {}
        self._dirty = False
        if record is not None:
            try:
                doc = json.loads(record.read_text())
                if doc.get("version") == VERSION and isinstance(doc.get("files"), dict):
                    self._seen = doc["files"]
            except (OSError, ValueError, AttributeError):
                pass

    def sha256(self, path: Path) -> str:
        path = Path(path).resolve()
        st = path.stat()
        known = self._seen.get(str(path))
        if isinstance(known, list) and len(known) == 6 and known[:5] == _identity(st):
            return known[5]
        digest = sha256_file(path)
        self.hashed += 1
        if _identity(path.stat()) == _identity(st):     # not changed while we read it
            self._seen[str(path)] = [*_identity(st), digest]
            self._dirty = True
        return digest

    def save(self) -> None:
        if self.record is None or not self._dirty:
            return
        live = {p: v for p, v in self._seen.items() if Path(p).exists()}
        try:
            write_atomic(self.record, json.dumps({"version": VERSION, "files": live}).encode(), 0o600)
            self._dirty = False
        except OSError:
            pass                        # a cache: the next run hashes again
