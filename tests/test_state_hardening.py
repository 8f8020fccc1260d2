"""Issue 21: nobody but the user may have written the state directory, no secret passes through a
file someone can guess or that outlives the installer.

- the state directory and every directory above it (StrictModes): another user's, or writable
  by others, is refused with one message naming the directory, exit 2, nothing changed; a
  root-owned sticky parent (/tmp) is fine;
- inside it: a symbolic link, or another user's file, is refused naming it;
- ``write_atomic``: a link planted at a temporary name gets nothing;
- Helm and the API client: the admin credential never lands in TMPDIR, even when the installer
  is SIGKILLed while using it.

Root plays "another user" by chowning to uid 65534 (nobody); those tests need root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from installer import api
from installer.core.errors import StateError
from installer.core.pki import issue
from installer.core.safefs import write_atomic
from installer.core.state import StateDir

from .conftest import EXAMPLE, ROOT, write_inventory

INSTALLER = str(Path(sys.executable).parent / "installer")
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def tree(root: Path) -> dict[str, tuple]:
    """Everything under ``root`` (itself included): owner, mode, link target or bytes."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(p)
        what = (os.readlink(p) if stat.S_ISLNK(st.st_mode) else p.read_bytes() if stat.S_ISREG(st.st_mode)
                else None)
        out[str(p.relative_to(root))] = (st.st_uid, st.st_mode, what)
    return out


def chown_tree(root: Path, uid: int) -> None:
    for p in [root, *root.rglob("*")]:
        os.chown(p, uid, uid, follow_symlinks=False)


