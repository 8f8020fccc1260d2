"""installer.host.ssh against real hosts: run/put/get, binary stdin, known_hosts verification (unknown,
accepted, changed), unreachable hosts, a bastion, sudo for a non-root user.

Boots its own 1 control + 1 worker lab (``sshlab`` on 10.213.205.0/24): cp1 .11, w1 .21.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from installer.core import inventory
from installer.core.errors import InventoryError
from installer.host.ssh import HostError, Remote
from installer.lab import debian_artifacts
from installer.lab import lab as lab_mod
from installer.lab.seed import new_ed25519

from .labfixtures import start_lab

LAB, SUBNET = "sshlab", "10.213.205.0/24"
CP1, W1, BRIDGE, UNUSED = "10.213.205.11", "10.213.205.21", "10.213.205.1", "10.213.205.99"
lab = pytest.mark.lab


@pytest.fixture(scope="module")
def sshlab(tmp_path_factory):
    the_lab = start_lab(LAB, SUBNET, tmp_path_factory.mktemp("sshlab"), controls=1, workers=1)
    yield the_lab
    lab_mod.down(LAB, log=lambda *_: None)


@pytest.fixture(scope="module")
def lab_doc(sshlab) -> dict:
    return yaml.safe_load(sshlab.inventory.read_text())


def make_inventory(tmp_path: Path, doc: dict, name: str = "inventory.yaml", **ssh) -> inventory.Inventory:
    """The lab's inventory with spec.ssh entries replaced (None removes one)."""
    doc = copy.deepcopy(doc)
    for k, v in ssh.items():
        if v is None:
            doc["spec"]["ssh"].pop(k, None)
        else:
            doc["spec"]["ssh"][k] = v
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inventory.load(path)


def known_line(sshlab, address: str) -> list[str]:
    """[names, type, base64] of the lab's known_hosts line for ``address``."""
    for line in sshlab.paths.known_hosts.read_text().splitlines():
        if address in line.split()[0].split(","):
            return line.split()
    raise KeyError(address)


def known_hosts_with(tmp_path: Path, sshlab, *addresses: str, name="known_hosts") -> Path:
    p = tmp_path / name
    p.write_text("".join(" ".join(known_line(sshlab, a)) + "\n" for a in addresses))
    return p


# --- run, put, get ------------------------------------------------------------------------------

@lab
def test_run_binary_stdin_failure_and_counters(sshlab, lab_doc, tmp_path):
    inv = make_inventory(tmp_path, lab_doc)
    with Remote(inv.host("cp1"), inv) as r:
        out = r.run("hostname; id -u")
        assert (out.stdout.split(), out.rc) == (["cp1", "0"], 0)

        with pytest.raises(HostError) as e:
            r.run("echo oops >&2; exit 3", what="probe the widget")
        msg = str(e.value)
        assert e.value.host == "cp1" and msg.startswith("cp1: ")
        assert "probe the widget" in msg and "exit 3" in msg and "oops" in msg
        assert r.run("exit 4", check=False).rc == 4
        # a timeout bounds the whole command; the connection stays usable
        t0 = time.monotonic()
        with pytest.raises(HostError, match=r"^cp1: nap: no answer within 1 s"):
            r.run("echo started; sleep 30", timeout=1, what="nap")
        assert time.monotonic() - t0 < 5
        assert r.run("echo still-here").stdout == "still-here\n"

        # 5 MB of every byte value, sent in chunks over one channel, hashed on the host
        blob = os.urandom(5 << 20) + bytes(range(256)) + b"\0\r\n\x1a\xff"
        before = (r.counters.round_trips, r.counters.bytes_up)
        t0 = time.monotonic()
        out = r.run("sha256sum | cut -d' ' -f1; echo err >&2", stdin=blob)
        assert out.stdout.strip() == hashlib.sha256(blob).hexdigest()
        assert out.stderr.strip() == "err"
        assert (r.counters.round_trips, r.counters.bytes_up) == (before[0] + 1, before[1] + len(blob))
        assert time.monotonic() - t0 < 10
        # a command that ignores its stdin neither hangs nor fails
        assert r.run("exit 0", stdin=blob).rc == 0

        # stdout is binary-safe too: Result.raw, and put/get built on it
        r.put("/tmp/hp-test/blob.bin", blob, mode=0o640, owner="root:root")
        rt = r.counters.round_trips
        assert r.get("/tmp/hp-test/blob.bin") == blob
        assert r.counters.round_trips == rt + 1 and r.counters.bytes_down >= len(blob)
        st = r.run("stat -c '%a %U %G' /tmp/hp-test/blob.bin; ls -a /tmp/hp-test").stdout.split()
        assert st[:3] == ["640", "root", "root"] and "blob.bin.hp-new" not in st
        r.put("/tmp/hp-test/blob.bin", "replaced\n", mode=0o600)      # atomic replace of an existing file
        assert r.get("/tmp/hp-test/blob.bin") == b"replaced\n"
        # the content never appears in a command line: a secret travels on stdin only
        commands, exec_ = [], r._exec
        r._exec = (lambda command, stdin, timeout, progress=None:
                   (commands.append(command), exec_(command, stdin, timeout, progress))[1])
        r.put("/tmp/hp-test/secret", b"s3cr3t-token\n")
        del r._exec
        assert len(commands) == 1 and "s3cr3t" not in commands[0]
        assert (r.run("cat /tmp/hp-test/secret; stat -c %a /tmp/hp-test/secret").stdout.split()
                == ["s3cr3t-token", "644"])
        with pytest.raises(HostError, match=r"cp1: read /nonexistent failed \(exit 1\)"):
            r.get("/nonexistent")
        with pytest.raises(ValueError):
            r.put("relative/path", b"x")
        with pytest.raises(ValueError):
            r.put("/tmp/x", b"x", owner="root; rm -rf /")


