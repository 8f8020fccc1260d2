"""The core of `installer apply`, without SSH: the real facts probe and the real apply script run
under /bin/sh on this machine (state paths moved into tmp_path, systemctl replaced by a small
fake that records its calls), the pure diff, the phase partition, preflight, the lock's
staleness, the post-apply verification and the --only/--skip checks."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import platform
import pwd
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core.components import CONTROL_UNITS, ETCD_UNIT, WORKER_UNITS
from installer.core.diff import HostChanges, Selection, diff
from installer.core.errors import InstallerError
from installer.core.facts import (
    LOCK,
    MANIFEST,
    PENDING,
    PROBE,
    STATE_DIR,
    DirFact,
    FileFact,
    HostFacts,
    parse,
    probe_input,
)
from installer.core.network import REPAIR_TIMER, ROUTES_UNIT
from installer.core.render.files import HostDir, HostFile, SystemUser
from installer.engine import runner
from installer.engine.parts import control_plane_part, etcd_part, worker_part
from installer.engine.phases import PHASE_NAMES
from installer.engine.phases.run_preflight import problems
from installer.engine.phases.verify_hidden import violations
from installer.host.applylock import LOCK_TTL, Identity, stale_reason
from installer.host.hostops import LARGE, Payloads, codec_for, compress, script, tarball

from .conftest import EXAMPLE

STAMP = "20240102T030405"
# a system user and group every Debian/Ubuntu has, to show ownership other than root
OTHER = "daemon"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def owner_of(p: Path) -> tuple[int, str, str]:
    st = os.stat(p)
    return stat.S_IMODE(st.st_mode), pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name


# --- a fake systemd: records mutating calls, answers is-active/is-enabled/show from its state ---

FAKE_SYSTEMCTL = r"""#!/bin/sh
d=@DIR@
cmd=$1; shift
q=0; units=""
for a in "$@"; do case "$a" in --quiet) q=1;; --no-block) ;; *) units="$units $a";; esac; done
case "$cmd" in
  is-active)
    for u in $units; do s=$(cat "$d/active.$u" 2>/dev/null || echo inactive)
      [ $q = 1 ] || echo "$s"; [ "$s" = active ] || exit 3; done;;
  is-enabled)
    for u in $units; do s=$(cat "$d/enabled.$u" 2>/dev/null || echo disabled)
      [ $q = 1 ] || echo "$s"; [ "$s" = enabled ] || exit 1; done;;
  show)   # show -p Id,ActiveState,UnitFileState -- UNIT...: a block per unit, as systemd prints
    sep=""
    for u in $units; do case "$u" in -p|--|*,*) continue;; esac
      printf '%sId=%s\nActiveState=%s\nUnitFileState=%s\n' "$sep" "$u" \
        "$(cat "$d/active.$u" 2>/dev/null || echo inactive)" \
        "$(cat "$d/enabled.$u" 2>/dev/null || echo disabled)"; sep="
"; done;;
  *)
    echo "$cmd${*:+ $*}" >> "$d/calls"
    if [ "$cmd" = restart ]; then echo "  pending: $(sort @PENDING@ | tr '\n' ' ')" >> "$d/calls"; fi
    case "$cmd" in
      start|restart) for u in $units; do echo active > "$d/active.$u"; done;;
      enable) for u in $units; do echo enabled > "$d/enabled.$u"; done;;
    esac;;
esac
exit 0
"""

FAKE_USERADD = """#!/bin/sh
echo "useradd $*" >> @DIR@/calls
"""


class Host:
    """This machine standing in for a managed host: state under tmp_path, a fake systemctl."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path
        self.state = tmp_path / "state"
        self.systemd = tmp_path / "systemd"
        self.unit_dir = tmp_path / "etc-systemd-system"     # stands in for /etc/systemd/system
        self.systemd.mkdir()
        self.unit_dir.mkdir()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, text in (("systemctl", FAKE_SYSTEMCTL), ("useradd", FAKE_USERADD)):
            exe = bin_dir / name
            exe.write_text(text.replace("@DIR@", str(self.systemd)).replace("@PENDING@", self.pending))
            exe.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    @property
    def manifest(self) -> str:
        return MANIFEST.replace(STATE_DIR, str(self.state))

    @property
    def pending(self) -> str:
        return PENDING.replace(STATE_DIR, str(self.state))

    def local(self, text: str) -> str:
        return text.replace(STATE_DIR, str(self.state)).replace("/etc/systemd/system/", f"{self.unit_dir}/")

    def probe(self, files=(), dirs=(), units=(), keep_end: bool = True) -> str:
        r = subprocess.run(["/bin/sh", "-c", self.local(PROBE)], input=probe_input(list(files), list(dirs),
                           list(units)), capture_output=True, env=self.env, timeout=30)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode()

    def facts(self, files=(), dirs=(), units=()) -> HostFacts:
        return parse(self.probe(files, dirs, units))

    def apply(self, changes: HostChanges, no_block: bool = False, codec: str | None = None,
              payload: bytes | None = None) -> subprocess.CompletedProcess:
        text = self.local(script(changes, stamp=STAMP, no_block=no_block, codec=codec))
        data = payload if payload is not None else compress(tarball(changes), codec)
        return subprocess.run(["/bin/sh", "-c", text], input=data, capture_output=True, env=self.env, timeout=30)

    def calls(self) -> list[str]:
        p = self.systemd / "calls"
        return p.read_text().splitlines() if p.exists() else []

    def set_unit(self, unit: str, active: str = "active", enabled: str = "enabled") -> None:
        (self.systemd / f"active.{unit}").write_text(active + "\n")
        (self.systemd / f"enabled.{unit}").write_text(enabled + "\n")

    def manifest_rows(self) -> dict[str, list[str]]:
        rows = {}
        for line in Path(self.manifest).read_text().splitlines():
            path, *rest = line.split("\t")
            assert path not in rows, f"{path} recorded twice in the manifest"
            rows[path] = rest
        return rows

    def leftovers(self) -> list[Path]:
        return [p for p in self.root.rglob("*") if p.name.endswith(".hp-new")]


