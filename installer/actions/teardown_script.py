"""The teardown of one host as data and as a script, pure: ``Teardown`` (what the host holds, in
the order it is taken off), ``steps`` (each thing done: the words a person reads and the sh lines
that do it) and ``render_script`` (the POSIX sh script of those steps). installer/actions/teardown.py
derives the ``Teardown`` of a host and runs the script; its docstring has the rules."""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from installer.actions.teardown_shell import CNI_NETNS, CONTAINERD_DATA, CONTAINERD_RUN, PRELUDE, exe_pids
from installer.core import components, network
from installer.core.facts import MANIFEST, STATE_DIR
from installer.core.render.addons import cilium
from installer.core.render.addons.netpol import NFT_TABLE as NETPOL_TABLE
from installer.core.render.control import AUDIT_DIR
from installer.core.render.files import BIN_DIR, SYSTEMD_DIR
from installer.core.render.network import IPTABLES, SYSCTL_BIN, SYSCTL_FILE
from installer.core.render.worker import KUBELET_DIR, SYSCTLS
from installer.host.hostops import q

KUBELET_UNIT, KUBE_PROXY_UNIT, CONTAINERD_UNIT = components.units("kubelet", "kube-proxy", "containerd")
CTR = f"{BIN_DIR}/ctr"
CONTAINERD_OPT = "/opt/containerd"      # containerd's "opt" plugin makes it (empty bin/, lib/)
CNI_STATE = "/var/lib/cni"              # host-local leases, the CNI result cache
KEPT_DATA = f"{STATE_DIR}/kept-data"    # what a teardown without data left behind
RESTORED = f"{STATE_DIR}/restored"      # backups already moved back (an interrupted run resumes)
LOG_DIR = posixpath.dirname(AUDIT_DIR)  # /var/log/kubernetes
# chains the installed components add (kube-proxy, the kubelet, the CNI portmap plugin) and ours
CHAIN_PREFIXES = ("KUBE-", "CNI-", network.MASQ_CHAIN, cilium.CHAIN_PREFIX)
# what the kernel uses when no sysctl.d file sets the key (network namespaces start from these)
KERNEL_DEFAULTS = {
    "net.bridge.bridge-nf-call-iptables": 1,
    "net.bridge.bridge-nf-call-ip6tables": 1,
    "net.ipv4.ip_forward": 0,
    "net.ipv6.conf.all.forwarding": 0,
}
assert set(KERNEL_DEFAULTS) == set(SYSCTLS)


@dataclass(frozen=True)
class Teardown:
    """Everything the teardown of one host touches, in the order it is taken off."""

    host: str
    role: str
    data: bool
    units: tuple[str, ...]          # stop/disable order (a worker's first three are special-cased)
    files: tuple[str, ...]          # planned files, absent files, binaries
    trees: tuple[str, ...]          # removed whole (made by the installed components or the installer)
    data_trees: tuple[str, ...]     # removed only with data (else kept)
    dirs: tuple[str, ...]           # removed when empty, deepest first
    users: tuple[tuple[str, str], ...]          # (name, home) created by the installer
    processes: tuple[str, ...]      # binaries whose processes must not survive
    binary_dirs: tuple[str, ...] = ()           # manifest entries here are skipped when binaries=False
    leftovers: tuple[str, ...] = ()                  # globs of installer-made data (with data only)


# --- the script -----------------------------------------------------------------------------

def _sysctl_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


@dataclass(frozen=True)
class Step:
    """One thing a teardown does: what a person reads (``says``: dry runs and confirmations)
    and the script lines that do it (``sh``). ``render_script`` and ``host_plan`` read the same
    list, so the words cannot drift from the script."""
    says: tuple[str, ...] = ()
    sh: tuple[str, ...] = ()


