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

PROBE = (r"""
set -u
T=$(printf '\t')
k() { printf 'K\t%s\t%s\n' "$1" "$2"; }
k hostname "$(hostname)"
if [ -r /etc/os-release ]; then . /etc/os-release; fi
k os "${ID:-unknown} ${VERSION_ID:-}"
k arch "$(uname -m)"
k init "$(cat /proc/1/comm 2>/dev/null || echo unknown)"
k swap "$(awk 'NR>1' /proc/swaps 2>/dev/null | wc -l)"
if [ -e /var/lib/kubelet/pki/kubelet-client-current.pem ]; then k joined 1; fi
if [ -d /var/lib/etcd/member ]; then k etcd_data 1; fi
if [ -s PENDING ]; then k pending "$(sort -u PENDING | tr '\n' ' ')"; fi
if [ -f LOCK ]; then k lock "$(head -c 300 LOCK | tr '\t\n' '  ')"; fi
awk '{print "M\t" $1}' /proc/modules 2>/dev/null
# built-in modules do not show in /proc/modules (nor does anything inside a container): look
# for what they provide instead
if grep -qw overlay /proc/filesystems 2>/dev/null; then printf 'M\toverlay\n'; fi
if [ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]; then printf 'M\tbr_netfilter\n'; fi
for x in TOOLS; do if command -v "$x" >/dev/null 2>&1; then printf 'T\t%s\n' "$x"; fi; done
if command -v ss >/dev/null 2>&1; then ss -Htln 2>/dev/null | awk '{n=split($4,a,":"); print "P\t" a[n]}'; fi
awk -F: '{print "S\t" $1}' /etc/passwd
for x in RUNTIME; do
  if command -v "$x" >/dev/null 2>&1 || [ -e "/usr/local/bin/$x" ]; then printf 'X\tbinary\t%s\n' "$x"; fi
  if pgrep -x "$x" >/dev/null 2>&1; then printf 'X\tprocess\t%s\n' "$x"; fi
  if [ -e "/etc/systemd/system/$x.service" ] || [ -e "/lib/systemd/system/$x.service" ]; then
    printf 'X\tunit\t%s\n' "$x"
  fi
done
tmp=$(mktemp -d)
: > "$tmp/f"; : > "$tmp/u"
while IFS="$T" read -r kind p; do
  case "$kind" in
    F) printf '%s\n' "$p" >> "$tmp/f";;
    D) if [ -d "$p" ]; then printf 'D\t%s\t%s\n' "$p" "$(stat --printf '%a\t%U\t%G' "$p")"; fi;;
    U) printf '%s\n' "$p" >> "$tmp/u";;
    C) if [ -f "$p" ]; then printf 'C\t%s\t%s\n' "$p" "$(head -c 65536 "$p" | base64 | tr -d '\n')"; fi;;
  esac
done
# units: one `systemctl show` for all of them and systemd-resolved (two `systemctl` calls a
# unit took 60-80 ms on a control host, this one 13 ms); a block per unit, in argument order,
# each starting with its Id (a unit that does not exist: inactive, no file state)
if command -v systemctl >/dev/null 2>&1; then
  printf 'systemd-resolved.service\n' >> "$tmp/u"
  tr '\n' '\0' < "$tmp/u" | xargs -0 systemctl show -p Id,ActiveState,UnitFileState -- 2>/dev/null |
    awk -v OFS="$T" -v list="$tmp/u" '
      BEGIN { while ((getline u < list) > 0) name[++n] = u }
      /^Id=/ { i++ }
      /^ActiveState=/ { a[i] = substr($0, 13) }
      /^UnitFileState=/ { e[i] = substr($0, 15) }
      END { for (j = 1; j < n; j++) print "U", name[j], a[j], e[j]
            if (a[n] == "active") print "K", "resolved", 1 }'
fi
# files: one stat for all; a file whose size and mtime match the manifest reports the digest
# recorded there, the others are hashed (one sha256sum for all of them)
if [ -s "$tmp/f" ]; then
  tr '\n' '\0' < "$tmp/f" | xargs -0 stat --printf '%n\t%s\t%Y\t%a\t%U\t%G\n' 2>/dev/null > "$tmp/st" || true
  if [ -f MANIFEST ]; then cp MANIFEST "$tmp/m"; else : > "$tmp/m"; fi
  awk -F"$T" -v OFS="$T" -v h="$tmp/h" '
    FILENAME == ARGV[1] { known[$1 SUBSEP $3 SUBSEP $4] = $2; next }
    { k = $1 SUBSEP $2 SUBSEP $3
      if (k in known) print "F", $1, known[k], $4, $5, $6
      else { print "A", $1, $4, $5, $6; print $1 > h } }' "$tmp/m" "$tmp/st"
  if [ -s "$tmp/h" ]; then
    tr '\n' '\0' < "$tmp/h" | xargs -0 sha256sum 2>/dev/null |
      awk -v OFS="$T" '{ d = $1; sub(/^[^ ]+  /, ""); print "Z", $0, d }'
  fi
  awk -F"$T" -v OFS="$T" '{ print "R", $1, $2 }' "$tmp/m"
fi
rm -rf "$tmp"
echo END
""".replace("MANIFEST", MANIFEST).replace("LOCK", LOCK).replace("PENDING", PENDING)
         .replace("RUNTIME", " ".join(RUNTIME_MARKERS)).replace("TOOLS", " ".join(HOST_TOOLS + UNPACKERS)))


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
    trusted: dict[str, bytes] = field(default_factory=dict)   # CA certificate file -> its content


def probe_input(files: list[str], dirs: list[str], units: list[str], trust: list[str] = ()) -> bytes:
    """``trust``: CA certificate files whose content the probe returns (public; a few KiB)."""
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
                facts.trusted[cols[0]] = base64.b64decode(cols[1], validate=True)
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
