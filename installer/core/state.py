"""The local state directory: the cluster's PKI, tokens and kubeconfigs on the operator machine.

Layout (all under one directory, 0700; every key, token and kubeconfig 0600)::

    pki/ca.crt ca.key front-proxy-ca.* etcd/ca.* apiserver.* ... sa.key sa.pub
    pki/etcd/server-<host>.* pki/etcd/peer-<host>.* pki/kubelet/<node>-serving.*
    secrets/encryption.key       base64, 32 bytes for secretbox
    secrets/tokens.yaml          per-node bootstrap tokens with expiry
    admin.conf                   admin kubeconfig pointing at the API endpoint
    network.yaml                 each worker's pod CIDR (cni: routes), node: CIDR; not secret (0644)
    .lock                        empty; flocked by the installer process using the state (0600)

Writes are atomic (temp file + rename) and only touch what changed.

Whoever can write the state directory, or any directory above it, can plant the cluster CA's key
before the first run and read every credential after it. So, as OpenSSH's StrictModes does for
``~/.ssh``, every command checks the path before using it (``StateDir.secure``): the directory
must be the invoking user's and writable by nobody else, each directory above it the user's or
root's and writable by nobody else (a root-owned sticky one such as /tmp excepted), and nothing
inside may be a symbolic link, another user's, or writable by group or others.
"""

from __future__ import annotations

import base64
import datetime as dt
import errno
import fcntl
import os
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from installer.core.errors import StateError
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.issue import Pair
from installer.core.pki.material import BootstrapToken, Material
from installer.core.pki.specs import CAS, cert_specs
from installer.core.render.kubeconfig import kubeconfig
from installer.core.safefs import mode_problem, secure_path, write_atomic
from installer.core.state_tenant import TenantRecords

NETWORK_HEADER = b"""\
# Pod CIDR of each worker (cni: routes), allocated by hiddenplane and never moved.
# A node removed from the inventory keeps its slice until its line is deleted here.
"""


STATE_SUBDIR = ".hiddenplane"
LOCK_NAME = ".lock"


def default_state_dir(inv: Inventory) -> Path:
    """The one rule: next to the inventory file, ``<its directory>/.hiddenplane/<cluster>``, so
    every command (and whoever runs it, sudo or not) finds the same state from the inventory
    alone."""
    return (inv.base_dir / STATE_SUBDIR / inv.metadata.name).resolve()