@pytest.fixture
def host(tmp_path) -> Host:
    return Host(tmp_path)


# --- 1. facts: the real probe ------------------------------------------------------------------

def test_probe_reports_files_dirs_units_and_host_keys(host, tmp_path):
    a = tmp_path / "etc" / "a.conf"
    a.parent.mkdir()
    a.write_bytes(b"alpha\n")
    a.chmod(0o640)
    spaced = tmp_path / "etc" / "with space.key"
    spaced.write_bytes(b"\x00binary\xff" * 1000)
    spaced.chmod(0o600)
    os.chown(spaced, pwd.getpwnam(OTHER).pw_uid, grp.getgrnam(OTHER).gr_gid)
    d = tmp_path / "var"
    d.mkdir()
    d.chmod(0o710)
    missing = tmp_path / "etc" / "missing.conf"

    facts = host.facts([str(a), str(spaced), str(missing)], [str(d), str(tmp_path / "nodir")], ["ssh.service"])

    assert facts.files[str(a)] == FileFact(sha(b"alpha\n"), 0o640, "root", "root", False)
    assert facts.files[str(spaced)] == FileFact(sha(spaced.read_bytes()), 0o600, OTHER, OTHER, False)
    assert str(missing) not in facts.files
    assert set(facts.files) == {str(a), str(spaced)}
    assert facts.dirs == {str(d): DirFact(0o710, "root", "root")}
    assert facts.units == {"ssh.service": ("inactive", "disabled")}    # as the fake systemctl says
    assert facts.hostname == socket.gethostname()
    assert facts.arch == platform.machine()
    assert "root" in facts.users and OTHER in facts.users
    assert facts.lock is None and facts.pending_restarts == set()
    assert facts.init and facts.os


def test_probe_reads_lock_and_pending_restarts(host):
    host.state.mkdir()
    Path(host.pending).write_text("b.service\na.service\na.service\n")
    Path(LOCK.replace(STATE_DIR, str(host.state))).write_text('{"machine": "m", "pid": 1}\n')
    facts = host.facts()
    assert facts.pending_restarts == {"a.service", "b.service"}
    assert facts.lock.strip() == '{"machine": "m", "pid": 1}'


