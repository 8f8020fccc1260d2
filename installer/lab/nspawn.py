"""systemd-nspawn hosts: an overlay root over the cached base, booted in its own netns.

Started with --register=no (no machined, no system D-Bus here) and --keep-unit, detached with
setsid; the nspawn PID is kept in the host's directory. SIGTERM to nspawn shuts the container
down cleanly (it asks the container's systemd to halt).

Each host gets its own cgroup (``hiddenplane/<lab>/<host>`` in the name=systemd and cgroup2
hierarchies) before nspawn starts. With --keep-unit and no systemd on the machine, nspawn puts
its payload under its own cgroup: started from the root cgroup, every container of every lab
shared ``/payload``, and their systemds created and removed each other's unit cgroups (units
failing with 219/CGROUP at boot, and at shutdown a failed systemd-halt.service that left the
container running forever after nspawn was killed). The cgroup is also how ``stop`` knows that
every process of the host is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from installer.lab import cilium as lab_cilium
from installer.lab.model import LabError, LabHost
from installer.lab.seed import write_files


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def _mounted(path: Path) -> bool:
    return str(path.resolve()) in _mount_points()


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    return [m for m in _mount_points() if m.startswith(prefix)]


def mount_root(base: Path, host_dir: Path, files: dict[str, tuple[bytes, int]],
               links: dict[str, str] | None = None) -> Path:
    """The host's root, an overlay over ``base``; ``files`` and symlinks ``links`` (path ->
    target) laid into the upper layer before the mount, so they shadow the base's."""
    upper, work, root = host_dir / "upper", host_dir / "work", host_dir / "root"
    for d in (upper, work, root):
        d.mkdir(parents=True, exist_ok=True)
    write_files(upper, files)
    for link, target in (links or {}).items():
        path = upper / link.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_symlink():
            path.symlink_to(target)
    if not _mounted(root):
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                               f"lowerdir={base},upperdir={upper},workdir={work}", str(root)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise LabError(f"mount overlay for {host_dir.name}: {proc.stderr.strip()}")
    return root


