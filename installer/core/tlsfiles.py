"""Client credentials as files, for libraries that only load keys from files (ssl, urllib3).

Written into a private directory the caller owns (0700; files 0600, created exclusively) and
removed with it.
"""

from __future__ import annotations

import os

from installer.core.pki import issue
from installer.core.pki.material import Material


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def client_files(directory: str, material: Material, credential: str = "admin") -> tuple[str, str, str]:
    """(certificate, key, cluster CA) paths of ``credential`` inside ``directory``."""
    pair, ca = material.pair(credential), material.pair("ca")
    cert, key, cafile = (os.path.join(directory, n) for n in ("client.crt", "client.key", "ca.crt"))
    write_private(cert, issue.cert_pem(pair.cert))
    write_private(key, issue.key_pem(pair.key))
    write_private(cafile, issue.cert_pem(ca.cert))
    return cert, key, cafile
