"""etcd day 2 of a control plane on control hosts (planes/systemd.py), over SSH: list members,
save a snapshot, restore one on every member.

Everything that talks to etcd runs ``etcdctl`` (API v3) on the control hosts with the
health-check client certificate; nothing listens beyond what apply set up. A snapshot is taken
with ``etcdctl snapshot save`` into a 0600 file under /var/lib/hiddenplane, checked with
``etcdutl snapshot status`` (its integrity hash), copied to the operator machine (written 0600,
atomically) and removed from the host. etcd 3.6 took ``snapshot status`` and ``snapshot
restore`` out of etcdctl: both work on files, not on a member, so they are etcdutl's.

A restore follows etcd's documented order: stop every apiserver (and the controller-manager
and scheduler) first, stop etcd on every member, restore the *same* snapshot on every member
with a new cluster token, start etcd everywhere, wait for health, then start the control plane.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from installer.core.components import CONTROL_UNITS, ETCD_UNIT, LOCAL_CONTROL_PORTS
from installer.core.etcd_rules import RESTORE_FLAGS, EtcdOpError, Member, parse_members
from installer.core.inventory import HostSpec, Inventory
from installer.core.render.control import ETCD_DATA_DIR, ETCD_RESTORE_ASIDE, etcd_servers, initial_cluster, peer_url
from installer.core.safefs import write_atomic
from installer.engine.steps import Step, plan, run_steps
from installer.host.etcdctl import LOCAL, endpoint_health_script, error_line, etcdctl
from installer.host.fetch import binary_path
from installer.host.ssh import HostError, Remote
from installer.host.waits import listening_script

WORK_DIR = "/var/lib/hiddenplane"
ETCDUTL = binary_path("etcdutl")


def day2_etcdctl(endpoints: str) -> str:
    """etcdctl for a day-2 command (10 s per command)."""
    return etcdctl(endpoints, "10s")


def control_remotes(run) -> dict[str, Remote]:
    """A Remote per control host (connected on first use) of the command's run (closed with it;
    a Remote added to the dict meanwhile is the run's too)."""
    run.session.connect(run.inv.controls)
    return run.session.remotes


def _first_reachable(inv: Inventory, remotes: dict[str, Remote]) -> Remote:
    errors = []
    for h in inv.controls:
        try:
            remotes[h.name].open()
            return remotes[h.name]
        except HostError as e:
            errors.append(str(e))
    raise EtcdOpError("no control host is reachable: " + "; ".join(errors))


# --- members -----------------------------------------------------------------------------

def members(run) -> list[Member]:
    inv = run.inv
    r = _first_reachable(inv, control_remotes(run))
    out = r.run(f"{day2_etcdctl(etcd_servers(inv))} member list -w json", what="etcdctl member list").stdout
    return parse_members(out, r.name)


def etcdctl_local(run, host: str, args: list[str], what: str, timeout: float) -> str:
    """etcdctl ``args`` on ``host`` against its own member only."""
    r = control_remotes(run)[host].run(f"{etcdctl(LOCAL, f'{int(timeout)}s')} {shlex.join(args)}", check=False,
                                       what=what)
    if r.rc != 0:
        raise EtcdOpError(f"{host}: {what} failed: {error_line(r)}")
    return r.stdout


# --- snapshot save -------------------------------------------------------------------------

@dataclass
class SnapshotInfo:
    path: str
    host: str
    hash: int
    revision: int
    total_keys: int
    size: int


def snapshot_dest(dest, force: bool) -> Path:
    """Where a snapshot goes, checked before any member is asked: a refused save changes nothing
    anywhere."""
    dest = Path(dest)
    if not force and (dest.exists() or dest.is_symlink()):
        raise EtcdOpError(f"{dest} already exists: not overwriting it (pass --force to replace it)")
    if dest.is_dir():
        raise EtcdOpError(f"{dest} is a directory")
    return dest


def saved_snapshot(where: str, out: str, data: bytes, dest: Path) -> SnapshotInfo:
    """``out``: the save's two JSON lines (the member's status before it, the file's status);
    ``data``: the file read from ``where``, written to ``dest`` 0600, atomically."""
    lines = [x for x in out.splitlines() if x.strip()]
    try:
        member, st = json.loads(lines[0]), json.loads(lines[-1])
    except (ValueError, IndexError):
        raise EtcdOpError(f"{where}: etcdctl endpoint status / etcdutl snapshot status printed no JSON: "
                          f"{out[:200]}") from None
    if not data:
        raise EtcdOpError(f"{where}: the snapshot is empty")
    write_atomic(dest, data, 0o600)
    return snapshot_info(st, str(dest), where, len(data), member_revision(member))