# --- host keys ----------------------------------------------------------------------------------

@lab
def test_unknown_host_key_refused_then_accepted_and_recorded(sshlab, lab_doc, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    inv = make_inventory(tmp_path, lab_doc, knownHosts=str(known))
    with pytest.raises(HostError) as e:
        Remote(inv.host("cp1"), inv).open()
    msg = str(e.value)
    assert msg.startswith("cp1: ") and f"host key of {CP1}:22 is not in {known}" in msg
    assert "--accept-new-host-keys" in msg
    assert known.read_text() == ""                                  # nothing recorded when not asked

    with Remote(inv.host("cp1"), inv, accept_new_host_keys=True) as r:
        assert r.run("hostname").stdout.strip() == "cp1"
    lines = known.read_text().splitlines()
    assert len(lines) == 1
    names, kind, b64 = lines[0].split()
    assert names == CP1 and [kind, b64] == known_line(sshlab, CP1)[1:]
    # recorded: a later connection without the option verifies against it
    with Remote(inv.host("cp1"), inv) as r:
        assert r.run("true").rc == 0
    assert len(known.read_text().splitlines()) == 1


@lab
def test_changed_host_key_refused_even_when_accepting_new(sshlab, lab_doc, tmp_path):
    other = new_ed25519().public_openssh.decode()
    known = tmp_path / "known_hosts"
    known.write_text(f"{CP1} {other}\n")
    inv = make_inventory(tmp_path, lab_doc, knownHosts=str(known))
    for accept in (False, True):
        with pytest.raises(HostError) as e:
            Remote(inv.host("cp1"), inv, accept_new_host_keys=accept).open()
        assert str(e.value).startswith("cp1: host key CHANGED for 10.213.205.11:22")
        assert "SHA256:" in str(e.value)
    assert known.read_text() == f"{CP1} {other}\n"                  # never overwritten


# --- unreachable --------------------------------------------------------------------------------

@lab
def test_unreachable_address_and_closed_port(sshlab, lab_doc, tmp_path):
    doc = copy.deepcopy(lab_doc)
    w = next(h for h in doc["spec"]["hosts"] if h["name"] == "w1")
    w["address"] = UNUSED
    inv = make_inventory(tmp_path, doc)
    t0 = time.monotonic()
    with pytest.raises(HostError) as e:
        Remote(inv.host("w1"), inv, connect_timeout=5).open()
    assert str(e.value) in (f"w1: cannot reach {UNUSED}:22: No route to host",
                            f"w1: cannot reach {UNUSED}:22: timed out")
    assert time.monotonic() - t0 < 8

    inv = make_inventory(tmp_path, lab_doc, port=2222)
    with pytest.raises(HostError) as e:
        Remote(inv.host("cp1"), inv, connect_timeout=5).open()
    assert str(e.value) == f"cp1: cannot reach {CP1}:2222: Connection refused"

    inv = make_inventory(tmp_path, lab_doc, keyPath="no-such-key")
    with pytest.raises(HostError, match=r"cp1: SSH key .*/no-such-key does not exist"):
        Remote(inv.host("cp1"), inv).open()


# --- bastion ------------------------------------------------------------------------------------

@lab
def test_bastion_carries_the_connection(sshlab, lab_doc, tmp_path):
    inv = make_inventory(tmp_path, lab_doc, bastion={"address": CP1})
    assert inv.ssh_for(inv.host("w1")).bastion.address == CP1
    assert inv.ssh_for(inv.host("cp1")).bastion is None             # never its own jump host
    with Remote(inv.host("w1"), inv) as r:
        assert r.run("hostname").stdout.strip() == "w1"
        # sshd on w1 saw the connection come from cp1 (the bastion), not from this machine
        client = r.run("echo $SSH_CLIENT").stdout.split()[0]
        assert client == CP1 and client != BRIDGE
        blob = os.urandom(1 << 20)
        assert r.run("sha256sum", stdin=blob).stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    # the same inventory without a bastion: the client is the bridge address
    with Remote(inv.host("w1"), make_inventory(tmp_path, lab_doc, "direct.yaml")) as r:
        assert r.run("echo $SSH_CLIENT").stdout.split()[0] == BRIDGE


@lab
def test_bastion_host_key_verified_and_failures_named(sshlab, lab_doc, tmp_path):
    # the bastion's key missing from known_hosts: the error names the bastion
    only_w1 = known_hosts_with(tmp_path, sshlab, W1, name="only_w1")
    inv = make_inventory(tmp_path, lab_doc, "a.yaml", bastion={"address": CP1}, knownHosts=str(only_w1))
    with pytest.raises(HostError) as e:
        Remote(inv.host("w1"), inv).open()
    assert str(e.value).startswith(f"w1: bastion {CP1}:22: host key of {CP1}:22 is not in {only_w1}")

    # the target's key missing, the bastion's known: the error names the target, not the bastion
    only_cp1 = known_hosts_with(tmp_path, sshlab, CP1, name="only_cp1")
    inv = make_inventory(tmp_path, lab_doc, "b.yaml", bastion={"address": CP1}, knownHosts=str(only_cp1))
    with pytest.raises(HostError) as e:
        Remote(inv.host("w1"), inv).open()
    assert str(e.value).startswith(f"w1: host key of {W1}:22 is not in {only_cp1}")

    # a changed bastion key is refused even with accept_new
    changed = tmp_path / "changed"
    changed.write_text(f"{CP1} {new_ed25519().public_openssh.decode()}\n" + " ".join(known_line(sshlab, W1)) + "\n")
    inv = make_inventory(tmp_path, lab_doc, "c.yaml", bastion={"address": CP1}, knownHosts=str(changed))
    with pytest.raises(HostError, match=rf"^w1: bastion {CP1}:22: host key CHANGED"):
        Remote(inv.host("w1"), inv, accept_new_host_keys=True).open()

    # the bastion is up but cannot reach the target
    doc = copy.deepcopy(lab_doc)
    next(h for h in doc["spec"]["hosts"] if h["name"] == "w1")["address"] = UNUSED
    inv = make_inventory(tmp_path, doc, "d.yaml", bastion={"address": CP1})
    with pytest.raises(HostError) as e:
        Remote(inv.host("w1"), inv, connect_timeout=8).open()
    assert str(e.value).startswith(f"w1: cannot reach {UNUSED}:22 through bastion {CP1}:22")

    # an unreachable bastion
    inv = make_inventory(tmp_path, lab_doc, "e.yaml", bastion={"address": UNUSED})
    with pytest.raises(HostError, match=rf"^w1: bastion {UNUSED}:22: cannot reach {UNUSED}:22"):
        Remote(inv.host("w1"), inv, connect_timeout=5).open()

    # no failed attempt above left a connection (paramiko transport thread) behind
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if isinstance(t, paramiko.Transport) and t.is_alive()]


