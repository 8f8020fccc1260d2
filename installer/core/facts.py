"""Facts: one read-only probe per host, and a pure parser of what it prints.

The probe is a POSIX shell script fed the managed paths and units on stdin; it prints one
tab-separated record per line. Hashing large binaries on every run would dominate a no-op
apply, so a file whose size and mtime equal what the installer recorded when it wrote it
(/var/lib/hiddenplane/manifest) reports the recorded digest instead of re-reading it; and
every file is examined by one `stat` and one `awk` for all, not a few processes each.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from installer.core.shellfiles import shell_file

STATE_DIR = "/var/lib/hiddenplane"
MANIFEST = f"{STATE_DIR}/manifest"
LOCK = f"{STATE_DIR}/apply.lock"
PENDING = f"{STATE_DIR}/pending-restart"
# what would un-hide a control host, or collide with what we run
RUNTIME_MARKERS = ("kubelet", "containerd", "dockerd", "crio")
# host commands the components call that the installer does not ship (preflight checks them)
HOST_TOOLS = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "modprobe")
# what can unpack a compressed upload (host/hostops.py picks one)
UNPACKERS = ("zstd", "gzip")

PROBE = shell_file("facts-probe.sh", MANIFEST=MANIFEST, LOCK=LOCK, PENDING=PENDING,
                   HOST_TOOLS=" ".join(HOST_TOOLS + UNPACKERS), RUNTIME_MARKERS=" ".join(RUNTIME_MARKERS))


@dataclass(frozen=True)
class FileFact:
    sha256: str
    mode: int
    owner: str
    group: str
    ours: bool          # the content is what the installer last wrote there


@dataclass(frozen=True)
class DirFact:
    mode: int
    owner: str
    group: str


@dataclass
class HostFacts:
    hostname: str = ""
    os: str = ""
    arch: str = ""
    init: str = ""
    swap_devices: int = 0
    systemd_resolved: bool = False
    lock: str | None = None
    pending_restarts: set[str] = field(default_factory=set)
    kubelet_joined: bool = False
    etcd_data: bool = False             # /var/lib/etcd/member exists: this host was an etcd member
    modules: set[str] = field(default_factory=set)
    tools: set[str] = field(default_factory=set)        # HOST_TOOLS and UNPACKERS found on the PATH
    listening: set[int] = field(default_factory=set)
    users: set[str] = field(default_factory=set)
    runtime: set[tuple[str, str]] = field(default_factory=set)     # (binary|process|unit, name)
    files: dict[str, FileFact] = field(default_factory=dict)
    dirs: dict[str, DirFact] = field(default_factory=dict)
    units: dict[str, tuple[str, str]] = field(default_factory=dict)  # unit -> (active, enabled)
    # certificate file -> its content (public): the CA files and the leaf certificates the plan
    # manages, for the CA guard and the stale-leaf guard (core/trust.py)
    certs: dict[str, bytes] = field(default_factory=dict)


def probe_input(files: list[str], dirs: list[str], units: list[str], trust: list[str] = ()) -> bytes:
    """``trust``: certificate files whose content the probe returns (public; a few KiB each)."""
    lines = ([f"F\t{p}" for p in files] + [f"D\t{d}" for d in dirs] + [f"U\t{u}" for u in units]
             + [f"C\t{p}" for p in trust])
    return ("\n".join(lines) + "\n").encode()


def parse(output: str) -> HostFacts:
    """Pure: the probe's output -> HostFacts. Raises ValueError on a truncated probe."""
    facts = HostFacts()
    ours: set[tuple[str, str]] = set()                 # (path, digest) the installer wrote
    unhashed: dict[str, list[str]] = {}
    hashed: dict[str, str] = {}
    complete = False
    for line in output.splitlines():
        if line == "END":
            complete = True
            continue
        kind, _, rest = line.partition("\t")
        cols = rest.split("\t")
        if kind == "K" and len(cols) == 2:
            key, value = cols
            if key == "swap":
                facts.swap_devices = int(value or 0)
            elif key == "resolved":
                facts.systemd_resolved = True
            elif key == "lock":
                facts.lock = value
            elif key == "joined":
                facts.kubelet_joined = True
            elif key == "etcd_data":
                facts.etcd_data = True
            elif key == "pending":
                facts.pending_restarts = set(value.split())
            elif key in ("hostname", "os", "arch", "init"):
                setattr(facts, key, value.strip())
        elif kind == "M":
            facts.modules.add(cols[0])
        elif kind == "T":
            facts.tools.add(cols[0])
        elif kind == "P" and cols[0].isdigit():
            facts.listening.add(int(cols[0]))
        elif kind == "S":
            facts.users.add(cols[0])
        elif kind == "X" and len(cols) == 2:
            facts.runtime.add((cols[0], cols[1]))
        elif kind == "F" and len(cols) == 5:
            path, digest, mode, owner, group = cols
            facts.files[path] = FileFact(digest, int(mode, 8), owner, group, False)
        elif kind == "A" and len(cols) == 4:
            unhashed[cols[0]] = cols[1:]
        elif kind == "Z" and len(cols) == 2:
            hashed[cols[0]] = cols[1]
        elif kind == "R" and len(cols) == 2:
            ours.add((cols[0], cols[1]))
        elif kind == "D" and len(cols) == 4:
            path, mode, owner, group = cols
            facts.dirs[path] = DirFact(int(mode, 8), owner, group)
        elif kind == "U" and len(cols) == 3:
            facts.units[cols[0]] = (cols[1], cols[2])
        elif kind == "C" and len(cols) == 2:
            try:
                facts.certs[cols[0]] = base64.b64decode(cols[1], validate=True)
            except ValueError:
                raise ValueError(f"the facts probe sent unreadable content for {cols[0]}") from None
    if not complete:
        raise ValueError("the facts probe did not finish")
    for path, (mode, owner, group) in unhashed.items():
        if path in hashed:
            facts.files[path] = FileFact(hashed[path], int(mode, 8), owner, group, False)
    for path, f in facts.files.items():
        if (path, f.sha256) in ours:
            facts.files[path] = FileFact(f.sha256, f.mode, f.owner, f.group, True)
    return facts