def test_parse_refuses_truncated_output(host, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    out = host.probe([str(f)])
    assert out.splitlines()[-1] == "END"
    assert str(f) in parse(out).files
    with pytest.raises(ValueError):
        parse(out.replace("END\n", ""))
    with pytest.raises(ValueError):
        parse("\n".join(out.splitlines()[:3]))
    with pytest.raises(ValueError):
        parse("")


def test_probe_manifest_shortcut_reports_recorded_digest_and_ownership(host, tmp_path):
    f = tmp_path / "big.bin"
    f.write_bytes(b"payload" * 100)
    st = f.stat()
    fake = "f" * 64
    host.state.mkdir()
    decoy = f"/decoy{f}"          # a longer path containing ours: must not be taken for it
    Path(host.manifest).write_text(
        f"{decoy}\t{'d' * 64}\t{st.st_size}\t{int(st.st_mtime)}\n"
        f"{f}\t{fake}\t{st.st_size}\t{int(st.st_mtime)}\n")

    have = host.facts([str(f)]).files[str(f)]
    # size and mtime match the record: the recorded digest is reported without reading the file
    assert have.sha256 == fake
    assert have.ours is True

    os.utime(f, (st.st_atime, st.st_mtime - 10))
    have = host.facts([str(f)]).files[str(f)]
    assert have.sha256 == sha(f.read_bytes())      # re-hashed
    assert have.ours is False                      # and not what the installer recorded

    # the record holds the real digest but a stale mtime: re-hashed, and still ours
    Path(host.manifest).write_text(f"{f}\t{sha(f.read_bytes())}\t{st.st_size}\t1\n")
    have = host.facts([str(f)]).files[str(f)]
    assert (have.sha256, have.ours) == (sha(f.read_bytes()), True)

    # same mtime, different size: re-hashed
    Path(host.manifest).write_text(f"{f}\t{fake}\t{st.st_size + 1}\t{int(f.stat().st_mtime)}\n")
    assert host.facts([str(f)]).files[str(f)] == FileFact(sha(f.read_bytes()), 0o644, "root", "root", False)


# --- 2. hostops: the real apply script --------------------------------------------------------

def hf(path, content: bytes, mode=0o644, owner="root", group="root", **kw) -> HostFile:
    return HostFile(str(path), content, mode, owner, group, **kw)


def test_apply_script_installs_backs_up_and_records(host, tmp_path):
    new = hf(tmp_path / "etc" / "deep" / "new.conf", b"new content\n", 0o640)
    foreign = tmp_path / "foreign.conf"
    foreign.write_bytes(b"hand-written\n")
    foreign.chmod(0o664)
    replaced = hf(foreign, b"managed now\n", 0o644)
    secret = hf(tmp_path / "secret.key", b"SECRET-XYZ\n", 0o600, OTHER, OTHER, secret=True)
    host.state.mkdir()
    Path(host.manifest).write_text(f"{new.path}\t{'0' * 64}\t1\t1\nunrelated\t{'1' * 64}\t2\t2\n")

    ch = HostChanges("h", write=[new, replaced, secret], backup={str(foreign)})
    r = host.apply(ch)
    assert r.returncode == 0, r.stderr.decode()
    assert b"SECRET-XYZ" not in script(ch).encode()       # contents travel in the tar only

    for f in (new, replaced, secret):
        p = Path(f.path)
        assert p.read_bytes() == f.content
        assert owner_of(p) == (f.mode, f.owner, f.group)
    backup = tmp_path / f"foreign.conf.hiddenplane-backup-{STAMP}"
    assert backup.read_bytes() == b"hand-written\n"
    assert stat.S_IMODE(backup.stat().st_mode) == 0o664       # cp -p
    assert sorted(p.name for p in tmp_path.rglob("*hiddenplane-backup*")) == [backup.name]

    rows = host.manifest_rows()
    assert rows.pop("unrelated") == ["1" * 64, "2", "2"]
    assert set(rows) == {new.path, replaced.path, secret.path}
    for f in (new, replaced, secret):
        st = os.stat(f.path)
        assert rows[f.path] == [f.sha256, str(st.st_size), str(int(st.st_mtime))]
    assert host.leftovers() == []
    assert list((host.state / "stage").iterdir()) == []
    assert stat.S_IMODE(host.state.stat().st_mode) == 0o700
    assert host.calls() == []                       # no unit involved: systemctl never ran

    # what it wrote is recognised as ours, with the recorded digest: nothing left to do
    facts = host.facts([f.path for f in (new, replaced, secret)])
    assert all(facts.files[f.path] == FileFact(f.sha256, f.mode, f.owner, f.group, True)
               for f in (new, replaced, secret))
    assert diff("h", Selection(files=(new, replaced, secret)), facts).empty

    # a second write of the same path replaces its manifest row
    newer = hf(new.path, b"newer\n", 0o640)
    assert host.apply(HostChanges("h", write=[newer])).returncode == 0
    rows = host.manifest_rows()
    assert rows[new.path][0] == newer.sha256 and rows[secret.path][0] == secret.sha256
    assert len(rows) == 4


@pytest.mark.parametrize("codec", [None, "gzip", "zstd"])
def test_large_upload_compressed_shared_and_moved_into_place(host, tmp_path, codec):
    """A binary-sized change travels compressed (as the host can unpack it), is built once for
    every host getting the same bytes, and is moved out of the stage rather than copied."""
    if codec == "zstd" and not shutil.which("zstd"):
        pytest.skip("no zstd here (scripts/test installs it)")
    src = tmp_path / "artifacts" / "kubelet"
    src.parent.mkdir()
    src.write_bytes(b"".join(i.to_bytes(4, "big") * 64 for i in range(2 * LARGE // 256)))
    binary = HostFile(str(tmp_path / "bin" / "kubelet"), b"", 0o755, source=src, digest=sha(src.read_bytes()))
    conf = hf(tmp_path / "etc" / "kubelet.conf", b"small\n", 0o600, OTHER, OTHER)
    ch = HostChanges("h", write=[binary, conf])
    assert codec_for(ch, {"zstd", "gzip"} if codec == "zstd" else {codec} if codec else set()) == codec
    assert codec_for(HostChanges("h", write=[conf]), {"zstd", "gzip"}) is None      # small: as it is

    payloads = Payloads()
    first = payloads.get(ch, codec)
    assert payloads.get(HostChanges("other", write=[binary, conf]), codec) is first   # built once
    if codec:
        assert len(first) < src.stat().st_size // 4
    r = host.apply(ch, codec=codec, payload=first)
    assert r.returncode == 0, r.stderr.decode()
    assert Path(binary.path).read_bytes() == src.read_bytes() and owner_of(binary.path) == (0o755, "root", "root")
    assert Path(conf.path).read_bytes() == b"small\n" and owner_of(conf.path) == (0o600, OTHER, OTHER)
    assert "mv -f" in script(ch) and host.leftovers() == [] and list((host.state / "stage").iterdir()) == []
    facts = host.facts([binary.path, conf.path])
    assert diff("h", Selection(files=(binary, conf)), facts).empty

    # a payload that does not unpack fails the script and leaves the files as they were
    broken = host.apply(HostChanges("h", write=[hf(conf.path, b"other\n", 0o600)]), codec="gzip",
                        payload=b"not gzip")
    assert broken.returncode != 0 and Path(conf.path).read_bytes() == b"small\n"


def test_apply_script_units_in_order_with_pending_restarts(host, tmp_path):
    unit = hf("/etc/systemd/system/hp-test.service", b"[Service]\nExecStart=/bin/true\n", 0o600,
              restarts=("hp-test.service",))
    conf = hf(tmp_path / "a.conf", b"a\n", restarts=("a.service", "b.service", "later.service"))
    host.state.mkdir()
    Path(host.pending).write_text("other.service\n")        # another phase's, left for it
    ch = HostChanges("h", write=[unit, conf], defer=["later.service"], enable=["c.service"],
                     start=["c.service"], restart=["b.service", "a.service"])
    assert ch.daemon_reload
    assert not HostChanges("h", write=[conf]).daemon_reload
    r = host.apply(ch)
    assert r.returncode == 0, r.stderr.decode()

    assert (host.unit_dir / "hp-test.service").read_bytes() == unit.content
    assert host.calls() == [
        "daemon-reload",
        "enable --quiet c.service",
        "start c.service",
        "restart b.service",
        "  pending: a.service b.service later.service other.service ",
        "restart a.service",
        "  pending: a.service b.service later.service other.service ",
    ]
    # restarted units are cleared, the deferred one and the other phase's stay recorded
    assert sorted(Path(host.pending).read_text().split()) == ["later.service", "other.service"]
    assert host.facts().pending_restarts == {"later.service", "other.service"}


def test_apply_script_no_block_and_no_daemon_reload(host):
    ch = HostChanges("h", start=["etcd.service"], restart=["x.service"])
    assert not ch.daemon_reload
    assert host.apply(ch, no_block=True).returncode == 0
    assert [c for c in host.calls() if not c.startswith("  ")] == ["start --no-block etcd.service",
                                                                   "restart --no-block x.service"]


def test_apply_script_users_dirs_fix_and_remove(host, tmp_path):
    keep = tmp_path / "keep.conf"
    keep.write_bytes(b"same\n")
    keep.chmod(0o666)
    gone = tmp_path / "bootstrap.conf"
    gone.write_bytes(b"token\n")
    d = HostDir(str(tmp_path / "x" / "y"), 0o750, OTHER, OTHER)
    ch = HostChanges("h", users=[SystemUser("root", "/root"), SystemUser("hp-no-such-user", "/var/lib/hp")],
                     dirs=[d], fix=[hf(keep, b"same\n", 0o600, OTHER, OTHER)], remove=[str(gone)])
    r = host.apply(ch)
    assert r.returncode == 0, r.stderr.decode()
    assert host.calls() == ["useradd --system --user-group --no-create-home --home-dir /var/lib/hp "
                            "--shell /usr/sbin/nologin hp-no-such-user"]        # root exists already
    assert owner_of(Path(d.path)) == (0o750, OTHER, OTHER)
    assert keep.read_bytes() == b"same\n" and owner_of(keep) == (0o600, OTHER, OTHER)
    assert not gone.exists()
    assert not Path(host.manifest).exists()          # nothing written: nothing recorded


def test_apply_script_failure_stops_before_touching_existing_files(host, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file, not a directory\n")
    existing = tmp_path / "existing.conf"
    existing.write_bytes(b"precious\n")
    host.state.mkdir()
    Path(host.manifest).write_text(f"{existing}\t{sha(b'precious')}\t9\t1\n")
    before = Path(host.manifest).read_text()
    ch = HostChanges("h", write=[hf(blocker / "sub" / "x.conf", b"x\n"), hf(existing, b"replacement\n",
                                                                                restarts=("a.service",))],
                     restart=["a.service"])
    r = host.apply(ch)
    assert r.returncode != 0
    assert existing.read_bytes() == b"precious\n"
    assert Path(host.manifest).read_text() == before
    assert host.calls() == []                                  # no restart after a failure...
    assert Path(host.pending).read_text().split() == ["a.service"]    # ...but the next run does it
    assert host.leftovers() == []
    assert list((host.state / "stage").iterdir()) == []


@pytest.mark.parametrize("which", ["dir", "fix"])
def test_apply_script_failing_dir_or_fix_step_fails_the_script(host, tmp_path, which):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    if which == "dir":
        ch = HostChanges("h", dirs=[HostDir(str(blocker / "sub"), 0o755)], start=["a.service"])
    else:
        ch = HostChanges("h", fix=[hf(tmp_path / "vanished.conf", b"", 0o600)], start=["a.service"])
    r = host.apply(ch)
    assert r.returncode != 0
    assert host.calls() == []


def test_apply_script_replaces_without_truncating(host, tmp_path):
    """A reader never sees an empty or partial file: the new content is renamed over the old."""
    target = tmp_path / "t.conf"
    target.write_bytes(b"old\n")
    inode = target.stat().st_ino
    r = host.apply(HostChanges("h", write=[hf(target, b"new\n" * 1000)]))
    assert r.returncode == 0, r.stderr.decode()
    assert target.read_bytes() == b"new\n" * 1000
    assert target.stat().st_ino != inode                     # a new inode: renamed, not rewritten


def test_apply_converges_across_phases_with_deferred_restarts(host, tmp_path):
    """An artifacts-like phase writes an input of a unit a later phase owns (deferred), the later
    phase starts that unit for the first time: afterwards nothing is pending and a re-run is a
    no-op (no spurious restart)."""
    binary = hf(tmp_path / "bin" / "svc", b"#!/bin/sh\n", 0o755, restarts=("svc.service",))
    conf = hf(tmp_path / "etc" / "svc.conf", b"k=v\n", 0o600, restarts=("svc.service",))
    first = Selection(files=(binary,))
    second = Selection(files=(conf,), units=("svc.service",))
    paths = [binary.path, conf.path]

    ch = diff("h", first, host.facts(paths, units=["svc.service"]))
    assert ch.defer == ["svc.service"] and ch.restart == []
    assert host.apply(ch).returncode == 0
    facts = host.facts(paths, units=["svc.service"])
    assert facts.pending_restarts == {"svc.service"}

    ch = diff("h", second, facts)
    assert ch.start == ["svc.service"] and ch.restart == [] and ch.enable == ["svc.service"]
    assert host.apply(ch).returncode == 0
    assert host.calls() == ["enable --quiet svc.service", "start svc.service"]

    facts = host.facts(paths, units=["svc.service"])
    assert facts.units["svc.service"] == ("active", "enabled")
    assert facts.pending_restarts == set()
    for sel in (first, second):
        assert diff("h", sel, facts).empty, diff("h", sel, facts)

    # a later change of the binary restarts the (now running) unit exactly once
    binary2 = hf(binary.path, b"#!/bin/sh\n# v2\n", 0o755, restarts=("svc.service",))
    ch = diff("h", Selection(files=(binary2,)), facts)
    assert host.apply(ch).returncode == 0
    facts = host.facts(paths, units=["svc.service"])
    ch = diff("h", second, facts)
    assert ch.restart == ["svc.service"] and ch.write == []
    assert host.apply(ch).returncode == 0
    facts = host.facts(paths, units=["svc.service"])
    assert facts.pending_restarts == set()
    assert diff("h", second, facts).empty


# --- 3. diff -----------------------------------------------------------------------------------

F = hf("/etc/a.conf", b"new\n", 0o644, restarts=("a.service",))
U = "a.service"


def have(f: HostFile = F, *, content: bytes | None = None, mode=None, owner=None, ours=False) -> FileFact:
    digest = sha(content) if content is not None else f.sha256
    return FileFact(digest, f.mode if mode is None else mode, owner or f.owner, owner or f.group, ours)


def facts_of(files=None, units=None, pending=(), users=("root",), dirs=None) -> HostFacts:
    return HostFacts(files=dict(files or {}), units=dict(units or {}), pending_restarts=set(pending),
                     users=set(users), dirs=dict(dirs or {}))


ACTIVE = {U: ("active", "enabled")}
DIFF_CASES = {
    "new file": (Selection(files=(F,)), facts_of(),
                 dict(write=[F.path], backup=set(), fix=[], restart=[], start=[])),
    "same content, other mode: fix only": (Selection(files=(F,)), facts_of({F.path: have(mode=0o666)}),
                                           dict(write=[], fix=[F.path])),
    "same content, other owner: fix only": (Selection(files=(F,)), facts_of({F.path: have(owner=OTHER)}),
                                            dict(write=[], fix=[F.path])),
    "changed, not ours: backup": (Selection(files=(F,)), facts_of({F.path: have(content=b"old", ours=False)}),
                                  dict(write=[F.path], backup={F.path}, fix=[])),
    "changed, ours: no backup": (Selection(files=(F,)), facts_of({F.path: have(content=b"old", ours=True)}),
                                 dict(write=[F.path], backup=set())),
    "unit inactive: start, not restart": (
        Selection(files=(F,), units=(U,)), facts_of({F.path: have(content=b"old")}, {U: ("inactive", "enabled")}),
        dict(start=[U], restart=[], enable=[])),
    "unit failed and disabled: enable and start": (
        Selection(units=(U,)), facts_of(units={U: ("failed", "disabled")}), dict(start=[U], enable=[U])),
    "unit unknown: enable and start": (Selection(units=(U,)), facts_of(), dict(start=[U], enable=[U])),
    "active, input changed: restart": (Selection(files=(F,), units=(U,)),
                                       facts_of({F.path: have(content=b"old", ours=True)}, ACTIVE),
                                       dict(restart=[U], start=[], enable=[])),
    "active, only mode fixed: nothing restarted": (Selection(files=(F,), units=(U,)),
                                                   facts_of({F.path: have(mode=0o600)}, ACTIVE),
                                                   dict(fix=[F.path], restart=[], start=[])),
    "active, unchanged: nothing": (Selection(files=(F,), units=(U,)), facts_of({F.path: have()}, ACTIVE),
                                   dict(empty=True)),
    "pending restart recorded on the host: restart": (
        Selection(files=(F,), units=(U,)), facts_of({F.path: have()}, ACTIVE, pending={U, "other.service"}),
        dict(write=[], restart=[U], defer=[])),
    "changed input of another phase's unit: defer": (
        Selection(files=(F,)), facts_of({F.path: have(content=b"old", ours=True)}, ACTIVE),
        dict(write=[F.path], defer=[U], restart=[], start=[])),
    "absent path present: remove": (Selection(absent=("/etc/bootstrap.conf", "/etc/never")),
                                    facts_of({"/etc/bootstrap.conf": have()}),
                                    dict(remove=["/etc/bootstrap.conf"], empty=False)),
    "missing user and dir: create": (
        Selection(users=(SystemUser("etcd", "/var/lib/etcd"), SystemUser("root", "/root")),
                  dirs=(HostDir("/etc/x", 0o755), HostDir("/etc/y", 0o700), HostDir("/etc/z", 0o700))),
        facts_of(dirs={"/etc/y": DirFact(0o755, "root", "root"), "/etc/z": DirFact(0o700, "root", "root")}),
        dict(users=["etcd"], dirs=["/etc/x", "/etc/y"])),
    "converged: empty": (
        Selection(files=(F,), dirs=(HostDir("/etc", 0o755),), users=(SystemUser("root", "/root"),), units=(U,),
                  absent=("/etc/gone",)),
        facts_of({F.path: have(ours=False)}, ACTIVE, dirs={"/etc": DirFact(0o755, "root", "root")}),
        dict(empty=True, backup=set())),
}


@pytest.mark.parametrize("sel,facts,want", DIFF_CASES.values(), ids=DIFF_CASES.keys())
def test_diff(sel, facts, want):
    ch = diff("h", sel, facts)
    got = {"write": [f.path for f in ch.write], "fix": [f.path for f in ch.fix], "backup": ch.backup,
           "restart": ch.restart, "start": ch.start, "enable": ch.enable, "defer": ch.defer, "remove": ch.remove,
           "users": [u.name for u in ch.users], "dirs": [d.path for d in ch.dirs], "empty": ch.empty}
    assert {k: got[k] for k in want} == want
    if want.get("empty"):
        assert ch.summary() == []


def test_diff_restarts_in_selection_order_and_defers_sorted():
    f1 = hf("/etc/1", b"1", restarts=("z.service", "b.service", "y.service"))
    f2 = hf("/etc/2", b"2", restarts=("a.service", "x.service"))
    units = ("b.service", "a.service")
    facts = facts_of(units={u: ("active", "enabled") for u in units})
    ch = diff("h", Selection(files=(f1, f2), units=units), facts)
    assert ch.restart == ["b.service", "a.service"]
    assert ch.defer == ["x.service", "y.service", "z.service"]


def test_summary_names_secrets_without_content():
    secret = hf("/etc/kubernetes/pki/sa.key", b"SECRET-XYZ", 0o600, secret=True, restarts=(U,))
    facts = facts_of({secret.path: have(secret, content=b"SECRET-OLD", ours=False)}, ACTIVE)
    ch = diff("h", Selection(files=(secret,), units=(U,)), facts)
    lines = ch.summary()
    text = "\n".join(lines)
    assert "SECRET" not in text and "XYZ" not in text
    assert any(secret.path in line and "(secret)" in line and "backing up" in line for line in lines)
    assert f"* restart {U}" in lines
    # the tar carries the content, the script never does
    assert b"SECRET-XYZ" in tarball(ch) and "SECRET-XYZ" not in script(ch)


# --- 4. the phases' partition of each host plan ------------------------------------------------

def _etcd_anything(sel: Selection) -> list[str]:
    return ([f.path for f in sel.files if "etcd" in f.path] + [d.path for d in sel.dirs if "etcd" in d.path]
            + [u.name for u in sel.users if "etcd" in u.name] + [u for u in sel.units if "etcd" in u])


@pytest.mark.parametrize("cluster", ["prepared", "three_controls"])
def test_phase_selections_partition_every_plan(cluster, request):
    plans = request.getfixturevalue(cluster).plans
    roles = {p.role for p in plans.values()}
    assert roles == {"control", "worker"}
    for name, plan in plans.items():
        parts = [etcd_part(plan), control_plane_part(plan)] if plan.role == "control" else [worker_part(plan)]
        for kind, items, key in (("file", plan.files.values(), lambda s: s.files),
                                 ("dir", plan.dirs.values(), lambda s: s.dirs),
                                 ("user", plan.users, lambda s: s.users)):
            for item in items:
                owners = sum(item in key(s) for s in parts)
                assert owners == 1, f"{name}: {kind} {item} is in {owners} selections"
            assert sum(len(key(s)) for s in parts) == len(list(items)), f"{name}: {kind} not from the plan"
        units = [u for s in parts for u in s.units]
        assert sorted(units) == sorted(plan.units) and len(set(units)) == len(units), name
        absent = [p for s in parts for p in s.absent]
        assert sorted(absent) == sorted(plan.absent), name

        if plan.role == "control":
            etcd = etcd_part(plan)
            paths = {f.path for f in etcd.files}
            assert {"/etc/kubernetes/pki/etcd/healthcheck-client.crt",
                    "/etc/kubernetes/pki/etcd/healthcheck-client.key",
                    "/etc/kubernetes/pki/etcd/ca.crt", "/etc/etcd/pki/ca.crt"} <= paths
            assert "/etc/systemd/system/etcd.service" in paths
            assert etcd.units == (ETCD_UNIT,) and [u.name for u in etcd.users] == ["etcd"]
            cp = control_plane_part(plan)
            # the example cluster routes to pods from its control hosts (cni and egress: routes),
            # and puts back the routes a link flap took away
            assert cp.units == (*CONTROL_UNITS, ROUTES_UNIT, REPAIR_TIMER) and cp.users == ()
            # the apiserver's etcd client pair is the apiserver's input, nothing else of etcd is
            assert [p for p in _etcd_anything(cp) if "/apiserver-etcd-client." not in p] == []
        else:
            assert worker_part(plan).units == (ROUTES_UNIT, REPAIR_TIMER, *WORKER_UNITS)
            assert _etcd_anything(worker_part(plan)) == [], name


# --- 5. preflight ------------------------------------------------------------------------------

def ok_facts(name: str, role: str) -> HostFacts:
    worker = role == "worker"
    return HostFacts(hostname=name, os="debian 12", arch="x86_64", init="systemd",
                     modules={"overlay", "br_netfilter"} if worker else set(), users={"root"},
                     tools={"iptables", "iptables-save", "iptables-restore", "modprobe"} if worker else set())


def test_preflight_accepts_good_hosts(prepared):
    for h in prepared.inventory.spec.hosts:
        assert problems(h, ok_facts(h.name, h.role)) == [], h.name
    cp = prepared.inventory.host("cp1")
    # a control host's hostname is not checked (it never registers as a node)
    assert problems(cp, HostFacts(**{**ok_facts("cp1", "control").__dict__, "hostname": "other"})) == []


def _with(facts: HostFacts, **kw) -> HostFacts:
    for k, v in kw.items():
        setattr(facts, k, v)
    return facts


@pytest.mark.parametrize("host_name,change,expect", [
    ("cp1", dict(runtime={("binary", "kubelet")}), ["kubelet", "would not stay hidden"]),
    ("cp1", dict(runtime={("process", "containerd")}), ["containerd", "would not stay hidden"]),
    ("node2", dict(swap_devices=1), ["swapoff -a"]),
    ("node2", dict(hostname="localhost"), ["'localhost'", "'node2'", "hostnamectl set-hostname node2"]),
    ("node3", dict(init="init"), ["PID 1 is init", "systemd"]),
    ("cp1", dict(init=""), ["PID 1 is unknown"]),
    ("cp1", dict(os="centos 9"), ["unsupported OS 'centos 9'", "debian 12"]),
    ("node2", dict(os="ubuntu 20.04"), ["unsupported OS"]),
    ("node2", dict(arch="armv7l"), ["unsupported architecture 'armv7l'"]),
    ("node2", dict(modules={"overlay"}), ["br_netfilter", "not loadable", "modprobe -a br_netfilter"]),
    ("node2", dict(tools={"iptables", "modprobe"}), ["iptables-save, iptables-restore", "apt-get install iptables"]),
    ("cp1", dict(listening={6443}), ["port 6443", "kube-apiserver.service"]),
    ("node2", dict(listening={10250}), ["port 10250", "kubelet.service"]),
])
def test_preflight_problems(prepared, host_name, change, expect):
    h = prepared.inventory.host(host_name)
    found = problems(h, _with(ok_facts(h.name, h.role), **change))
    assert len(found) == 1, found
    for text in expect:
        assert text in found[0]


# what the probe printed on an arm64 worker (a Debian 12 Raspberry Pi), abridged to what preflight reads
AARCH64_PROBE = """K\thostname\tnode2
K\tos\tdebian 12
K\tarch\taarch64
K\tinit\tsystemd
K\tswap\t0
M\toverlay
M\tbr_netfilter
T\tiptables
T\tiptables-save
T\tiptables-restore
T\tmodprobe
S\troot
END
"""


def test_preflight_refuses_a_host_of_another_architecture_than_the_artifacts(prepared):
    from types import SimpleNamespace

    from installer.engine.phases.run_preflight import RunPreflight
    from installer.host.ssh import HostError
    facts = parse(AARCH64_PROBE)
    assert facts.arch == "aarch64"
    node2 = prepared.inventory.host("node2")
    assert problems(node2, facts, "arm64") == []
    found = problems(node2, facts)                      # the default: amd64 artifacts
    assert len(found) == 1 and "aarch64 (arm64)" in found[0] and "linux-amd64" in found[0], found
    ctx = SimpleNamespace(inv=prepared.inventory, facts={"node2": facts}, options=SimpleNamespace(dry_run=False),
                          remotes={}, artifacts_arch="amd64")
    with pytest.raises(HostError) as e:
        RunPreflight().run_host(ctx, "node2")
    assert "node2" in str(e.value) and "aarch64" in str(e.value) and "linux-amd64" in str(e.value)


def test_preflight_port_held_by_our_own_unit_is_fine(prepared):
    cp = prepared.inventory.host("cp1")
    facts = _with(ok_facts("cp1", "control"), listening={2379, 2380, 6443, 22},
                  units={ETCD_UNIT: ("active", "enabled"), "kube-apiserver.service": ("active", "enabled")})
    assert problems(cp, facts) == []
    facts.units[ETCD_UNIT] = ("activating", "enabled")  # restarted without blocking: still ours
    assert problems(cp, facts) == []
    facts.units[ETCD_UNIT] = ("failed", "enabled")     # then whoever listens is not etcd
    assert sorted(problems(cp, facts)) == ["port 2379 is in use by something other than etcd.service",
                                           "port 2380 is in use by something other than etcd.service"]


def test_preflight_reports_every_problem_at_once(prepared):
    w = prepared.inventory.host("node3")
    found = problems(w, HostFacts(hostname="x", os="arch", arch="i686", init="runit", swap_devices=2))
    assert len(found) == 7, found


# --- 6. the lock's staleness -------------------------------------------------------------------

# this machine, as stale_reason is told it (no file read: the same on a CI box without a machine id)
HERE = Identity(socket.gethostname(), "1" * 32, "00000000-0000-4000-8000-000000000001", 1)


def lock(machine: str | None = None, pid: int | None = None, since: float | None = None) -> str:
    """A lock as this release writes it (host name, machine id, boot id, pid namespace: ``HERE``'s);
    ``machine``: another machine's, with a machine id of its own."""
    h = {**HERE.fields(), "pid": pid or os.getpid(), "since": int(time.time() if since is None else since)}
    if machine:
        h.update(machine=machine, machineId="0" * 32)
    return json.dumps(h)


def dead_pid() -> int:
    p = subprocess.Popen(["/bin/true"])
    p.wait()
    return p.pid


def test_stale_reason():
    now = time.time()
    assert stale_reason(lock(), now, HERE) is None
    assert stale_reason(lock(machine="elsewhere", pid=dead_pid()), now, HERE) is None  # can't tell: trust it
    why = stale_reason(lock(pid=dead_pid()), now, HERE)
    assert why and why.startswith("process ") and "gone" in why
    why = stale_reason(lock(machine="elsewhere", since=now - LOCK_TTL - 5), now, HERE)
    assert why and "older than 3600 s" in why
    assert stale_reason(lock(machine="elsewhere", since=now - LOCK_TTL + 60), now, HERE) is None
    # our live process, but a very old lock: still stale by age
    assert "older" in stale_reason(lock(since=now - 2 * LOCK_TTL), now, HERE)


@pytest.mark.parametrize("content", ["", "garbage", '{"machine": "m", "pi', "{}", "42", "null", "[]",
                                     '{"machine": "m", "since": "yesterday"}', '{"since": null}',
                                     '{"machine": "@HERE@", "pid": null}', '{"machine": "@HERE@", "pid": [1]}',
                                     '{"machine": "@HERE@", "pid": 99999999999999999999}'])
def test_stale_reason_garbage_is_stale(content):
    # never an exception: a lock nobody can read is reported (and broken with --force-unlock)
    assert stale_reason(content.replace("@HERE@", socket.gethostname()), time.time())


# --- 7. verify -----------------------------------------------------------------------------------

def converged(plan) -> HostFacts:
    return HostFacts(files={f.path: FileFact(f.sha256, f.mode, f.owner, f.group, True) for f in plan.files.values()},
                     units={u: ("active", "enabled") for u in plan.units})


def test_verify_violations(prepared):
    plan = prepared.plans["cp1"]
    facts = converged(plan)
    assert violations(plan, facts) == []
    assert violations(prepared.plans["node2"], converged(prepared.plans["node2"])) == []

    facts.runtime.add(("unit", "kubelet"))
    assert violations(plan, facts) == ["control host has a kubelet unit: it would not stay hidden"]
    facts.runtime.clear()

    key = next(f for f in plan.files.values() if f.secret)
    facts.files[key.path] = FileFact(key.sha256, 0o644, "root", "root", True)
    found = violations(plan, facts)
    assert len(found) == 1 and key.path in found[0] and "0644" in found[0]
    facts = converged(plan)

    facts.files["/etc/kubernetes/kubelet.conf"] = FileFact("0" * 64, 0o600, "root", "root", False)
    assert violations(plan, facts) == ["control host holds node credential /etc/kubernetes/kubelet.conf"]
    facts = converged(plan)
    del facts.files["/etc/kubernetes/admin.conf"]
    facts.units["etcd.service"] = ("activating", "enabled")
    assert violations(plan, facts) == ["/etc/kubernetes/admin.conf is missing", "etcd.service is not active"]
    # a worker may run a kubelet: that is not a violation there
    w = converged(prepared.plans["node2"])
    w.runtime.add(("process", "kubelet"))
    assert violations(prepared.plans["node2"], w) == []


def test_verify_secret_with_group_bits_even_if_planned():
    from installer.core.render.files import HostPlan
    plan = HostPlan("cp", "control")
    plan.add(hf("/etc/s.key", b"k", 0o640, secret=True))
    facts = HostFacts(files={"/etc/s.key": FileFact(sha(b"k"), 0o640, "root", "root", True)})
    assert violations(plan, facts) == ["/etc/s.key holds a secret but is readable by others"]


# --- 8. --only / --skip ------------------------------------------------------------------------

def test_check_phase_names():
    runner.check_phase_names(frozenset(PHASE_NAMES), "--only")
    runner.check_phase_names(frozenset(), "--skip")
    with pytest.raises(InstallerError) as e:
        runner.check_phase_names(frozenset({"nope", "etcd", "zzz"}), "--only")
    msg = str(e.value)
    assert msg.startswith("--only: unknown phase(s) nope, zzz; phases: ")
    assert msg.endswith(", ".join(PHASE_NAMES))
    assert e.value.exit_code == 2


@pytest.mark.parametrize("flag", ["--only", "--skip"])
@pytest.mark.parametrize("command", ["apply", "plan"])
def test_cli_rejects_unknown_phase(tmp_path, flag, command):
    # names are checked before the inventory is read, any state created or any host contacted
    result = CliRunner().invoke(cli, [command, str(EXAMPLE), flag, "nope", "--state", str(tmp_path / "state")])
    assert result.exit_code == 2, result.output
    assert f"error: {flag}: unknown phase(s) nope; phases: {', '.join(PHASE_NAMES)}" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "state").exists()
