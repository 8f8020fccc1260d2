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

import datetime as dt
import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from installer.core.errors import StateError
from installer.core.facts import HostFacts
from installer.core.render import kubeconfig
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


def certificate_paths(plan: HostPlan) -> list[str]:
    """The files of ``plan`` whose certificates the guards read where they are held: its CA
    files, its leaf certificates (``.crt``) and its kubeconfigs that embed a client certificate
    (the facts probe sends only that certificate, never the key beside it)."""
    return [f.path for f in plan.files.values() if f.trust or f.path.endswith(".crt")
            or (f.path.endswith(kubeconfig.SUFFIX) and kubeconfig.client_certificate(f.content) is not None)]


def leaf(path: str, content: bytes) -> bytes | None:
    """The leaf certificate (PEM) of a file the guards compare: a kubeconfig's client certificate
    (from the whole kubeconfig, as a plan or a tenant's Secret holds it, or already extracted, as
    the facts probe sends it); any other file as it is."""
    if path.endswith(kubeconfig.SUFFIX) and not content.lstrip().startswith(b"-----BEGIN"):
        return kubeconfig.client_certificate(content)
    return content


def mismatches(plans: Mapping[str, HostPlan], facts: Mapping[str, HostFacts]) -> list[Mismatch]:
    """Pure: every managed CA file whose copy on the host shares no certificate with the plan's."""
    out = []
    for host, plan in plans.items():
        if host in facts:
            out += held_mismatches(host, plan, facts[host].certs)
    return out


@dataclass(frozen=True)
class Older:
    """A leaf certificate the state would push over a newer one of the same CA."""
    host: str
    path: str
    on_host: dt.datetime
    in_state: dt.datetime


def older_leaves(where: str, plan: HostPlan, held: Mapping[str, bytes]) -> list[Older]:
    """Pure: each leaf certificate of ``plan`` (not a CA file; a kubeconfig's client certificate
    counts) whose copy in ``held`` was issued later by the same CA. The state issues every one of
    them: one newer where it is held was issued by a newer copy of the state (a renewal, maybe
    after a key leaked), and pushing the older one would bring the replaced key back."""
    out = []
    for f in plan.files.values():
        have = held.get(f.path) if not f.trust else None
        if have is None:
            continue
        have, mine = leaf(f.path, have), leaf(f.path, f.content)
        if not have or not mine or have == mine:
            continue
        try:
            live, ours = x509.load_pem_x509_certificate(have), x509.load_pem_x509_certificate(mine)
        except ValueError:
            continue
        if live.issuer == ours.issuer and live.not_valid_before_utc > ours.not_valid_before_utc:
            out.append(Older(where, f.path, live.not_valid_before_utc, ours.not_valid_before_utc))
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


def older_message(found: list[Older], state_root: str) -> str:
    lines = [f"the hosts hold newer certificates than the state directory {state_root} (a copy from before a "
             "renewal?): nothing was changed"]
    lines += [f"  {o.host} {o.path}: issued {o.on_host:%Y-%m-%d %H:%M} UTC there, {o.in_state:%Y-%m-%d %H:%M} UTC "
              "in the state" for o in found[:SHOWN]]
    if len(found) > SHOWN:
        lines.append(f"  ... and {len(found) - SHOWN} more")
    lines += ["what to do:",
              "  use the state directory that issued them (--state DIR); pushing these would bring back the keys a "
              "renewal replaced",
              "  the state is the only one left? run `installer certs renew INVENTORY` from it first"]
    return "\n".join(lines)


def check(plans: Mapping[str, HostPlan], facts: Mapping[str, HostFacts], state_root: str, new_ca: bool,
          more: Sequence[tuple[str, HostPlan, Mapping[str, bytes]]] = ()) -> None:
    """``more``: certificates held elsewhere (a hosted tenant's, in its hosting cluster), as
    (where, the plan of what is written there, path -> content)."""
    held = [(host, plans[host], facts[host].certs) for host in plans if host in facts] + list(more)
    found = [m for where, plan, certs in held for m in held_mismatches(where, plan, certs)]
    if found:
        raise TrustMismatch(message(found, state_root, new_ca))
    older = [o for where, plan, certs in held for o in older_leaves(where, plan, certs)]
    if older:
        raise TrustMismatch(older_message(older, state_root))
