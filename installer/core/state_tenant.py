"""What a hosted tenant's state directory records about the namespace it applied the tenant in
(core/tenancy.py reads both): a random id of the state, which the namespace's owner ConfigMap
names, and the namespace's UID. Mixed into ``StateDir`` (core/state.py), whose reads, checks and
lock they use.
"""

from __future__ import annotations

import os
import re

from installer.core.errors import StateError
from installer.core.safefs import write_atomic

TENANT_ID = "tenant-id"
# the UID of the namespace this state applied its tenant in: a namespace deleted and made again
# (its label and owner record copied) is another object, with another UID
NAMESPACE_UID = "tenant-namespace-uid"
# "NAMESPACE UID": the name too, so that a UID is compared with the namespace it was recorded for
_RECORD = re.compile(rb"([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?) "
                     rb"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\n")


class TenantRecords:
    """``StateDir``'s tenant files (``root``, ``_fd``, ``_read`` and ``secure`` are its)."""

    def tenant_id(self) -> str | None:
        path = self.root / TENANT_ID
        data = self._read(path) if self.secure() else None
        if data is not None and not re.fullmatch(rb"[0-9a-f]{32}\n", data):
            raise StateError(f"{path} is corrupt (it names this tenant's hosted namespace): restore it")
        return data.decode().strip() if data else None

    def ensure_tenant_id(self) -> str:
        if self._fd is None:
            raise StateError(f"state directory {self.root}: the tenant id is written only under its lock")
        if not (found := self.tenant_id()):
            found = os.urandom(16).hex()
            write_atomic(self.root / TENANT_ID, found.encode() + b"\n", 0o600)
        return found

    def namespace_uid(self, namespace: str) -> str | None:
        """The UID recorded for ``namespace`` (None: none, or one recorded for another name)."""
        path = self.root / NAMESPACE_UID
        data = self._read(path) if self.secure() else None
        if data is None:
            return None
        m = _RECORD.fullmatch(data)
        if not m:
            raise StateError(f"{path} is corrupt (the UID of this tenant's hosted namespace): delete it, and the "
                             "namespace's label and owner record are trusted as before")
        return m[3].decode() if m[1].decode() == namespace else None

    def record_namespace_uid(self, namespace: str, uid: str | None) -> None:
        """Kept under the lock; None (the namespace deleted by reset) forgets it."""
        if self._fd is None:
            raise StateError(f"state directory {self.root}: the namespace UID is written only under its lock")
        path = self.root / NAMESPACE_UID
        if uid is None:
            path.unlink(missing_ok=True)
            return
        line = f"{namespace} {uid}\n".encode()
        if not _RECORD.fullmatch(line):
            raise StateError(f"the hosting cluster gave namespace {namespace!r} UID {uid!r}, which is no UID")
        if line != self._read(path):
            write_atomic(path, line, 0o600)
