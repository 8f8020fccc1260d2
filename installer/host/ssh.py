"""The one module that talks SSH (Fabric over paramiko).

Host keys are verified against the inventory's known_hosts: an unknown or changed key is an
error naming the host, unless the operator explicitly accepts new keys (``accept_new``), which
records them (a changed key is refused even then). With ``spec.ssh.bastion`` every connection
goes through that jump host (a Fabric gateway: an SSH direct-tcpip channel), whose key is
verified the same way. Commands are shell scripts passed as the command line, run as root
(through ``sudo -n`` for another login user); data (file contents, which may be secret) only
ever travels on stdin, never in argv. Every call is counted, so benchmarks can report round
trips and bytes per host.

Only the inventory configures a connection: ``~/.ssh/config``, ``/etc/ssh/ssh_config``, Fabric
config files and SSH agents are not consulted.

A lost host never hangs a caller: every step is bounded. Connecting (TCP connect, banner, key
exchange, authentication, the bastion's onward channel) and opening a command's channel each
take at most ``Remote.connect_timeout``; once connected, a watchdog per connection (the
bastion's too) sends an SSH keepalive that wants a reply every ``KEEPALIVE_INTERVAL`` seconds
and closes the connection when none comes within ``Remote.dead_after``, which wakes every
blocked read and write of a running command (``HostError``: "lost the connection"). The check
rides on SSH, not TCP, so it also sees a target behind a bastion go; on a direct socket TCP
keepalive and ``TCP_USER_TIMEOUT`` back it up. A command may run as long as its own timeout
(up to 600 s for etcd waits) as long as its host keeps answering.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import paramiko
from fabric import Config, Connection

from installer.core.errors import InstallerError
from installer.core.inventory import BastionSpec, HostSpec, Inventory, SSHSpec
from installer.host.liveness import DEAD_AFTER, KEEPALIVE_INTERVAL, Lost, Watchdog, tcp_liveness, why_dead
from installer.host.runmark import shell_command


class HostError(InstallerError):
    """Something failed on (or on the way to) one host; the message names it. Exit 3, as
    for every command that cannot reach a host (2 is for what the operator gave)."""

    exit_code = 3

    def __init__(self, host: str, message: str):
        self.host = host
        super().__init__(f"{host}: {message}")


@dataclass
class Result:
    stdout: str
    stderr: str
    rc: int
    raw: bytes = b""            # stdout exactly as received (binary-safe)


@dataclass
class Counters:
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class _RecordNewKey(paramiko.MissingHostKeyPolicy):
    """--accept-new-host-keys: trust an unknown key once and write it to known_hosts.
    A *changed* key never reaches a policy: paramiko raises BadHostKeyException for it."""

    def __init__(self, path: Path, lock: threading.Lock):
        self.path, self.lock = path, lock

    def missing_host_key(self, client, hostname, key):
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":      # never glue our line onto an unterminated one
                        f.write(b"\n")
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n".encode())
        client.get_host_keys().add(hostname, key.get_name(), key)


_known_hosts_lock = threading.Lock()
# every SSH failure reaches the caller as a HostError; paramiko's own error log lines (e.g.
# "Secsh channel 0 open FAILED") would only repeat it on stderr through logging's last resort
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# what sudo -n says when it will not run the command (the command then never ran)
_SUDO_REFUSED = ("a password is required", "is not in the sudoers file", "is not allowed to",
                 "may not run sudo", "must have a tty", "no tty present")
_OWNER = re.compile(r"[A-Za-z0-9._-]+(:[A-Za-z0-9._-]+)?")


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass
class Remote:
    host: HostSpec
    inventory: Inventory
    accept_new_host_keys: bool = False
    # bounds each step of connecting and the opening of each command's channel
    connect_timeout: float = 10
    # a connection whose keepalive stays unanswered this long is closed (see KEEPALIVE_INTERVAL)
    dead_after: float = DEAD_AFTER
    # when set, every command's processes carry the mark HIDDENPLANE_RUN=<scope>-<n> in their
    # environment, so that a later run can end this run's remote processes: stop_scopes()
    scope: str | None = None
    counters: Counters = field(default_factory=Counters)
    _conn: Connection | None = None
    _gateway: Connection | None = None
    _watchdogs: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.host.name

    # --- connecting ------------------------------------------------------------------------

    def _connection(self, address: str, user: str, port: int, key: str, known: Path,
                    gateway: Connection | None) -> Connection:
        # an explicit (empty) SSHConfig and a lazy Config: no ssh_config or Fabric config
        # file changes where or how we connect; gateway=False also ignores a ProxyJump
        conn = Connection(address, user=user, port=port, gateway=gateway or False,
                          config=Config(ssh_config=paramiko.SSHConfig(), lazy=True),
                          connect_timeout=max(1, math.ceil(self.connect_timeout)),
                          connect_kwargs={"key_filename": [key], "allow_agent": False,
                                          "look_for_keys": False,
                                          # paramiko waits 15 s, 30 s and an hour by default
                                          "banner_timeout": self.connect_timeout,
                                          "auth_timeout": self.connect_timeout,
                                          "channel_timeout": self.connect_timeout})
        # Fabric trusts unknown hosts by default; we never do unless asked
        if known.is_file():
            conn.client.load_host_keys(str(known))
        policy = _RecordNewKey(known, _known_hosts_lock) if self.accept_new_host_keys else paramiko.RejectPolicy()
        conn.client.set_missing_host_key_policy(policy)
        return conn

    def _open_one(self, conn: Connection, ssh: SSHSpec, key: str, label: str,
                  bastion: BastionSpec | None = None) -> None:
        """Open ``conn``; every failure becomes a HostError saying what (``label``) failed and why."""
        where = _hostport(conn.host, conn.port)
        via = f" through bastion {_hostport(bastion.address, bastion.port)}" if bastion else ""

        def fail(message: str) -> HostError:
            return HostError(self.name, f"{label}{message}")
        if not os.access(key, os.R_OK):
            why = "does not exist" if not os.path.exists(key) else "is not readable"
            raise fail(f"SSH key {key} {why}")
        try:
            try:
                conn.open()
            except BaseException:
                conn.client.close()        # a failed handshake leaves paramiko's transport running
                raise
        except paramiko.BadHostKeyException as e:
            raise fail(f"host key CHANGED for {where} (got {e.key.get_name()} {e.key.fingerprint}, "
                       f"{ssh.knownHosts} has another): refusing to connect; if the host was "
                       "reinstalled, remove its old line") from None
        except paramiko.AuthenticationException as e:
            raise fail(f"{conn.user}@{where} did not accept the key {key}: {e}") from None
        except paramiko.ChannelException as e:
            # the bastion could not open the direct-tcpip channel to the target
            raise fail(f"cannot reach {where}{via}: {e.text or e.code}") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                missing = "" if Path(ssh.knownHosts).is_file() else " (the file does not exist)"
                raise fail(f"host key of {where} is not in {ssh.knownHosts}{missing}; add it "
                           "(verified out of band) or pass --accept-new-host-keys") from None
            if "Timeout opening channel" in str(e):
                raise fail(f"cannot reach {where}{via}: timed out") from None
            raise fail(f"SSH to {conn.user}@{where}{via} failed: {e}") from None
        except (socket.timeout, TimeoutError):
            raise fail(f"cannot reach {where}{via}: timed out") from None
        except paramiko.ssh_exception.NoValidConnectionsError as e:
            # it wraps the real errors (refused, no route) per address family
            causes = sorted({err.strerror or str(err) for err in e.errors.values()}) or [str(e)]
            raise fail(f"cannot reach {where}{via}: {'; '.join(causes)}") from None
        except OSError as e:
            raise fail(f"cannot reach {where}{via}: {e.strerror or e}") from None
        except EOFError:
            raise fail(f"{where}{via} closed the connection during the SSH handshake") from None
        tcp_liveness(conn.transport.sock, self.dead_after)
        self._watchdogs.append(Watchdog(conn.transport, f"{self.name} {label}{where}",
                                         KEEPALIVE_INTERVAL, self.dead_after))

    def open(self) -> None:
        if self._conn is not None and self._conn.is_connected:
            return
        self.close()                       # a dropped connection: start over, bastion included
        ssh = self.inventory.ssh_for(self.host)
        known = Path(ssh.knownHosts)
        gateway, b = None, ssh.bastion
        if b is not None:
            gateway = self._connection(b.address, b.user, b.port, b.keyPath, known, None)
            self._open_one(gateway, ssh, b.keyPath, f"bastion {_hostport(b.address, b.port)}: ")
            # bound the wait for the bastion to connect onwards (paramiko's default is an hour)
            gateway.transport.channel_timeout = self.connect_timeout
        conn = self._connection(self.host.address, ssh.user, ssh.port, ssh.keyPath, known, gateway)
        try:
            self._open_one(conn, ssh, ssh.keyPath, "", b)
        except BaseException:
            if gateway is not None:
                gateway.close()
            raise
        self._conn, self._gateway = conn, gateway

    @property
    def connected(self) -> bool:
        """Whether the connection to the host is open (``open`` makes it)."""
        return self._conn is not None and self._conn.is_connected

    def forward_local(self, local_port: int, remote_port: int):
        """A context manager: 127.0.0.1:``local_port`` here forwards to 127.0.0.1:``remote_port``
        on the host, over the open connection."""
        self.open()
        return self._conn.forward_local(local_port, remote_port=remote_port, remote_host="127.0.0.1",
                                        local_host="127.0.0.1")

    def open_channel(self, address: str, port: int, timeout: float):
        """A direct-tcpip channel to ``address:port`` as seen from the host (a socket-like object)."""
        self.open()
        return self._conn.transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0),
                                                 timeout=timeout)

    def _lost_reason(self) -> str | None:
        return next((w.lost for w in self._watchdogs if w.lost), None)

    def close(self) -> None:
        for w in self._watchdogs:
            w.stop()
        self._watchdogs = []
        for c in (self._conn, self._gateway):
            if c is not None:
                c.close()
        self._conn = self._gateway = None

    # --- commands --------------------------------------------------------------------------

    def _command(self, script: str, scoped: bool) -> str:
        command = shell_command(script, self.scope, scoped)
        if self.inventory.ssh_for(self.host).user != "root":
            command = f"sudo -n {command}"
        return command

    def run(self, script: str, stdin: bytes | None = None, check: bool = True, what: str | None = None,
            timeout: float | None = 600, *, scoped: bool = True,
            progress: Callable[[int, int], None] | None = None) -> Result:
        """Run ``script`` with sh on the host (as root, through sudo when the user is not root).
        ``stdin`` is sent byte-exact; ``Result.raw`` is stdout byte-exact. When sudo refuses
        (the script never ran) this raises even with ``check=False``. ``scoped=False`` keeps
        this one command out of ``scope`` (stop_scopes must not stop itself). ``progress(sent,
        total)`` is called after each chunk of ``stdin`` sent."""
        command = self._command(script, scoped)        # a bad scope fails before connecting
        self.open()
        what = what or "command"
        ssh = self.inventory.ssh_for(self.host)
        self.counters.round_trips += 1
        self.counters.bytes_up += len(stdin or b"")
        try:
            out, err, rc = self._exec(command, stdin or b"", timeout, progress)
        except (socket.timeout, TimeoutError):
            raise HostError(self.name, f"{what}: no answer within {timeout} s (it may still be "
                            "running on the host)") from None
        except (Lost, paramiko.SSHException, OSError, EOFError) as e:
            lost = self._lost_reason()
            self.close()
            if lost or isinstance(e, Lost):
                raise HostError(self.name, f"{what}: lost the connection ({lost or e}); the command "
                                "may have run in part") from None
            raise HostError(self.name, f"{what}: connection failed: {e}") from None
        self.counters.bytes_down += len(out)
        result = Result(out.decode(errors="replace"), err.decode(errors="replace"), rc, out)
        if ssh.user != "root":
            self._sudo_check(ssh.user, what, result)
        if check and result.rc != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-6:])
            raise HostError(self.name, f"{what} failed (exit {result.rc}): {tail}")
        return result

    def _sudo_check(self, user: str, what: str, r: Result) -> None:
        lines = r.stderr.strip().splitlines()
        first = lines[0] if lines else ""
        if r.rc == 127 and re.search(r"\bsudo: (command )?not found", first):
            raise HostError(self.name, f"{what}: the SSH user {user} is not root and the host has no sudo: "
                            "install sudo and grant it passwordless sudo, or log in as root")
        if r.rc == 1 and first.startswith("sudo:") and any(p in first for p in _SUDO_REFUSED):
            raise HostError(self.name, f"{what}: the SSH user {user} cannot run commands as root "
                            f"without a password ({first}); grant it passwordless sudo "
                            f"(`{user} ALL=(ALL) NOPASSWD:ALL`) or log in as root")

    def put(self, path: str, data: bytes | str, mode: int = 0o644, owner: str = "root:root",
            what: str | None = None) -> None:
        """Write ``data`` to ``path`` atomically (``path.hp-new``, then rename), one round trip.
        The content travels on stdin only; the parent directory is created if missing."""
        if not path.startswith("/"):
            raise ValueError(f"put: {path!r} is not an absolute path")
        if not _OWNER.fullmatch(owner):
            raise ValueError(f"put: {owner!r} is not USER or USER:GROUP")
        data = data.encode() if isinstance(data, str) else data
        final, tmp = shlex.quote(path), shlex.quote(path + ".hp-new")
        script = (
            "set -e\n"
            f'mkdir -p -- "$(dirname -- {final})"\n'
            "umask 077\n"                       # never readable by others while being written
            f"rm -f -- {tmp}\n"
            f"cat > {tmp}\n"
            f"chown {owner} -- {tmp}\n"         # before chmod: chown may clear mode bits
            f"chmod {mode:o} -- {tmp}\n"
            f"sync -- {tmp} 2>/dev/null || true\n"
            f"mv -f -- {tmp} {final}\n")
        self.run(script, stdin=data, what=what or f"write {path}")

    def get(self, path: str, what: str | None = None) -> bytes:
        """The content of ``path``, byte-exact; a missing file is a HostError."""
        return self.run(f"cat -- {shlex.quote(path)}", what=what or f"read {path}").raw

    def _exec(self, command: str, stdin: bytes, timeout: float | None,
              progress: Callable[[int, int], None] | None = None) -> tuple[bytes, bytes, int]:
        """One channel: binary-safe stdin, stdout and stderr read concurrently (no deadlock).
        ``timeout`` bounds the whole command from the exec request on: when it passes, the
        channel is closed and socket.timeout raised. A connection that dies meanwhile (closed
        by the watchdog, or by the kernel) raises Lost."""
        transport = self._conn.client.get_transport()
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
        except paramiko.SSHException as e:
            if "Timeout opening channel" in str(e):
                raise Lost(f"no answer to opening a channel within {self.connect_timeout:g} s") from None
            raise
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            chan.close()                   # wakes every read and write below
        timer = threading.Timer(timeout, expire) if timeout is not None else None
        try:
            if timer is not None:
                timer.daemon = True
                timer.start()
            chan.exec_command(command)
            err: list[bytes] = []

            def drain_stderr() -> None:
                try:
                    err.append(chan.makefile_stderr("rb").read())
                except (OSError, EOFError, paramiko.SSHException):
                    pass

            def feed() -> None:
                # paramiko's sendall re-slices the whole buffer per packet (quadratic on
                # large uploads): hand it bounded chunks instead
                view = memoryview(stdin)
                try:
                    for i in range(0, len(view), 1 << 18):
                        chan.sendall(bytes(view[i:i + (1 << 18)]))
                        if progress is not None:
                            progress(min(i + (1 << 18), len(view)), len(view))
                    chan.shutdown_write()
                except (OSError, EOFError, paramiko.SSHException):
                    pass     # the command exited without reading it all: its status tells
            threads = [threading.Thread(target=f, daemon=True) for f in (drain_stderr, feed)]
            for t in threads:
                t.start()
            out = chan.makefile("rb").read()
            for t in threads:
                t.join(self.dead_after)    # the channel is at EOF or closed: they end at once
            rc = chan.recv_exit_status()
            if expired.is_set() and rc == -1:
                raise socket.timeout(f"no answer within {timeout} s")
            if rc == -1 and not transport.is_active():
                # no exit status and a dead connection: not the command's verdict
                raise Lost(self._lost_reason() or why_dead(transport.get_exception()))
            return out, b"".join(err), rc
        finally:
            if timer is not None:
                timer.cancel()
            chan.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