def _head(t: Teardown, root: str) -> list[str]:
    worker = t.role == "worker"
    return [
        f"R={shlex.quote(root)}",
        f"RESTORED={shlex.quote(RESTORED)}",
        f"PREFIXES={shlex.quote('|'.join(CHAIN_PREFIXES))}",
        "FILES=" + shlex.quote("\n".join(t.files)),
        f"CG_UNITS={shlex.quote(' '.join([CONTAINERD_UNIT, KUBELET_UNIT, KUBE_PROXY_UNIT]) if worker else '')}",
        "NAMESPACES=''",
        PRELUDE,
        f"# nothing of hiddenplane was ever on a host without {STATE_DIR}",
        f'[ -d "$R"{q(STATE_DIR)} ] || exit 0',
        exe_pids(t.processes),
        f"SCRIPTS=''; for b in {' '.join(t.processes)}; do "
        "[ \"$(head -c 2 \"$R$b\" 2>/dev/null)\" = '#!' ] && SCRIPTS=\"$SCRIPTS $b\"; done",
        # our services and timers (the routes' repair), also those of an earlier configuration
        f"MANIFEST_UNITS=$(cut -f1 \"$R\"{q(MANIFEST)} 2>/dev/null | sed -n "
        + " ".join(f"-e 's|^{SYSTEMD_DIR}/\\([^/]*\\.{kind}\\)$|\\1|p'" for kind in ("service", "timer"))
        + " | sort -u | "
        f"grep -vxF -e {' -e '.join(shlex.quote(u) for u in sorted(set(t.units)))} || true)",
    ]


def _container_steps(t: Teardown) -> list[Step]:
    """A worker's first three units (kubelet, kube-proxy, containerd) and its containers."""
    first = list(t.units[:3])
    return [
        Step((f"stop and disable {KUBELET_UNIT} and {KUBE_PROXY_UNIT}",), tuple(f"off {q(u)}" for u in first[:2])),
        Step(("kill and delete every container task in every containerd namespace",), (
            "# every container task in every containerd namespace: killed and deleted (its shim exits)",
            f'if [ -x "$R"{q(CTR)} ] && [ -S "$R"{q(CONTAINERD_RUN + "/containerd.sock")} ]; then',
            f'  NAMESPACES=$(timeout 30 "$R"{q(CTR)} namespaces ls -q 2>/dev/null)',
            "  for ns in $NAMESPACES; do",
            f'    for t in $(timeout 30 "$R"{q(CTR)} -n "$ns" tasks ls -q 2>/dev/null); do',
            f'      timeout 60 "$R"{q(CTR)} -n "$ns" tasks kill -a -s SIGKILL "$t" >/dev/null 2>&1',
            f'      timeout 60 "$R"{q(CTR)} -n "$ns" tasks delete -f "$t" >/dev/null 2>&1',
            '      say "killed container $ns/$t"',
            "    done",
            "  done",
            "fi",
            "# containerd's namespaces also from its state directories (when it was not running)",
            f'for d in "$R"{q(CONTAINERD_RUN)}/io.containerd.runtime.v2.task/* '
            f'"$R"{q(CONTAINERD_DATA)}/io.containerd.runtime.v2.task/*; do',
            '  [ -d "$d" ] && NAMESPACES="$NAMESPACES ${d##*/}"',
            "done",
            "# shellcheck disable=SC2086 # one word per namespace",
            "NAMESPACES=$(printf '%s\\n' $NAMESPACES k8s.io | grep -E '^[A-Za-z0-9._-]+$' | sort -u | tr '\\n' ' ')",
        )),
        Step((f"stop and disable {CONTAINERD_UNIT}, then kill what is left in its, the kubelet's and the "
              "pods' cgroups and every process of our binaries (shims, runc, containers)",),
             (f"off {q(first[2])}", "reap")),
        Step((f"unmount what is mounted below {CONTAINERD_RUN}, {CONTAINERD_DATA}, {KUBELET_DIR}; "
              f"remove the pod network namespaces {CNI_NETNS}*",),
             ("unmount_ours",
              f'for f in "$R"{q(CNI_NETNS)}*; do '
              f'if [ -e "$f" ]; then rm -f "$f" && say "removed ${{f#"$R"}}"; fi; done')),
    ]