def legacy_state_dir(cluster: str) -> Path:
    """Where earlier versions kept the state by default (per user: sudo found another)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "hiddenplane" / cluster


def check_not_moved(inv: Inventory, root: Path) -> None:
    """Refuse to start a new, empty state when this cluster's PKI sits at the old default:
    a new CA pushed to hosts that trust the old one breaks the whole cluster."""
    old = legacy_state_dir(inv.metadata.name)
    if not (root / "pki" / "ca.crt").exists() and (old / "pki" / "ca.crt").exists() and old.resolve() != root:
        raise StateError(f"the state of cluster {inv.metadata.name} is at {old} (the default of earlier versions); "
                         f"the default is now next to the inventory: move it there (mv {old} {root}) "
                         f"or pass --state {old}")


VERSIONS_HEADER = (b"# the versions the hosts run, written by `installer apply` and `installer upgrade`: apply\n"
                   b"# refuses an inventory that asks for others (`installer upgrade` moves the cluster)\n")


class StateBusy(StateError):
    """Another installer process holds the state directory."""


def _flock_holder(st: os.stat_result) -> str:
    """Who holds the flock on the file ``st`` describes, from /proc/locks (nothing written to
    the lock file, so a held state stays byte-for-byte unchanged)."""
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            cols = line.split()
            if len(cols) > 5 and cols[1] == "FLOCK" and cols[5] == ident:
                pid = cols[4]
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    cmd = " ".join(a.decode(errors="replace") for a in argv[1:4] if a)
                except OSError:
                    cmd = ""
                return f"process {pid}" + (f" ({cmd})" if cmd else "")
    except OSError:
        pass
    return "another process"


class StateDir(TenantRecords):
    def __init__(self, root: Path):
        self.root = Path(root).expanduser()
        # the flock this object holds and how many blocks hold it: a command resolves its state
        # once (core/cluster.py) and hands this one object down, so a nested holder (apply
        # inside a day-2 command) shares the flock, which a second open file description would
        # fight over; another StateDir of the same directory is another holder, refused
        self._fd: int | None = None
        self._depth = 0
        self._guard = threading.Lock()

    @contextmanager
    def locked(self, create: bool = True) -> Iterator["StateDir"]:
        """Hold the state directory (an flock on ``.lock``, re-entrant on this object); another
        holder is an error naming it, never a wait: two operators racing on one PKI must not
        both write it. ``create=False``: a directory that does not exist is left so (nothing to
        hold; whoever creates it takes the lock)."""
        with self._guard:
            nested = self._depth > 0
            if nested:
                self._depth += 1
        if nested:
            try:
                yield self
            finally:
                self._leave()
            return
        if not self.secure(create):
            yield self
            return
        self._tighten()
        with self._guard:
            if self._depth == 0:
                self._fd = self._flock(self.root.resolve() / LOCK_NAME)
            self._depth += 1
        try:
            yield self
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth == 0 and self._fd is not None:
                os.close(self._fd)          # closing the descriptor drops the flock
                self._fd = None

    def _flock(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StateError(f"state directory {self.root}: cannot open {path.name}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(os.fstat(fd))
            os.close(fd)
            raise StateBusy(f"state directory {self.root} is in use by {holder}; wait for it to finish") from None
        return fd

    # -- layout --
    def pki(self, name: str, ext: str) -> Path:
        return self.root / "pki" / f"{name}.{ext}"

    @property
    def tokens_path(self) -> Path:
        return self.root / "secrets" / "tokens.yaml"

    @property
    def encryption_key_path(self) -> Path:
        return self.root / "secrets" / "encryption.key"

    @property
    def network_path(self) -> Path:
        return self.root / "network.yaml"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.conf"

    @property
    def versions_path(self) -> Path:
        return self.root / "versions.yaml"

    # -- the versions the cluster runs (written by apply and upgrade) --
    def recorded_versions(self) -> dict[str, str]:
        """``{"kubernetes": "v1.36.5", "etcd": "v3.6.16"}`` as the last apply or upgrade left the
        hosts; {} before the first (or for a state of an earlier release)."""
        data = self._read(self.versions_path)
        try:
            doc = yaml.safe_load(data) if data else {}
        except yaml.YAMLError:
            raise StateError(f"{self.versions_path} is corrupt; move it away (the next apply writes it "
                             "again)") from None
        return {k: str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}

    def record_versions(self, versions: dict[str, str]) -> None:
        write_atomic(self.versions_path, VERSIONS_HEADER + yaml.safe_dump(dict(sorted(versions.items()))).encode(),
                     0o600)

    # -- the owner id of a hosted tenant's namespace (core/tenancy.py), made by its first apply --
    # -- permissions --
    def secure(self, create: bool = False) -> bool:
        """Refuse a state directory someone else could have written (StateError naming the path
        and what is wrong; nothing changed): the directories from / down to it (see
        ``secure_path``), then everything inside it, which must be the user's own plain
        directories and files (no link, device or pipe; none writable by group or others).
        With ``create``, a missing directory is made (0700). False when it does not exist.
        Every way into the state passes here: ``locked``, ``ensure_root``, ``load``."""
        real = secure_path(self.root, create)
        if real is None:
            return False
        euid = os.geteuid()
        todo = [real]
        while todo:
            d = todo.pop()
            try:
                entries = list(os.scandir(d))
            except OSError as e:
                raise StateError(f"{d}: {e.strerror}") from None
            for e in entries:
                path = self.root / Path(e.path).relative_to(real)
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue                   # a temporary file of ours, renamed meanwhile
                if stat.S_ISLNK(st.st_mode):
                    raise StateError(f"{path} is a symbolic link (to {os.readlink(e.path)}): the state "
                                     "directory holds its own files only; remove it and check where it "
                                     "points and who made it")
                if st.st_uid != euid:
                    raise StateError(f"{path} is owned by uid {st.st_uid}, not you (uid {euid}): someone "
                                     "else wrote into the state directory; check it before using it")
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                    raise StateError(f"{path} is not a regular file or directory")
                if (why := mode_problem(stat.S_IMODE(st.st_mode))) is not None:
                    raise StateError(f"{path} is {why}: check nobody changed it, then chmod go-w it")
                if stat.S_ISDIR(st.st_mode):
                    todo.append(Path(e.path))
        return True

    def _tighten(self) -> None:
        """0700 for a checked state directory that lets others read or enter it."""
        try:
            if stat.S_IMODE(self.root.stat().st_mode) != 0o700:
                os.chmod(self.root, 0o700)
        except OSError as e:
            raise StateError(f"state directory {self.root}: {e.strerror}") from None

    def ensure_root(self) -> None:
        self.secure(create=True)
        self._tighten()

    # -- reading --
    def _read(self, path: Path) -> bytes | None:
        """The file's bytes, None when it is missing; never through a link (O_NOFOLLOW) nor from
        a file another user owns. ``secure`` already refused both, and nobody else can change a
        directory it passed; checking the very file opened costs nothing and holds for a caller
        that skipped it."""
        try:
            # O_NONBLOCK: a pipe in place of the file must not hang the open (it is refused below)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StateError(f"{path} is a symbolic link: the state directory holds its own files "
                                 "only; remove it and check where it points and who made it") from None
            raise StateError(f"{path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StateError(f"{path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise StateError(f"{path} is owned by uid {st.st_uid}, not you (uid {os.geteuid()}): "
                                 "someone else wrote into the state directory; check it before using it")
            try:
                return f.read()
            except OSError as e:
                raise StateError(f"{path}: {e.strerror}") from None

    def _pair(self, name: str) -> Pair | None:
        crt, key = self._read(self.pki(name, "crt")), self._read(self.pki(name, "key"))
        if crt is None or key is None:
            return None
        try:
            return Pair(issue.load_cert(crt), issue.load_key(key))
        except ValueError:
            # Name the file, never its content: it holds a private key.
            raise StateError(f"{self.pki(name, 'crt')} or its .key is not valid PEM; move them away "
                             "to have them re-issued") from None

    def load(self, inv: Inventory) -> Material:
        m = Material()
        if not self.secure():
            return m
        for ca in CAS:
            if (p := self._pair(ca.name)) is not None:
                m.cas[ca.name] = p
        for spec in cert_specs(inv):
            if (p := self._pair(spec.name)) is not None:
                m.certs[spec.name] = p
        if (sa := self._read(self.pki("sa", "key"))) is not None:
            m.sa_key = issue.load_key(sa)
        if (ek := self._read(self.encryption_key_path)) is not None:
            try:
                m.encryption_key = base64.b64decode(ek.strip(), validate=True)
            except ValueError:
                m.encryption_key = None
            if m.encryption_key is None or len(m.encryption_key) != 32:
                # never re-create it silently: secrets in etcd are encrypted with it
                raise StateError(f"{self.encryption_key_path} is not a base64 32-byte key; restore it "
                                 "from a backup (Secrets in etcd are encrypted with it)")
        m.tokens = self._read_tokens()
        if (nw := self._read(self.network_path)) is not None:
            try:
                doc = yaml.safe_load(nw) or {}
                cidrs = doc.get("podCIDRs") or {}
                if not isinstance(cidrs, dict) or not all(isinstance(v, str) for v in cidrs.values()):
                    raise TypeError
            except (yaml.YAMLError, AttributeError, TypeError):
                # never re-allocate silently: running pods hold addresses from these slices
                raise StateError(f"{self.network_path} is corrupt: expected `podCIDRs:` mapping node names to "
                                 "CIDRs; fix it by hand (or restore it from a backup)") from None
            m.pod_cidrs = {str(k): v for k, v in cidrs.items()}
        return m

    # -- writing --
    def save(self, m: Material) -> list[Path]:
        """Write whatever differs from the disk (unchanged files are not touched)."""
        self.ensure_root()
        written: list[Path] = []

        def put(path: Path, data: bytes, mode: int) -> None:
            if write_atomic(path, data, mode):
                written.append(path)

        for name, pair in {**m.cas, **m.certs}.items():
            put(self.pki(name, "key"), issue.key_pem(pair.key), 0o600)
            put(self.pki(name, "crt"), issue.cert_pem(pair.cert), 0o644)
        if m.sa_key is not None:
            put(self.pki("sa", "key"), issue.key_pem(m.sa_key), 0o600)
            put(self.pki("sa", "pub"), issue.public_pem(m.sa_key), 0o644)
        if m.encryption_key is not None:
            put(self.encryption_key_path, m.encryption_key_b64.encode() + b"\n", 0o600)
        put(self.tokens_path, _tokens_yaml(m.tokens), 0o600)
        if m.pod_cidrs or self.network_path.exists():
            put(self.network_path, NETWORK_HEADER + yaml.safe_dump({"podCIDRs": dict(sorted(m.pod_cidrs.items()))},
                                                                  sort_keys=True).encode(), 0o644)
        return written

    def _read_tokens(self) -> dict[str, BootstrapToken]:
        if (tk := self._read(self.tokens_path)) is None:
            return {}
        try:
            return {node: BootstrapToken(t["id"], t["secret"], dt.datetime.fromisoformat(t["expires"]))
                    for node, t in (yaml.safe_load(tk) or {}).items()}
        except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
            raise StateError(f"{self.tokens_path} is corrupt; move it away to have tokens re-issued") from None

    def drop_token(self, node: str) -> bool:
        """Forget ``node``'s bootstrap token (True when there was one): a node taken out joined
        with it, and a certificate issued to a request made with it marks it used for good
        (bootstrap.joined_workers), so `node add` must get a new one, not its old one back
        without a Secret."""
        tokens = self._read_tokens()
        if tokens.pop(node, None) is None:
            return False
        write_atomic(self.tokens_path, _tokens_yaml(tokens), 0o600)
        return True


def _tokens_yaml(tokens: dict[str, BootstrapToken]) -> bytes:
    return yaml.safe_dump({n: {"id": t.id, "secret": t.secret, "expires": t.expires.isoformat()}
                           for n, t in sorted(tokens.items())}, sort_keys=True).encode()


def state_for(inv: Inventory, state_dir: "str | Path | None") -> StateDir:
    """``--state DIR``, else the default next to the inventory (see default_state_dir)."""
    if state_dir:
        return StateDir(Path(state_dir))
    root = default_state_dir(inv)
    check_not_moved(inv, root)
    return StateDir(root)


def write_admin_kubeconfig(inv: Inventory, state: StateDir, material: Material) -> None:
    ca = material.pair("ca")
    write_atomic(state.admin_kubeconfig,
                 kubeconfig(inv.metadata.name, inv.api_url, issue.cert_pem(ca.cert), "kubernetes-admin",
                            client=material.pair("admin")), 0o600)
