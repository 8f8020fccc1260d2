"""workers: kernel settings, containerd, kubelet (bootstrap kubeconfig) and kube-proxy.

Waits until the units are active and the kubelet serves its port. With a real cluster (the
cluster-bootstrap phase ran) it then approves each joining node's client CSR when it was made
with that node's own token and its kubelet's own key, one per token (and denies every other
bootstrap-token CSR: installer/host/csr_approval.py), reads each issued certificate back, waits
for each Node to register, deletes the token Secrets of every registered Node (also when
another worker failed), turns the kubelet's client certificate rotation on and removes the
bootstrap kubeconfig on each worker that joined in this run (one kubelet restart), sets each
Node's spec.podCIDR to the installer's allocation (any CNI) and waits for Ready.

Image archives from the artifacts (``image-*.tar``, uploaded to the workers by the artifacts
phase) are imported into containerd's ``k8s.io`` namespace once containerd runs, only when
missing: when an image the archive names is not in containerd, or the archive is not the one
last imported (a stamp ``<archive>.imported`` holds its sha256). Each image is pinned for the
kubelet's image garbage collection (nothing could pull it back). Each import (and each pin of
an image found unpinned) is named in the phase's event; a run with nothing to do reports none.
"""

from __future__ import annotations

import functools
import json
import shlex
import tarfile
import time
from pathlib import Path

from installer.core import components
from installer.core.components import worker_units
from installer.core.diff import Selection
from installer.core.errors import InstallerError
from installer.core.render.worker import BOOTSTRAP_KUBECONFIG, KUBELET_CONFIG, KUBELET_KUBECONFIG
from installer.core.shellfiles import shell_file
from installer.engine.context import Bootstrapped, Context, Event
from installer.engine.parts import worker_part
from installer.engine.phases.base import Phase
from installer.host import apireach, csr_approval, probes
from installer.host.fetch import BIN_DIR, IMAGE_DIR, is_image
from installer.host.parallel import each
from installer.host.ssh import HostError
from installer.host.waits import active_script, listening_script

KUBELET_PORTS = (components.port("kubelet", "secure"),)
CONTAINERD_WAIT = 120          # seconds the image import waits for containerd to answer


def normalize_ref(ref: str) -> str:
    """An image reference as containerd stores it (``busybox:1`` -> ``docker.io/library/busybox:1``)."""
    first, slash, rest = ref.partition("/")
    if not slash:
        return f"docker.io/library/{ref}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{ref}"
    return ref


@functools.lru_cache(maxsize=64)
def archive_images(path: Path) -> tuple[str, ...]:
    """The image names an archive carries: OCI ``index.json`` (``io.containerd.image.name``) or
    ``docker save``'s ``manifest.json`` (RepoTags). Empty when it names none."""
    names: list[str] = []
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                inner = member.name.removeprefix("./")
                if inner not in ("index.json", "manifest.json") or not member.isreg():
                    continue
                doc = json.load(tar.extractfile(member))
                if inner == "index.json":
                    names += [m.get("annotations", {}).get("io.containerd.image.name", "")
                              for m in doc.get("manifests", [])]
                else:
                    names += [t for entry in doc for t in (entry.get("RepoTags") or [])]
    except (OSError, tarfile.TarError, ValueError, AttributeError, TypeError):
        return ()
    return tuple(sorted({normalize_ref(n) for n in names if n}))


def import_script(images: list[tuple[str, str, tuple[str, ...]]], ctr: str = f"{BIN_DIR}/ctr",
                  directory: str = IMAGE_DIR) -> str:
    """Shell that imports each (archive file, sha256, image names) into containerd's k8s.io
    namespace when one of its images is missing or its stamp differs; prints "imported FILE"."""
    lines = [shell_file("import-images.sh", ctr=ctr, dir=directory, tries=str(CONTAINERD_WAIT)).rstrip("\n")]
    for name, digest, refs in images:
        lines.append(" ".join(shlex.quote(x) for x in ("imp", name, digest, *refs)))
    return "\n".join(lines) + "\n"


def worker_images(ctx: Context) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n, a.sha256, archive_images(a.path)) for n, a in sorted(ctx.artifacts.items()) if is_image(n)]


