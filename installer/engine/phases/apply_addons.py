"""addons: CoreDNS and the konnectivity agents through the API; Cilium with the Helm CLI
(needs a real kube-apiserver).

Runs after cluster-bootstrap (whose ``hiddenplane:cluster-admins`` binding gives the admin
certificate its rights) and before workers, so the CoreDNS objects exist when the nodes join;
the pods schedule once nodes are Ready. The objects (``render.addons.addon_objects``) go through
the API from the operator machine (``host/kube.py``), like cluster-bootstrap's (directly, or over an
SSH tunnel via a control host), schema-validated before anything is sent, then created or
brought back to what we set (``kube_objects.apply_objects``).

With ``cni: cilium`` the phase then runs ``helm upgrade --install`` on this machine, with the
chart from the artifacts directory (``spec.artifacts.path`` with ``source: dir``, the cache
directory with ``source: download``; listed in its ``SHA256SUMS``) and the values
``cilium_values_yaml`` renders. Helm reaches the API through the same URL (the tunnel stays
open), with an admin kubeconfig made for the call. It and the values are anonymous in-memory
files (``memfd_create``, 0600) that helm inherits and opens as ``/proc/self/fd/N``
(``--kubeconfig``, ``--values``, ``KUBECONFIG``): no admin credential is ever on disk, so
none is left in /tmp when the installer is killed. ``helm`` is the artifacts directory's when
its SHA256SUMS lists one (verified), else the one on ``PATH``.

Skipping: like cluster-bootstrap this phase needs a real API, so ``--skip cluster-bootstrap``
skips it too (the runner adds ``addons`` to the skipped phases); ``--only addons`` runs it alone
against a cluster bootstrapped earlier. A dry run lists the objects it would apply and the Helm
command it would run (with ``cni: cilium`` it checks that helm and the chart are there, too);
against a running apiserver it reads each object and lists only those that would change.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from installer.core.artifacts import ArtifactError, read_sums, verify
from installer.core.errors import InstallerError
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.render.addons import (
    CILIUM_CHART,
    CILIUM_VERSION,
    NAMESPACE,
    RELEASE,
    addon_objects,
    cilium_chart,
    cilium_values_yaml,
    helm_argv,
)
from installer.core.render.kubeconfig import kubeconfig
from installer.core.tlsfiles import fd_path, memory_file
from installer.engine.api_objects import api_live, apply_api_objects
from installer.engine.context import Context, Event
from installer.engine.phases.base import Phase
from installer.host.fetch import cache_dir
from installer.host.helm import HelmCall

HELM = "helm"
ADMIN_USER = "kubernetes-admin"


def chart_dir(inv: Inventory) -> Path:
    """Where the Cilium chart is looked for: the artifacts directory (``source: dir``) or the
    cache directory's top level (``source: download``; the chart is never downloaded)."""
    directory = inv.artifacts_dir()
    if directory is None:
        directory = cache_dir(inv)
    return Path(directory)


def helm_prerequisites(inv: Inventory) -> tuple[str, Path, str]:
    """The helm executable, the verified chart and its digest, or an InstallerError naming what
    to install or where to put it."""
    directory = chart_dir(inv)
    if HELM in read_sums(directory):
        # scripts/build-kubernetes --only cilium puts one there: the one that was tested
        try:
            verify(directory, [HELM])
        except ArtifactError as e:
            raise InstallerError(f"cni: cilium: {directory / HELM} is not verified: {e}") from None
        helm = str(directory / HELM)
    elif (helm := shutil.which(HELM)) is None:
        raise InstallerError(f"cni: cilium is installed with the Helm CLI on this machine, and neither the "
                             f"artifacts ({directory}) nor PATH has `{HELM}`: install Helm 3 "
                             "(https://helm.sh/docs/intro/install/) and rerun")
    chart = cilium_chart(directory)
    if not chart.is_file():
        raise InstallerError(
            f"cni: cilium needs the Cilium chart {CILIUM_VERSION} as {chart} (the "
            f"{'artifacts' if inv.artifacts_dir() is not None else 'artifacts cache'} directory), listed in "
            f"its SHA256SUMS: `scripts/build-kubernetes default DIR --only cilium` builds it (with the images and "
            f"helm), or `helm pull cilium --repo https://helm.cilium.io --version {CILIUM_VERSION}` gives "
            f"{CILIUM_CHART}; put it there and add its line (sha256sum {CILIUM_CHART} >> SHA256SUMS)")
    try:
        digest = verify(chart.parent, [CILIUM_CHART])[CILIUM_CHART]
    except ArtifactError as e:
        raise InstallerError(f"cni: cilium: the chart {chart} is not verified: {e}") from None
    return helm, chart, digest


def admin_kubeconfig(inv: Inventory, material: Material, server: str) -> bytes:
    """The admin kubeconfig for ``server`` (the URL api_access yields: the endpoint, or the
    tunnel's 127.0.0.1 port, a SAN of the apiserver certificate)."""
    return kubeconfig(inv.metadata.name, server, issue.cert_pem(material.pair("ca").cert), ADMIN_USER,
                      client=material.pair("admin"))


def run_helm(inv: Inventory, material: Material, server: str, helm: str, chart: Path, digest: str,
             dry_run: bool = False) -> list[str]:
    """``helm upgrade --install cilium`` against ``server`` unless the deployed release already has
    this chart (by its digest, in the release's description) and these values: a second apply
    makes no new revision. Returns the lines of the event (none when nothing changed)."""
    values_yaml = cilium_values_yaml(inv)
    description = f"hiddenplane {chart.name} sha256:{digest}"
    with memory_file(admin_kubeconfig(inv, material, server)) as kc_fd, memory_file(values_yaml) as values_fd:
        # the same descriptor numbers in helm (pass_fds), where /proc/self is helm itself
        kc, values = fd_path(kc_fd), fd_path(values_fd)
        env = {**os.environ, "KUBECONFIG": kc}
        call = HelmCall(helm, env, (kc_fd, values_fd))
        if call.deployed(RELEASE, NAMESPACE) == (description, yaml.safe_load(values_yaml)):
            return []
        if dry_run:
            return [f"would run helm upgrade --install cilium {chart.name} --namespace {NAMESPACE}"]
        call.run(helm_argv(chart, values, kubeconfig=Path(kc), helm=helm) + ["--description", description],
                 "upgrade --install cilium")
        return [f"helm upgrade --install cilium {chart.name}"]


class ApplyAddons(Phase):
    name = "addons"
    description = "CoreDNS and konnectivity agents through the Kubernetes API; Cilium with Helm"

    def prepare(self, ctx: Context) -> list[str]:
        return ["(api)"]

    def run_host(self, ctx: Context, host: str) -> Event:
        inv = ctx.inv
        cilium = inv.spec.network.cni == "cilium"
        helm, chart, digest = helm_prerequisites(inv) if cilium else (None, None, None)
        # against a running apiserver (a dry run too) it reads the release and runs helm only for a change
        then = (lambda url: run_helm(inv, ctx.material, url, helm, chart, digest, ctx.options.dry_run)) \
            if cilium else None
        ev = apply_api_objects(ctx, self.name, addon_objects(inv), "admin", then)
        if cilium and ctx.options.dry_run and not api_live(ctx):
            ev.action = "changed"
            ev.detail.append(f"would run helm upgrade --install cilium {chart} --namespace {NAMESPACE}")
        return ev
