"""Remote.scope without hosts: the command line it builds, run by this machine's own sh (every
process of it carries the run's mark), stop_scopes' script run here too, and the refusal of a
bad scope before any connection. On real hosts: test_ssh_faults_lab.py."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from installer.core import inventory
from installer.host.runmark import stop_scopes
from installer.host.ssh import Remote

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def inv():
    return inventory.load(ROOT / "inventory.example.yaml")


def sh(command: str, stdin: bytes) -> subprocess.CompletedProcess:
    # what sshd does with the command line: hand it to the login shell
    return subprocess.run(["sh", "-c", command], input=stdin, capture_output=True)


def test_unscoped_command_is_unchanged(inv):
    r = Remote(inv.host("cp1"), inv)
    assert r._command("echo hi", scoped=True) == "sh -c 'echo hi'"


def test_scoped_command_passes_stdin_stdout_stderr_and_exit_code_through(inv):
    r = Remote(inv.host("cp1"), inv, scope="hp-run-abc")
    data = bytes(range(256)) * 64
    script = "cat; printf 'to stderr' >&2; exit 7"
    cmd = r._command(script, scoped=True)
    assert "HIDDENPLANE_RUN=hp-run-abc-" in cmd
    p = sh(cmd, data)
    assert (p.stdout, p.stderr, p.returncode) == (data, b"to stderr", 7)
    # the shell itself carries the mark (a wait loop's sh must be found), and what it starts
    marked = sh(r._command("tr '\\0' '\\n' < /proc/$$/environ; cat /proc/self/environ", scoped=True), b"")
    assert marked.stdout.count(b"HIDDENPLANE_RUN=hp-run-abc-") == 2
    # each command gets a unit of its own
    assert r._command(script, scoped=True) != cmd
    assert r._command(script, scoped=False) == f"sh -c {shlex.quote(script)}"


def test_scoped_command_runs_through_sudo_for_another_user(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text((ROOT / "inventory.example.yaml").read_text().replace("user: root", "user: ops"))
    other = inventory.load(path)
    r = Remote(other.host("cp1"), other, scope="hp-run-abc")
    assert r._command("true", scoped=True).startswith("sudo -n env HIDDENPLANE_RUN=hp-run-abc-")


@pytest.mark.parametrize("bad", ["", "a b", "x;reboot", "a\\x2d", "s/x", "a" * 201, "run\n"])
def test_a_bad_scope_is_refused_before_connecting(inv, bad):
    # the example inventory's hosts are not reachable from here: a connection attempt would
    # end in a HostError, not this ValueError
    r = Remote(inv.host("cp1"), inv, scope=bad)
    with pytest.raises(ValueError, match="scope"):
        r.run("true")
    with pytest.raises(ValueError, match="prefix"):
        stop_scopes(r, bad)


def test_the_stop_script_ends_only_its_prefixes_processes():
    """stop_scopes' script, run by this machine's sh on two marked background processes."""
    import time

    from installer.host.runmark import _STOP_MARKED
    procs = {m: subprocess.Popen(["sleep", "3911"], env={"HIDDENPLANE_RUN": m, "PATH": "/usr/bin:/bin"})
             for m in ("hp-dead-4", "hp-alive-1")}
    try:
        time.sleep(0.2)
        script = _STOP_MARKED.replace("PATTERN", shlex.quote("^HIDDENPLANE_RUN=hp-dead-[0-9]*$"))
        p = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
        assert p.stdout.split() == ["hp-dead-4"]
        assert procs["hp-dead-4"].wait(timeout=5) == -9
        assert procs["hp-alive-1"].poll() is None
    finally:
        for pr in procs.values():
            pr.kill()
            pr.wait()
