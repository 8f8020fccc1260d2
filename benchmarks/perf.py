"""The performance figures of issue 15 in one table, every figure a whole `installer` process:

  `installer --help`, `installer validate` (3+50 inventory)        <= 0.5 s each
  `installer plan --render` of 3+50, warm state (no hosts)         <= 1 s
  no-op `apply` and `plan --check` on a converged lab              <= 2x the plain-ssh floor
  no-op 1+20 / no-op 1+2                                           <= 1.3x
  cold apply 1+20                                                  <= 24 s and <= 2x cold 1+2

The plain-ssh floor is OpenSSH `ssh` to every host of the lab at once, each running the
installer's own facts probe with the stdin the installer sends. The physical floor of a cold
apply is one parallel raw copy of the bytes that apply uploaded to each host, plus a restart of
that host's units. Ansible (ansible-core from PyPI, in a venv outside the checkout) runs
benchmarks/ansible/converge.yml, the same file + unit convergence, for comparison (no target).
Stand-in labs (tests/standins, cluster-bootstrap skipped); `--real` adds a 1+2 lab with the
built binaries (scripts/build-kubernetes), cold apply up to every Node Ready.

Runs are interleaved (no-op, check, floor, ansible; then again) and medians reported. One lab
at a time (the hosts share this machine's CPUs). Needs root. Prints figures and MET / NOT MET;
never fails on a time (exit 0). Every lab is removed at the end, even on error.

Run from the repository root:
  sudo .venv/bin/python benchmarks/perf.py [--runs 3] [--real] [--no-ansible] [--sizes 2,20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from installer.core.cluster import resolve
from installer.core.facts import PROBE, probe_input
from installer.engine import runner
from installer.engine.context import Options
from installer.engine.parts import binaries_part, managed_paths
from installer.host.runmark import shell_command
from installer.lab.model import built_artifacts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render import inventory as generated_inventory  # noqa: E402 - benchmarks/render.py

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = str(Path(sys.executable).with_name("installer"))
PLAYBOOK = Path(__file__).resolve().parent / "ansible" / "converge.yml"
ANSIBLE_CORE = "2.19.14"        # the newest ansible-core pip offers for Python 3.11
ANSIBLE_VENV = Path(f"/var/cache/hiddenplane/bench/ansible-core-{ANSIBLE_CORE}")
STANDIN_LABS = {2: ("bperf2", "10.213.231.0/24"), 20: ("bperf20", "10.213.232.0/24")}
REAL_LAB = ("bperf3r", "10.213.233.0/24")
SKIP = frozenset({"cluster-bootstrap"})      # the stand-ins answer no API call


@dataclass(frozen=True)
class Fig:
    key: str                        # the raw runs whose median is the measured value
    label: str
    ref: float | str | None = None  # what the ratio divides by: seconds, or another figure's key
    limit: float | None = None      # the target: ratio <= limit (None: printed, no target)


FIGURES = (
    Fig("help", "installer --help", 0.5, 1),
    Fig("validate", "installer validate, 3+50 inventory", 0.5, 1),
    Fig("render", "plan --render 3+50, warm state", 1.0, 1),
    Fig("floor2", "plain-ssh floor 1+2"),
    Fig("noop2", "no-op apply 1+2", "floor2", 2),
    Fig("check2", "plan --check 1+2", "floor2", 2),
    Fig("ansible2", "ansible no-op 1+2"),
    Fig("noop2", "no-op apply 1+2 vs ansible", "ansible2"),
    Fig("floor20", "plain-ssh floor 1+20"),
    Fig("noop20", "no-op apply 1+20", "floor20", 2),
    Fig("check20", "plan --check 1+20", "floor20", 2),
    Fig("noop20", "no-op apply 1+20 vs 1+2", "noop2", 1.3),
    Fig("ansible20", "ansible no-op 1+20"),
    Fig("noop20", "no-op apply 1+20 vs ansible", "ansible20"),
    Fig("cold2", "cold apply 1+2"),
    Fig("phys2", "physical floor of cold 1+2"),
    Fig("cold2", "cold apply 1+2 vs physical floor", "phys2"),
    Fig("cold20", "cold apply 1+20", 24.0, 1),
    Fig("cold20", "cold apply 1+20 vs cold 1+2", "cold2", 2),
    Fig("phys20", "physical floor of cold 1+20"),
    Fig("cold20", "cold apply 1+20 vs physical floor", "phys20"),
    Fig("cold-real", "real 1+2: cold apply to Nodes Ready"),
    Fig("floor-real", "real 1+2: plain-ssh floor"),
    Fig("noop-real", "real 1+2: no-op apply", "floor-real", 2),
    Fig("check-real", "real 1+2: plan --check", "floor-real", 2),
)


def quiet(*_) -> None:
    return None


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(cmd: list, ok=(0,), env=None, cwd=None) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of one whole process; an exit status not in ``ok`` raises."""
    t = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, env=env, cwd=cwd)
    seconds = time.perf_counter() - t
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n"
                           f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return seconds, proc