def snapshot_save(run, dest, force: bool = False) -> SnapshotInfo:
    dest = snapshot_dest(dest, force)
    r = _first_reachable(run.inv, control_remotes(run))
    tmp = f"{WORK_DIR}/etcd-snapshot-{int(time.time())}-{os.getpid()}.db"
    q = shlex.quote(tmp)
    try:
        # etcdctl writes FILE.part, then renames; umask 077 keeps both 0600. The output is
        # two JSON lines: the member's status just before the save, then the file's status.
        out = r.run(f"set -e; mkdir -p {WORK_DIR}; chmod 0700 {WORK_DIR}; umask 077; "
                    f"{day2_etcdctl(LOCAL)} endpoint status -w json; echo; "
                    f"{day2_etcdctl(LOCAL)} snapshot save {q} >/dev/null; chmod 0600 {q}; "
                    f"{shlex.join(snapshot_status_argv(tmp))}",
                    what="etcdctl snapshot save, etcdutl snapshot status", timeout=300).stdout
        data = r.get(tmp, what="copy the snapshot")
    finally:
        r.run(f"rm -f -- {q} {q}.part", check=False, what="remove the host's snapshot file")
    return saved_snapshot(r.name, out, data, dest)


def member_revision(endpoint_status) -> int:
    """The store revision in ``etcdctl endpoint status -w json`` (0 when it names none)."""
    try:
        return int(endpoint_status[0]["Status"]["header"]["revision"])
    except (LookupError, TypeError, ValueError):
        return 0


def snapshot_status_argv(snapshot: str) -> list[str]:
    """Checks ``snapshot``'s integrity hash; prints hash, revision, totalKey, totalSize and
    version as JSON."""
    return [ETCDUTL, "snapshot", "status", snapshot, "-w", "json"]


def snapshot_info(status: dict, path: str, host: str, size: int, revision_before: int = 0) -> SnapshotInfo:
    """``status``: the JSON of snapshot_status_argv; ``revision_before``: the member's store
    revision read just before the save. etcdutl takes the revision from the newest entry of the
    file's key bucket, so a store no key was ever written to says 0, while etcd's revision
    starts at 1 (every etcdctl answer's header says so). Revisions only grow: the snapshot's
    is at least the one read before it."""
    return SnapshotInfo(path, host, int(status.get("hash", 0)),
                        max(int(status.get("revision", 0)), revision_before),
                        int(status.get("totalKey", 0)), size)


# --- snapshot restore ----------------------------------------------------------------------

def restore_plan(inv: Inventory, snapshot: str, stamp: str) -> list[str]:
    """The restore's steps in words (nothing is read or reached)."""
    return plan(_restore_steps(inv, str(snapshot), b"", stamp, {}, 0))


def restore_token(inv: Inventory, stamp: str) -> str:
    return f"{inv.metadata.name}-etcd-restore-{stamp}"


def snapshot_restore_argv(inv: Inventory, host: HostSpec, snapshot: str, stamp: str) -> list[str]:
    """Writes ``host``'s member of a new cluster (every control host, a new token) from
    ``snapshot`` into the etcd data dir, which must not exist, its revision raised past every
    client's (``RESTORE_FLAGS``). Flags as ``--flag=value``, as in the etcd unit."""
    return [ETCDUTL, "snapshot", "restore", snapshot,
            f"--name={host.name}",
            f"--initial-cluster={initial_cluster(inv.controls)}",
            f"--initial-cluster-token={restore_token(inv, stamp)}",
            f"--initial-advertise-peer-urls={peer_url(host.address)}",
            f"--data-dir={ETCD_DATA_DIR}", *RESTORE_FLAGS]


def _restore_script(inv: Inventory, host: HostSpec, snap: str, stamp: str) -> str:
    data, aside = ETCD_DATA_DIR, f"{ETCD_RESTORE_ASIDE}{stamp}"
    return (
        "set -e\n"
        f"if [ -e {data} ]; then mv -- {data} {aside}; fi\n"
        f"{shlex.join(snapshot_restore_argv(inv, host, snap, stamp))}\n"
        f"chown -R etcd:etcd {data}\n"
        f"chmod 0700 {data}\n")


def snapshot_restore(run, snapshot, wait_timeout: float = 120) -> list[str]:
    """Restore ``snapshot`` on every member (the run holds the apply lock). Returns the hosts
    restored."""
    return _snapshot_restore(run, snapshot, wait_timeout, run.log)


