"""Health checks over TLS from the operator machine, with the cluster's own credentials.

The client key reaches Python's ssl module (which loads keys only from a path) through an
anonymous in-memory file (``tlsfiles.load_client_cert``): nothing on disk, even if killed.
"""

from __future__ import annotations

import http.client
import ssl
import time
from contextlib import contextmanager

from installer.core.pki.material import Material
from installer.core.tlsfiles import ca_pem, load_client_cert


@contextmanager
def client_context(material: Material, client: str = "admin"):
    ctx = ssl.create_default_context(cadata=ca_pem(material))
    load_client_cert(ctx, material, client)
    yield ctx


def https_get(ctx: ssl.SSLContext, host: str, port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def wait_ok(ctx: ssl.SSLContext, host: str, port: int, paths: tuple[str, ...], timeout: float) -> str | None:
    """Poll until every path answers 200; None on success, else the last failure."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            failures = []
            for p in paths:
                status, body = https_get(ctx, host, port, p)
                if status != 200:
                    failures.append(f"{p} -> {status} {body[:200]}")
            if not failures:
                return None
            last = "; ".join(failures)
        except (OSError, ssl.SSLError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            return last
        time.sleep(1)