def parallel_ssh(ssh: list[str], jobs: dict[str, tuple[str, Path]]) -> float:
    """Wall seconds of one `ssh` per address, all started together, each running its command with
    stdin from its file; waits for all. Any non-zero exit raises."""
    inputs = {addr: open(path, "rb") for addr, (_, path) in jobs.items()}
    try:
        t = time.perf_counter()
        procs = {addr: subprocess.Popen([*ssh, f"root@{addr}", cmd], stdin=inputs[addr], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE) for addr, (cmd, _) in jobs.items()}
        errors = {addr: p.communicate()[1] for addr, p in procs.items()}
        seconds = time.perf_counter() - t
    finally:
        for f in inputs.values():
            f.close()
    failed = {a: e.decode(errors="replace")[-300:] for a, e in errors.items() if procs[a].returncode != 0}
    if failed:
        raise RuntimeError(f"ssh failed: {failed}")
    return seconds


class Measures(dict):
    """key -> the seconds of each run."""

    def add(self, key: str, seconds: float) -> None:
        self.setdefault(key, []).append(seconds)

    def median(self, key: str) -> float:
        return statistics.median(self[key])


# --- a lab -----------------------------------------------------------------------------------

@dataclass
class Lab:
    name: str
    subnet: str
    workers: int
    tmp: Path
    tag: str                       # suffix of its figures' keys: "2", "20", "-real"
    real: bool = False

    @property
    def inventory(self) -> Path:
        return self.tmp / f"{self.name}.inventory.yaml"

    @property
    def state(self) -> Path:
        return self.tmp / f"{self.name}-state"

    @property
    def skip(self) -> frozenset[str]:
        return frozenset() if self.real else SKIP

    def cli(self, command: str, *extra) -> list:
        skip = [a for p in sorted(self.skip) for a in ("--skip", p)]
        return [INSTALLER, *command.split(), self.inventory, "--state", self.state, *skip, *extra]

    def up(self) -> None:
        t = time.perf_counter()
        artifacts = [] if self.real else ["--no-artifacts"]
        timed([INSTALLER, "lab", "up", "--name", self.name, "--control", 1, "--workers", self.workers,
               "--subnet", self.subnet, "--inventory", self.inventory, *artifacts])
        if not self.real:
            timed([sys.executable, "-m", "tests.standins", "install",
                   f"/var/lib/hiddenplane/labs/{self.name}/artifacts"], cwd=ROOT)
        print(f"{self.name}: lab up 1+{self.workers} in {time.perf_counter() - t:.1f} s (load average {load()})",
              flush=True)

    def ssh(self) -> list[str]:
        """OpenSSH with the inventory's key and known_hosts (host keys checked)."""
        ssh = yaml.safe_load(self.inventory.read_text())["spec"]["ssh"]
        return ["ssh", "-i", ssh["keyPath"], "-o", f"UserKnownHostsFile={ssh['knownHosts']}", "-o", "BatchMode=yes"]


def lab_down(name: str) -> None:
    subprocess.run([INSTALLER, "lab", "down", "--name", name], capture_output=True, timeout=300)


# --- what the installer itself knows about the hosts -----------------------------------------

