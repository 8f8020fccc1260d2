"""The Vagrant lab (vagrant/): the Vagrantfile passes Vagrant's own validation (and that
validation is shown to catch a misspelled setting), it has no side effects, its hosts equal
vagrant/inventory.yaml's, and the known_hosts helper keeps one verified key per address.

Needs the `vagrant` command (Debian: apt-get install vagrant; it brings ruby). No VM is booted:
VirtualBox is not available where CI runs, so `vagrant up` itself is not proven here.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import struct
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from installer.core import inventory

from .conftest import EXAMPLE, ROOT

LAB = ROOT / "vagrant"
VAGRANTFILE = LAB / "Vagrantfile"
INVENTORY = LAB / "inventory.yaml"
HOST_LINE = re.compile(r'^\{ name: "([a-z0-9-]+)",\s*ip: "([0-9.]+)",\s*role: "(control|worker)" \},$')


def vagrant() -> str:
    path = shutil.which("vagrant")
    if not path:
        pytest.fail("vagrant is not installed: apt-get install vagrant")
    return path


def ruby() -> str:
    path = shutil.which("ruby")
    if not path:
        pytest.fail("ruby is not installed (it comes with vagrant): apt-get install vagrant")
    return path


def run_vagrant(args: list[str], cwd: Path, tmp_path: Path, plugins: bool = True,
                **extra_env: str) -> subprocess.CompletedProcess:
    """Run vagrant with all its state in tmp_path: VAGRANT_HOME, and the .vagrant directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAGRANT_")}
    env.update(VAGRANT_HOME=str(tmp_path / "vagrant-home"),
               VAGRANT_DOTFILE_PATH=str(tmp_path / "vagrant-dotfile"),
               VAGRANT_CHECKPOINT_DISABLE="1", **extra_env)
    if not plugins:
        env["VAGRANT_NO_PLUGINS"] = "1"   # plain Vagrant, as with `apt-get install --no-install-recommends`
    return subprocess.run([vagrant(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def lab_copy(tmp_path: Path, edit=None) -> Path:
    d = tmp_path / "lab"
    d.mkdir()
    for name in ("Vagrantfile", "known_hosts.rb"):
        shutil.copy(LAB / name, d / name)
    if edit:
        text = VAGRANTFILE.read_text()
        changed = edit(text)
        assert changed != text, "the edit did not apply: the test is out of date"
        (d / "Vagrantfile").write_text(changed)
    return d


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size) for p in d.rglob("*")}


def vagrantfile_hosts() -> list[tuple[str, str, str]]:
    """The HOSTS table, read strictly: every line between `HOSTS = [` and `].freeze` is a host."""
    m = re.search(r"^HOSTS = \[\n(.*?)^\]\.freeze$", VAGRANTFILE.read_text(), re.M | re.S)
    assert m, "Vagrantfile: no `HOSTS = [ ... ].freeze` table"
    hosts = []
    for line in m.group(1).splitlines():
        line = re.sub(r"\s+", " ", line.strip())
        if not line or line.startswith("#"):
            continue
        hm = HOST_LINE.match(line)
        assert hm, f"Vagrantfile: unexpected line in HOSTS: {line!r}"
        hosts.append(hm.groups())
    return hosts


# --- Vagrant's own validation ----------------------------------------------------------------

@pytest.mark.parametrize("plugins", [True, False], ids=["installed-plugins", "no-plugins"])
def test_vagrantfile_validates_without_side_effects(tmp_path, plugins):
    before = tree(LAB)
    r = run_vagrant(["validate", "--ignore-provider"], LAB, tmp_path, plugins=plugins)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Vagrantfile validated successfully" in r.stdout
    for name, *_ in vagrantfile_hosts():
        assert f"==> {name}:" in r.stdout   # every machine was loaded and checked
    assert tree(LAB) == before, "vagrant validate changed files in vagrant/"


def test_validation_is_real_a_misspelled_setting_fails(tmp_path):
    d = lab_copy(tmp_path, lambda t: t.replace("node.vm.hostname =", "node.vm.hostnme =", 1))
    r = run_vagrant(["validate", "--ignore-provider"], d, tmp_path)
    assert r.returncode != 0
    assert "The following settings shouldn't exist: hostnme" in r.stderr, r.stdout + r.stderr


def test_libvirt_provider_block_validates(tmp_path):
    """With the vagrant-libvirt plugin (apt recommends it), its settings are checked too."""
    plugins = run_vagrant(["plugin", "list"], LAB, tmp_path)
    if "vagrant-libvirt" not in plugins.stdout:
        pytest.skip("vagrant-libvirt is not installed (apt-get install vagrant-libvirt)")
    r = run_vagrant(["validate"], LAB, tmp_path, VAGRANT_DEFAULT_PROVIDER="libvirt")
    assert r.returncode == 0, r.stdout + r.stderr
    d = lab_copy(tmp_path, lambda t: t.replace("lv.memory =", "lv.memroy =", 1))
    r = run_vagrant(["validate"], d, tmp_path, VAGRANT_DEFAULT_PROVIDER="libvirt")
    assert r.returncode != 0
    assert "The following settings shouldn't exist: memroy" in r.stderr, r.stdout + r.stderr


def test_key_pair_is_made_by_provisioning_commands_only(tmp_path):
    d = lab_copy(tmp_path)
    for cmd in (["validate", "--ignore-provider"], ["status"]):
        run_vagrant(cmd, d, tmp_path, plugins=False)
        assert not (d / ".ssh").exists(), f"vagrant {cmd[0]} created .ssh/"
    # `vagrant provision` loads the Vagrantfile (making the key) before it finds no provider
    run_vagrant(["provision"], d, tmp_path, plugins=False)
    key, pub = d / ".ssh" / "id_ed25519", d / ".ssh" / "id_ed25519.pub"
    assert (d / ".ssh").stat().st_mode & 0o777 == 0o700
    assert key.stat().st_mode & 0o777 == 0o600
    assert pub.read_text().startswith("ssh-ed25519 ")
    first = key.read_bytes()
    run_vagrant(["provision"], d, tmp_path, plugins=False)
    assert key.read_bytes() == first, "the key pair was made again"


# --- the Vagrantfile and the inventory agree -------------------------------------------------

def test_inventory_is_valid_and_matches_the_vagrantfile():
    inv = inventory.load(INVENTORY)
    assert [(h.name, h.address, h.role) for h in inv.spec.hosts] == vagrantfile_hosts()
    # the reference lab: same hosts, network and API as inventory.example.yaml
    example = yaml.safe_load(EXAMPLE.read_text())["spec"]
    ours = yaml.safe_load(INVENTORY.read_text())["spec"]
    for key in ("kubernetes", "network", "apiServer", "hosts", "pki"):
        assert ours[key] == example[key], f"spec.{key} differs from inventory.example.yaml"
    assert inv.spec.artifacts.source == "download"
    # ssh paths, relative to the inventory's directory, are where the Vagrantfile puts them
    assert inv.spec.ssh.user == "root"
    assert inv.spec.ssh.keyPath == ".ssh/id_ed25519"
    assert inv.spec.ssh.knownHosts == ".ssh/known_hosts"
    text = VAGRANTFILE.read_text()
    assert 'KEY_PATH    = File.join(SSH_DIR, "id_ed25519")' in text
    assert 'KNOWN_HOSTS = File.join(SSH_DIR, "known_hosts")' in text
    assert 'SSH_DIR     = File.join(LAB_DIR, ".ssh")' in text


def test_vagrantfile_settings():
    text = VAGRANTFILE.read_text()
    assert re.search(r'^BOX = "debian/bookworm64"$', text, re.M)
    assert "node.vm.hostname = host[:name]" in text          # hostname == inventory name
    assert 'node.vm.network "private_network", ip: host[:ip]' in text
    assert '"control" => { memory: 2048, cpus: 2 }' in text
    assert '"worker"  => { memory: 2048, cpus: 2 }' in text
    for provider in ("virtualbox", "libvirt"):
        assert f'node.vm.provider "{provider}"' in text
    assert all(ip.startswith("192.168.56.") for _, ip, _ in vagrantfile_hosts())


def test_provision_script_is_valid_shell():
    m = re.search(r"^PROVISION = <<~'SH'\n(.*?)^SH$", VAGRANTFILE.read_text(), re.M | re.S)
    assert m
    script = textwrap.dedent(m.group(1))
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for needed in ("/root/.ssh/authorized_keys", "swapoff -a", "ssh-keygen -A", "sshd -t"):
        assert needed in script


def test_gitignore_keeps_lab_secrets_out():
    for path in (".ssh/id_ed25519", ".ssh/known_hosts", ".vagrant/machines/cp1/id", "out/cp1/MANIFEST"):
        r = subprocess.run(["git", "check-ignore", "-q", f"vagrant/{path}"], cwd=ROOT)
        if r.returncode == 128:
            pytest.skip("not a git checkout")
        assert r.returncode == 0, f"vagrant/{path} is not ignored by git"


# --- known_hosts.rb: the trigger's helper, run with plain ruby -------------------------------

def ed25519_line(fill: int) -> str:
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + bytes([fill]) * 32
    return "ssh-ed25519 " + base64.b64encode(blob).decode()


KEY_A, KEY_B = ed25519_line(0xAA), ed25519_line(0xBB)


def known_hosts(path: Path, *calls: str) -> subprocess.CompletedProcess:
    script = f'require {str(LAB / "known_hosts.rb")!r}\nP = {str(path)!r}\n' + "\n".join(calls)
    return subprocess.run([ruby(), "-e", script], capture_output=True, text=True, timeout=60)


def test_known_hosts_one_verified_key_per_address(tmp_path):
    kh = tmp_path / ".ssh" / "known_hosts"
    kh.parent.mkdir()
    kh.write_text("192.168.56.231 ssh-ed25519 OLDKEY\nother.example ssh-rsa AAAAB3\n")
    r = known_hosts(kh,
                    f'HiddenplaneKnownHosts.record(P, "192.168.56.230", "{KEY_A} root@cp1\\n")',
                    f'HiddenplaneKnownHosts.record(P, "192.168.56.231", "{KEY_B} root@node2\\n")',
                    f'HiddenplaneKnownHosts.record(P, "192.168.56.230", "{KEY_B}")')
    assert r.returncode == 0, r.stderr
    assert kh.read_text().splitlines() == [
        "other.example ssh-rsa AAAAB3",           # not the lab's: kept
        f"192.168.56.231 {KEY_B}",                # the stale key replaced, comment dropped
        f"192.168.56.230 {KEY_B}",                # re-recorded: still one line
    ]
    assert kh.stat().st_mode & 0o777 == 0o600
    r = known_hosts(kh, 'HiddenplaneKnownHosts.forget(P, "192.168.56.231")')
    assert r.returncode == 0, r.stderr
    assert kh.read_text().splitlines() == ["other.example ssh-rsa AAAAB3", f"192.168.56.230 {KEY_B}"]
    # a key as a VM's /etc/ssh/ssh_host_ed25519_key.pub holds it
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "root@node3",
                    "-f", str(tmp_path / "host_key")], check=True)
    real = (tmp_path / "host_key.pub").read_text()
    r = known_hosts(kh, f'HiddenplaneKnownHosts.record(P, "192.168.56.232", {real!r})')
    assert r.returncode == 0, r.stderr
    assert kh.read_text().splitlines()[-1] == "192.168.56.232 " + " ".join(real.split()[:2])


@pytest.mark.parametrize("answer", ["", "cat: /etc/ssh/ssh_host_ed25519_key.pub: No such file",
                                    "ssh-rsa AAAAB3NzaC1yc2E root@cp1", "ssh-ed25519 notakey",
                                    KEY_A[:-4] + "AAA=",              # right length, not base64 of a key
                                    KEY_A.replace("ed25519", "ed448")])
def test_known_hosts_refuses_anything_but_an_ed25519_key(tmp_path, answer):
    kh = tmp_path / "known_hosts"
    kh.write_text(f"192.168.56.230 {KEY_A}\n")
    r = known_hosts(kh, f'HiddenplaneKnownHosts.record(P, "192.168.56.230", {answer!r})')
    assert r.returncode != 0
    assert "not an ssh-ed25519 public key" in r.stderr
    assert kh.read_text() == f"192.168.56.230 {KEY_A}\n"
