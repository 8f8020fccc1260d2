"""The Helm CLI on the operator's machine (``cni: cilium``): one call at a time, with the
environment and inherited descriptors the caller gives it (the admin kubeconfig is an anonymous
in-memory file, installer/engine/phases/apply_addons.py), and what the deployed release is."""

from __future__ import annotations

import json
import subprocess

from installer.core.errors import InstallerError

HELM_TIMEOUT = 600.0         # seconds: `helm upgrade --install` without --wait returns once sent


class HelmCall:
    """The helm CLI with one environment and the descriptors it inherits."""

    def __init__(self, helm: str, env: dict[str, str], fds: tuple[int, ...]):
        self.helm, self.env, self.fds = helm, env, fds

    def run(self, argv: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=HELM_TIMEOUT,
                                  stdin=subprocess.DEVNULL, pass_fds=self.fds)
        except subprocess.TimeoutExpired:
            raise InstallerError(f"helm {what}: no answer after {HELM_TIMEOUT:g}s") from None
        except OSError as e:
            raise InstallerError(f"{self.helm}: cannot run it: {e.strerror or e}") from None
        if check and proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise InstallerError(f"helm {what} failed (exit {proc.returncode}):\n{tail}")
        return proc

    def deployed(self, release: str, namespace: str) -> tuple[str, object] | None:
        """The deployed revision's description and user values, or None (no release, or its
        last revision is not deployed: failed, pending)."""
        proc = self.run([self.helm, "history", release, "--namespace", namespace, "--max", "1", "-o", "json"],
                        f"history {release}", check=False)
        if proc.returncode != 0:
            if "not found" in proc.stderr:
                return None
            raise InstallerError(f"helm history {release} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        last = (json.loads(proc.stdout) or [{}])[-1]
        if last.get("status") != "deployed":
            return None
        got = self.run([self.helm, "get", "values", release, "--namespace", namespace, "-o", "json"],
                       f"get values {release}")
        return last.get("description", ""), json.loads(got.stdout or "null")