def installer_view(lab: Lab) -> runner.Context:
    """The installer's plans and resolved artifacts, as its apply has them before it connects."""
    ctx = runner.context(resolve(lab.inventory, lab.state), Options(skip=lab.skip), log=quiet)
    runner._resolve_artifacts(ctx)
    return ctx


def probe(ctx: runner.Context, host: str) -> tuple[str, bytes]:
    """The installer's facts probe of ``host``: the command line its Remote.run sends (the script
    as `sh -c SCRIPT`, unscoped) and the stdin (installer/engine/phases/connect_hosts.py)."""
    return shell_command(PROBE, scoped=False), probe_input(*managed_paths(ctx, host))


def floor_jobs(ctx: runner.Context, tmp: Path) -> dict[str, tuple[str, Path]]:
    jobs = {}
    for h in ctx.inv.spec.hosts:
        command, stdin = probe(ctx, h.name)
        path = tmp / f"probe-{h.name}.in"
        path.write_bytes(stdin)
        jobs[h.address] = (command, path)
    return jobs


def physical_jobs(ctx: runner.Context, uploaded: dict[str, int], tmp: Path) -> dict[str, tuple[str, Path]]:
    """Per host: receive as many bytes as the cold apply uploaded to it, restart its units."""
    jobs = {}
    for h in ctx.inv.spec.hosts:
        size = uploaded.get(h.name, 0)
        path = tmp / f"bytes-{size}.bin"
        if not path.exists():
            with open(path, "wb") as f:
                for i in range(0, size, 1 << 24):
                    f.write(os.urandom(min(1 << 24, size - i)))
        units = " ".join(ctx.plans[h.name].units)
        jobs[h.address] = (f"cat > /var/tmp/hp-floor.bin && systemctl restart {units} && rm -f /var/tmp/hp-floor.bin",
                           path)
    return jobs


# --- Ansible ---------------------------------------------------------------------------------

def ansible_playbook() -> Path:
    """ansible-playbook from a venv keyed by version, made once (outside the checkout)."""
    exe = ANSIBLE_VENV / "bin" / "ansible-playbook"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", ANSIBLE_VENV], check=True)
        subprocess.run([ANSIBLE_VENV / "bin" / "pip", "install", "-q", f"ansible-core=={ANSIBLE_CORE}"], check=True)
    return exe


