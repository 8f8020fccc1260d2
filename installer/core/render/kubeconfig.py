"""Kubeconfig documents with the CA and credentials embedded (no file references to break)."""

from __future__ import annotations

import base64
import binascii

from installer.core import yamlsafe
from installer.core.pki import issue
from installer.core.pki.issue import Pair
from installer.core.render.files import to_yaml

SUFFIX = ".conf"        # every kubeconfig a plan writes ends so (the guards and `certs check` find them)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(cluster: str, server: str, ca_pem: bytes, user: str, *,
               client: Pair | None = None, token: str | None = None) -> bytes:
    if (client is None) == (token is None):
        raise ValueError("a kubeconfig needs exactly one of a client certificate or a token")
    creds = ({"token": token} if token is not None else {
        "client-certificate-data": _b64(issue.cert_pem(client.cert)),
        "client-key-data": _b64(issue.key_pem(client.key)),
    })
    context = f"{user}@{cluster}"
    return to_yaml({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": context, "context": {"cluster": cluster, "user": user}}],
        "current-context": context,
        "preferences": {},
    })


def client_certificate(content: bytes) -> bytes | None:
    """The PEM client certificate a kubeconfig embeds (its first user's), or None: a token, no
    user, or not a kubeconfig. Bounded: the content may come from where others write (a hosted
    tenant's Secrets)."""
    try:
        doc, _ = yamlsafe.load(content)
        data = doc["users"][0]["user"]["client-certificate-data"]
        return base64.b64decode(data, validate=True) if isinstance(data, str) else None
    except (yamlsafe.InputError, binascii.Error, KeyError, IndexError, TypeError, ValueError):
        return None
