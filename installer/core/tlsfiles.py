"""Client credentials for code that loads them only from a path (Python's ssl, the Helm CLI).

The bytes go into an anonymous in-memory file (``memfd_create``) that the path
``/proc/self/fd/N`` names, in this process or in a child that inherits the descriptor: nothing
is on any filesystem, so nothing outlives the process, SIGKILL included. (A 0600 file in a
private temporary directory stayed in /tmp, key and all, whenever the process was killed before
it removed it.)
"""

from __future__ import annotations

import os
import ssl
from contextlib import contextmanager
from typing import Iterator

from installer.core.pki import issue
from installer.core.pki.material import Material


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@contextmanager
def memory_file(data: bytes, name: str = "hiddenplane") -> Iterator[int]:
    """A descriptor of an anonymous file holding ``data`` (0600, close-on-exec: a child gets it
    only when passed explicitly, ``pass_fds``); closed, and so gone, after the block."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)            # memfds are born 0777 (0666 on newer kernels)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """The path that opens ``fd``'s file again (from offset 0), in whichever process holds it."""
    return f"/proc/self/fd/{fd}"


def load_client_cert(context: ssl.SSLContext, material: Material, credential: str = "admin") -> None:
    """Load ``credential``'s certificate and key into ``context``; the key is in the context's
    memory only when this returns."""
    pair = material.pair(credential)
    with memory_file(issue.cert_pem(pair.cert) + issue.key_pem(pair.key)) as fd:
        context.load_cert_chain(fd_path(fd))


def ca_pem(material: Material, ca: str = "ca") -> str:
    """The CA certificate as ``cadata`` for ``ssl.create_default_context``."""
    return issue.cert_pem(material.pair(ca).cert).decode()