def _network_steps(t: Teardown) -> list[Step]:
    worker = t.role == "worker"
    out = []
    if worker:
        out.append(Step((f"delete the CNI bridge {network.BRIDGE}",), (
            "# the CNI bridge (and any veth still on it)",
            f"if has ip && ip link show {network.BRIDGE} >/dev/null 2>&1; then",
            f"  ip link delete {network.BRIDGE} && say 'removed the CNI bridge {network.BRIDGE}'",
            "fi",
        )))
    out += [
        Step((f"flush the routes with proto {network.ROUTE_PROTO} (IPv4 and IPv6)",), (
            f"# routes of the pod network carry proto {network.ROUTE_PROTO}",
            "if has ip; then for f in 4 6; do",
            f'  if [ -n "$(ip -$f route show proto {network.ROUTE_PROTO} 2>/dev/null)" ]; then',
            f'    ip -$f route flush proto {network.ROUTE_PROTO}'
            f' && say "removed the IPv$f routes proto {network.ROUTE_PROTO}"',
            "  fi",
            "done; fi",
        )),
        Step(("remove the iptables chains " + ", ".join(f"{p}*" if p.endswith("-") else p for p in CHAIN_PREFIXES)
              + " and the rules jumping to them",),
             (f"clean_rules {posixpath.basename(IPTABLES[4])} ip",
              f"clean_rules {posixpath.basename(IPTABLES[6])} ip6")),
    ]
    if worker:
        # the NetworkPolicy enforcer's table outlives its pod (it fails closed: killed, it leaves
        # its rules): a pod given an address it held is queued to nobody and dropped. Without
        # the nft tool it stays until the next boot (the lab's hosts have none)
        out.append(Step((f"delete the nftables table inet {NETPOL_TABLE} (spec.network.policy)",), (
            f"if has nft && nft list table inet {NETPOL_TABLE} >/dev/null 2>&1; then",
            f"  nft delete table inet {NETPOL_TABLE} && say 'removed the nftables table inet {NETPOL_TABLE}'",
            "fi",
        )))
    if worker:
        out.append(_cilium_step())
    sysctl = ["# forwarding: back to the kernel default, then to what a remaining sysctl.d file says",
              f'if [ -e "$R"{q(SYSCTL_FILE)} ]; then']
    for key, value in KERNEL_DEFAULTS.items():
        path = _sysctl_path(key)
        sysctl.append(f'  if [ -w "$R{path}" ] && [ "$(cat "$R{path}")" != {value} ]; then '
                      f'echo {value} > "$R{path}" && say "set {key} = {value}"; fi')
    prefixes = " ".join(f"--prefix={k}" for k in KERNEL_DEFAULTS)
    sysctl += [f"  rmf {q(SYSCTL_FILE)}",
               f'  if [ -x "$R"{q(SYSCTL_BIN)} ]; then "$R"{q(SYSCTL_BIN)} {prefixes} >/dev/null 2>&1; fi',
               "fi"]
    # only workers are given the sysctl file; the lines run everywhere (a no-op without it)
    says = (f"remove {SYSCTL_FILE}; forwarding back to the kernel default "
            + ", ".join(f"{k}={v}" for k, v in KERNEL_DEFAULTS.items()) + " unless another sysctl.d file sets it",)
    out.append(Step(says if worker else (), tuple(sysctl)))
    return out


