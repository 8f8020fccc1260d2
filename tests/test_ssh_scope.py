"""Remote.scope without hosts: the command line it builds, run by this machine's own sh (which
has no systemd as PID 1, so the wrapper's plain-sh branch runs), and the refusal of a bad scope
before any connection. The systemd branch runs on the lab in test_ssh_faults_lab.py."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from installer import inventory
from installer.ssh import Remote, stop_scopes

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
    assert "--unit=hp-run-abc-" in cmd
    assert not Path("/run/systemd/system").is_dir(), "this test means the machine without systemd"
    p = sh(cmd, data)
    assert (p.stdout, p.stderr, p.returncode) == (data, b"to stderr", 7)
    # each command gets a unit of its own
    assert r._command(script, scoped=True) != cmd
    assert r._command(script, scoped=False) == f"sh -c {shlex.quote(script)}"


def test_scoped_command_runs_through_sudo_for_another_user(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text((ROOT / "inventory.example.yaml").read_text().replace("user: root", "user: ops"))
    other = inventory.load(path)
    r = Remote(other.host("cp1"), other, scope="hp-run-abc")
    assert r._command("true", scoped=True).startswith("sudo -n sh -c ")


@pytest.mark.parametrize("bad", ["", "a b", "x;reboot", "a\\x2d", "s/x", "a" * 201, "run\n"])
def test_a_bad_scope_is_refused_before_connecting(inv, bad):
    # the example inventory's hosts are not reachable from here: a connection attempt would
    # end in a HostError, not this ValueError
    r = Remote(inv.host("cp1"), inv, scope=bad)
    with pytest.raises(ValueError, match="scope"):
        r.run("true")
    with pytest.raises(ValueError, match="prefix"):
        stop_scopes(r, bad)