def test_bastion_in_the_inventory(tmp_path, doc):
    """spec.ssh.bastion defaults (user, keyPath relative to the inventory), per-host override and
    null, and validation (no lab needed)."""
    doc["spec"]["ssh"] = {"user": "ops", "keyPath": "keys/id", "knownHosts": "kh",
                          "bastion": {"address": "jump.example.com", "port": 2200}}
    doc["spec"]["hosts"][1]["ssh"] = {"bastion": None}
    doc["spec"]["hosts"][2]["ssh"] = {"bastion": {"address": "10.0.0.9", "user": "j", "keyPath": "/k"}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    inv = inventory.load(path)
    hosts = inv.spec.hosts
    b = inv.ssh_for(hosts[0]).bastion
    assert (b.address, b.port, b.user, b.keyPath) == ("jump.example.com", 2200, "ops", str(tmp_path / "keys/id"))
    assert inv.ssh_for(hosts[1]).bastion is None
    b = inv.ssh_for(hosts[2]).bastion
    assert (b.address, b.port, b.user, b.keyPath) == ("10.0.0.9", 22, "j", "/k")

    doc["spec"]["ssh"]["bastion"] = {"address": "not a host!", "extra": 1}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    text = str(e.value)
    assert "spec.ssh.bastion.address" in text and "spec.ssh.bastion.extra: unknown field" in text


# --- a non-root login user ----------------------------------------------------------------------

@lab
def test_non_root_user_runs_through_sudo(sshlab, lab_doc, tmp_path):
    root_inv = make_inventory(tmp_path, lab_doc, "root.yaml")
    deb = debian_artifacts.download(["sudo"], log=lambda *_: None)["sudo"]   # on this machine; the lab has no network
    with Remote(root_inv.host("w1"), root_inv) as root:
        for user in ("deploy", "nosudo"):
            root.run(f"id {user} >/dev/null 2>&1 || useradd -m -s /bin/sh {user}; usermod -p '*' {user}; "
                     f"install -d -m 700 -o {user} -g {user} /home/{user}/.ssh; "
                     f"install -m 600 -o {user} -g {user} /root/.ssh/authorized_keys /home/{user}/.ssh/",
                     what=f"create {user}")
        root.run("dpkg -r sudo >/dev/null 2>&1 || true")

        deploy_inv = make_inventory(tmp_path, lab_doc, "deploy.yaml", user="deploy")
        with Remote(deploy_inv.host("w1"), deploy_inv) as r:
            with pytest.raises(HostError,
                               match="w1: command: the SSH user deploy is not root and the host has no sudo"):
                r.run("id -u", check=False)

        root.put("/tmp/sudo.deb", deb.read_bytes(), mode=0o600)
        root.run("dpkg -i /tmp/sudo.deb >/dev/null && rm /tmp/sudo.deb", what="install sudo")
        root.put("/etc/sudoers.d/deploy", "deploy ALL=(ALL) NOPASSWD:ALL\n", mode=0o440)

    with Remote(deploy_inv.host("w1"), deploy_inv) as r:
        out = r.run("id -u; echo $SUDO_USER; whoami")
        assert out.stdout.split() == ["0", "deploy", "root"]
        blob = os.urandom(1 << 20)                                   # stdin passes through sudo intact
        assert r.run("sha256sum", stdin=blob).stdout.split()[0] == hashlib.sha256(blob).hexdigest()
        r.put("/root/written-by-deploy", b"x", mode=0o600)
        assert r.run("stat -c '%U %a' /root/written-by-deploy").stdout.split() == ["root", "600"]

    nosudo_inv = make_inventory(tmp_path, lab_doc, "nosudo.yaml", user="nosudo")
    with Remote(nosudo_inv.host("w1"), nosudo_inv) as r:
        with pytest.raises(HostError) as e:
            r.run("id -u", check=False, what="read facts")
    msg = str(e.value)
    assert msg.startswith("w1: read facts: the SSH user nosudo cannot run commands as root without a password")
    assert "sudo: a password is required" in msg