def ansible_inventory(lab: Lab, ctx: runner.Context) -> Path:
    """An Ansible inventory of the lab whose host vars are what `plan --render` renders for each
    host (same state as the lab's apply) plus its binaries and units."""
    render = lab.tmp / f"{lab.name}-render"
    timed([INSTALLER, "plan", lab.inventory, "--render", render, "--state", lab.state])
    ssh = yaml.safe_load(lab.inventory.read_text())["spec"]["ssh"]
    hosts = {}
    for h in ctx.inv.spec.hosts:
        dirs, files = [], []
        for line in (render / h.name / "MANIFEST").read_text().splitlines():
            path, mode, owner, _ = line.rsplit(" ", 3)
            user, group = owner.split(":")
            if path.endswith("/"):
                dirs.append({"path": path.rstrip("/"), "mode": mode, "owner": user, "group": group})
            else:
                files.append({"src": str(render / h.name / path.lstrip("/")), "dest": path, "mode": mode,
                              "owner": user, "group": group})
        files += [{"src": str(f.source), "dest": f.path, "mode": f"{f.mode:04o}", "owner": f.owner, "group": f.group}
                  for f in binaries_part(ctx, h.name).files]
        hosts[h.name] = {"ansible_host": h.address, "hp_dirs": dirs, "hp_files": files,
                         "hp_units": list(ctx.plans[h.name].units)}
    doc = {"all": {"hosts": hosts, "vars": {
        "ansible_user": "root", "ansible_ssh_private_key_file": ssh["keyPath"],
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={ssh['knownHosts']} -o StrictHostKeyChecking=yes",
        "ansible_python_interpreter": "/usr/bin/python3"}}}
    path = lab.tmp / f"{lab.name}-ansible.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_ansible(exe: Path, inventory: Path, tmp: Path) -> tuple[float, int]:
    """One whole ansible-playbook run with fresh SSH connections (a new ControlPath directory):
    (seconds, tasks reported changed)."""
    control = Path(tempfile.mkdtemp(dir=tmp, prefix="cp-"))
    # ANSIBLE_CONFIG names no existing file: no ansible.cfg from anywhere, only these settings
    env = dict(os.environ, ANSIBLE_CONFIG=str(tmp / "none.cfg"), ANSIBLE_FORKS="25", ANSIBLE_PIPELINING="True",
               ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_SSH_CONTROL_PATH_DIR=str(control),
               ANSIBLE_SSH_ARGS="-C -o ControlMaster=auto -o ControlPersist=20s",
               ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"), ANSIBLE_NOCOLOR="1")
    seconds, proc = timed([exe, "-i", inventory, PLAYBOOK], env=env, cwd=tmp)
    return seconds, sum(int(n) for n in re.findall(r"\bchanged=(\d+)", proc.stdout))


# --- the measurements ------------------------------------------------------------------------

def measure_no_hosts(tmp: Path, runs: int, m: Measures) -> None:
    """--help, validate and the offline render of a generated 3+50 inventory (like render.py's)."""
    inv = tmp / "r350.inventory.yaml"
    inv.write_text(yaml.safe_dump(generated_inventory(3, 50)))
    render = [INSTALLER, "plan", inv, "--render", tmp / "r350-render", "--state", tmp / "r350-state"]
    timed(render)                                   # creates the PKI: the runs below are warm
    for _ in range(runs):
        m.add("help", timed([INSTALLER, "--help"])[0])
        m.add("validate", timed([INSTALLER, "validate", inv])[0])
        m.add("render", timed(render)[0])


def measure_lab(lab: Lab, runs: int, ansible: Path | None, m: Measures, notes: list[str]) -> None:
    lab_down(lab.name)                              # a stale lab from a run that died mid-way
    lab.up()
    extra = ["--wait-timeout", "900"] if lab.real else []
    seconds, proc = timed(lab.cli("apply", "--output", "json", *extra))
    m.add(f"cold{lab.tag}", seconds)
    uploaded = json.loads(proc.stdout)["bytesUploaded"]
    print(f"{lab.name}: cold apply {seconds:.1f} s, uploaded {uploaded}", flush=True)
    ctx, ssh = installer_view(lab), lab.ssh()
    probes = floor_jobs(ctx, lab.tmp)
    if not lab.real:                                # restarts would disturb a real cluster's no-ops
        physical = physical_jobs(ctx, uploaded, lab.tmp)
        for _ in range(runs):
            m.add(f"phys{lab.tag}", parallel_ssh(ssh, physical))

    noop, check = lab.cli("apply", "--output", "json"), lab.cli("plan", "--check")
    if json.loads(timed(noop)[1].stdout)["changes"]:     # warm-up, not counted
        notes.append(f"{lab.name}: the warm-up no-op after the cold apply changed something")
    inventory = None
    if ansible is not None and not lab.real:
        inventory = ansible_inventory(lab, ctx)
        _, changed = run_ansible(ansible, inventory, lab.tmp)    # warm-up, not counted
        if changed:
            notes.append(f"{lab.name}: ansible's first run on the converged lab changed {changed} task(s)")
        if timed(check, ok=(0, 1))[1].returncode:
            notes.append(f"{lab.name}: after ansible's first run `plan --check` saw pending changes")
            timed(noop)

    for i in range(runs):
        print(f"{lab.name}: run {i + 1} of {runs}", flush=True)
        seconds, proc = timed(noop)
        m.add(f"noop{lab.tag}", seconds)
        if (changes := json.loads(proc.stdout)["changes"]):
            notes.append(f"{lab.name}: no-op run {i + 1} made {changes} change(s)")
        seconds, proc = timed(check, ok=(0, 1))
        m.add(f"check{lab.tag}", seconds)
        if proc.returncode:
            notes.append(f"{lab.name}: plan --check run {i + 1} exited 1 (changes pending)")
        m.add(f"floor{lab.tag}", parallel_ssh(ssh, probes))
        if inventory is not None:
            seconds, changed = run_ansible(ansible, inventory, lab.tmp)
            m.add(f"ansible{lab.tag}", seconds)
            if changed:
                notes.append(f"{lab.name}: ansible run {i + 1} changed {changed} task(s)")


# --- the report ------------------------------------------------------------------------------

def table(m: Measures) -> list[tuple[str, ...]]:
    rows = []
    for f in FIGURES:
        if f.key not in m or (isinstance(f.ref, str) and f.ref not in m):
            continue
        value = m.median(f.key)
        if f.ref is None:
            rows.append((f.label, f"{value:.2f} s", "-", "", "-"))
            continue
        ref = m.median(f.ref) if isinstance(f.ref, str) else f.ref
        what = f"{f.ref} {ref:.2f} s" if isinstance(f.ref, str) else f"{ref:g} s"
        target = f"<= {f.limit:g}x {what}" if f.limit and isinstance(f.ref, str) else (
            f"<= {what}" if f.limit else f"vs {what}")
        ratio = value / ref
        verdict = "-" if f.limit is None else ("MET" if ratio <= f.limit else "NOT MET")
        rows.append((f.label, f"{value:.2f} s", target, f"{ratio:.2f}x", verdict))
    return rows


def report(m: Measures, notes: list[str]) -> None:
    labels: dict[str, str] = {}
    for f in FIGURES:
        labels.setdefault(f.key, f.label)
    print("\nraw runs (seconds, in run order):")
    for key, runs in m.items():
        print(f"  {key:<11} {labels.get(key, ''):<38} {' '.join(f'{s:.2f}' for s in runs)}"
              f"  (median {m.median(key):.2f})")
    head = ("figure", "measured", "target", "ratio", "MET / NOT MET")
    rows = table(m)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if notes:
        print("\nnotes:")
        for n in notes:
            print(f"  {n}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--real", action="store_true", help="also a 1+2 lab with the built real binaries")
    ap.add_argument("--no-ansible", action="store_true")
    ap.add_argument("--sizes", default="2,20", help="stand-in labs 1+N, N in 2,20")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not set(sizes) <= set(STANDIN_LABS):
        ap.error(f"--sizes: each of {', '.join(map(str, STANDIN_LABS))}")
    if os.geteuid() != 0:
        print("benchmarks/perf.py needs root (the lab): sudo .venv/bin/python benchmarks/perf.py", file=sys.stderr)
        return 1
    print(f"machine: {os.cpu_count()} CPUs, load average {load()}")
    m, notes = Measures(), []
    ansible = None if args.no_ansible else ansible_playbook()
    if ansible:
        print(f"ansible: ansible-core {ANSIBLE_CORE} ({ansible})")
    names = [STANDIN_LABS[s][0] for s in sizes] + ([REAL_LAB[0]] if args.real else [])
    try:
        with tempfile.TemporaryDirectory(prefix="hp-perf-") as tmp:
            measure_no_hosts(Path(tmp), args.runs, m)
            labs = [Lab(*STANDIN_LABS[s], s, Path(tmp), str(s)) for s in sizes]
            if args.real:
                if built_artifacts() is None:
                    notes.append("--real: no built binaries (run scripts/build-kubernetes)")
                else:
                    print(f"real binaries: {built_artifacts()}")
                    labs.append(Lab(*REAL_LAB, 2, Path(tmp), "-real", real=True))
            for lab in labs:
                try:
                    measure_lab(lab, args.runs, ansible, m, notes)
                except RuntimeError as e:          # a command failed: report it and go on
                    notes.append(f"{lab.name}: failed: {e}")
                except Exception as e:  # noqa: BLE001 - a bug here: the other figures still print
                    notes.append(f"{lab.name}: failed: {type(e).__name__}: {e}")
                    traceback.print_exc()
                finally:
                    lab_down(lab.name)              # one lab at a time: the hosts share the CPUs
    finally:
        for name in names:
            lab_down(name)
    report(m, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
