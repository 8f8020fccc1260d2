"""`installer lab up|status|down`: a lab of real local hosts for `installer apply`.

``up`` is idempotent: hosts already running are kept, missing pieces are (re)created. ``down``
removes every process, mount, network namespace, link and file of the lab; the cached base
image and Debian packages stay (they are shared by all labs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from installer.core import versions
from installer.core.inventory_fields import API_VERSION
from installer.lab import cilium as lab_cilium
from installer.lab import debian_artifacts, images, net, nspawn, seed, tenant, vm, vm_image
from installer.lab.model import DEFAULT_SUBNET, LabError, LabHost, LabPaths, LabSpec
from installer.lab.watch import ssh_banner, wait_ssh

# the nspawn workers' disk thresholds (spec.workerHosts.evictionHard): see inventory_doc
LAB_EVICTION_HARD = {"nodefs.available": "2Gi", "imagefs.available": "2Gi"}
TOOLS = {"systemd-nspawn": "systemd-container", "debootstrap": "debootstrap", "ip": "iproute2",
         "mount": "mount", "dpkg-deb": "dpkg", "apt-get": "apt"}


# --- preflight -----------------------------------------------------------------------------

def preflight(spec: LabSpec, paths: LabPaths) -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("the lab needs root (network namespaces, mounts, systemd-nspawn): run it with sudo")
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if spec.vm_workers:
        missing += [p for p in vm_image.missing_tools() if p not in missing]
    if missing:
        problems.append(f"missing tools: apt-get install {' '.join(missing)}")
    if "overlay" not in Path("/proc/filesystems").read_text():
        problems.append("the kernel has no overlay file system (modprobe overlay)")
    if paths.spec_file.exists():
        existing = load_spec(paths)
        if (existing.controls, existing.workers, existing.vm_workers, existing.subnet, existing.cni) != \
                (spec.controls, spec.workers, spec.vm_workers, spec.subnet, spec.cni):
            problems.append(f"lab {spec.name} already exists as {describe(existing)}; "
                            f"run `installer lab down --name {spec.name}` first")
    elif net.link_exists(spec.bridge):
        problems.append(f"the network interface {spec.bridge} exists but is not this lab's: pick another --name")
    if not problems:
        taken = net.routes_overlapping(spec.subnet, ignore_dev=spec.bridge)
        if taken:
            problems.append(f"--subnet {spec.subnet} is already in use on this machine ({', '.join(taken)}): "
                            "pick another private /24")
    if problems:
        raise LabError("lab preflight:\n  " + "\n  ".join(problems))


def describe(spec: LabSpec) -> str:
    vms = f" ({spec.vm_workers} VM)" if spec.vm_workers else ""
    cni = f", cni {spec.cni}" if spec.cni != "routes" else ""
    return f"{spec.controls} control + {spec.workers} workers{vms} on {spec.subnet}{cni}"


def load_spec(paths: LabPaths) -> LabSpec:
    data = json.loads(paths.spec_file.read_text())
    return LabSpec.create(data["name"], data["controls"], data["workers"], data["vm_workers"], data["subnet"],
                          data.get("cni", "routes"))


# --- up ------------------------------------------------------------------------------------

def inventory_doc(spec: LabSpec, paths: LabPaths, k8s_version: str | None = None,
                  containerd_version: str | None = None, hosting: bool = False) -> dict:
    """The lab's inventory. What only the lab needs is set here, never as a product default:
    the lab has no registry (images come from the artifacts), so AlwaysPullImages is off; the
    versions are those of the binaries in its artifacts when they differ from the defaults
    (Debian's containerd is 1.6, which reads another config format)."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": "Cluster",
        "metadata": {"name": spec.name},
        "spec": {
            # no endpoint: one control host is its own; with more, every worker balances over
            # all their apiservers (spec.apiServer.balancer auto), as a user's inventory would
            "apiServer": {"alwaysPullImages": False},
            "ssh": {"user": "root", "port": 22, "keyPath": str(paths.ssh_key), "knownHosts": str(paths.known_hosts)},
            "hosts": [{"name": h.name, "address": h.address, "role": h.role} for h in spec.hosts],
            "artifacts": {"source": "dir", "path": str(paths.artifacts)},
        },
    }
    if any(h.role == "worker" and h.kind == "nspawn" for h in spec.hosts):
        # an nspawn worker is a container on this cgroup v1 machine: the kubelet must accept
        # cgroup v1, containerd may not lower oom_score_adj, kube-proxy may not set conntrack
        # limits (nspawn.POD_HOST_ARGS gives it the rest). Its filesystem is the machine's
        # whole disk, shared with the build caches and every other lab: the kubelet's 10 % and
        # 15 % of it (25-38 GiB of 252) are not its to keep, and it evicted the tests' pods
        # with tens of GiB still free; it keeps 2 GiB instead.
        doc["spec"]["workerHosts"] = {"cgroupV1": True, "inContainer": True, "evictionHard": LAB_EVICTION_HARD}
    if hosting:
        # a cluster hosting tenants enforces their NetworkPolicies (docs/hosted.md); the
        # enforcer's image is among the hosting archives
        doc["spec"]["network"] = {"policy": "kube-network-policies"}
    if k8s_version:
        doc["spec"]["kubernetes"] = {"version": k8s_version}
    if containerd_version and containerd_version != versions.DEFAULT_COMPONENTS["containerd"]:
        doc["spec"]["artifacts"]["versions"] = {"containerd": containerd_version}
    return doc