def unmount_root(host_dir: Path) -> None:
    root = host_dir / "root"
    if root.exists() and _mounted(root):
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def pid_of(host_dir: Path) -> int | None:
    """The running nspawn PID of this host, or None (a stale pidfile counts as not running)."""
    try:
        pid = int((host_dir / "pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):     # gone, or exiting right now (ESRCH)
        return None
    # the PID may have been reused by an unrelated process since
    if not cmdline or not cmdline[0].endswith(b"systemd-nspawn") or str(host_dir / "root").encode() not in cmdline:
        return None
    return pid


CGROUP_DIR = "hiddenplane"


def _cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy of the machine: each cgroup v1 controller, name=systemd and cgroup2.
    A host gets its own cgroup in each: nspawn's cgroup namespace then roots the host's view of
    every controller there, so a kubelet's ``kubepods`` of one host is not another's."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype = (post.split() + [""])[0]
            if fstype in ("cgroup", "cgroup2"):
                found.append(Path(pre.split()[4]))
    return found


_CGROUP_MAKING = threading.Lock()      # hosts boot in parallel threads and share parents


def _make_cgroup(top: Path, path: Path) -> None:
    """mkdir the cgroup ``path`` and its parents below the hierarchy's mount ``top``; a new
    cpuset cgroup holds no CPU and no memory node until given its parent's (no process could be
    moved into it)."""
    with _CGROUP_MAKING:
        d = top
        for part in path.relative_to(top).parts:
            d = d / part
            d.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                f = d / name
                if f.exists() and not f.read_text().strip():
                    f.write_text((d.parent / name).read_text())


def cgroup_dirs(host_dir: Path) -> list[Path]:
    """The host's own cgroup in each hierarchy (``host_dir`` is <labs>/<lab>/hosts/<host>)."""
    lab, host = host_dir.parent.parent.name, host_dir.name
    return [m / CGROUP_DIR / lab / host for m in _cgroup_mounts()]


DEFAULT_CPU_SHARES = 1024


def lab_cpu_shares(lab: str, shares: int) -> int | None:
    """Give every host of the lab ``lab`` together this CPU weight against the other labs (cgroup
    v1 ``cpu.shares`` of ``hiddenplane/<lab>``; 1024 is the kernel's default, every lab's); the
    weight it had, or None on a machine without that hierarchy or lab."""
    for top in _cgroup_mounts():
        f = top / CGROUP_DIR / lab / "cpu.shares"
        if f.exists():
            old = int(f.read_text())
            f.write_text(f"{shares}\n")
            return old
    return None


def _make_cgroups(host_dir: Path) -> list[Path]:
    dirs = cgroup_dirs(host_dir)
    for d in dirs:
        _make_cgroup(d.parents[2], d)          # <mount>/hiddenplane/<lab>/<host>
    return dirs


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _cgroups(top: Path, deepest_first: bool = False) -> list[Path]:
    """Every cgroup directory under ``top`` (``top`` too). The tree changes while it is read (the
    host's systemd removes a unit's cgroup once its processes are gone): a directory gone by the
    time it is listed is left out, never an error (pathlib's rglob raised FileNotFoundError on
    one: `lab down` after the chaos test failed so once in CI)."""
    return [Path(d) for d, _, _ in os.walk(top, topdown=not deepest_first)]


def cgroup_pids(host_dir: Path) -> list[int]:
    """Live processes in the host's cgroup tree (zombies hold nothing and do not count)."""
    pids = set()
    for top in cgroup_dirs(host_dir):
        if not top.is_dir():
            continue
        for d in _cgroups(top):
            try:
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                continue
    return sorted(p for p in pids if _state(p) not in (None, "Z", "X"))


def _remove_cgroups(host_dir: Path) -> None:
    for top in cgroup_dirs(host_dir):
        if not top.is_dir():
            continue
        # a cgroup is removed with rmdir, children first; its control files go with it
        for d in _cgroups(top, deepest_first=True):       # top last
            try:
                d.rmdir()
            except OSError:
                pass
        for parent in (top.parent, top.parent.parent):     # <lab>, then hiddenplane, once empty
            try:
                parent.rmdir()
            except OSError:
                break


def _enter_cgroups(procs_files: list[bytes]):
    """For preexec_fn: only os-level calls, no Python locks, as the child of a threaded parent."""
    def enter():
        for path in procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
    return enter


# What a host that runs pods needs of nspawn (a worker: kubelet, containerd, runc):
# - runc joins a session keyring for each container; nspawn's seccomp filter refuses keyctl
#   ("unable to join session keyring") unless the @keyring set is allowed;
# - the kubelet opens /dev/kmsg (its OOM watcher) and fails without it; reading it takes
#   CAP_SYSLOG where dmesg_restrict is 1;
# - the kubelet writes the kernel tunables it wants (vm.overcommit_memory=1, kernel.panic=10,
#   kernel.panic_on_oops=1) when they differ, and /proc/sys is read-only here: the host sees
#   files of its own holding those values (SYSCTL_FILES, seeded; the machine's stay as they are);
# - the cgroup v1 controllers are mounted read-only: CGROUP_RW_UNIT remounts them writable.
POD_HOST_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
SYSCTL_FILES = "/etc/hiddenplane-lab/sysctl"
POD_HOST_ARGS = ("--system-call-filter=@keyring", "--capability=CAP_SYSLOG", "--bind=/dev/kmsg",
                 *(f"--bind-ro={SYSCTL_FILES}/{k.replace('/', '.')}:/proc/sys/{k}" for k in POD_HOST_SYSCTLS))
CGROUP_RW_UNIT = """[Unit]
Description=hiddenplane lab: make the cgroup v1 controllers writable (nspawn mounts them read-only)
DefaultDependencies=no
Before=sysinit.target containerd.service kubelet.service
ConditionPathIsMountPoint=/sys/fs/cgroup/memory

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for c in /sys/fs/cgroup/*; do case "$(stat -f -c %%T "$c")" in \
cgroupfs) mount -o remount,bind,rw "$c" || exit 1;; esac; done'

[Install]
WantedBy=sysinit.target
"""


def pod_host_files(bpf: bool = False) -> dict[str, tuple[bytes, int]]:
    """Seed files of a host that runs pods: the sysctl files and the unit remounting the
    controllers (enabled by its symlink); ``bpf``: lab/cilium.py's BPF_HOST_UNIT, too."""
    files = {f"{SYSCTL_FILES}/{k.replace('/', '.')}": (f"{v}\n".encode(), 0o444) for k, v in POD_HOST_SYSCTLS.items()}
    files["/etc/systemd/system/hiddenplane-lab-cgroup-rw.service"] = (CGROUP_RW_UNIT.encode(), 0o644)
    # a pod's process that ignores SIGTERM (a shell) would hold the host's shutdown for the
    # default 90 s; `lab down` kills what is left after its own timeout anyway
    files["/etc/systemd/system.conf.d/hiddenplane-lab.conf"] = (b"[Manager]\nDefaultTimeoutStopSec=10s\n", 0o644)
    if bpf:
        files["/etc/systemd/system/hiddenplane-lab-bpf-host.service"] = (lab_cilium.BPF_HOST_UNIT.encode(), 0o644)
    return files


POD_HOST_LINKS = {"/etc/systemd/system/sysinit.target.wants/hiddenplane-lab-cgroup-rw.service":
                  "/etc/systemd/system/hiddenplane-lab-cgroup-rw.service"}


def pod_host_links(bpf: bool = False) -> dict[str, str]:
    if not bpf:
        return POD_HOST_LINKS
    unit = "/etc/systemd/system/hiddenplane-lab-bpf-host.service"
    return {**POD_HOST_LINKS, f"/etc/systemd/system/sysinit.target.wants/{unit.rsplit('/', 1)[1]}": unit}


def boot(host: LabHost, host_dir: Path, root: Path, binds: list[tuple[Path, str]] = (), *,
         pods: bool = False, bpf: bool = False) -> int:
    """Start the host's nspawn; ``pods``: with what a kubelet, containerd and runc need (above);
    ``bpf``: and what Cilium's agent needs (lab/cilium.py's BPF_HOST_ARGS)."""
    if (pid := pid_of(host_dir)) is not None:
        return pid
    cmd = ["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit", "-b",
           f"--network-namespace-path=/run/netns/{host.netns}", f"--machine={host.name}",
           # routes, the CNI bridge and iptables of the pod network, like any real host: the
           # capability acts on the host's own network namespace (the machine's is out of reach)
           "--capability=CAP_NET_ADMIN"]
    if pods:
        cmd += POD_HOST_ARGS
    if bpf:
        cmd += lab_cilium.BPF_HOST_ARGS
    cmd += [f"--bind={src}:{dst}" for src, dst in binds]
    # /proc/sys/net is per network namespace: writable for the host's own forwarding and
    # bridge settings, harmless to the machine; the rest of /proc/sys stays read-only.
    # nspawn's own messages go to the console log too: with stderr not a terminal it would
    # otherwise log to the machine's journal (or kmsg), and a host that dies at once leaves an
    # empty console log
    env = {**os.environ, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "network", "SYSTEMD_LOG_TARGET": "console"}
    if leftover := cgroup_pids(host_dir):
        raise LabError(f"{host.name}: processes {leftover} of an earlier boot are still alive in its cgroup")
    procs = []
    for d in _make_cgroups(host_dir):
        procs.append(bytes(d / "cgroup.procs"))
    return _spawn(cmd, host_dir, env, procs)


def _spawn(cmd: list[str], host_dir: Path, env: dict[str, str], procs: list[bytes]) -> int:
    """Start ``cmd`` detached, output to the host's console log, inside the cgroups whose
    ``cgroup.procs`` files are ``procs``; its PID goes to the host's pidfile."""
    with open(host_dir / "console.log", "ab") as console, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=console, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_enter_cgroups(procs))
    (host_dir / "pid").write_text(f"{proc.pid}\n")
    _STARTED[proc.pid] = proc
    return proc.pid


# Every nspawn this process started, by PID, for its whole life: a dropped Popen of a running
# child goes to subprocess's own list, and the next Popen anywhere reaps it there, losing the
# exit status the report on a host that did not boot must show (seen in CI: "not running"
# with no status).
_STARTED: dict[int, subprocess.Popen] = {}


def _poll(pid: int) -> int | None:
    """``pid``'s exit code (minus the signal number when a signal ended it), reaping it, once it
    has ended and is our child; None while it runs or when it is not ours."""
    if (proc := _STARTED.get(pid)) is not None:
        return proc.poll()
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def exit_status(host_dir: Path) -> str | None:
    """How this host's nspawn ended, when this process started it and it has ended (its zombie
    is reaped here); None otherwise."""
    try:
        pid = int((host_dir / "pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    code = _poll(pid)
    if code is None:
        return None
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def describe_pids(pids: list[int]) -> list[str]:
    """``pid state command line`` of each (for a report on a host that did not come up)."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        out.append(f"{pid} {_state(pid) or '?'} {cmd[:160] or '[' + _comm(pid) + ']'}")
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _thaw(host_dir: Path) -> None:
    """Thaw every frozen cgroup of the host (v1 freezer.state, v2 cgroup.freeze): a frozen
    process shows as D and a SIGKILL takes effect only once it runs again."""
    for top in cgroup_dirs(host_dir):
        for d in _cgroups(top):
            for name, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                try:
                    if (d / name).read_text().strip() not in ("THAWED", "0"):
                        (d / name).write_text(thawed)
                except OSError:
                    continue


def _kill_all(host_dir: Path) -> None:
    _thaw(host_dir)
    for pid in cgroup_pids(host_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_empty(host_dir: Path, pid: int | None, timeout: float, kill: bool = False) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if kill:
            _kill_all(host_dir)     # again each round: a process forked meanwhile is killed too
        if pid is not None:
            _poll(pid)          # reaps it when we are its parent
        if pid_of(host_dir) is None and not cgroup_pids(host_dir):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def stop(host_dir: Path, timeout: float = 30, kill_timeout: float = 30) -> None:
    """Stop the host and return only once every process of it is gone (a container whose
    shutdown hangs is killed after ``timeout``); raises LabError if some process survives."""
    pid = pid_of(host_dir)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    if not _wait_empty(host_dir, pid, timeout if pid is not None else 0):
        # killing nspawn alone leaves the container's init running as an orphan: kill them all
        if not _wait_empty(host_dir, pid, kill_timeout, kill=True):
            raise LabError(f"{host_dir.name}: processes {cgroup_pids(host_dir)} survived SIGKILL; "
                           "the host's mounts and network are kept")
    (host_dir / "pid").unlink(missing_ok=True)
    _remove_cgroups(host_dir)
