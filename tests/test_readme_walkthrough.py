"""The README's walkthrough, run as written, so it cannot drift from the code.

Every line of the ```sh block after the ``<!-- walkthrough: ... -->`` marker runs verbatim with
bash in an empty directory, as root, with the checkout's ``.venv/bin`` first on PATH (what
``scripts/try`` promises through its /usr/local/bin link). ``sudo`` is a shell function that runs
its arguments: as root it changes nothing else, and a real sudo's secure_path would pick
whatever /usr/local/bin/installer points at instead of this checkout. Each line must exit 0, and
the outputs the README promises are checked: the second apply changes nothing, ``plan --check``
is clean, ``kubectl get nodes`` lists only the workers, cp1 runs the control plane. The lab is
"demo" on its default subnet, real binaries, nspawn workers running real pods: the README's own lab.

``scripts/try`` (cheap, no lab: ``--no-lab``) is run from a scratch copy to check what the
README builds on: it links ``installer`` into the bin directory and keeps no state of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import click
import pytest

from installer.core import versions
from installer.lab import lab as lab_mod

from .builtfixtures import default_dir
from .labfixtures import require_lab_tools

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TRY = ROOT / "scripts" / "try"
MARKER = "<!-- walkthrough: tested by tests/test_readme_walkthrough.py -->"
NAME = "demo"


def walkthrough_lines(text: str) -> list[str]:
    """The command lines of every ```sh block right after a walkthrough marker."""
    blocks = re.findall(re.escape(MARKER) + r"\s*\n```sh\n(.*?)\n```", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def bash_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    # the state of an installer that still uses the XDG rule stays in the test's directory too
    env["XDG_STATE_HOME"] = str(tmp / "xdg-state")
    return env


def run_line(line: str, cwd: Path, env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    script = 'sudo() { "$@"; }\nset -o pipefail\n' + line + "\n"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_walkthrough_block_is_marked_and_complete():
    lines = walkthrough_lines(README.read_text())
    assert lines, f"README.md has no ```sh block after {MARKER!r}"
    assert lines[0].startswith(f"sudo installer lab up --name {NAME}")
    assert lines[-1].startswith(f"sudo installer lab down --name {NAME}")
    assert not any("--state" in line for line in lines), "the walkthrough must find the state without a flag"
    assert not any("<(" in line for line in lines), "ssh -F <(...) fails with OpenSSH 9.2: use a file"


# --- scripts/try --no-lab: the PATH link and the state rule ----------------------------------

def try_copy(tmp: Path) -> Path:
    """A checkout with scripts/try, the example inventory and this checkout's .venv (linked: the
    editable install still points here)."""
    co = tmp / "checkout"
    (co / "scripts").mkdir(parents=True)
    shutil.copy2(TRY, co / "scripts" / "try")
    shutil.copy2(ROOT / "inventory.example.yaml", co / "inventory.example.yaml")
    (co / ".venv").symlink_to(ROOT / ".venv")
    return co