_VERSION_OUT = re.compile(r"^Kubernetes (v\d+\.\d+\.\d+)$")


_CONTAINERD_OUT = re.compile(r"^containerd \S+ v?(\d+\.\d+\.\d+)")


def _version_of(binary: Path, pattern: re.Pattern) -> str | None:
    if not binary.is_file():
        return None
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = pattern.match(out)
    return m[1] if m else None


def binaries_version(artifacts: Path) -> str | None:
    """The version real Kubernetes binaries in ``artifacts`` report (None: none there, or the
    stand-ins, which print no release version)."""
    return _version_of(artifacts / "kube-apiserver", _VERSION_OUT)


def containerd_version(artifacts: Path) -> str | None:
    return _version_of(artifacts / "containerd", _CONTAINERD_OUT)


INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
MIN_INOTIFY_INSTANCES = 1024


def _raise_inotify_limit(log) -> None:
    """Each host's systemd takes several inotify instances, all counted against root: the
    common default of 128 stops the fourth or fifth host from booting ("Too many open files")."""
    try:
        current = int(INOTIFY_INSTANCES.read_text())
    except (OSError, ValueError):
        return
    if current < MIN_INOTIFY_INSTANCES:
        INOTIFY_INSTANCES.write_text(f"{MIN_INOTIFY_INSTANCES}\n")
        log(f"raised fs.inotify.max_user_instances from {current} to {MIN_INOTIFY_INSTANCES} "
            "(until reboot) so that many lab hosts can boot")


def _host_keys(paths: LabPaths, spec: LabSpec) -> dict[str, seed.KeyPair]:
    """One host key per host, kept across `up` runs so known_hosts stays valid."""
    keys = {}
    for h in spec.hosts:
        keys[h.name] = seed.load_or_create(paths.host_dir(h.name) / "ssh_host_ed25519_key", f"root@{h.name}")
    return keys


SETTLE = ("s=$(systemctl is-system-running --wait 2>/dev/null); "
          "if [ \"$s\" = degraded ]; then f=$(systemctl --failed --no-legend --plain | awk '{print $1}'); "
          "echo \"restarting $f\"; systemctl restart $f; fi; systemctl is-system-running")


def _settle_boot(paths: LabPaths, host: LabHost, log) -> None:
    """Wait for the host's boot to finish; a unit that failed at boot is restarted once, so
    every host starts out `running` (seen before each host had its own cgroup: 219/CGROUP)."""
    proc = subprocess.run(ssh_command(paths, host, SETTLE), capture_output=True, text=True, timeout=180)
    lines = proc.stdout.split("\n")
    if lines and lines[0].startswith("restarting "):
        log(f"  {host.name}: restarted units that failed at boot: {lines[0][len('restarting '):]}")
    if proc.stdout.strip().split("\n")[-1] != "running":
        log(f"  {host.name}: systemd reports {proc.stdout.strip().splitlines()[-1:] or proc.stderr.strip()}")


def _start_host(spec: LabSpec, paths: LabPaths, base: Path, h: LabHost, files, log) -> None:
    host_dir = paths.host_dir(h.name)
    if h.kind == "vm":
        if not vm.vm_running(host_dir):
            log(f"  {h.name}: booting qemu VM (software emulation: about a minute)")
            vm.start_vm(spec, h, host_dir, files, log=log)
        return
    net.ensure_host_net(spec, h)
    pods = h.role == "worker"           # a worker runs a real kubelet, containerd and runc
    bpf = pods and spec.cni == "cilium"
    root = nspawn.mount_root(base, host_dir, {**files, **nspawn.pod_host_files(bpf)} if pods else files,
                             nspawn.pod_host_links(bpf) if pods else None)
    binds = []
    if pods:
        # containerd's overlayfs snapshotter cannot work on an overlayfs root: give it a plain dir
        state = host_dir / "containerd"
        state.mkdir(exist_ok=True)
        binds.append((state, "/var/lib/containerd"))
    if nspawn.pid_of(host_dir) is None:
        if leftover := nspawn.cgroup_pids(host_dir):
            # a previous boot's container outlived its nspawn: it must not share the new boot
            log(f"  {h.name}: stopping {len(leftover)} processes left from an earlier boot")
            nspawn.stop(host_dir)
        log(f"  {h.name}: booting ({h.address})")
    nspawn.boot(h, host_dir, root, binds, pods=pods, bpf=bpf)