def installer(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([INSTALLER, *map(str, args)], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env)


def refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


@pytest.fixture
def site(doc, tmp_path):
    """An inventory in its own directory; its default state would be site/.hiddenplane/lab.
    Should a command get past the state, it could reach nothing: no known host key, no key, local
    artifacts only."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "known_hosts").write_text("")
    (d / "artifacts").mkdir()
    doc["spec"]["ssh"].update(keyPath=str(d / "no-such-key"), knownHosts=str(d / "known_hosts"))
    doc["spec"]["artifacts"] = {"source": "dir", "path": "artifacts"}
    return write_inventory(d, doc)


@pytest.fixture(scope="module")
def foreign_ca(tmp_path_factory) -> Path:
    """A real state made elsewhere: its CA is what an attacker plants (and so knows the key of)."""
    state = tmp_path_factory.mktemp("attacker") / "state"
    api.prepare(EXAMPLE, state)
    return state / "pki"


# --- the state directory and the directories above it ------------------------------------------

@as_root
def test_a_state_directory_made_by_another_user_with_a_planted_ca_is_refused(site, foreign_ca, tmp_path):
    root = site.parent / ".hiddenplane" / "lab"
    (root / "pki").mkdir(parents=True, mode=0o700)
    for n in ("ca.crt", "ca.key"):
        shutil.copy(foreign_ca / n, root / "pki" / n)
    chown_tree(site.parent / ".hiddenplane", NOBODY)
    before = tree(site.parent)
    out = tmp_path / "out"
    proc = installer("plan", site, "--render", out)
    # the first directory someone else could have changed is the one named
    refused(proc, f"state directory {root}: {root.parent} is owned by uid {NOBODY}, not you (uid 0)")
    assert not out.exists()                     # nothing rendered with the planted CA
    assert tree(site.parent) == before          # nothing changed
    os.chown(root.parent, 0, 0)                 # .hiddenplane ours again, lab/ still theirs
    proc = installer("plan", site, "--render", out)
    refused(proc, f"state directory {root} is owned by uid {NOBODY}, not you (uid 0)")
    assert not out.exists()


@as_root
@pytest.mark.parametrize("command", [
    ["apply", "{inv}"],
    ["kubeconfig", "{inv}", "-o", "{tmp}/admin.kubeconfig"],
    ["certs", "check", "{inv}", "--offline"],
    ["node", "list", "{inv}"],
    ["verify", "{inv}"],
])
def test_every_command_refuses_another_users_state(site, tmp_path, command):
    api.prepare(site)
    root = site.parent / ".hiddenplane" / "lab"
    os.chown(root, NOBODY, NOBODY)
    before = tree(root)
    proc = installer(*(a.format(inv=site, tmp=tmp_path) for a in command))
    refused(proc, f"state directory {root} is owned by uid {NOBODY}, not you (uid 0)")
    assert tree(root) == before
    assert not (tmp_path / "admin.kubeconfig").exists()


def test_a_group_writable_state_directory_is_refused_and_left_as_it_was(site, tmp_path):
    state = tmp_path / "state"
    api.prepare(site, state)
    state.chmod(0o775)
    before = tree(state)
    proc = installer("plan", site, "--render", tmp_path / "out", "--state", state)
    refused(proc, f"state directory {state} is group-writable (mode 0775)")
    assert tree(state) == before and stat.S_IMODE(state.stat().st_mode) == 0o775
    state.chmod(0o757)
    with pytest.raises(StateError, match=re.escape(f"state directory {state} is world-writable (mode 0757)")):
        api.prepare(site, state)
    state.chmod(0o755)                          # only readable by others: ours, tightened
    api.prepare(site, state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


@as_root
def test_a_parent_directory_owned_by_another_user_is_refused(site, tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    state = parent / "deeper" / "state"
    proc = installer("plan", site, "--render", tmp_path / "out", "--state", state)
    refused(proc, f"state directory {state}: {parent} is owned by uid {NOBODY}, not you (uid 0)")
    assert list(parent.iterdir()) == [] and not (tmp_path / "out").exists()     # nothing created


def test_a_writable_parent_is_refused_unless_root_owned_and_sticky(site, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                          # no sticky bit: anyone may rename our directory away
    with pytest.raises(StateError, match=re.escape(f": {shared} is group- and world-writable (mode 0777)")):
        api.prepare(site, shared / "state")
    assert list(shared.iterdir()) == []
    shared.chmod(0o770)
    if os.geteuid() == 0:
        os.chown(shared, 0, NOBODY)              # a group with others in it (not the owner's own)
    with pytest.raises(StateError, match=re.escape(f": {shared} is group-writable (mode 0770)")):
        api.prepare(site, shared / "state")
    if os.geteuid() != 0:
        return
    shared.chmod(0o1777)                         # like /tmp: root's, sticky
    api.prepare(site, shared / "me" / "state")
    for d in (shared / "me", shared / "me" / "state"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d      # made 0700
    # beneath the sticky directory, a per-user directory must be ours (or root's)
    other = shared / "other"
    other.mkdir(mode=0o755)
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(StateError, match=re.escape(f": {other} is owned by uid {NOBODY}, not you (uid 0)")):
        api.prepare(site, other / "state")
    assert list(other.iterdir()) == []


def test_a_group_writable_parent_of_the_owners_private_group_is_accepted(site, tmp_path):
    """Debian and Ubuntu give each user a group of their own; with umask 002 a checkout is
    group-writable by that group alone (as Debian's OpenSSH StrictModes accepts)."""
    import grp
    import pwd
    me = pwd.getpwuid(os.geteuid())
    group = grp.getgrgid(me.pw_gid)
    if group.gr_name != me.pw_name or set(group.gr_mem) - {me.pw_name}:
        pytest.skip(f"{me.pw_name}'s primary group {group.gr_name} is not a private one")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    checkout.chmod(0o775)
    os.chown(checkout, me.pw_uid, me.pw_gid)
    api.prepare(site, checkout / ".hiddenplane" / "lab")


@as_root
def test_under_sudo_the_invoking_users_checkout_is_accepted_and_nobody_elses(site, tmp_path):
    """`sudo installer …` in one's own checkout: the directories above the state may be the
    user's who ran sudo (SUDO_UID), who could run the command anyway; any other user's still not."""
    checkout = tmp_path / "checkout"
    checkout.mkdir(mode=0o755)
    os.chown(checkout, NOBODY, NOBODY)
    state = checkout / ".hiddenplane" / "lab"
    proc = installer("plan", site, "--render", tmp_path / "out", "--state", state,
                     env={**os.environ, "SUDO_UID": str(NOBODY)})
    assert proc.returncode == 0, proc.stderr
    assert state.stat().st_uid == 0 and stat.S_IMODE(state.stat().st_mode) == 0o700
    shutil.rmtree(checkout / ".hiddenplane")
    proc = installer("plan", site, "--render", tmp_path / "out2", "--state", state,
                     env={**os.environ, "SUDO_UID": str(NOBODY - 1)})
    refused(proc, f"{checkout} is owned by uid {NOBODY}, not you (uid 0)")


def test_a_link_on_the_path_is_judged_by_its_target(site, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    api.prepare(site, link / "state")           # our own link to our own directory: fine
    assert (real / "state" / "pki" / "ca.key").is_file()
    real.chmod(0o777)
    with pytest.raises(StateError,
                       match=re.escape(f"state directory {link / 'state'}: {real} is group- and world-writable")):
        api.prepare(site, link / "state")


# --- inside the state --------------------------------------------------------------------------

@pytest.fixture
def made(site, tmp_path):
    state = tmp_path / "state"
    api.prepare(site, state)
    return site, state


def test_a_symlinked_ca_key_is_refused_naming_it(made, foreign_ca, tmp_path):
    site, state = made
    theirs = tmp_path / "theirs.key"
    shutil.copy(foreign_ca / "ca.key", theirs)
    key = state / "pki" / "ca.key"
    key.unlink()
    key.symlink_to(theirs)
    before, their_bytes = tree(state), theirs.read_bytes()
    proc = installer("plan", site, "--render", tmp_path / "out", "--state", state)
    refused(proc, f"{key} is a symbolic link")
    assert not (tmp_path / "out").exists() and tree(state) == before and theirs.read_bytes() == their_bytes
    # the reading itself never follows a link either (O_NOFOLLOW), whatever came before it
    with pytest.raises(StateError, match=re.escape(f"{key} is a symbolic link")):
        StateDir(state)._read(key)


def test_a_symlinked_state_subdirectory_is_refused_naming_it(made, tmp_path):
    site, state = made
    elsewhere = tmp_path / "elsewhere"
    shutil.move(state / "pki" / "etcd", elsewhere)
    (state / "pki" / "etcd").symlink_to(elsewhere)
    with pytest.raises(StateError, match=re.escape(f"{state / 'pki' / 'etcd'} is a symbolic link")):
        api.prepare(site, state)


@as_root
def test_a_file_owned_by_another_user_inside_the_state_is_refused(made, tmp_path):
    site, state = made
    crt = state / "pki" / "ca.crt"
    os.chown(crt, NOBODY, NOBODY)
    proc = installer("plan", site, "--render", tmp_path / "out", "--state", state)
    refused(proc, f"{crt} is owned by uid {NOBODY}, not you (uid 0)")
    with pytest.raises(StateError, match=re.escape(f"{crt} is owned by uid {NOBODY}")):
        StateDir(state)._read(crt)


def test_a_world_writable_file_inside_the_state_is_refused(made):
    site, state = made
    key = state / "secrets" / "tokens.yaml"
    key.chmod(0o666)
    with pytest.raises(StateError, match=re.escape(f"{key} is group- and world-writable (mode 0666)")):
        api.prepare(site, state)


# --- write_atomic ------------------------------------------------------------------------------

def test_a_link_planted_at_a_temporary_name_gets_nothing(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    target = d / "admin.conf"
    # every name a writer might predict: the old one (.<name>.tmp-<pid>) and its kin
    for name in (f".admin.conf.tmp-{os.getpid()}", ".admin.conf.tmp", "admin.conf.tmp", ".admin.conf.swp"):
        (d / name).symlink_to(victim)
    secret = b"client-key-data: c2VjcmV0\n"
    assert write_atomic(target, secret, 0o600)
    assert victim.read_bytes() == b""
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and target.read_bytes() == secret
    assert sorted(p.name for p in d.iterdir() if not p.is_symlink()) == ["admin.conf"]      # no temp left


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"same\n")
    victim.chmod(0o600)
    target = tmp_path / "admin.conf"
    target.symlink_to(victim)
    assert write_atomic(target, b"same\n", 0o600)       # a link never counts as already written
    assert not target.is_symlink() and target.read_bytes() == b"same\n" and victim.read_bytes() == b"same\n"
    assert not write_atomic(target, b"same\n", 0o600)   # now it does


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    d = tmp_path / "d"
    (d / "admin.conf").mkdir(parents=True)            # os.replace onto a directory fails
    with pytest.raises(IsADirectoryError):
        write_atomic(d / "admin.conf", b"secret\n", 0o600)
    assert [p.name for p in d.iterdir()] == ["admin.conf"]


# --- no admin credential left in TMPDIR, even after SIGKILL -----------------------------------

FAKE_HELM = r"""#!/bin/sh
# records what it was given while the installer waits on it, then waits to be killed; no
# release is installed yet
rec="$HELM_RECORD"
if [ "$1" = history ]; then echo "Error: release: not found" >&2; exit 1; fi
prev=""
for a in "$@"; do
  if [ "$prev" = "--kubeconfig" ]; then printf '%s' "$a" > "$rec/path"; cat "$a" > "$rec/kubeconfig"; fi
  prev="$a"
done
echo $$ > "$rec/pid"
touch "$rec/ready"
exec sleep 60
"""

RUN_HELM = """
import sys
from pathlib import Path
from installer import api
from installer.engine.phases.apply_addons import run_helm
p = api.prepare(sys.argv[1], sys.argv[2])
run_helm(p.inventory, p.material, "https://127.0.0.1:6443", sys.argv[3], Path(sys.argv[4]), "0" * 64)
"""


def secrets_of(state: Path) -> list[bytes]:
    """The admin key and certificate as PEM, and as the base64 a kubeconfig holds."""
    import base64
    m = StateDir(state).load(api.validate(EXAMPLE))
    pems = [issue.key_pem(m.pair("admin").key), issue.cert_pem(m.pair("admin").cert)]
    return pems + [base64.b64encode(p) for p in pems] + [p.splitlines()[1] for p in pems]


def leaked(tmpdir: Path, needles: list[bytes]) -> list[str]:
    found = []
    for p in tmpdir.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            found += [str(p) for n in needles if n in data]
    return found


def test_sigkill_during_helm_leaves_no_admin_credential_in_tmpdir(tmp_path):
    bindir, rec, tmpdir, state = tmp_path / "bin", tmp_path / "rec", tmp_path / "tmpdir", tmp_path / "state"
    for d in (bindir, rec, tmpdir):
        d.mkdir()
    helm = bindir / "helm"
    helm.write_text(FAKE_HELM)
    helm.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(tmpdir), "HELM_RECORD": str(rec), "PATH": f"{bindir}:/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", RUN_HELM, str(EXAMPLE), str(state), str(helm),
                              str(tmp_path / "cilium-1.0.0.tgz")], env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (rec / "ready").exists():
            assert child.poll() is None, "the installer ended before helm ran"
            assert time.monotonic() < deadline, "helm never ran"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if (rec / "pid").exists():
            try:
                os.kill(int((rec / "pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    needles = secrets_of(state)
    assert leaked(tmpdir, needles) == []
    assert list(tmpdir.iterdir()) == []
    # while it ran, helm read a whole admin kubeconfig from the path it was given
    assert re.fullmatch(r"/proc/self/fd/\d+", (rec / "path").read_text())
    kc = yaml.safe_load((rec / "kubeconfig").read_text())
    assert kc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    user = kc["users"][0]["user"]
    assert needles[2] == user["client-key-data"].encode() and needles[3] == user["client-certificate-data"].encode()


KILLED_LOADING_KEY = """
import os, signal, ssl, sys
from installer import api
from installer.host import kube
p = api.prepare(sys.argv[1], sys.argv[2])
real = ssl.SSLContext.load_cert_chain
def die(self, *args, **kw):
    real(self, *args, **kw)
    os.kill(os.getpid(), signal.SIGKILL)      # the worst moment: the key just loaded from its path
ssl.SSLContext.load_cert_chain = die
kube.api_client("https://127.0.0.1:6443", p.material)
"""


def test_sigkill_while_the_api_client_loads_its_key_leaves_nothing_in_tmpdir(tmp_path):
    tmpdir, state = tmp_path / "tmpdir", tmp_path / "state"
    tmpdir.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILLED_LOADING_KEY, str(EXAMPLE), str(state)], cwd=ROOT,
                          env={**os.environ, "TMPDIR": str(tmpdir)}, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert leaked(tmpdir, secrets_of(state)) == [] and list(tmpdir.iterdir()) == []


# --- the inventory and the hosting kubeconfig: the operator's word, read as it is ------------------

@as_root
@pytest.mark.parametrize("attack, needle", [
    (lambda inv: os.chmod(inv, 0o646), "is world-writable (mode 0646)"),
    (lambda inv: os.chown(inv, NOBODY, NOBODY), f"is owned by uid {NOBODY}, not you"),
    (lambda inv: os.chmod(inv.parent, 0o777), "is group- and world-writable (mode 0777)"),
    (lambda inv: os.chown(inv.parent, NOBODY, NOBODY), f"is owned by uid {NOBODY}, not you"),
])
def test_an_inventory_someone_else_could_have_written_is_refused(site, attack, needle):
    """An inventory is what the installer does to the hosts: one another user owns, or could
    change through its directory, is refused naming it (exit 2), before any host or state."""
    attack(site)
    for args in (("validate", site), ("plan", site)):
        refused(installer(*args), str(site), needle, "whoever can change it")


@as_root
def test_an_inventory_reached_through_a_link_in_a_writable_directory_is_refused(site, tmp_path):
    """A link is only as safe as the directory holding it: through a world-writable one, anyone
    could point it at another inventory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "cluster.yaml").symlink_to(site)
    refused(installer("validate", shared / "cluster.yaml"), "shared is group- and world-writable (mode 0777)")
    # and a link in a safe directory to a safe file is fine
    (site.parent / "link.yaml").symlink_to(site.name)
    assert installer("validate", site.parent / "link.yaml").returncode == 0


@as_root
def test_a_hosting_kubeconfig_someone_else_could_have_written_is_refused(tmp_path):
    """The hosting kubeconfig says which cluster gets a tenant's keys, with whose credentials."""
    import copy

    from installer.core import inventory as inventory_mod
    from installer.host import hosting

    from .test_hosted import TENANT, _kubeconfig
    _kubeconfig(tmp_path, {}, {"token": "t"})
    inv = inventory_mod.parse(copy.deepcopy(TENANT), base_dir=tmp_path)
    hosting.hosting_client(inv)                                   # as it is: read
    os.chmod(tmp_path / "hosting.kubeconfig", 0o646)
    with pytest.raises(hosting.HostingError, match="it is world-writable .*point the installer at another cluster"):
        hosting.hosting_client(inv)