def _cilium_step() -> Step:
    """What Cilium's agent left (cni: cilium; nothing to do without it). After the containers:
    the agent is dead, so unpinning its BPF objects detaches its programs (tcx links) for good."""
    pins = " ".join(f'"$R"{q(p.removesuffix("*"))}*' if p.endswith("*") else f'"$R"{q(p)}'
                    for p in cilium.HOST_BPF_PINS)
    says = (f"remove Cilium's interfaces ({cilium.HOST_LINKS.replace('|', ', ')}), its pinned BPF objects "
            f"({', '.join(cilium.HOST_BPF_PINS)}), {cilium.HOST_RUN} (its cgroup2 mount unmounted), "
            + ", ".join(cilium.HOST_FILES) + f"; put back CNI configurations it renamed *{cilium.CNI_BACKUP_SUFFIX}")
    says += "; the routes to other workers' pods it made in native routing (proto kernel, via a gateway)"
    return Step((says,), (
        "# Cilium's, when cni: cilium left them (no-ops otherwise)",
        "if has ip; then",
        "  for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' "
        f"| grep -E '^({cilium.HOST_LINKS})$'); do",
        '    # a veth pair goes whole: its other end may be gone by the time it comes up',
        '    if ip link show "$l" >/dev/null 2>&1 && ip link delete "$l" 2>/dev/null; then '
        'say "removed the link $l"; fi',
        "  done",
        "  # native routing's routes to the other workers' pod ranges: the kernel itself never makes",
        "  # a route through a gateway, and Cilium marks these as the kernel's",
        "  for f in 4 6; do",
        "    ip -$f route show proto kernel 2>/dev/null | grep ' via ' | while read -r r; do",
        "      # its words as they are, never evaluated: a device name may hold $(...) (anyone with",
        "      # CAP_NET_ADMIN in the host's network namespace names devices)",
        "      set -f",
        "      # shellcheck disable=SC2086 # split into words on purpose, globbing off",
        "      set -- $r",
        "      set +f",
        '      ip -$f route del "$@" 2>/dev/null && say "removed the IPv$f route $r"',
        "    done",
        "  done",
        "fi",
        f"for p in {pins}; do",
        '  if [ -e "$p" ]; then rm -rf "$p" && say "removed the BPF pin ${p#"$R"}"; fi',
        "done",
        f'rmd {q("/sys/fs/bpf/tc/globals")}; rmd {q("/sys/fs/bpf/tc")}',
        "awk '{print $5}' \"$R/proc/self/mountinfo\" 2>/dev/null "
        f"| grep {q(f'^{cilium.HOST_RUN}/')} | sort -r | while read -r m; do",
        '  if umount "$R$m" 2>/dev/null || umount -l "$R$m" 2>/dev/null; then say "unmounted $m"; fi',
        "done",
        f"rmtree {q(cilium.HOST_RUN)}",
        *(f"rmf {q(f)}" for f in cilium.HOST_FILES),
        f'for f in "$R"{q(posixpath.dirname(cilium.HOST_FILES[0]))}/*{cilium.CNI_BACKUP_SUFFIX}; do',
        f'  o="${{f%{cilium.CNI_BACKUP_SUFFIX}}}"',
        "  # recorded as restored, as rmf does: the removal of the CNI directory then keeps it",
        '  if [ -e "$f" ] && mv -f "$f" "$o"; then say "put back ${o#"$R"}"; '
        'printf "%s\\n" "${o#"$R"}" >> "$R$RESTORED"; fi',
        "done",
    ))


def _file_steps(t: Teardown) -> list[Step]:
    manifest = [
        f'if [ -f "$R"{q(MANIFEST)} ]; then',
        f'  cut -f1 "$R"{q(MANIFEST)} | sort -u | while IFS= read -r f; do',
        f"    case \"$f\" in {STATE_DIR}/*) continue;; /*) ;; *) continue;; esac",
    ]
    if t.binary_dirs:
        manifest.append("    case \"$f\" in " + " | ".join(f"{shlex.quote(d)}/*" for d in t.binary_dirs)
                        + ") continue;; esac")
    manifest += [
        '    rmf "$f"',
        "  done",
        "fi",
        "# shellcheck disable=SC2086 # one word per unit",
        "if has systemctl; then systemctl daemon-reload >/dev/null 2>&1; "
        f"systemctl reset-failed {q(*t.units)} $MANIFEST_UNITS >/dev/null 2>&1; fi",
    ]
    data_sh = [f"rmtree {q(d)}" for d in t.data_trees] if t.data else []
    if t.data:
        data_sh += [f'for d in "$R"{q(g.rstrip("*"))}*; do [ -e "$d" ] && rmtree "${{d#"$R"}}"; done'
                    for g in t.leftovers]
    return [
        Step(tuple(f"remove {f} (or put back the file it replaced)" for f in t.files if f != SYSCTL_FILE),
             ("# our files (an original that was there before comes back), then what the manifest adds",
              'for f in $FILES; do rmf "$f"; done')),
        Step((f"remove every other file {MANIFEST} lists (written by the installer)",), tuple(manifest)),
        Step(tuple(f"remove {d}" for d in t.trees),
             ("# trees made by us or by the components (credentials, CNI and runtime state)",
              *(f"rmtree {q(d)}" for d in t.trees))),
        Step(tuple(f"remove {d} (data)" if t.data else f"keep {d} (data)" for d in (*t.data_trees, *t.leftovers)),
             tuple(data_sh)),
        Step(("remove these directories when empty: " + ", ".join(t.dirs),), tuple(f"rmd {q(d)}" for d in t.dirs)),
    ]