def _restore_steps(inv: Inventory, snapshot: str, data: bytes, stamp: str, remotes: dict[str, Remote],
                   wait_timeout: float) -> list[Step[None]]:
    names = [h.name for h in inv.controls]
    hosts = ", ".join(names)
    remote_snap = f"{WORK_DIR}/etcd-restore-{stamp}.db"
    units = " ".join(CONTROL_UNITS)

    def on_each(command: str, what: str, **kw) -> Callable[[None], None]:
        def run(_) -> None:
            for n in names:
                remotes[n].run(command, what=what, **kw)
        return run

    def upload(_) -> None:
        for n in names:
            remotes[n].put(remote_snap, data, mode=0o600, what="upload the snapshot")

    def restore(_) -> None:
        for h in inv.controls:
            remotes[h.name].run(_restore_script(inv, h, remote_snap, stamp), what="etcdutl snapshot restore",
                                timeout=300)

    def start_etcd(_) -> None:
        # a member waits for its peers before it reports ready: never block on one
        on_each(f"systemctl start --no-block {ETCD_UNIT}", "start etcd")(None)
        r = remotes[names[0]].run(endpoint_health_script(etcd_servers(inv), wait_timeout), check=False,
                                  what="wait for etcd health", timeout=wait_timeout + 30)
        if r.rc != 0:
            raise EtcdOpError(f"{names[0]}: etcd did not become healthy after the restore "
                              f"(the old data is in {ETCD_RESTORE_ASIDE}{stamp}): {r.stderr.strip()[-500:]}")

    def start_control_plane(_) -> None:
        on_each(f"systemctl start {units}", "start the control plane")(None)
        # the units are simple services: wait until the apiserver, controller-manager and
        # scheduler listen again (the apiserver only does once it reaches etcd)
        ports = (inv.spec.apiServer.port, *LOCAL_CONTROL_PORTS)
        for n in names:
            r = remotes[n].run(listening_script(ports, wait_timeout), check=False,
                               what="wait for the control plane", timeout=wait_timeout + 30)
            if r.rc != 0:
                raise EtcdOpError(f"{n}: the control plane did not come back after the restore: "
                                  f"{r.stderr.strip()[-600:]}")
        on_each(f"rm -f -- {shlex.quote(remote_snap)}", "remove the snapshot copy", check=False)(None)

    # first every apiserver (nothing may write to etcd while it is replaced), then every member.
    # The same snapshot on every member, with a new cluster token. The unit still says
    # --initial-cluster-token=<cluster>-etcd: that flag (like --initial-cluster-state) only
    # matters when bootstrapping an empty data dir; a restored data dir carries its own
    # membership and token, so the unit needs no change.
    return [
        Step(f"upload {snapshot} to {WORK_DIR}/ on {hosts} (0600)", upload),
        Step(f"stop {', '.join(u.removesuffix('.service') for u in CONTROL_UNITS)} on {hosts}",
             on_each(f"systemctl stop {units}", "stop the control plane")),
        Step(f"stop etcd on {hosts}", on_each(f"systemctl stop {ETCD_UNIT}", "stop etcd")),
        Step(f"on each member: move {ETCD_DATA_DIR} to {ETCD_RESTORE_ASIDE}{stamp}, "
             f"restore the snapshot into {ETCD_DATA_DIR} with cluster token {restore_token(inv, stamp)}", restore),
        Step("start etcd on every member, wait for a healthy cluster", start_etcd),
        Step("start the control plane again, wait until it listens; remove the snapshot copies", start_control_plane),
    ]


def read_snapshot(snapshot) -> tuple[bytes, str]:
    """The snapshot file's bytes, read before anything is stopped (an unreadable or empty file
    changes nothing), and the restore's stamp (its cluster token, the old data's name)."""
    try:
        data = Path(snapshot).read_bytes()
    except OSError as e:
        raise EtcdOpError(f"cannot read {snapshot}: {e.strerror or e}") from None
    if not data:
        raise EtcdOpError(f"{snapshot} is empty")
    return data, time.strftime("%Y%m%d%H%M%S", time.gmtime())


def _snapshot_restore(run, snapshot, wait_timeout: float, log: Callable[[str], None]) -> list[str]:
    inv = run.inv
    data, stamp = read_snapshot(snapshot)
    names = [h.name for h in inv.controls]
    remotes = control_remotes(run)
    for n in names:                     # every host must be reachable before we stop anything
        remotes[n].open()
    run_steps("etcd snapshot restore", _restore_steps(inv, str(snapshot), data, stamp, remotes, wait_timeout),
              None, log)
    return names
