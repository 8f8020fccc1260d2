"""The CA guard: no run pushes a CA that the hosts do not already trust.

A state directory that is not the cluster's (a wrong or forgotten ``--state``, a copy made
before a rotation) holds other CAs; applying it would replace every CA on the hosts and
break every certificate, kubeconfig and token the cluster has handed out. The facts probe
returns each CA certificate file the plan manages (``HostFile.trust``); a file on a host
sharing no certificate with what the state would write there stops the run before the lock
and any change. Sharing one is fine: that is a CA rotation under way (a bundle of old and
new). A host without the file trusts nothing yet and is not compared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from installer.core.errors import StateError
from installer.core.facts import HostFacts
from installer.core.render.files import HostPlan

SHOWN = 8       # mismatch lines before "... and N more"


class TrustMismatch(StateError):
    """The hosts trust other CAs than the state directory holds."""


@dataclass(frozen=True)
class Cert:
    fingerprint: str        # SHA-256 of the DER, hex
    subject: str            # its CN, to tell the CAs apart in a message

    @property
    def short(self) -> str:
        fp = self.fingerprint.upper()
        return ":".join(fp[i:i + 2] for i in range(0, 16, 2)) + "…"


@dataclass(frozen=True)
class Mismatch:
    host: str
    path: str
    on_host: tuple[Cert, ...]
    in_state: tuple[Cert, ...]


def certificates(pem: bytes) -> tuple[Cert, ...]:
    """Every certificate of a PEM bundle; unreadable content gives none (then it trusts nothing
    this state could share, which the caller reports)."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return ()
    out = []
    for c in certs:
        cn = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        out.append(Cert(hashlib.sha256(c.public_bytes(Encoding.DER)).hexdigest(),
                        str(cn[0].value) if cn else c.subject.rfc4514_string()))
    return tuple(out)


def mismatches(plans: Mapping[str, HostPlan], facts: Mapping[str, HostFacts]) -> list[Mismatch]:
    """Pure: every managed CA file whose copy on the host shares no certificate with the plan's."""
    out = []
    for host, plan in plans.items():
        if host in facts:
            out += held_mismatches(host, plan, facts[host].trusted)
    return out


def held_mismatches(where: str, plan: HostPlan, held: Mapping[str, bytes]) -> list[Mismatch]:
    """Pure: each CA file of ``plan`` whose copy in ``held`` (path -> bytes: a host's files, or a
    hosted tenant's ConfigMaps in its hosting cluster) shares no certificate with the plan's."""
    out = []
    for f in plan.files.values():
        have = held.get(f.path) if f.trust else None
        if have is None:
            continue
        on_host, in_state = certificates(have), certificates(f.content)
        if not {c.fingerprint for c in on_host} & {c.fingerprint for c in in_state}:
            out.append(Mismatch(where, f.path, on_host, in_state))
    return out


def _certs(cs: tuple[Cert, ...]) -> str:
    return " + ".join(f"{c.subject} {c.short}" for c in cs) or "no readable certificate"


def message(found: list[Mismatch], state_root: str, new_ca: bool) -> str:
    lines = [f"the hosts trust other CAs than the state directory {state_root}: nothing was changed"]
    lines += [f"  {m.host} {m.path}: the host trusts {_certs(m.on_host)}; the state has {_certs(m.in_state)}"
              for m in found[:SHOWN]]
    if len(found) > SHOWN:
        lines.append(f"  ... and {len(found) - SHOWN} more")
    if new_ca:
        lines.append("  the state directory had no CA: this run would have made a new one")
    lines += ["what to do:",
              "  wrong state directory? pass --state DIR (the default is .hiddenplane/<cluster> next to the "
              "inventory file)",
              "  the hosts hold an old cluster you mean to replace? run `installer reset INVENTORY --yes` first",
              "  replacing a CA on purpose? use `installer ca rotate INVENTORY`"]
    return "\n".join(lines)


def check(plans: Mapping[str, HostPlan], facts: Mapping[str, HostFacts], state_root: str, new_ca: bool,
          more: list[Mismatch] = ()) -> None:
    """``more``: mismatches found elsewhere (a hosted tenant's hosting cluster)."""
    found = mismatches(plans, facts) + list(more)
    if found:
        raise TrustMismatch(message(found, state_root, new_ca))