def run_try(co: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(co / "scripts" / "try"), "--no-lab"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_try_links_installer_onto_path(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("scripts/try links installer only as root (CI runs as root)")
    co, bin_dir = try_copy(tmp_path), tmp_path / "bin"
    env = {**bash_env(tmp_path), "HIDDENPLANE_BIN_DIR": str(bin_dir)}
    proc = run_try(co, env)
    link, target = bin_dir / "installer", co / ".venv" / "bin" / "installer"
    assert link.is_symlink() and Path(os.readlink(link)) == target, proc.stdout
    assert f"linked {link} -> {target}" in proc.stdout
    version = subprocess.run(["installer", "--version"], env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "hiddenplane" in version.stdout, version.stdout + version.stderr
    # a second run leaves a correct link alone and says nothing about it
    again = run_try(co, env)
    assert "linked" not in again.stdout and Path(os.readlink(link)) == target, again.stdout
    # a file that is not a link (e.g. a pipx install) is never replaced
    link.unlink()
    link.write_text("#!/bin/sh\n")
    other = run_try(co, env)
    assert link.read_text() == "#!/bin/sh\n" and "left alone" in other.stderr, other.stderr


def test_try_keeps_no_state_of_its_own(tmp_path):
    """The commands the README types after scripts/try (no --state) find the state it used."""
    co = try_copy(tmp_path)
    env = {**bash_env(tmp_path), "HIDDENPLANE_BIN_DIR": str(tmp_path / "bin")}
    proc = run_try(co, env)
    assert not (co / ".state").exists(), "scripts/try keeps its own ./.state: the README's commands miss it"
    assert ".state/" not in proc.stdout
    check = subprocess.run([str(co / ".venv" / "bin" / "installer"), "plan", "inventory.example.yaml", "--render",
                            "out"], cwd=co, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "pki:" not in check.stdout, f"the README's render found another state and made new PKI:\n{check.stdout}"


def try_ssh_command() -> str:
    """The 'look around' command scripts/try prints (without the echo)."""
    found = re.findall(r'^echo "\s*(sudo installer lab ssh-config [^"]*ssh -F [^"]*)"$', TRY.read_text(), re.M)
    assert len(found) == 1, f"scripts/try should print one ssh command that works, found {found}"
    return found[0]


# --- the walkthrough itself: a real lab ------------------------------------------------------

def check_second_apply(out: str) -> None:
    assert re.search(r"apply: 0 change\(s\), 0 restart\(s\), 0 ?\w* uploaded", out), out


def check_nodes(out: str) -> None:
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert sorted(r[0] for r in rows) == ["w1", "w2"], out
    assert all(r[1] == "Ready" for r in rows), out


def check_cp1_active(out: str) -> None:
    assert out.split() == ["active", "active"], out


def check_verify(out: str) -> None:
    assert re.search(r"^(\d+)/\1 checks passed$", out, re.M), out


PROMISES = {   # a walkthrough line -> what its output must show
    re.compile(r"^sudo installer apply demo\.inventory\.yaml\s+#.*second run"): check_second_apply,
    re.compile(r"kubectl --kubeconfig demo\.kubeconfig get nodes"): check_nodes,
    re.compile(r"ssh -F demo\.ssh_config cp1 systemctl is-active etcd kube-apiserver"): check_cp1_active,
    re.compile(r"^sudo installer verify demo\.inventory\.yaml"): check_verify,
}


@pytest.mark.lab
@pytest.mark.real
def test_readme_walkthrough_runs_verbatim(tmp_path, built_artifacts):
    require_lab_tools()
    expected = Path("/var/cache/hiddenplane/build") / f"artifacts-{versions.DEFAULT_KUBERNETES_VERSION}"
    if built_artifacts.resolve() != expected or default_dir() != expected:
        pytest.skip(f"the README names the built binaries in {expected}; these are in {built_artifacts}")
    lines = walkthrough_lines(README.read_text())
    matched = {p: [line for line in lines if p.search(line)] for p in PROMISES}
    assert all(len(m) == 1 for m in matched.values()), f"each promise must be on one walkthrough line: {matched}"
    env, work = bash_env(tmp_path), tmp_path / "newcomer"
    work.mkdir()
    lab_mod.down(NAME, log=lambda *_: None)          # a lab left over by an earlier run or a user
    seconds: list[tuple[float, str]] = []
    try:
        for line in lines[:-1]:
            if line.startswith("sudo ssh -F"):
                # scripts/try's "look around" line too, with a command so it returns
                start = time.monotonic()
                proc = run_line(try_ssh_command() + " true", work, env, timeout=120)
                seconds.append((time.monotonic() - start, "scripts/try's ssh line"))
                assert proc.returncode == 0, f"{try_ssh_command()} true: rc={proc.returncode}\n{proc.stderr}"
            start = time.monotonic()
            proc = run_line(line, work, env)
            seconds.append((time.monotonic() - start, line))
            # what failed first (a long report's failing check may sit above its last 3000 characters)
            failing = "\n".join(x for x in proc.stdout.splitlines() if x.lstrip().startswith("✗"))
            assert proc.returncode == 0, (f"{line}\nrc={proc.returncode}\nfailing:\n{failing}\n"
                                          f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
            for pattern, check in PROMISES.items():
                if pattern.search(line):
                    check(proc.stdout)
        assert (work / "demo.kubeconfig").stat().st_mode & 0o777 == 0o600
        start = time.monotonic()
        proc = run_line(lines[-1], work, env, timeout=300)
        seconds.append((time.monotonic() - start, lines[-1]))
        assert proc.returncode == 0, f"{lines[-1]}\n{proc.stdout}\n{proc.stderr}"
        assert not lab_mod.LabPaths.of(NAME).root.exists()
        assert not (work / "demo.inventory.yaml").exists(), "lab down leaves the unchanged inventory copy"
    finally:
        print("\nREADME walkthrough, seconds per line:")
        for s, line in seconds:
            print(f"  {s:7.1f}  {line[:100]}")
        lab_mod.down(NAME, log=lambda *_: None)


# --- the command table and the Day 2 synopsis: names, options and exit codes the code has ------

def _cli_command(words: list[str]):
    from installer.cli.main import cli
    cmd = cli
    for w in words:
        sub = cmd.get_command(click.Context(cmd), w) if isinstance(cmd, click.Group) else None
        assert sub is not None, f"README names `installer {' '.join(words)}`: no such command"
        cmd = sub
    return cmd


def _command_paths(cell: str) -> list[list[str]]:
    """`installer etcd members/snapshot save` -> [[etcd, members], [etcd, snapshot, save]]."""
    paths = []
    for part in re.findall(r"`installer ([^`]*)`", cell):
        words = [w for w in part.split() if re.fullmatch(r"[a-z][a-z0-9/|-]*", w)]
        alternatives = " ".join(words).replace("|", "/").split("/")
        prefix = alternatives[0].split()[:-1]
        paths += [prefix + alternatives[0].split()[-1:]] + [prefix + a.split() for a in alternatives[1:]]
    return paths


def command_table() -> dict[str, str]:
    """Each row of the README's command table: its command cell -> its exit-code cell."""
    rows = re.findall(r"^\| (`installer [^|]*) \| [^|]* \| ([^|]*) \|$", README.read_text(), re.M)
    assert len(rows) >= 10, "README.md's command table is gone"
    return dict(rows)


def test_command_table_names_real_commands_and_their_exit_codes():
    from installer.actions.etcd_members import MembershipRefused
    from installer.actions.rollout import RenewError
    from installer.actions.verify import VerifyError
    from installer.engine.runner import ApplyError
    table = command_table()
    for cell in table:
        for path in _command_paths(cell):
            _cli_command(path)

    def codes(command: str) -> set[int]:
        cells = [codes for cell, codes in table.items() if command.split() in _command_paths(cell)]
        assert cells, f"README's command table has no row for `installer {command}`"
        return {int(c) for c in re.findall(r"\b(\d)\b", cells[0])}

    assert MembershipRefused.exit_code in codes("etcd member add")          # refusals: exit 4
    assert ApplyError.exit_code in codes("apply")
    assert VerifyError.exit_code in codes("verify")
    assert RenewError.exit_code in codes("certs renew")
    assert 4 not in codes("etcd members"), "only membership changes are refused with exit 4"


def test_day2_synopsis_options_exist():
    text = README.read_text()
    block = re.search(r"^## Day 2\n\n```sh\n(.*?)\n```", text, re.M | re.S)
    assert block, "README.md's Day 2 synopsis block is gone"
    for line in block[1].splitlines():
        for path in _command_paths(f"`{line.strip()}`"):
            cmd = _cli_command(path)
            known = {o for p in cmd.params for o in getattr(p, "opts", [])}
            for option in re.findall(r"(--[a-z-]+)", line):
                assert option in known, f"{line.strip()}: `installer {' '.join(path)}` has no {option}"