class JoinWorkers(Phase):
    name = "workers"
    description = "containerd, kubelet and kube-proxy on the workers; wait until they run"
    reads = (Bootstrapped,)

    def prepare(self, ctx: Context) -> list[str]:
        return [h.name for h in ctx.hosts("worker")]

    def run_host(self, ctx: Context, host: str) -> Event:
        # started without waiting: every worker's units start at once, and finish waits for
        # all of them together instead of each holding a pool slot while its units come up
        return ctx.execute(self.name, host, ctx.changes_for(host, worker_part(ctx.plans[host])), no_block=True)

    def _settle(self, ctx: Context, host: str, ev: Event) -> list[Event]:
        """Wait until ``host``'s units run (unless they already did), then import missing images."""
        out = []
        units = worker_units(ctx.inv)
        if not ctx.settled([ev], units):
            start, timeout = time.monotonic(), ctx.options.wait_timeout
            # the units, then the kubelet's port; a joining kubelet serves it only once the
            # installer approved its CSR (below), so then the Node's registration is the wait
            script = active_script(units, timeout)
            if not (ctx.result(Bootstrapped) and not ctx.facts[host].kubelet_joined):
                script += " && " + listening_script(KUBELET_PORTS, timeout, ("kubelet",))
            r = ctx.remotes[host].run(script, check=False, what="wait for the worker units",
                                      timeout=2 * timeout + 30)
            if r.rc != 0:
                raise HostError(host, f"worker units did not come up: {r.stderr.strip()[-800:]}")
            ctx.mark_active([host], units)
            out.append(Event(self.name, host, "waited", seconds=time.monotonic() - start,
                             detail=[f"{u} active" for u in units]))
        images = worker_images(ctx)
        if images:
            r = ctx.remotes[host].run(import_script(images), check=False, what="import container images",
                                      timeout=max(600, ctx.options.wait_timeout))
            if r.rc != 0:
                raise HostError(host, f"importing container images failed: {r.stderr.strip()[-800:]}")
            imported = [line for line in r.stdout.splitlines() if line.startswith(("imported ", "pinned "))]
            if imported:
                out.append(Event(self.name, host, "changed", detail=imported))
        return out

    def _settle_all(self, ctx: Context, events: list[Event]) -> None:
        """Every worker at once (the waits are remote loops, cheap here); all failures named."""
        if ctx.options.dry_run or not events:
            return
        by_host = {ev.host: ev for ev in events}
        results = each(lambda host: self._settle(ctx, host, by_host[host]), by_host, width=len(by_host))
        failed = [r for r in results.values() if isinstance(r, InstallerError)]
        for r in results.values():
            if not isinstance(r, InstallerError):
                ctx.events += r
        if len(failed) == 1:
            raise failed[0]
        if failed:
            raise HostError(", ".join(getattr(e, "host", "?") for e in failed), "; ".join(str(e) for e in failed))

    def finish(self, ctx: Context, events: list[Event]) -> None:
        self._settle_all(ctx, events)
        if ctx.options.dry_run or not ctx.result(Bootstrapped):
            return   # Node objects exist only on a real cluster bootstrapped in this run
        from installer.host import kube  # lazy: runs that never reach the API skip urllib3 and the schemas
        names = [h.name for h in ctx.hosts("worker")]
        # every worker's token is known (a request made with the token of a worker outside this
        # run is left pending, not denied: its kubelet key is read only for the run's hosts)
        token_nodes = {ctx.material.tokens[h.name].id: h.name for h in ctx.inv.workers if h.name in ctx.material.tokens}
        inventory_hosts = {h.name for h in ctx.inv.spec.hosts}
        verdicts: list[csr_approval.Verdict] = []
        approved: list[csr_approval.Verdict] = []

        def keys_of(nodes: set[str]) -> dict[str, frozenset[bytes]]:
            mine = sorted(n for n in nodes if n in names)
            got = each(lambda n: csr_approval.read_kubelet_keys(ctx.remotes[n]), mine, width=max(1, len(mine)))
            # a host that did not answer: its request waits for the next round
            return {n: k for n, k in got.items() if not isinstance(k, Exception)}

        def decide() -> None:
            new = csr_approval.approve_pending(api, token_nodes, keys_of)
            verdicts.extend(new)
            approved[:] = csr_approval.check_issued(api, approved + [v for v in new if v.approve], inventory_hosts)

        with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, kube.api_client(url, ctx.material) as api:
            try:
                # each joining kubelet waits for its CSR: the installer approves it when the token
                # is that node's own and the key its kubelet's (csr_approval), then the Node registers
                kube.wait_nodes_ready(api, names, ctx.options.wait_timeout, registered_only=True, each_round=decide)
                decide()
                deadline = time.monotonic() + ctx.options.wait_timeout
                while approved and time.monotonic() < deadline:   # every approval's certificate read back
                    time.sleep(0.5)
                    decide()
                if approved:
                    raise csr_approval.CSRError("no certificate issued for the approved CSR(s) "
                                                + ", ".join(v.csr for v in approved))
            finally:
                if verdicts:
                    ctx.events.append(Event(self.name, "(api)", "changed", detail=[
                        f"{'approved' if v.approve else 'denied'} CSR {v.csr}: {v.message}" for v in verdicts]))
                # a registered Node holds its own client certificate: its token is done, delete it
                # so that a leaked copy is worth nothing; also when another worker failed to join
                deleted = delete_registered_tokens(api, ctx)
                if deleted:
                    ctx.events.append(Event(self.name, "(api)", "changed",
                                            detail=[f"deleted the bootstrap token Secret of {n}" for n in deleted]))
            restarted = self._joined(ctx, names)
            # podCIDR as soon as each Node exists: Cilium (ipam kubernetes) needs it before the
            # node can become Ready
            done = {n: kube.set_pod_cidr(api, n, ctx.material.pod_cidrs[n]) for n in names}
            ctx.events.append(Event(self.name, "(api)", "changed" if "set" in done.values() else "unchanged",
                                    detail=[f"node {n} podCIDR {ctx.material.pod_cidrs[n]}: {how}"
                                            for n, how in done.items()]))
            # a Node Ready before its kubelet's restart above shows its old Ready for a moment,
            # then NotReady from the new kubelet: only a Ready posted since the restart counts
            kube.wait_nodes_ready(api, names, ctx.options.wait_timeout, since=restarted)
            ctx.events.append(Event(self.name, "(api)", "waited", detail=[f"node {n} Ready" for n in names]))

    def _joined(self, ctx: Context, names: list[str]) -> dict[str, float]:
        """The Nodes that registered in this run hold the kubelet's own client certificate: in
        this run, not the next, the bootstrap kubeconfig (its token deleted) goes and the
        kubelet's config turns client certificate rotation on (off while it bootstrapped: see
        render/worker.kubelet_config); the kubelet restarts for it. Returns when each restarted
        kubelet started (its host's clock)."""
        newly = [n for n in names if not ctx.facts[n].kubelet_joined]
        if not newly:
            return {}
        for n in newly:
            ctx.facts[n].kubelet_joined = True
        ctx.rerender()
        for n in newly:
            # and its kubeconfig ours (render/worker.kubelet_kubeconfig: the server it must use)
            config = (ctx.plans[n].files[KUBELET_CONFIG], ctx.plans[n].files[KUBELET_KUBECONFIG])
            ctx.events.append(ctx.execute(self.name, n, ctx.changes_for(
                n, Selection(files=config, absent=(BOOTSTRAP_KUBECONFIG,), units=(components.unit("kubelet"),)))))
        started = each(lambda n: probes.ask(ctx.remotes[n], probes.unit_started("kubelet")), newly,
                       width=len(newly))
        return {n: t for n, t in started.items() if isinstance(t, float | int)}


def delete_registered_tokens(api, ctx: Context) -> list[str]:
    """Delete the bootstrap token Secret of every inventory worker whose Node is registered
    (but those this command makes bootstrap again); returns those nodes."""
    from installer.host import kube
    registered = kube.list_nodes(api)
    return csr_approval.delete_token_secrets(api, {ctx.material.tokens[h.name].id: h.name for h in ctx.inv.workers
                                                   if h.name in registered and h.name in ctx.material.tokens
                                                   and h.name not in ctx.rejoin})
