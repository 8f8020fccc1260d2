"""Pure comparison of what a host must hold with what its facts say it holds.

The result is the smallest set of actions: files whose content differs are written (backed
up first when the installer did not write the current content), files that only have the
wrong mode or owner are fixed in place, missing users and directories are created, units
are started when not running and restarted only when one of their inputs changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from installer.core import components
from installer.core.facts import HostFacts
from installer.core.render.files import HostDir, HostFile, SystemUser


@dataclass(frozen=True)
class Selection:
    """The part of a host plan one phase is responsible for."""

    files: tuple[HostFile, ...] = ()
    dirs: tuple[HostDir, ...] = ()
    users: tuple[SystemUser, ...] = ()
    units: tuple[str, ...] = ()          # in start order
    absent: tuple[str, ...] = ()         # paths to remove


@dataclass
class HostChanges:
    host: str
    write: list[HostFile] = field(default_factory=list)
    backup: set[str] = field(default_factory=set)
    fix: list[HostFile] = field(default_factory=list)       # mode/owner only
    remove: list[str] = field(default_factory=list)
    defer: list[str] = field(default_factory=list)          # restarts a later phase owns
    dirs: list[HostDir] = field(default_factory=list)
    users: list[SystemUser] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)
    enable: list[str] = field(default_factory=list)

    @property
    def daemon_reload(self) -> bool:
        return any(f.path.startswith("/etc/systemd/system/") for f in self.write)

    @property
    def empty(self) -> bool:
        return not (self.write or self.fix or self.remove or self.dirs or self.users or self.restart
                    or self.start or self.enable)

    @property
    def upload_bytes(self) -> int:
        return sum(f.size for f in self.write)

    def summary(self) -> list[str]:
        """Human lines; secret files are named but their content never appears."""
        out = [f"+ user {u.name}" for u in self.users]
        out += [f"+ dir {d.path} {d.mode:04o} {d.owner}:{d.group}" for d in self.dirs]
        for f in self.write:
            tag = " (secret)" if f.secret else ""
            note = " (backing up a file the installer did not write)" if f.path in self.backup else ""
            out.append(f"~ {f.path} {f.mode:04o} {f.owner}:{f.group} sha256:{f.sha256[:12]}{tag}{note}")
        out += [f"~ {f.path}: mode/owner -> {f.mode:04o} {f.owner}:{f.group}" for f in self.fix]
        out += [f"- {p}" for p in self.remove]
        out += [f"* enable {u}" for u in self.enable]
        out += [f"* start {u}" for u in self.start]
        out += [f"* {'reload' if components.reloads(u) else 'restart'} {u}" for u in self.restart]
        return out


def diff(host: str, sel: Selection, facts: HostFacts) -> HostChanges:
    ch = HostChanges(host)
    ch.users = [u for u in sel.users if u.name not in facts.users]
    for d in sel.dirs:
        have = facts.dirs.get(d.path)
        if have is None or (have.mode, have.owner, have.group) != (d.mode, d.owner, d.group):
            ch.dirs.append(d)
    # restarts an interrupted run recorded but never did
    touched: set[str] = set(facts.pending_restarts & set(sel.units))
    for f in sel.files:
        have = facts.files.get(f.path)
        if have is None or have.sha256 != f.sha256:
            ch.write.append(f)
            if have is not None and not have.ours:
                ch.backup.add(f.path)
            touched.update(f.restarts)
        elif (have.mode, have.owner, have.group) != (f.mode, f.owner, f.group):
            ch.fix.append(f)
    ch.remove = [p for p in sel.absent if p in facts.files]
    # a changed input of a unit another phase starts (the apiserver reads the etcd CA):
    # recorded on the host, so that phase restarts it even if this run stops before it
    ch.defer = sorted(touched - set(sel.units))
    for unit in sel.units:
        active, enabled = facts.units.get(unit, ("inactive", ""))
        if enabled != "enabled":
            ch.enable.append(unit)
        if active in ("inactive", "failed", "", "unknown"):
            ch.start.append(unit)        # starting reads the new inputs anyway
        elif unit in touched:
            ch.restart.append(unit)      # also when still "activating": it may hold old inputs
    return ch
