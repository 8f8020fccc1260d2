"""Bring the cluster's secret material up to date with the inventory, in memory.

``ensure`` takes what the state directory already holds and returns the full set plus the
names that changed and why: existing keys and certificates are kept unless they no longer
fit (new host, changed SANs, a re-created CA, expiry), so re-runs are no-ops.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import secrets as pysecrets
import string
from dataclasses import dataclass, field

from installer.core import network
from installer.core.errors import StateError
from installer.core.inventory import Inventory
from installer.core.pki import issue
from installer.core.pki.issue import Pair, PrivateKey
from installer.core.pki.specs import CAS, CertSpec, cert_specs

TOKEN_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class BootstrapToken:
    id: str
    secret: str
    expires: dt.datetime

    @property
    def value(self) -> str:
        return f"{self.id}.{self.secret}"


@dataclass
class Material:
    """Everything secret the cluster is built from, plus the workers' pod CIDRs (not secret,
    but kept in the state the same way: allocated once, never re-derived)."""

    cas: dict[str, Pair] = field(default_factory=dict)
    certs: dict[str, Pair] = field(default_factory=dict)
    sa_key: PrivateKey | None = None
    encryption_key: bytes | None = None            # 32 random bytes for secretbox
    tokens: dict[str, BootstrapToken] = field(default_factory=dict)   # by node name
    pod_cidrs: dict[str, str] = field(default_factory=dict)           # node -> CIDR (network.py)

    def pair(self, name: str) -> Pair:
        return self.cas.get(name) or self.certs[name]

    @property
    def encryption_key_b64(self) -> str:
        assert self.encryption_key is not None
        return base64.b64encode(self.encryption_key).decode()


@dataclass
class Changes:
    reasons: dict[str, str] = field(default_factory=dict)   # name -> why it was (re)made

    def add(self, name: str, why: str) -> None:
        self.reasons[name] = why

    def __bool__(self) -> bool:
        return bool(self.reasons)


def new_token(expires: dt.datetime) -> BootstrapToken:
    def pick(n: int) -> str:
        return "".join(pysecrets.choice(TOKEN_ALPHABET) for _ in range(n))
    return BootstrapToken(pick(6), pick(16), expires)


def _ensure_cas(inv: Inventory, old: Material, new: Material, ch: Changes, now: dt.datetime) -> None:
    algo, days = inv.spec.pki.keyAlgorithm, inv.spec.pki.caValidityDays
    for ca in CAS:
        pair = old.cas.get(ca.name)
        if pair is not None and issue.key_algorithm(pair.key) != algo:
            # one algorithm for every key: mixing would follow from re-keying leaves only
            raise StateError(
                f"the state's {ca.cn} key is {issue.key_algorithm(pair.key)} but spec.pki.keyAlgorithm "
                f"is {algo}; changing the algorithm means a new PKI: use a new state directory "
                "(or set keyAlgorithm back)")
        # A CA is never silently replaced: if its files exist it is kept (rotation is explicit).
        if pair is not None and issue.key_matches(pair.cert, pair.key):
            if pair.cert.not_valid_after_utc <= now:
                # Issuing under it would fail (a leaf cannot end before it starts); say so.
                raise StateError(
                    f"the {ca.cn} certificate (pki/{ca.name}.crt) expired on "
                    f"{pair.cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; rotating a CA is explicit: "
                    f"move pki/{ca.name}.crt and pki/{ca.name}.key away to create a new one")
            new.cas[ca.name] = pair
            continue
        key = issue.new_key(algo)
        new.cas[ca.name] = Pair(issue.make_ca(ca.cn, key, days, now), key)
        ch.add(ca.name, "new CA" if pair is None else "CA key did not match its certificate")


def _ensure_leaf(spec: CertSpec, inv: Inventory, old: Material, new: Material, ch: Changes,
                 now: dt.datetime) -> None:
    algo = inv.spec.pki.keyAlgorithm
    ca = new.cas[spec.ca]
    pair = old.certs.get(spec.name)
    why = "new" if pair is None else issue.why_reissue(spec, pair, ca, algo, now)
    if why is None:
        new.certs[spec.name] = pair
        return
    key = pair.key if pair is not None and issue.key_algorithm(pair.key) == algo else issue.new_key(algo)
    new.certs[spec.name] = Pair(issue.issue(spec, key, ca, inv.spec.pki.certValidityDays, now), key)
    ch.add(spec.name, why)


def ensure(inv: Inventory, old: Material, now: dt.datetime | None = None) -> tuple[Material, Changes]:
    now = now or dt.datetime.now(dt.timezone.utc)
    new, ch = Material(), Changes()
    _ensure_cas(inv, old, new, ch, now)
    for spec in cert_specs(inv):
        _ensure_leaf(spec, inv, old, new, ch, now)

    algo = inv.spec.pki.keyAlgorithm
    if old.sa_key is not None:
        new.sa_key = old.sa_key
    else:
        # kube-apiserver verifies tokens with any algorithm it can parse; keep one algorithm anyway
        new.sa_key = issue.new_key(algo)
        ch.add("sa", "new")
    if old.encryption_key is not None and len(old.encryption_key) == 32:
        new.encryption_key = old.encryption_key
    else:
        new.encryption_key = os.urandom(32)
        ch.add("encryption-key", "new")

    ttl = dt.timedelta(hours=inv.spec.pki.bootstrapTokenTTLHours)
    for h in inv.workers:
        tok = old.tokens.get(h.name)
        # a token handed out in its last quarter could expire before the kubelet uses it
        if tok is not None and tok.expires - now > ttl / 4:
            new.tokens[h.name] = tok
        else:
            new.tokens[h.name] = new_token(now + ttl)
            why = "new" if tok is None else "expired" if tok.expires <= now else "expiring"
            ch.add(f"token/{h.name}", why)

    # every CNI gets the installer's allocation: cni: routes renders it into the CNI config
    # and routes, and both set it as Node.spec.podCIDR (Cilium's ipam.mode: kubernetes reads it)
    net = inv.spec.network
    new.pod_cidrs, reasons = network.allocate(net.podCIDR, net.nodeCIDRMaskSize, old.pod_cidrs,
                                              [h.name for h in inv.workers])
    for node, why in reasons.items():
        ch.add(f"network/{node}", why)
    return new, ch
