"""The mark every process of a locked run carries on the hosts (``HIDDENPLANE_RUN=<scope>-<n>`` in
its environment), and ending a dead run's processes by it. A command is marked with ``env``,
not an export inside the script: /proc/PID/environ shows what a process was started with, and
the shell running a wait loop must carry the mark too. An environment variable costs nothing
per command (a systemd scope per command cost 24 ms on an nspawn host, 0.4-1 s on an emulated VM)."""

from __future__ import annotations

import itertools
import re
import shlex

# a unit name systemd accepts, without the escaping backslash
_UNIT_PREFIX = re.compile(r"[A-Za-z0-9:_.-]{1,200}")
# one counter for the process: two Remotes to one host with one scope never pick the same unit
_scope_counter = itertools.count(1)


RUN_MARK = "HIDDENPLANE_RUN"

def check_unit_prefix(value: str, what: str = "scope") -> str:
    if not isinstance(value, str) or not _UNIT_PREFIX.fullmatch(value):
        raise ValueError(f"{what}: {value!r:.80} is not a systemd unit name prefix "
                         "(letters, digits, ':', '_', '.', '-'; at most 200)")
    return value


def shell_command(script: str, scope: str | None = None, scoped: bool = True) -> str:
    """``sh -c SCRIPT``, marked with ``scope`` (a Remote's: its session's once the run holds
    a lock) when ``scoped``."""
    if scope is None or not scoped:
        return f"sh -c {shlex.quote(script)}"
    mark = f"{check_unit_prefix(scope)}-{next(_scope_counter)}"
    return f"env {RUN_MARK}={mark} sh -c {shlex.quote(script)}"


# PATTERN: a grep -z pattern of the marks; $$ (this script) is never one of them
_STOP_MARKED = r"""
marked() {
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    m=$(grep -az -m1 -e PATTERN "$e" 2>/dev/null | tr -d '\000') || continue
    [ -n "$m" ] && printf '%s %s\n' "$p" "${m#*=}"
  done
}
found=$(marked)
[ -n "$found" ] || exit 0
printf '%s\n' "$found" | while read -r p m; do kill -9 "$p" 2>/dev/null; done
i=0
while [ $i -lt 50 ] && [ -n "$(marked)" ]; do sleep 0.1; i=$((i + 1)); done
left=$(marked)
if [ -n "$left" ]; then echo "still running: $left" >&2; exit 1; fi
printf '%s\n' "$found" | awk '{ print $2 }' | sort -u
"""


def stop_scopes(remote, prefix: str) -> list[str]:
    """End every process that commands run with ``scope=prefix`` left on ``remote`` (SIGKILL:
    their run is gone), found by the mark they inherited, in one round trip. The marks of the
    commands ended (``<prefix>-<n>``); a process still alive afterwards is a HostError."""
    pattern = shlex.quote(f"^{RUN_MARK}={check_unit_prefix(prefix, 'stop_scopes prefix')}-[0-9]*$")
    r = remote.run(_STOP_MARKED.replace("PATTERN", pattern), what=f"end the commands of {prefix}",
                   scoped=False)
    return r.stdout.split()
