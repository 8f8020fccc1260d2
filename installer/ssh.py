"""The one module that talks SSH (Fabric over paramiko).

Host keys are verified against the inventory's known_hosts: an unknown or changed key is an
error naming the host, unless the operator explicitly accepts new keys (``accept_new``), which
records them. Commands are shell scripts passed as the command line; data (file contents,
which may be secret) only ever travels on stdin, never in argv. Every call is counted, so
benchmarks can report round trips and bytes per host.
"""

from __future__ import annotations

import shlex
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from fabric import Connection

from .errors import InstallerError
from .inventory import HostSpec, Inventory


class HostError(InstallerError):
    """Something failed on (or on the way to) one host; the message names it."""

    def __init__(self, host: str, message: str):
        self.host = host
        super().__init__(f"{host}: {message}")


@dataclass
class Result:
    stdout: str
    stderr: str
    rc: int


@dataclass
class Counters:
    round_trips: int = 0
    bytes_up: int = 0


class _RecordNewKey(paramiko.MissingHostKeyPolicy):
    """--accept-new-host-keys: trust an unknown key once and write it to known_hosts.
    A *changed* key never reaches a policy: paramiko raises BadHostKeyException for it."""

    def __init__(self, path: Path, lock: threading.Lock):
        self.path, self.lock = path, lock

    def missing_host_key(self, client, hostname, key):
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


_known_hosts_lock = threading.Lock()


@dataclass
class Remote:
    host: HostSpec
    inventory: Inventory
    accept_new_host_keys: bool = False
    connect_timeout: float = 10
    counters: Counters = field(default_factory=Counters)
    _conn: Connection | None = None

    @property
    def name(self) -> str:
        return self.host.name

    def _connection(self) -> Connection:
        ssh = self.inventory.ssh_for(self.host)
        known = Path(ssh.knownHosts)
        conn = Connection(self.host.address, user=ssh.user, port=ssh.port,
                          connect_timeout=self.connect_timeout,
                          connect_kwargs={"key_filename": [ssh.keyPath], "allow_agent": False,
                                          "look_for_keys": False})
        # Fabric trusts unknown hosts by default; we never do unless asked
        if known.is_file():
            conn.client.load_host_keys(str(known))
        policy = _RecordNewKey(known, _known_hosts_lock) if self.accept_new_host_keys else paramiko.RejectPolicy()
        conn.client.set_missing_host_key_policy(policy)
        return conn

    def open(self) -> None:
        if self._conn is not None and self._conn.is_connected:
            return
        conn = self._connection()
        ssh = self.inventory.ssh_for(self.host)
        try:
            conn.open()
        except paramiko.BadHostKeyException as e:
            raise HostError(self.name, f"host key CHANGED for {self.host.address} (got {e.key.get_name()}, "
                            f"{ssh.knownHosts} has another): refusing to connect; if the host was "
                            "reinstalled, remove its old line") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise HostError(self.name, f"host key of {self.host.address} is not in {ssh.knownHosts}; "
                                "add it (verified out of band) or pass --accept-new-host-keys") from None
            raise HostError(self.name, f"SSH to {ssh.user}@{self.host.address}:{ssh.port} failed: {e}") from None
        except (socket.timeout, TimeoutError):
            raise HostError(self.name, f"cannot reach {self.host.address}:{ssh.port}: timed out") from None
        except OSError as e:
            raise HostError(self.name, f"cannot reach {self.host.address}:{ssh.port}: {e.strerror or e}") from None
        self._conn = conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run(self, script: str, stdin: bytes | None = None, check: bool = True, what: str | None = None,
            timeout: float | None = 600) -> Result:
        """Run ``script`` with sh on the host (as root, through sudo when the user is not root)."""
        self.open()
        ssh = self.inventory.ssh_for(self.host)
        command = f"sh -c {shlex.quote(script)}"
        if ssh.user != "root":
            command = f"sudo -n {command}"
        self.counters.round_trips += 1
        self.counters.bytes_up += len(stdin or b"")
        try:
            out, err, rc = self._exec(command, stdin or b"", timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostError(self.name, f"{what or 'command'}: connection failed: {e}") from None
        result = Result(out.decode(errors="replace"), err.decode(errors="replace"), rc)
        if check and result.rc != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-6:])
            raise HostError(self.name, f"{what or 'command'} failed (exit {result.rc}): {tail}")
        return result

    def _exec(self, command: str, stdin: bytes, timeout: float | None) -> tuple[bytes, bytes, int]:
        """One channel: binary-safe stdin, stdout and stderr read concurrently (no deadlock)."""
        chan = self._conn.client.get_transport().open_session()
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            err: list[bytes] = []
            reader = threading.Thread(target=lambda: err.append(chan.makefile_stderr("rb").read()), daemon=True)
            reader.start()

            def feed() -> None:
                # paramiko's sendall re-slices the whole buffer per packet (quadratic on
                # large uploads): hand it bounded chunks instead
                view = memoryview(stdin)
                for i in range(0, len(view), 1 << 18):
                    chan.sendall(bytes(view[i:i + (1 << 18)]))
                chan.shutdown_write()
            writer = threading.Thread(target=feed, daemon=True)
            writer.start()
            out = chan.makefile("rb").read()
            writer.join(timeout)
            reader.join(timeout)
            return out, b"".join(err), chan.recv_exit_status()
        finally:
            chan.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
