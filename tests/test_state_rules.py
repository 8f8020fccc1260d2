"""Where the state directory is found, and that one process at a time uses it (no hosts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from installer import api
from installer.cli.main import cli
from installer.core.state import StateBusy, StateDir

from .conftest import write_inventory

HOLD = """
import sys, time
from installer.core.state import StateDir
with StateDir(sys.argv[1]).locked():
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_state_is_found_next_to_the_inventory(doc, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "site").mkdir()
    inv = write_inventory(tmp_path / "site", doc)
    out = CliRunner().invoke(cli, ["plan", str(inv), "--render", str(tmp_path / "out")])
    assert out.exit_code == 0, out.output
    root = tmp_path / "site" / ".hiddenplane" / doc["metadata"]["name"]
    assert f"state: {root}" in out.output
    assert (root / "pki" / "ca.crt").is_file() and not (tmp_path / "xdg").exists()
    # any other command, from anywhere, finds the same state from the inventory alone
    monkeypatch.chdir(tmp_path)
    kc = tmp_path / "admin.kubeconfig"
    out = CliRunner().invoke(cli, ["kubeconfig", str(inv), "-o", str(kc)])
    assert out.exit_code == 0, out.output
    assert kc.read_text() == (root / "admin.conf").read_text()


def test_a_state_left_at_the_old_default_is_not_replaced_by_a_new_one(doc, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    old = tmp_path / "xdg" / "hiddenplane" / doc["metadata"]["name"]
    inv = write_inventory(tmp_path, doc)
    api.prepare(inv, old)
    out = CliRunner().invoke(cli, ["plan", str(inv), "--render", str(tmp_path / "out")])
    assert out.exit_code == 2
    new = tmp_path / ".hiddenplane" / doc["metadata"]["name"]
    assert f"is at {old}" in out.output and f"mv {old} {new}" in out.output and f"--state {old}" in out.output
    assert not (new / "pki").exists()


def test_a_state_in_use_by_another_process_is_refused(doc, tmp_path):
    inv, state = write_inventory(tmp_path, doc), tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = CliRunner().invoke(cli, ["plan", str(inv), "--render", str(tmp_path / "out"), "--state", str(state)])
        assert out.exit_code == 2
        assert f"state directory {state} is in use by process {holder.pid}" in out.output
        assert not (state / "pki").exists()         # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder's death releases it
    out = CliRunner().invoke(cli, ["plan", str(inv), "--render", str(tmp_path / "out"), "--state", str(state)])
    assert out.exit_code == 0, out.output


def test_the_state_lock_is_reentrant_on_the_object_a_command_hands_down(tmp_path):
    """A command resolves its state once and hands that StateDir down (a nested command, an
    apply inside a day-2 command, holds it again): re-entrant on the object. There is no
    process-wide registry: another StateDir of the same directory is another holder, refused."""
    s = StateDir(tmp_path / "s")
    with s.locked(), s.locked():
        with pytest.raises(StateBusy, match=f"state directory {tmp_path / 's'} is in use by process {os.getpid()}"):
            with StateDir(tmp_path / "s").locked():
                pass
    with s.locked():                # released after the outer block: taken again
        pass
    assert not (tmp_path / "absent").exists()
    with StateDir(tmp_path / "absent").locked(create=False):
        pass
    assert not (tmp_path / "absent").exists()


def test_a_command_resolves_its_cluster_once(doc, tmp_path, monkeypatch):
    """open_cluster parses the inventory once and holds the state for the block; what derives
    from them is read once; a derived inventory keeps the state. The CLI opens it for every
    command that takes INVENTORY and --state, and the inventory file is read once per command."""
    from installer.core import inventory as inventory_mod
    from installer.core.cluster import Cluster, open_cluster
    inv_path, state = write_inventory(tmp_path, doc), tmp_path / "state"
    api.prepare(inv_path, state)
    with open_cluster(inv_path, state) as c:
        assert isinstance(c, Cluster) and c.state.root == state
        assert c.material is c.material and c.plans is c.plans and set(c.plans) == {h.name for h in c.inv.spec.hosts}
        other = c.with_inventory(c.inv.model_copy())
        assert other.state is c.state and other.inv is not c.inv
        holder = subprocess.run([sys.executable, "-c", HOLD, str(state)], capture_output=True, text=True, timeout=30)
        assert holder.returncode != 0 and "in use by process" in holder.stderr     # held meanwhile
    loads = []
    real = inventory_mod.load
    monkeypatch.setattr(inventory_mod, "load", lambda p: loads.append(p) or real(p))
    out = CliRunner().invoke(cli, ["node", "list", str(inv_path), "--state", str(state)])
    assert out.exit_code == 0, out.output
    assert loads == [str(inv_path)]


def test_every_command_with_an_inventory_and_a_state_opens_its_cluster():
    """No command is left to find its state by itself (the CLI used to guess it from parameter
    names): each callback that Click hands INVENTORY and --state is wrapped by with_cluster."""
    import click

    from installer.cli.main import LAZY
    ctx = click.Context(cli)
    names = list(cli.list_commands(ctx)) + list(LAZY)
    seen = 0

    def walk(cmd):
        nonlocal seen
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)
            return
        params = {p.name for p in cmd.params}
        if {"inventory", "state_dir"} <= params:
            seen += 1
            chain, fn = [], cmd.callback
            while fn is not None:
                chain.append(fn)
                fn = getattr(fn, "__wrapped__", None)
            assert any(vars(f).get("opens_cluster") for f in chain[:-1]), cmd.name
    for name in dict.fromkeys(names):
        walk(cli.get_command(ctx, name))
    assert seen == 20          # apply, plan, kubeconfig, verify, node x5, etcd x6, certs x2, ca, reset, upgrade
