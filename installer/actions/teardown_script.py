"""The teardown of one host as data and as a script, pure: ``Teardown`` (what the host holds, in
the order it is taken off), ``steps`` (each thing done: the words a person reads and the sh lines
that do it) and ``render_script`` (the POSIX sh script of those steps). installer/actions/teardown.py
derives the ``Teardown`` of a host and runs the script; its docstring has the rules."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from installer.core import components, network
from installer.core.facts import MANIFEST, STATE_DIR
from installer.host.hostops import BACKUP_INFIX, q
from installer.core.render.control import AUDIT_DIR
from installer.core.render.files import BIN_DIR, SYSTEMD_DIR
from installer.core.render.network import IPTABLES, SYSCTL_BIN, SYSCTL_FILE
from installer.core.render.worker import KUBELET_DIR, SYSCTLS

KUBELET_UNIT, KUBE_PROXY_UNIT, CONTAINERD_UNIT = components.units("kubelet", "kube-proxy", "containerd")
CTR = f"{BIN_DIR}/ctr"
CONTAINERD_RUN = "/run/containerd"
CONTAINERD_DATA = "/var/lib/containerd"
CONTAINERD_OPT = "/opt/containerd"      # containerd's "opt" plugin makes it (empty bin/, lib/)
CNI_STATE = "/var/lib/cni"              # host-local leases, the CNI result cache
CNI_NETNS = "/run/netns/cni-"           # network namespaces containerd's CRI makes for pods
KEPT_DATA = f"{STATE_DIR}/kept-data"    # what a teardown without data left behind
RESTORED = f"{STATE_DIR}/restored"      # backups already moved back (an interrupted run resumes)
LOG_DIR = posixpath.dirname(AUDIT_DIR)  # /var/log/kubernetes
# chains the installed components add (kube-proxy, the kubelet, the CNI portmap plugin) and ours
CHAIN_PREFIXES = ("KUBE-", "CNI-", network.MASQ_CHAIN)
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

_PRELUDE = r"""set -u
PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
say() { printf '%s\n' "$*"; }
has() { command -v "$1" >/dev/null 2>&1; }
# stop and disable a unit of ours (its unit file is ours: planned or in the manifest)
off() {
  has systemctl || return 0
  case "$(systemctl is-active "$1" 2>/dev/null)" in
    active|activating|reloading|deactivating) systemctl stop "$1" >/dev/null 2>&1 && say "stopped $1";;
  esac
  case "$(systemctl is-enabled "$1" 2>/dev/null)" in
    enabled|enabled-runtime) systemctl disable --quiet "$1" >/dev/null 2>&1 && say "disabled $1";;
  esac
  for l in "$R"/etc/systemd/system/*.wants/"$1"; do
    if [ -L "$l" ] && [ "$(readlink "$l")" = "/etc/systemd/system/$1" ]; then rm -f "$l"; say "removed ${l#$R}"; fi
  done
}
# one of our files: its pre-hiddenplane original comes back if there is one, else it goes
# (backup names end in a sortable time stamp: the first one the glob lists is the oldest)
rmf() {
  p="$R$1"
  if [ -s "$R$RESTORED" ] && grep -qxF "$1" "$R$RESTORED"; then return 0; fi
  b=''; n=0
  for x in "$p"BACKUP*; do
    [ -e "$x" ] || continue
    if [ -z "$b" ]; then b=$x; else n=$((n+1)); fi
  done
  if [ -n "$b" ]; then
    mv -f "$b" "$p" && say "restored $1 (the file that was there before hiddenplane)"
    printf '%s\n' "$1" >> "$R$RESTORED"
    if [ "$n" -gt 0 ]; then say "kept $n newer backup(s) of $1 (not written by hiddenplane)"; fi
  elif [ -e "$p" ] || [ -L "$p" ]; then
    rm -f "$p" && say "removed $1"
  fi
}
# a tree made by us or our components goes whole; but files that were there before hiddenplane
# (restored from a backup, or a newer backup) stay, with the directories holding them; a mount
# point is emptied, never removed
rmtree() {
  p="$R$1"
  [ -e "$p" ] || return 0
  keep=''
  if [ -e "$R$RESTORED" ] && grep -q "^$1/" "$R$RESTORED"; then keep=1; fi
  if [ -n "$(find "$p" -name '*BACKUP*' -print 2>/dev/null | head -n 1)" ]; then keep=1; fi
  if [ -n "$keep" ]; then
    find "$p" -depth ! -type d -print 2>/dev/null | while IFS= read -r f; do
      case "$f" in *BACKUP*) continue;; esac
      if [ -e "$R$RESTORED" ] && grep -qxF "${f#$R}" "$R$RESTORED"; then continue; fi
      rm -f "$f"
    done
    find "$p" -depth -mindepth 1 -type d -empty -delete 2>/dev/null
    say "emptied $1 but for the files that were there before hiddenplane"
  elif awk '{print $5}' "$R/proc/self/mountinfo" 2>/dev/null | grep -qxF "$1"; then
    if [ -n "$(ls -A "$p" 2>/dev/null)" ]; then
      find "$p" -mindepth 1 -maxdepth 1 -exec rm -rf {} + && say "emptied $1 (a mount point: kept)"
    fi
  else
    rm -rf "$p" && say "removed $1"
  fi
}
rmd() { if [ -d "$R$1" ] && [ ! -L "$R$1" ] && rmdir "$R$1" 2>/dev/null; then say "removed $1/"; fi; }
# cgroup directories of our worker units, of pods and of containerd's namespaces (ctr run
# puts a container in /<namespace>/<id> of every hierarchy)
hierarchies() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' "$R/proc/self/mounts" 2>/dev/null; }
cgdirs() {
  for h in $(hierarchies); do
    for u in $CG_UNITS; do [ -d "$R$h/system.slice/$u" ] && printf '%s\n' "$R$h/system.slice/$u"; done
    [ -n "$CG_UNITS" ] || continue
    for d in "$R$h"/kubepods*; do [ -d "$d" ] && printf '%s\n' "$d"; done
    for ns in $NAMESPACES; do [ -d "$R$h/$ns" ] && printf '%s\n' "$R$h/$ns"; done
  done
}
# processes in those cgroups, and processes running one of our binaries (a few processes for
# all of them: forks are slow on an emulated VM). 0 stands for a process of another PID
# namespace sharing a cgroup: never a target (kill -9 0 would hit our own process group)
pids() {
  {
    cgdirs | while read -r d; do find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null; done
    exe_pids
    # an interpreted binary (#!) runs as its interpreter: matched by its first argument
    for b in $SCRIPTS; do
      grep -lsF -- "$b" "$R"/proc/[0-9]*/cmdline 2>/dev/null | while read -r c; do
        [ "$(tr '\0' '\n' 2>/dev/null < "$c" | sed -n 2p)" = "$b" ] && { c=${c%/cmdline}; printf '%s\n' "${c##*/}"; }
      done
    done
  } | grep -E '^[1-9][0-9]*$' | grep -vx -e 1 -e "$$" | sort -un | while read -r x; do
    kill -0 "$x" 2>/dev/null && printf '%s\n' "$x"
  done
}
reap() {
  i=0; killed=0
  while [ $i -lt 20 ]; do
    p=$(pids)
    [ -n "$p" ] || break
    for x in $p; do kill -9 "$x" 2>/dev/null && killed=$((killed+1)); done
    i=$((i+1)); sleep 0.3
  done
  if [ "$killed" -gt 0 ]; then say "killed $killed leftover process(es) (shims, runc, containers, components)"; fi
  left=$(pids)
  if [ -n "$left" ]; then echo "processes survived SIGKILL: $left" >&2; fi
  # the pods' and namespaces' cgroups, now empty (systemd removes its units' own)
  for h in $(hierarchies); do
    [ -n "$CG_UNITS" ] || continue
    for d in "$R$h"/kubepods* $(for ns in $NAMESPACES; do printf '%s\n' "$R$h/$ns"; done); do
      [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
  done
  return 0
}
unmount_ours() {
  awk '{print $5}' "$R/proc/self/mountinfo" 2>/dev/null | while read -r m; do
    case "$m" in RUNC/*|DATAC/*|KUBELET/*|NETNS*) printf '%s\n' "$m";; esac
  done | sort -r | while read -r m; do
    if umount "$R$m" 2>/dev/null || umount -l "$R$m" 2>/dev/null; then say "unmounted $m"; fi
  done
}
# rules of ours and of the components in every table: first the jumps from other chains,
# then the chains; a nat table left empty by this is dropped when nft can (iptables cannot)
chains() {
  t=$1; ipt=$2
  "$ipt-save" -t "$t" 2>/dev/null | sed -n 's/^:\([^ ]*\) .*/\1/p' | grep -E "^($PREFIXES)" || true
}
clean_rules() {
  ipt=$1; fam=$2
  has "$ipt" && has "$ipt-save" || return 0
  for t in filter nat mangle raw; do
    ours=$(chains "$t" "$ipt")
    [ -n "$ours" ] || continue
    "$ipt-save" -t "$t" 2>/dev/null | grep '^-A ' | grep -Ev "^-A ($PREFIXES)" \
      | grep -E -- "-[jg] ($PREFIXES)" | sed 's/^-A //' | while read -r rule; do
        eval "\"$ipt\" -w -t $t -D $rule" 2>/dev/null && say "removed $fam $t rule: $rule"
      done
    for c in $ours; do "$ipt" -w -t "$t" -F "$c" 2>/dev/null; done
    for c in $ours; do "$ipt" -w -t "$t" -X "$c" 2>/dev/null && say "removed $fam $t chain $c"; done
    if [ "$t" = nat ] && has nft && "$ipt" -V 2>/dev/null | grep -q nf_tables \
       && [ -z "$("$ipt-save" -t nat 2>/dev/null | grep -E '^-A |^:[^ ]+ (-|DROP)')" ]; then
      nft delete table "$fam" nat 2>/dev/null && say "removed the empty $fam nat table"
    fi
  done
}
""".replace("BACKUP", BACKUP_INFIX).replace("RUNC", CONTAINERD_RUN).replace("DATAC", CONTAINERD_DATA) \
    .replace("KUBELET", KUBELET_DIR).replace("NETNS", CNI_NETNS)


def _exe_pids(binaries: Sequence[str]) -> str:
    """A shell function printing the PIDs whose executable is one of ``binaries`` (also once
    the file is deleted), with one find for all."""
    tests = " -o ".join(f"-lname {shlex.quote(b)} -o -lname {shlex.quote(b + ' (deleted)')}" for b in binaries)
    if not tests:
        return "exe_pids() { :; }"
    return (f'exe_pids() {{ find "$R"/proc/[0-9]*/exe -maxdepth 0 \\( {tests} \\) -print 2>/dev/null '
            "| sed -n 's|.*/proc/\\([0-9]*\\)/exe$|\\1|p'; }")


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
        _PRELUDE,
        f"# nothing of hiddenplane was ever on a host without {STATE_DIR}",
        f'[ -d "$R"{q(STATE_DIR)} ] || exit 0',
        _exe_pids(t.processes),
        f"SCRIPTS=''; for b in {' '.join(t.processes)}; do "
        "[ \"$(head -c 2 \"$R$b\" 2>/dev/null)\" = '#!' ] && SCRIPTS=\"$SCRIPTS $b\"; done",
        f"MANIFEST_UNITS=$(cut -f1 \"$R\"{q(MANIFEST)} 2>/dev/null | "
        f"sed -n 's|^{SYSTEMD_DIR}/\\([^/]*\\.service\\)$|\\1|p' | sort -u | "
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
            "NAMESPACES=$(printf '%s\\n' $NAMESPACES k8s.io | grep -E '^[A-Za-z0-9._-]+$' | sort -u | tr '\\n' ' ')",
        )),
        Step((f"stop and disable {CONTAINERD_UNIT}, then kill what is left in its, the kubelet's and the "
              "pods' cgroups and every process of our binaries (shims, runc, containers)",),
             (f"off {q(first[2])}", "reap")),
        Step((f"unmount what is mounted below {CONTAINERD_RUN}, {CONTAINERD_DATA}, {KUBELET_DIR}; "
              f"remove the pod network namespaces {CNI_NETNS}*",),
             ("unmount_ours",
              f'for f in "$R"{q(CNI_NETNS)}*; do if [ -e "$f" ]; then rm -f "$f" && say "removed ${{f#$R}}"; fi; done')),
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
            f'    ip -$f route flush proto {network.ROUTE_PROTO} && say "removed the IPv$f routes proto {network.ROUTE_PROTO}"',
            "  fi",
            "done; fi",
        )),
        Step(("remove the iptables chains " + ", ".join(f"{p}*" if p.endswith("-") else p for p in CHAIN_PREFIXES)
              + " and the rules jumping to them",),
             (f"clean_rules {posixpath.basename(IPTABLES[4])} ip", f"clean_rules {posixpath.basename(IPTABLES[6])} ip6")),
    ]
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
        "if has systemctl; then systemctl daemon-reload >/dev/null 2>&1; "
        f"systemctl reset-failed {q(*t.units)} $MANIFEST_UNITS >/dev/null 2>&1; fi",
    ]
    data_sh = [f"rmtree {q(d)}" for d in t.data_trees] if t.data else []
    if t.data:
        data_sh += [f'for d in "$R"{q(g.rstrip("*"))}*; do [ -e "$d" ] && rmtree "${{d#$R}}"; done' for g in t.leftovers]
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
    return Step((f"remove {STATE_DIR}" + ("" if t.data else f" but for {KEPT_DATA}, the list of kept data"),), tuple(sh))


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
