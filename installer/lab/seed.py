"""Per-host files a lab host boots with: hostname, SSH identity, login key, network (VMs).

Host keys are generated here, not on first boot, so that ``known_hosts`` is written before the
hosts start and SSH can verify them from the first connection (no trust-on-first-use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from installer.lab.model import LabHost, LabSpec

SSHD_DROPIN = """# hiddenplane lab: one host key, known in advance; keys only
HostKey /etc/ssh/ssh_host_ed25519_key
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UseDNS no
"""


@dataclass(frozen=True)
class KeyPair:
    private_openssh: bytes
    public_openssh: bytes       # "ssh-ed25519 AAAA..." without comment


def new_ed25519() -> KeyPair:
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return KeyPair(private, public)


def load_or_create(path: Path, comment: str) -> KeyPair:
    """The lab's login key: created once (0600), reused by later ``lab up`` runs."""
    pub_path = path.with_suffix(".pub")
    if path.exists() and pub_path.exists():
        kind, blob = pub_path.read_bytes().split()[:2]
        return KeyPair(path.read_bytes(), kind + b" " + blob)
    pair = new_ed25519()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pair.private_openssh)
    pub_path.write_bytes(pair.public_openssh + b" " + comment.encode() + b"\n")
    return pair


def network_unit(spec: LabSpec, host: LabHost) -> bytes:
    """systemd-networkd config for a VM (nspawn hosts are configured from outside their netns)."""
    return (f"[Match]\nName=en* eth*\n\n[Network]\nAddress={host.address}/{spec.prefixlen}\n"
            f"Gateway={spec.gateway}\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n").encode()


def host_files(spec: LabSpec, host: LabHost, login: KeyPair, host_key: KeyPair) -> dict[str, tuple[bytes, int]]:
    """Absolute path -> (content, mode) to lay into the host's root before it boots."""
    etc_hosts = ("127.0.0.1 localhost\n::1 localhost\n" +
                 "".join(f"{h.address} {h.name}\n" for h in spec.hosts)).encode()
    files = {
        "/etc/hostname": (f"{host.name}\n".encode(), 0o644),
        "/etc/hosts": (etc_hosts, 0o644),
        "/root/.ssh/authorized_keys": (login.public_openssh + b" hiddenplane-lab\n", 0o600),
        "/etc/ssh/ssh_host_ed25519_key": (host_key.private_openssh, 0o600),
        "/etc/ssh/ssh_host_ed25519_key.pub": (host_key.public_openssh + f" root@{host.name}\n".encode(), 0o644),
        "/etc/ssh/sshd_config.d/hiddenplane-lab.conf": (SSHD_DROPIN.encode(), 0o644),
    }
    if host.kind == "vm":
        files["/etc/systemd/network/10-lab.network"] = (network_unit(spec, host), 0o644)
    return files


def known_hosts_line(host: LabHost, host_key: KeyPair) -> str:
    return f"{host.address},{host.name} {host_key.public_openssh.decode()}\n"


def write_files(root: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for path, (content, mode) in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        os.chmod(target, mode)
