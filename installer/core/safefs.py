"""Files and directories of the operator's state, written so that a writer of the directory
cannot redirect them: atomic writes through an exclusive temporary file, and paths walked one
component at a time with their owners and modes checked (core/state.py uses both)."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path

from installer.core.errors import StateError


def write_atomic(path: Path, data: bytes, mode: int) -> bool:
    """Write ``data`` to ``path`` with ``mode``; return False (and touch nothing) if unchanged.

    The temporary file has a random name created exclusively (``mkstemp``: O_EXCL, never
    following a link), so nothing planted beside ``path`` receives the bytes; it is removed on
    any error. A symbolic link at ``path`` is never taken as holding ``data`` (its target is
    not read): it is replaced by the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP):
            raise
    else:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode and f.read() == data:
                return False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")     # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


# -- who may have written the state (StrictModes) --

def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s own group and nobody else's (Debian and Ubuntu give every user
    one, and a umask of 002 then makes checkouts group-writable): writable by that group is
    writable by that user alone. Debian's OpenSSH StrictModes accepts the same."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return group.gr_name == user.pw_name and user.pw_gid == gid and set(group.gr_mem) <= {user.pw_name}


def mode_problem(mode: int, st: os.stat_result | None = None) -> str | None:
    writable = [w for bit, w in ((0o020, "group"), (0o002, "world")) if mode & bit]
    if writable == ["group"] and st is not None and _private_group(st.st_gid, st.st_uid):
        return None
    return f"{'- and '.join(writable)}-writable (mode {mode:04o})" if writable else None


def _trusted_owners(euid: int) -> set[int]:
    """Who may own a directory above the state: the user, root, and under sudo the user who ran
    sudo (``sudo installer …`` in one's own checkout; that user could run the command anyway)."""
    owners = {euid, 0}
    sudo_uid = os.environ.get("SUDO_UID", "")
    if euid == 0 and sudo_uid.isdigit():
        owners.add(int(sudo_uid))
    return owners


def _dir_problem(st: os.stat_result, euid: int, parent: bool) -> str | None:
    """Why a directory on the state's path is unsafe, None when it is not. The state directory
    itself (``parent`` False) must be the user's; a directory above it may be root's (or, under
    sudo, the invoking user's) too, and a root-owned one writable by others only when sticky
    (/tmp: nobody may then rename or delete another's entry, so the user's own directory beneath
    it stays the user's)."""
    if st.st_uid != euid and not (parent and st.st_uid in _trusted_owners(euid)):
        return f"owned by uid {st.st_uid}, not you (uid {euid})" + (" or root" if parent and euid else "")
    mode = stat.S_IMODE(st.st_mode)
    if parent and st.st_uid == 0 and mode & stat.S_ISVTX:
        return None
    # the state directory itself is made 0700: any other mode there was set by someone
    return mode_problem(mode, st if parent else None)


_MAX_LINKS = 40          # the kernel's own limit (ELOOP)


def secure_path(root: Path, create: bool) -> Path | None:
    """Check every directory from / down to ``root``, following symbolic links component by
    component (a link is only as trustworthy as the directory holding it, which is checked
    first, and its target is then checked in turn); with ``create``, make the missing ones 0700
    once the existing ones passed. Returns the real path of ``root``; None when it does not
    exist (and not ``create``). StateError naming the first unsafe directory, before anything
    was created."""
    euid = os.geteuid()
    given = Path(root).absolute()
    parts = list(given.parts[1:])
    cur = Path("/")
    links = 0

    def unsafe(where: Path, why: str) -> StateError:
        what = f"state directory {root}" + ("" if where == given else f": {where}")
        return StateError(f"{what} is {why}; whoever can change it can plant or read the cluster's keys: "
                          "fix that (and check nothing was planted in it) or use another --state")

    def check(where: Path, st: os.stat_result, last: bool) -> None:
        if not stat.S_ISDIR(st.st_mode):
            raise StateError(f"state directory {root}: {where} is not a directory")
        if (why := _dir_problem(st, euid, parent=not last)) is not None:
            raise unsafe(where, why)

    check(cur, os.lstat(cur), last=not parts)
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            cur = cur.parent
            continue
        nxt = cur / part
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(nxt, 0o700)
                os.chmod(nxt, 0o700)         # the umask may have taken bits we need
            except FileExistsError:
                pass                         # made meanwhile (by us: only we can write here)
            except OSError as e:
                raise StateError(f"state directory {root}: cannot create {nxt}: {e.strerror}") from None
            parts.insert(0, part)            # check what is there now
            continue
        except OSError as e:
            raise StateError(f"state directory {root}: {nxt}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise StateError(f"state directory {root}: too many levels of symbolic links")
            target = Path(os.readlink(nxt))
            if target.is_absolute():
                cur = Path("/")
                check(cur, os.lstat(cur), last=False)
            parts[:0] = [p for p in target.parts if p != "/"]
            continue
        check(nxt, st, last=not [p for p in parts if p not in ("", ".")])
        cur = nxt
    check(cur, os.lstat(cur), last=True)      # a path ending in ".." ends on a directory checked as a parent
    return cur


def input_file_problem(path: Path) -> str | None:
    """Why a file the installer reads as the operator's word (the inventory, the hosting
    kubeconfig) could have been written by someone else, or None: the file and every directory
    above it, as named and as resolved (a link is only as safe as the directory holding it), must
    be the user's or root's (under sudo also the invoking user's) and writable by nobody else (a
    sticky root directory such as /tmp excepted for the directories). Missing: None (the caller
    reports that). The same owners and modes as the state directory's parents."""
    euid = os.geteuid()
    given = Path(path).absolute()
    try:
        real = Path(os.path.realpath(given))
        st = os.stat(real)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid not in _trusted_owners(euid):
        return f"it is owned by uid {st.st_uid}, not you (uid {euid})" + (" or root" if euid else "")
    if (why := mode_problem(stat.S_IMODE(st.st_mode), st)) is not None:
        return f"it is {why}"
    for d in dict.fromkeys([*given.parents, *real.parents]):
        try:
            dst = os.lstat(d) if d in real.parents else os.stat(d)
        except OSError:
            continue
        if (why := _dir_problem(dst, euid, parent=True)) is not None:
            return f"its directory {d} is {why}"
    return None
