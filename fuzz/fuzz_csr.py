#!/usr/bin/env python3
"""Fuzz the CSR judge (installer/core/csr_rules.py): ``judge`` and ``parse_request``.

An input is ``flags, user, payload``:

- ``flags`` (byte 0): bits 0-2 pick the usages (USAGES), bits 3-4 the kubelet keys the run
  read (0: any key is the kubelet's, 1: only SEED_KEY's, 2: none read (None), 3: {}), bit 5
  marks the token spent, bits 6-7 say what the payload is: 0 the request bytes as they are;
  1 DER, wrapped here in one canonical PEM block; 2 a subject Name (DER), 3 a whole
  CertificationRequestInfo (DER), each made here into a request signed with SEED_KEY (so that
  mutated subjects still carry a valid signature and reach the subject checks).
- ``user`` (byte 1): the requesting user, an index into USERS.
- ``payload``: the rest.

Properties, checked here without the code under test (``re``, ``base64`` and a strict DER
reader of our own on the raw request bytes):

- ``judge`` returns None or a Verdict, and raises nothing;
- it approves only when: the user is ``system:bootstrap:<id>`` of a token in TOKENS, not spent,
  with a kubelet key read for its node; the usages are client ones, ``client auth`` among them;
  the bytes are exactly one PEM block of type CERTIFICATE REQUEST (nothing before it, no
  headers, only whitespace after it) holding strict DER whose subject is exactly
  ``CN=system:node:<the token's node>`` and ``O=system:nodes`` (two RDNs, one attribute each);
- ``parse_request`` returns or raises ValueError, and returns only for
  bytes that are one such PEM block of strict DER.

    .venv/bin/python fuzz/fuzz_csr.py -max_total_time=600 -rss_limit_mb=2048 -timeout=10 \\
        /tmp/new-corpus fuzz/corpus/csr
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import re
import sys
from pathlib import Path

try:
    import atheris
except ImportError:     # the replay (tests/test_fuzz.py) calls check() without atheris
    atheris = None

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _harness  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402  (not under test: not instrumented)
from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: E402

# instrumented only when run as the fuzzer (the replay imports this module into pytest)
FUZZING = atheris is not None and __name__ == "__main__"
with atheris.instrument_imports(include=["installer.core.csr_rules"]) if FUZZING else contextlib.nullcontext():
    from installer.core import csr_rules

judge = csr_rules.judge
parse_request = csr_rules.parse_request
_JUDGE_PARAMS = inspect.signature(judge).parameters

TOKENS = {"abc123": "w1", "def456": "w10", "ghi789": "cp1"}
USERS = ["system:bootstrap:abc123", "system:bootstrap:def456", "system:bootstrap:ghi789",
         "system:bootstrap:zzz999", "system:node:w1", "system:bootstrap:", "system:bootstrap:abc123 ",
         "System:bootstrap:abc123", "system:bootstrap:abc123\n", "system:serviceaccount:kube-system:w1", ""]
CLIENT = {"digital signature", "key encipherment", "client auth"}
USAGES = [["digital signature", "key encipherment", "client auth"], ["client auth"],
          ["digital signature", "client auth"], [], ["client auth", "server auth"], ["digital signature"],
          ["client auth", "client auth"], ["Client Auth"]]

# deterministic signatures (Ed25519): the same input always makes the same request
SEED_KEY = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
SEED_SPKI = SEED_KEY.public_key().public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
ED25519_ALG = bytes.fromhex("300506032b6570")

OID_CN = bytes.fromhex("550403")
OID_O = bytes.fromhex("55040a")
PEM_ONE = re.compile(rb"-----BEGIN CERTIFICATE REQUEST-----\n((?:[A-Za-z0-9+/=]+\n)+)"
                     rb"-----END CERTIFICATE REQUEST-----[ \t\r\n]*")


class AnyKey:
    """The kubelet keys of a node, when any key is the kubelet's (so the fuzzer reaches approval)."""

    def __contains__(self, _key) -> bool:
        return True

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 1


# --- a strict DER reader, our own ------------------------------------------------------------

class NotDER(ValueError):
    pass


