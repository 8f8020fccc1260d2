"""Host teardown: take off a host exactly what the installer put there.

What a host holds is derived, not listed by hand: the host's rendered plan (its files, absent
files, directories, users and units), the binaries of its role (``fetch.role_binaries``), and
the host's own record of every file the installer wrote (``/var/lib/hiddenplane/manifest``,
which also covers files of an older configuration, e.g. konnectivity before egress changed).
On top of that come the things the installed components make themselves, named here by the
component that makes them: kubelet and containerd state and mounts, CNI state and the bridge,
routes marked ``proto 199``, the masquerade chain and kube-proxy/kubelet/CNI iptables chains,
the forwarding sysctls.

Rules:

- A host without ``/var/lib/hiddenplane`` never held anything of ours: the script does nothing
  there (so it is idempotent, and safe on a host the installer never touched). That directory
  goes last, so an interrupted teardown finishes on the next run.
- A file the installer replaced was backed up next to it (``PATH.hiddenplane-backup-STAMP``,
  installer/host/hostops.py): the oldest backup (the file as it was before hiddenplane) is moved
  back; newer backups, if any, are left in place and named in the output. A directory tree
  holding such a backup is never removed wholesale, only emptied of our files.
- Directories are removed when empty only (never a system directory such as /usr/local/bin);
  a mount point (e.g. a bind-mounted /var/lib/containerd) is emptied, not unmounted.
- ``data=False`` keeps etcd's data (``/var/lib/etcd`` and the data dirs a restore or a member
  removal moved aside), the audit logs, containerd's images and snapshots, and the etcd user
  that owns the data; ``/var/lib/hiddenplane`` keeps only the list of them (and of the
  originals put back), so that a later teardown with data removes them (and leaves the
  originals alone).
- Worker order (no orphan process survives): stop and disable kubelet and kube-proxy; kill
  and delete every container task in every containerd namespace; stop containerd; kill what
  is left in containerd's, the kubelet's and the containers' cgroups and every process running
  one of our binaries (containerd's unit has KillMode=process: shims outlive it); unmount what
  is mounted below /run/containerd, /var/lib/containerd, /var/lib/kubelet (not those
  directories themselves: they may be the admin's own disks) and the CNI network namespaces;
  then units, credentials, CNI state, routes, rules, sysctls, binaries, users.
- Forwarding sysctls go back to the kernel default, then to whatever a remaining sysctl.d
  file says (``systemd-sysctl --prefix``); the installer does not record earlier runtime values.

The script prints one line per thing it did, and nothing when there was nothing to do.
``wipe_host`` runs it over SSH; ``installer reset`` (installer/actions/reset.py) runs it on every host,
``installer node remove`` (installer/actions/node_ops.py) on one.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Callable

from installer.actions.teardown_script import (
    CNI_STATE,
    CONTAINERD_DATA,
    CONTAINERD_OPT,
    CONTAINERD_RUN,
    CONTAINERD_UNIT,
    KUBE_PROXY_UNIT,
    KUBELET_UNIT,
    LOG_DIR,
    Teardown,
    render_script,
    steps,
)
from installer.core.errors import InstallerError
from installer.core.facts import STATE_DIR
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki.material import Material, ensure
from installer.core.render.control import ETCD_DATA_DIR, ETCD_REMOVED_ASIDE, ETCD_RESTORE_ASIDE
from installer.core.render.files import BIN_DIR, K8S_DIR, SYSTEMD_DIR, HostPlan
from installer.core.render.network import CNI_CONF_DIR, CNI_DIR
from installer.core.render.plan import render_cluster
from installer.core.render.worker import KUBE_PROXY_DIR, KUBELET_DIR
from installer.host.fetch import CNI_BIN_DIR, binary_path, role_binaries
from installer.host.ssh import Remote

Log = Callable[[str], None]

# never removed, even when empty: directories of the system that files of ours live in
SYSTEM_DIRS = frozenset({"/", "/etc", "/etc/systemd", SYSTEMD_DIR, "/etc/sysctl.d", "/etc/modules-load.d",
                         "/usr", "/usr/local", BIN_DIR, "/opt", "/var", "/var/lib", "/var/log", "/run"})


class TeardownError(InstallerError):
    """A host could not be cleaned (the message names it and says why)."""


# --- what a host holds ----------------------------------------------------------------------

def _ancestors(path: str) -> list[str]:
    out, d = [], posixpath.dirname(path)
    while d not in ("/", ""):
        out.append(d)
        d = posixpath.dirname(d)
    return out


def _shape_plan(inv: Inventory, host: HostSpec) -> HostPlan:
    """The plan of a host the caller has none for (e.g. a node already removed from the
    inventory), rendered with throwaway in-memory material: only its paths, users and units
    are used, never content, and nothing is written."""
    hosts = [h for h in inv.spec.hosts if h.name != host.name] + [host]
    shaped = inv.model_copy(update={"spec": inv.spec.model_copy(update={"hosts": hosts})})
    material, _ = ensure(shaped, Material())
    return render_cluster(shaped, material)[host.name]


def plan_for(inv: Inventory, host: HostSpec, plans: Mapping[str, HostPlan]) -> HostPlan:
    plan = plans.get(host.name)
    return plan if plan is not None and plan.role == host.role else _shape_plan(inv, host)


def teardown_of(inv: Inventory, host: HostSpec, plan: HostPlan, *, data: bool, binaries: bool = True) -> Teardown:
    """Pure: what the teardown of ``host`` (planned as ``plan``) removes."""
    worker = host.role == "worker"
    bins = role_binaries(host.role, inv)
    bin_paths = tuple(binary_path(b) for b in bins)
    files = list(dict.fromkeys([*plan.files, *plan.absent, *(bin_paths if binaries else ())]))
    # the reverse of the start order; units of an earlier configuration (konnectivity before
    # egress changed, say) are found in the host's manifest by the script
    units = list(reversed(plan.units))
    if worker:
        first = [KUBELET_UNIT, KUBE_PROXY_UNIT, CONTAINERD_UNIT]
        units = first + [u for u in units if u not in first]
        trees = (K8S_DIR, KUBELET_DIR, KUBE_PROXY_DIR, CNI_STATE, CNI_CONF_DIR, CONTAINERD_RUN)
        data_trees = (CONTAINERD_DATA,)
        leftovers: tuple[str, ...] = ()
    else:
        trees = (K8S_DIR, "/etc/etcd")
        data_trees = (ETCD_DATA_DIR, LOG_DIR)
        leftovers = (f"{ETCD_RESTORE_ASIDE}*", f"{ETCD_REMOVED_ASIDE}*")
    candidates = set(plan.dirs) | {a for p in files for a in _ancestors(p)}
    if worker:
        candidates |= {CNI_DIR, CONTAINERD_OPT, f"{CONTAINERD_OPT}/bin", f"{CONTAINERD_OPT}/lib"}
    dirs = sorted((d for d in candidates - SYSTEM_DIRS if not d.startswith(STATE_DIR)),
                  key=lambda d: (-d.count("/"), d))
    return Teardown(
        host=host.name, role=host.role, data=data, units=tuple(units), files=tuple(files),
        trees=trees, data_trees=data_trees, dirs=tuple(dirs),
        users=tuple((u.name, u.home) for u in plan.users) if data else (),
        processes=bin_paths, binary_dirs=(BIN_DIR, CNI_BIN_DIR) if not binaries else (),
        leftovers=leftovers if data else ())


# --- the public builders (pure) --------------------------------------------------------------

def _host(inv: Inventory, host: str | HostSpec) -> HostSpec:
    if isinstance(host, HostSpec):
        return host
    try:
        return inv.host(host)
    except KeyError:
        raise TeardownError(f"no host named {host} in the inventory") from None


def host_teardown(inv: Inventory, host: str | HostSpec, plans: Mapping[str, HostPlan], *, data: bool,
                  binaries: bool = True) -> Teardown:
    spec = _host(inv, host)
    return teardown_of(inv, spec, plan_for(inv, spec, plans), data=data, binaries=binaries)


def host_script(inv: Inventory, host_name: str | HostSpec, plans: Mapping[str, HostPlan], *, data: bool,
                binaries: bool = True, root: str = "") -> str:
    """The POSIX sh script that takes off ``host_name`` what the installer put there. Idempotent;
    a no-op on a host without /var/lib/hiddenplane. ``host_name`` may be a HostSpec of a node
    that is no longer in the inventory (its plan is then rendered with throwaway material)."""
    return render_script(host_teardown(inv, host_name, plans, data=data, binaries=binaries), root)


def host_plan(inv: Inventory, host_name: str | HostSpec, plans: Mapping[str, HostPlan], *, data: bool,
              binaries: bool = True) -> list[str]:
    """What ``host_script`` removes, for humans (dry runs and confirmation): the same steps' words."""
    return [line for s in steps(host_teardown(inv, host_name, plans, data=data, binaries=binaries)) for line in s.says]


# --- executing ------------------------------------------------------------------------------

def wipe_host(inv: Inventory, host: HostSpec, plans: Mapping[str, HostPlan], remote: Remote, *, data: bool,
              log: Log = print) -> list[str]:
    """Run the teardown of ``host`` over ``remote`` (one round trip); returns one line per thing
    it did (empty: nothing of hiddenplane was there). ``host`` may be a node no longer in the
    inventory. Raises HostError when the host cannot be reached, TeardownError when something
    could not be removed (a rerun continues where it stopped)."""
    r = remote.run(host_script(inv, host, plans, data=data), check=False, what="remove what hiddenplane installed",
                   timeout=900)
    done = [line for line in r.stdout.splitlines() if line.strip()]
    for line in done:
        log(f"{host.name}: {line}")
    if r.rc != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-6:])
        raise TeardownError(f"{host.name}: teardown failed (exit {r.rc}): {tail}")
    return done
