"""`installer lab …`: local lab hosts (systemd-nspawn machines, qemu VMs) for trying apply."""

from __future__ import annotations

from pathlib import Path

import click

from installer.cli.errors import domain_errors
from installer.lab import lab as lab_mod
from installer.lab.model import DEFAULT_SUBNET, built_artifacts


@click.group()
def lab():
    """Build, inspect and remove a lab of local hosts (Linux, root)."""


@lab.command()
@click.option("--name", required=True, help="Lab name: 1-8 lower-case letters/digits.")
@click.option("--control", "controls", default=1, show_default=True, help="Control hosts (1, 3 or 5).")
@click.option("--workers", default=2, show_default=True, help="Workers.")
@click.option("--vm-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="How many of the workers are qemu VMs (software emulation, about 10x slower) instead "
                   "of systemd-nspawn hosts; both run real pods.")
@click.option("--subnet", default=DEFAULT_SUBNET, show_default=True, help="Private /24 for the lab.")
@click.option("--inventory", "inventory_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the lab's inventory. Default: ./<name>.inventory.yaml")
@click.option("--artifacts", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="A directory with SHA256SUMS (e.g. from scripts/build-kubernetes): its files go into "
                   "the lab's artifacts, verified, over the Debian ones. Default: "
                   "/var/cache/hiddenplane/build/artifacts-<default version> when it exists.")
@click.option("--no-artifacts", is_flag=True, help="Only Debian's packages, even when built artifacts exist.")
@click.option("--hosting", is_flag=True, help="The workers also get the image archives of hosted control planes "
              "(kube-apiserver, etcd, konnectivity, local-path-provisioner): the lab's cluster will host tenants "
              "(docs/hosted.md). Default: only the images workers run themselves (pause, CoreDNS, busybox).")
@click.option("--tenant-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --hosting: the last N workers are a hosted tenant's, not the hosting cluster's; its "
              "inventory is written too (docs/hosted.md's walkthrough).")
@click.option("--cni", type=click.Choice(["routes", "cilium"]), default="routes", show_default=True,
              help="The inventory's pod network. cilium: the nspawn workers may load BPF programs, get Cilium's "
              "images (build them: scripts/build-kubernetes default DIR --only cilium) and the lab's Helm values.")
@click.option("--tenant-inventory", "tenant_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the tenant's inventory. Default: ./<name>.tenant.yaml")
@domain_errors
def up(name, controls, workers, vm_workers, subnet, inventory_out, artifacts, no_artifacts, hosting, tenant_workers,
       cni, tenant_out):
    """Boot the lab (idempotent: running hosts are kept)."""
    if no_artifacts and artifacts:
        raise click.UsageError("--artifacts and --no-artifacts exclude each other")
    if artifacts is None and not no_artifacts:
        artifacts = built_artifacts()
        if artifacts:
            click.echo(f"artifacts: {artifacts} (built by scripts/build-kubernetes; --no-artifacts for Debian's only)")
    out = lab_mod.up(name, controls, workers, vm_workers, subnet, inventory_out, log=click.echo,
                     artifacts=artifacts, hosting=hosting, tenant_workers=tenant_workers, tenant_out=tenant_out,
                     cni=cni)
    click.echo(f"lab {name} is up; inventory: {out}")


@lab.command()
@click.option("--name", required=True)
@domain_errors
def status(name):
    """Show each host: role, kind, address, running, SSH."""
    spec, hosts = lab_mod.status(name)
    click.echo(f"lab {name}: {lab_mod.describe(spec)}")
    for h in hosts:
        click.echo(f"  {h.name:<5} {h.role:<8} {h.kind:<7} {h.address:<15} "
                   f"{'running' if h.running else 'stopped':<8} ssh {'ok' if h.ssh else '-'}")
    if not all(h.running and h.ssh for h in hosts):
        raise SystemExit(1)


@lab.command("ssh-config")
@click.option("--name", required=True)
@domain_errors
def ssh_config(name):
    """Print an ssh_config for the lab's hosts. Use it from a file (ssh -F reads no pipe):
    installer lab ssh-config --name X > X.ssh_config && ssh -F X.ssh_config cp1"""
    click.echo(lab_mod.ssh_config(name), nl=False)


@lab.command()
@click.option("--name", required=True)
@domain_errors
def down(name):
    """Stop every host and remove everything of the lab (the base image cache stays)."""
    lab_mod.down(name, log=click.echo)