def tlv(buf: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(tag, start, stop) of the element at ``pos``: DER only (definite, minimal lengths)."""
    if pos + 2 > end:
        raise NotDER("short")
    tag, n = buf[pos], buf[pos + 1]
    if tag & 0x1F == 0x1F:
        raise NotDER("high tag number")
    pos += 2
    if n & 0x80:
        k = n & 0x7F
        if k == 0 or k > 4 or pos + k > end:
            raise NotDER("length")
        length = int.from_bytes(buf[pos:pos + k], "big")
        if buf[pos] == 0 or length < 0x80:
            raise NotDER("length not minimal")
        pos += k
    else:
        length = n
    if pos + length > end:
        raise NotDER("past the end")
    return tag, pos, pos + length


def elements(buf: bytes, start: int, stop: int) -> list[tuple[int, int, int]]:
    out, pos = [], start
    while pos < stop:
        t = tlv(buf, pos, stop)
        out.append(t)
        pos = t[2]
    return out


def _text(tag: int, raw: bytes) -> str | None:
    codecs = {0x0C: "utf-8", 0x13: "ascii", 0x16: "ascii", 0x14: "latin-1", 0x1E: "utf-16-be", 0x1C: "utf-32-be"}
    try:
        return raw.decode(codecs[tag]) if tag in codecs else None
    except (UnicodeDecodeError, KeyError):
        return None


def request_facts(der: bytes) -> tuple[list[list[tuple[bytes, str | None]]], bytes]:
    """(the subject's RDNs as [(oid, text)], the SubjectPublicKeyInfo TLV) of a strict DER
    CertificationRequest; NotDER otherwise."""
    tag, s, e = tlv(der, 0, len(der))
    if tag != 0x30 or e != len(der):
        raise NotDER("not one SEQUENCE")
    top = elements(der, s, e)
    if [t[0] for t in top] != [0x30, 0x30, 0x03]:
        raise NotDER("not info, algorithm, signature")
    info = elements(der, top[0][1], top[0][2])
    if [t[0] for t in info] != [0x02, 0x30, 0x30, 0xA0] or der[info[0][1]:info[0][2]] != b"\x00":
        raise NotDER("not version 0, subject, key, attributes")
    rdns = []
    for stag, ss, se in elements(der, info[1][1], info[1][2]):
        if stag != 0x31:
            raise NotDER("an RDN that is not a SET")
        rdn = []
        for atag, as_, ae in elements(der, ss, se):
            parts = elements(der, as_, ae) if atag == 0x30 else []
            if len(parts) != 2 or parts[0][0] != 0x06:
                raise NotDER("not an attribute")
            (_, os_, oe), (vtag, vs, ve) = parts
            rdn.append((der[os_:oe], _text(vtag, der[vs:ve])))
        rdns.append(rdn)
    # the key: the whole TLV, header included
    key_start = info[1][2]
    return rdns, der[key_start:info[2][2]]


def one_pem_block(data: bytes) -> bytes | None:
    """The DER inside ``data`` when ``data`` is exactly one CERTIFICATE REQUEST block (nothing
    before it, no headers, whitespace only after it); None otherwise."""
    m = PEM_ONE.fullmatch(data)
    if m is None:
        return None
    try:
        return base64.b64decode(m.group(1).replace(b"\n", b""), validate=True)
    except ValueError:
        return None


def subject_problem(rdns, node: str) -> str | None:
    """What makes the subject other than exactly CN=system:node:<node>, O=system:nodes (None: nothing)."""
    if len(rdns) != 2 or any(len(r) != 1 for r in rdns):
        return "its RDNs are not two of one attribute each"
    if any(text is None for (_, text), in rdns):
        return "a value is of no string type"
    if sorted(a for a, in rdns) != sorted([(OID_CN, f"system:node:{node}"), (OID_O, "system:nodes")]):
        return "it is not CN=system:node:<node>, O=system:nodes"
    return None


# --- inputs ------------------------------------------------------------------------------------

def der_len(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def wrap(tag: int, content: bytes) -> bytes:
    return bytes([tag]) + der_len(len(content)) + content


def signed(info: bytes) -> bytes:
    return wrap(0x30, info + ED25519_ALG + wrap(0x03, b"\x00" + SEED_KEY.sign(info)))


def info_for(subject: bytes) -> bytes:
    return wrap(0x30, b"\x02\x01\x00" + subject + SEED_SPKI + b"\xa0\x00")


def pem(der: bytes) -> bytes:
    b64 = base64.b64encode(der)
    return (b"-----BEGIN CERTIFICATE REQUEST-----\n"
            + b"".join(b64[i:i + 64] + b"\n" for i in range(0, len(b64), 64))
            + b"-----END CERTIFICATE REQUEST-----\n")


def decode(data: bytes):
    """(username, usages, request bytes, kubelet keys, spent) from one fuzz input."""
    flags = data[0] if data else 0
    user = USERS[(data[1] if len(data) > 1 else 0) % len(USERS)]
    payload = data[2:]
    usages = list(USAGES[flags & 7])
    keys_mode = (flags >> 3) & 3
    spent = bool(flags & 0x20)
    form = flags >> 6
    if form == 1:
        request = pem(payload)
    elif form == 2:
        request = pem(signed(info_for(payload)))
    elif form == 3:
        request = pem(signed(payload))
    else:
        request = payload
    keys = [{n: AnyKey() for n in TOKENS.values()}, {n: {SEED_SPKI} for n in TOKENS.values()}, None, {}][keys_mode]
    return user, usages, request, keys, spent


def encode(user: str, request_or_payload: bytes, usages: int = 0, keys: int = 0, spent: bool = False,
           form: int = 0) -> bytes:
    """The fuzz input for these choices (fuzz/seeds.py makes the seed corpus with it)."""
    return bytes([usages | keys << 3 | (0x20 if spent else 0) | form << 6, USERS.index(user)]) + request_or_payload


# --- the property ------------------------------------------------------------------------------

def check(data: bytes) -> None:
    """The properties for one input; an AssertionError or any other exception is a crash."""
    user, usages, request, keys, spent = decode(data)
    der = one_pem_block(request)
    if parse_request is not None:
        try:
            parsed = parse_request(request)
        except ValueError:
            parsed = None
        if parsed is not None:
            assert der is not None, \
                "parse_request accepted bytes that are not exactly one PEM block: " + repr(request[:200])
            try:
                request_facts(der)
            except NotDER as e:
                raise AssertionError(f"parse_request accepted a request that is not strict DER: {e}") from None

    kwargs = {}
    if "kubelet_keys" in _JUDGE_PARAMS:
        kwargs["kubelet_keys"] = keys
    token = user[len("system:bootstrap:"):] if user.startswith("system:bootstrap:") else None
    if "spent" in _JUDGE_PARAMS:
        kwargs["spent"] = {token: "csr-0"} if spent and token is not None else {}
    verdict = judge("csr-1", user, request, usages, TOKENS, **kwargs)
    assert verdict is None or isinstance(verdict, csr_rules.Verdict), \
        f"judge returned neither None nor a Verdict: {verdict!r}"[:300]
    if verdict is None or not verdict.approve:
        return
    assert verdict.approve is True, f"approve is neither False nor True: {verdict.approve!r}"
    assert token is not None and token in TOKENS, f"approved for a user that is none of our tokens: {user!r}"
    node = TOKENS[token]
    assert (verdict.node, verdict.token) == (node, token), \
        f"approved naming another node or token: {verdict.node}/{verdict.token}"
    assert "client auth" in usages and set(usages) <= CLIENT, f"approved with usages that are not client ones: {usages}"
    if "spent" in _JUDGE_PARAMS:
        assert not spent, "approved a second request of a spent token: " + token
    if "kubelet_keys" in _JUDGE_PARAMS:
        assert keys, f"approved with no kubelet key read: {keys!r}"
    assert der is not None, \
        "approved bytes that are not exactly one PEM CERTIFICATE REQUEST block: " + repr(request[:200])
    try:
        rdns, key = request_facts(der)
    except NotDER as e:
        raise AssertionError(f"approved a request that is not strict DER: {e}") from None
    if keys is not None and not isinstance(keys.get(node), AnyKey):
        assert key in keys.get(node, ()), f"approved a request whose key is not the kubelet's: {key.hex()}"
    problem = subject_problem(rdns, node)
    assert problem is None, f"approved a request whose subject is wrong, {problem}: node {node}, subject {rdns}"


def main(argv: list[str]) -> None:
    _harness.run(check, argv, atheris)


if __name__ == "__main__":
    main(sys.argv)
