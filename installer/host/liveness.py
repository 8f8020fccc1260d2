"""Knowing that a host is lost while a command runs on it: an SSH keepalive that wants a reply,
timed from a thread of our own (``Watchdog``), backed on a direct TCP socket by the kernel's
keepalive and ``TCP_USER_TIMEOUT``. ``ssh.Remote`` arms both on every connection it opens."""

from __future__ import annotations

import errno
import socket
import threading

# seconds between liveness probes on every connection; a host is lost when a probe stays
# unanswered for Remote.dead_after (default DEAD_AFTER): a lost host fails within about
# KEEPALIVE_INTERVAL + DEAD_AFTER seconds, whatever it was doing
KEEPALIVE_INTERVAL = 5.0
DEAD_AFTER = 15.0
class Lost(Exception):
    """The connection died under a command (the watchdog's or the kernel's verdict)."""


class Watchdog:
    """Prove every ``interval`` that the peer's sshd still answers (a global request that
    wants a reply); close the transport when an answer takes longer than ``dead_after``.
    paramiko's own keepalive wants no reply (it detects nothing) and ``global_request(wait=True)``
    waits forever, so the probe runs in a thread of its own and is timed from here."""

    def __init__(self, transport, label: str, interval: float, dead_after: float):
        self.transport, self.interval, self.dead_after = transport, interval, dead_after
        self.stopped = threading.Event()
        self.lost: str | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True, name=f"ssh-watchdog {label}")
        self.thread.start()

    def _watch(self) -> None:
        t = self.transport
        while not self.stopped.wait(self.interval) and t.is_active():
            answered = threading.Event()

            def probe() -> None:
                try:
                    t.global_request("keepalive@openssh.com", wait=True)   # a refusal is an answer too
                except Exception:      # noqa: BLE001 - a dying transport: the loop sees it inactive
                    pass
                answered.set()
            threading.Thread(target=probe, daemon=True, name="ssh-keepalive").start()
            if not answered.wait(self.dead_after) and not self.stopped.is_set():
                self.lost = f"no answer to an SSH keepalive within {self.dead_after:g} s"
                try:
                    t.close()      # wakes every thread blocked on this connection
                except (EOFError, OSError):
                    # through a bastion the socket is a channel of the bastion's transport, and
                    # closing it sends a message on a link that is dead too: closed all the same
                    pass
                return

    def stop(self) -> None:
        self.stopped.set()


def tcp_liveness(sock, dead_after: float) -> None:
    """Kernel-side backup on a direct TCP socket: keepalive probes on an idle link, and
    TCP_USER_TIMEOUT so that data left unacknowledged (an upload into a dead link) errors out
    after about the watchdog's bound instead of after ~15 minutes of retransmissions. It is a
    little longer than the watchdog's, whose message says more."""
    if not isinstance(sock, socket.socket):
        return                     # a channel through the bastion: the watchdog covers it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    step = max(1, int(dead_after // 3))
    for opt, value in (("TCP_KEEPIDLE", step), ("TCP_KEEPINTVL", step), ("TCP_KEEPCNT", 3),
                       ("TCP_USER_TIMEOUT", int((dead_after + KEEPALIVE_INTERVAL) * 1000))):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def why_dead(e: BaseException | None) -> str:
    if isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
        return "no TCP acknowledgement from the host within the bound"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) if e is not None and str(e) else "the connection closed"