def up(name: str, controls: int = 1, workers: int = 2, vm_workers: int = 0, subnet: str | None = None,
       inventory_out: Path | None = None, log=print, artifacts: Path | None = None, hosting: bool = False,
       tenant_workers: int = 0, tenant_out: Path | None = None, cni: str = "routes") -> Path:
    """Boot the lab; ``artifacts``: a directory with a SHA256SUMS (e.g. from
    scripts/build-kubernetes) whose files are copied into the lab's artifacts, verified, over
    the Debian ones; ``hosting``: with the image archives of hosted control planes too (its
    cluster hosts tenants: docs/hosted.md), not only those its workers run themselves, and the
    hosting cluster's storage manifest beside the inventory; ``tenant_workers``: the last ones
    are a hosted tenant's, whose inventory goes to ``tenant_out`` (lab/tenant.py); ``cni``: the
    inventory's pod network (cilium: with the lab settings of lab/cilium.py)."""
    if tenant_workers and not hosting:
        raise LabError("--tenant-workers needs --hosting: a tenant's control plane runs in the lab's cluster")
    spec = LabSpec.create(name, controls, workers, vm_workers, subnet or DEFAULT_SUBNET, cni)
    if cni != "routes" and (hosting or tenant_workers):
        raise LabError("--cni cilium: not with --hosting (the hosting cluster's enforcer is for cni: routes)")
    if tenant_workers:
        tenant.split({"spec": {"hosts": [{"name": h.name, "role": h.role} for h in spec.hosts]}}, tenant_workers)
    paths = LabPaths.of(name)
    preflight(spec, paths)
    base = images.ensure_base(log)
    if spec.vm_workers:
        vm_image.ensure_vm_image(log)

    paths.root.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.root, 0o700)
    paths.spec_file.write_text(json.dumps({k: v for k, v in asdict(spec).items() if k != "hosts"}) + "\n")
    login = seed.load_or_create(paths.ssh_key, f"hiddenplane-lab-{name}")
    host_keys = _host_keys(paths, spec)
    paths.known_hosts.write_text("".join(seed.known_hosts_line(h, host_keys[h.name]) for h in spec.hosts))
    debian_artifacts.fill(paths.artifacts, log)
    if artifacts is not None:
        names = debian_artifacts.import_dir(Path(artifacts), paths.artifacts, all_images=hosting,
                                            extra_images=lab_cilium.IMAGES if cni == "cilium" else frozenset())
        log(f"artifacts: {len(names)} files from {artifacts}")
    if cni == "cilium":
        lab_cilium.check(paths.artifacts)

    _raise_inotify_limit(log)
    net.ensure_bridge(spec)
    with ThreadPoolExecutor(max_workers=8) as pool:
        jobs = [pool.submit(_start_host, spec, paths, base, h, seed.host_files(spec, h, login, host_keys[h.name]), log)
                for h in spec.hosts]
        for j in jobs:
            j.result()
    def restart(h: LabHost) -> None:
        # a boot that died at once (seen once in CI: nspawn gone, its console log empty)
        if h.kind == "vm":
            vm.stop_vm(h, paths.host_dir(h.name))
        else:
            nspawn.stop(paths.host_dir(h.name))
        _start_host(spec, paths, base, h, seed.host_files(spec, h, login, host_keys[h.name]), log)

    wait_ssh(list(spec.hosts), log, restart=restart)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda h: _settle_boot(paths, h, log), spec.hosts))

    doc = inventory_doc(spec, paths, binaries_version(paths.artifacts), containerd_version(paths.artifacts),
                        hosting=hosting)
    if cni == "cilium":
        lab_cilium.configure(doc, spec)
    out = (inventory_out or Path.cwd() / f"{name}.inventory.yaml").resolve()
    copies: list[tuple[Path, Path]] = []      # (the user's file, the lab's copy): `down` removes it unchanged
    if tenant_workers:
        doc, theirs = tenant.split(doc, tenant_workers)
        arts = tenant.tenant_artifacts(paths.artifacts, paths.root / "tenant-artifacts")
        tenant_path = (tenant_out or Path.cwd() / f"{name}.tenant.yaml").resolve()
        mine = paths.root / "tenant.yaml"
        mine.write_text(yaml.safe_dump(tenant.tenant_doc(doc, theirs, tenant.HOSTING_KUBECONFIG, arts),
                                       sort_keys=False))
        shutil.copyfile(mine, tenant_path)
        copies.append((tenant_path, mine))
        log(f"tenant inventory: {tenant_path} (workers {', '.join(h['name'] for h in theirs)}; it reads the "
            f"hosting cluster's kubeconfig from {tenant_path.parent / tenant.HOSTING_KUBECONFIG})")
    if hosting:
        storage = out.parent / tenant.STORAGE.name
        shutil.copyfile(tenant.STORAGE, storage)
        copies.append((storage, tenant.STORAGE))
        log(f"the hosting cluster's volumes: {storage} (local-path-provisioner; kubectl apply -f it)")
    text = yaml.safe_dump(doc, sort_keys=False)
    paths.inventory(name).write_text(text)
    out.write_text(text)
    copies.insert(0, (out, paths.inventory(name)))
    (paths.root / "inventory-copy").write_text("".join(f"{user}\t{lab}\n" for user, lab in copies))
    missing = debian_artifacts.missing_kubernetes(paths.artifacts)
    if missing:
        log(f"note: {paths.artifacts} has no {', '.join(missing)}: put the official binaries there and add "
            f"them to SHA256SUMS (`sha256sum NAME >> SHA256SUMS`), or for tests the contract stand-ins: "
            f"`python -m tests.standins install {paths.artifacts}`")
    return out