def _user_steps(t: Teardown) -> list[Step]:
    out = [Step((f"remove the user and group {name} (when `useradd --system` made them)",), (
        f"# the {name} user and group, when they are what `useradd --system --user-group` made for us",
        f"if grep -q '^{name}:[^:]*:[0-9]*:[0-9]*::{home}:/usr/sbin/nologin$' \"$R/etc/passwd\" 2>/dev/null; then",
        f"  gid=$(grep '^{name}:' \"$R/etc/passwd\" | cut -d: -f4)",
        f"  userdel {name} >/dev/null 2>&1 && say 'removed the user {name}'",
        f"  if grep -q \"^{name}:[^:]*:$gid:$\" \"$R/etc/group\" 2>/dev/null; then "
        f"groupdel {name} >/dev/null 2>&1 && say 'removed the group {name}'; fi",
        "fi",
    )) for name, home in t.users]
    if not t.data and t.role == "control":
        out.append(Step(("keep the user etcd (it owns the kept data)",)))
    return out


def _state_step(t: Teardown) -> Step:
    sh = [
        "# anything still there? then keep the state directory: a rerun finishes the job",
        "bad=''",
        'for f in $FILES; do if { [ -e "$R$f" ] || [ -L "$R$f" ]; } && '
        '! grep -qxF "$f" "$R$RESTORED" 2>/dev/null; then bad="$bad $f"; fi; done',
        'p=$(pids | tr "\\n" " ")',
        'if [ -n "$p" ]; then bad="$bad (processes $p)"; fi',
        'if [ -n "$bad" ]; then echo "could not remove:$bad" >&2; exit 1; fi',
    ]
    if t.data:
        sh.append(f'rm -rf "$R"{q(STATE_DIR)} && say {q("removed " + STATE_DIR)}')
    else:
        kept = " ".join(shlex.quote(d) for d in t.data_trees)
        sh += [
            f"# without data: {STATE_DIR} keeps only the list of what was kept, so that a later",
            "# teardown with data still finds this host (and those paths)",
            "kept=''",
            f'for d in {kept}; do [ -e "$R$d" ] && kept="$kept$d\n"; done' if kept else ":",
            # and the list of restored originals: a later teardown must not take them for ours
            f'find "$R"{q(STATE_DIR)} -mindepth 1 -maxdepth 1 ! -name {posixpath.basename(KEPT_DATA)} '
            f"! -name {posixpath.basename(RESTORED)} -exec rm -rf {{}} + 2>/dev/null",
            'if [ -n "$kept" ]; then',
            f'  printf "%b" "$kept" | sort -u > "$R"{q(KEPT_DATA)}',
            f'  say "kept $(printf "%b" "$kept" | sort -u | tr "\\n" " ")(data; {KEPT_DATA} lists it)"',
            "else",
            f'  rm -rf "$R"{q(STATE_DIR)} && say {q("removed " + STATE_DIR)}',
            "fi",
        ]
    return Step((f"remove {STATE_DIR}" + ("" if t.data else f" but for {KEPT_DATA}, the list of kept data"),),
                tuple(sh))


def steps(t: Teardown) -> list[Step]:
    """The teardown of one host, in the order it runs. Pure."""
    worker = t.role == "worker"
    rest = t.units[3:] if worker else t.units
    return [
        *(_container_steps(t) if worker else []),
        Step((f"stop and disable {', '.join(rest)} (those present), and any other unit of ours the "
              "host's manifest lists; kill any process left running one of our binaries",),
             (*(f"off {q(u)}" for u in rest), 'for u in $MANIFEST_UNITS; do off "$u"; done', "reap")),
        *_network_steps(t),
        *_file_steps(t),
        *_user_steps(t),
        _state_step(t),
    ]


def render_script(t: Teardown, root: str = "") -> str:
    """Pure: the POSIX sh script of ``t``. ``root`` prefixes every path the script touches
    (tests run it against a directory); it is empty on a real host."""
    return "\n".join(_head(t, root) + [line for s in steps(t) for line in s.sh]) + "\nexit 0\n"
