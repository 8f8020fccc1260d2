"""artifacts: put each host's binaries in /usr/local/bin (CNI plugins in /opt/cni/bin).

Binaries are resolved locally first (verified against their checksums, downloaded into the
cache for `source: download`); a host gets a binary only when its copy differs.
"""

from __future__ import annotations

from installer.engine.context import Context, Event
from installer.engine.parts import binaries_part
from installer.engine.phases.base import Phase


class UploadArtifacts(Phase):
    name = "artifacts"
    description = "upload binaries whose copy on the host differs"

    def run_host(self, ctx: Context, host: str) -> Event:
        return ctx.execute(self.name, host, ctx.changes_for(host, binaries_part(ctx, host)))