# --- status --------------------------------------------------------------------------------

@dataclass
class HostStatus:
    name: str
    role: str
    kind: str
    address: str
    running: bool
    ssh: bool


def status(name: str) -> tuple[LabSpec, list[HostStatus]]:
    paths = LabPaths.of(name)
    if not paths.spec_file.exists():
        raise LabError(f"no lab named {name} (looked in {paths.root})")
    spec = load_spec(paths)
    out = []
    for h in spec.hosts:
        if h.kind == "vm":
            running = vm.vm_running(paths.host_dir(h.name))
        else:
            running = nspawn.pid_of(paths.host_dir(h.name)) is not None
        out.append(HostStatus(h.name, h.role, h.kind, h.address, running, running and ssh_banner(h.address)))
    return spec, out


def ssh_config(name: str) -> str:
    """An ssh_config with one alias per lab host; host keys checked against the lab's known_hosts."""
    paths = LabPaths.of(name)
    if not paths.spec_file.exists():
        raise LabError(f"no lab named {name} (looked in {paths.root})")
    spec = load_spec(paths)
    return "\n".join(
        f"Host {h.name}\n  HostName {h.address}\n  User root\n  IdentityFile {paths.ssh_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {paths.known_hosts}\n  StrictHostKeyChecking yes\n"
        f"  BatchMode yes\n  ConnectTimeout 10\n" for h in spec.hosts)


def ssh_command(paths: LabPaths, host: LabHost, command: str) -> list[str]:
    return ["ssh", "-i", str(paths.ssh_key), "-o", f"UserKnownHostsFile={paths.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            f"root@{host.address}", command]


# --- down ----------------------------------------------------------------------------------

def down(name: str, log=print) -> None:
    paths = LabPaths.of(name)
    if not paths.root.exists():
        log(f"no lab named {name}: nothing to do")
        return
    spec = load_spec(paths) if paths.spec_file.exists() else LabSpec.create(name)

    def stop(h: LabHost) -> None:
        host_dir = paths.host_dir(h.name)
        if h.kind == "vm":
            vm.stop_vm(h, host_dir)
        else:
            nspawn.stop(host_dir)
            nspawn.unmount_root(host_dir)
            net.remove_host_net(h)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for j in [pool.submit(stop, h) for h in spec.hosts]:
            j.result()
    net.remove_bridge(spec)
    still = nspawn.mounts_under(paths.root)
    if still:
        # never delete through a live mount: it could reach the shared base image
        raise LabError(f"lab {name}: still mounted: {', '.join(still)}; unmount them and run down again")
    copy = paths.root / "inventory-copy"
    if copy.exists():
        # the files `up` wrote for the user, each removed when it is still as written (a line
        # without a tab: an earlier release's, the inventory alone)
        for line in copy.read_text().splitlines():
            user, _, lab_copy = line.partition("\t")
            user_copy, written = Path(user), Path(lab_copy) if lab_copy else paths.inventory(name)
            if user_copy.is_file() and written.is_file() and user_copy.read_bytes() == written.read_bytes():
                user_copy.unlink()
    shutil.rmtree(paths.root)
    log(f"lab {name} removed")
