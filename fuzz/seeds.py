"""Write the seed inputs of both harnesses into fuzz/corpus/<target>/seed-*.

    .venv/bin/python fuzz/seeds.py

The seeds are committed; this script only says how each was made (run it again after changing
an input format: it rewrites the seed-* files and leaves the files a fuzzing run added alone).
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import fuzz_csr as F  # noqa: E402

EXAMPLE = (ROOT / "inventory.example.yaml").read_text()


# --- inventories ---------------------------------------------------------------------------------

def bomb() -> str:
    lines = ['x: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n" + EXAMPLE.replace("extraSANs: []", "extraSANs: *i")


FULL = """\
apiVersion: hiddenplane/v1alpha1
kind: Cluster
metadata: {name: big}
spec:
  kubernetes: {version: v1.36.5}
  allowEvenControlHosts: false
  network:
    podCIDR: 10.244.0.0/16
    serviceCIDR: 10.96.0.0/12
    clusterDNS: 10.96.0.10
    clusterDomain: cluster.local
    resolvConf: /etc/resolv.conf
    cni: cilium
    egress: konnectivity
    nodeCIDRMaskSize: 24
    upstreamDNS: [1.1.1.1, "2606:4700:4700::1111"]
  apiServer:
    endpoint: api.example.com
    port: 6443
    extraSANs: [10.0.0.1, k8s.example.com]
    alwaysPullImages: false
  ssh:
    user: ops
    port: 2222
    keyPath: keys/id
    knownHosts: keys/known_hosts
    bastion: {address: 10.0.0.2, user: jump, port: 22, keyPath: keys/jump}
  hosts:
    - {name: cp1, address: 10.0.1.1, role: control}
    - {name: cp2, address: 10.0.1.2, role: control, ssh: {user: root, port: 22, bastion: null}}
    - {name: cp3, address: 10.0.1.3, role: control, ssh: {keyPath: ~/other, knownHosts: kh}}
    - {name: w1, address: 10.0.2.1, role: worker}
    - {name: w2, address: "fd00::2", role: worker}
  artifacts:
    source: dir
    path: .
    versions: {etcd: 3.6.16, containerd: 2.2.9, runc: 1.4.4, cni: 1.7.1}
    checksums: {kube-apiserver: "00000000000000000000000000000000000000000000000000000000000000ff"}
    cacheDir: /var/cache/x
    sandboxImage: registry.k8s.io/pause:3.10.2
  pki:
    keyAlgorithm: ecdsa-p256
    caValidityDays: 3650
    certValidityDays: 365
    bootstrapTokenTTLHours: 24
    kubeletClientCertHours: 24
  workerHosts: {cgroupV1: true, inContainer: true}
"""

ANCHORS = """\
apiVersion: hiddenplane/v1alpha1
kind: Cluster
metadata: {name: anchors}
spec:
  ssh: &ssh {user: ops, port: 2222}
  hosts:
    - &h {name: cp1, address: 192.168.56.230, role: control, ssh: *ssh}
    - <<: *h
      name: w1
      address: 192.168.56.231
      role: worker
"""

INVENTORIES = {
    "example": EXAMPLE,
    "vagrant": (ROOT / "vagrant" / "inventory.yaml").read_text(),
    "full": FULL,
    "anchors-merge": ANCHORS,
    "ipv6": EXAMPLE.replace("192.168.56.230", "fd00::10").replace("192.168.56.231", "fd00::11")
                   .replace("192.168.56.232", "fd00::12").replace("podCIDR: 10.244.0.0/16", "podCIDR: fd01::/48")
                   .replace("serviceCIDR: 10.96.0.0/12", "serviceCIDR: fd02::/108")
                   .replace("clusterDNS: 10.96.0.10", "clusterDNS: fd02::a"),
    "flow-json": '{"apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster", "metadata": {"name": "j"}, '
                 '"spec": {"hosts": [{"name": "c", "address": "10.0.0.1", "role": "control"}, '
                 '{"name": "w", "address": "10.0.0.2", "role": "worker"}]}}',
    "bad-fields": EXAMPLE.replace("role: worker}", "role: master, ip: 1.2.3.4}").replace("name: lab", "name: -Lab_")
                         .replace("port: 6443", "port: 99999").replace("v1.36.5", "v1.99"),
    "bad-network": EXAMPLE.replace("podCIDR: 10.244.0.0/16", "podCIDR: 10.96.0.0/16")
                          .replace("clusterDNS: 10.96.0.10", "clusterDNS: 10.97.0.10")
                          .replace("endpoint: 192.168.56.230", "endpoint: 127.0.0.1"),
    "duplicates": EXAMPLE.replace("    port: 22\n", "    port: 22\n    port: 2222\n") + "  hosts: []\n",
    "bomb": bomb(),
    "cycle": EXAMPLE.replace("extraSANs: []", "extraSANs: &loop [*loop]"),
    "deep-flow": "[" * 200 + "]" * 200,
    "deep-block": "".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + "  " * 40 + "v\n",
    "tags": "a: !!python/object:os.system x\nb: !!binary aGk=\nc: !!timestamp 2001-02-30\nd: !!set {a, b}\n"
            "e: !!omap [a: 1]\nf: !foo bar\ng: !!float .nan\nh: !!int 0x_ff\n",
    "huge-int": EXAMPLE.replace("port: 6443", "port: " + "9" * 5000),
    "bad-date": EXAMPLE.replace("name: lab", "name: 2001-02-30"),
    "odd-keys": EXAMPLE.replace("  kubernetes:",
                                "  ? [a, b]\n  : x\n  1: one\n  null: n\n  2001-01-01: d\n  kubernetes:"),
    "two-docs": EXAMPLE + "---\n" + EXAMPLE,
    "scalar": "just text\n",
    "list": "- apiVersion: hiddenplane/v1alpha1\n",
    "empty": "",
    "bom-crlf": "\ufeff" + EXAMPLE.replace("\n", "\r\n"),
    "control-char": EXAMPLE.replace("name: lab", "name: la\x01b"),
    "unicode-names": EXAMPLE.replace("node2", "nöde2").replace("name: lab", 'name: "lab\\u2028x"'),
    "tilde-nosuchuser-keypath": EXAMPLE.replace("~/.ssh/id_ed25519", "~nosuchuser/key")
                                       .replace("~/.ssh/known_hosts", "~root/kh"),
    "role-aliases": EXAMPLE.replace("role: control", "role: control+worker").replace("node3", "cp1"),
}
INVENTORY_BYTES = {
    "not-utf8": b"apiVersion: x\nkind: \xff\xfe\x00\x80garbage",
    "png": b"\x89PNG\r\n\x1a\n\x00\x00",
}


# --- certificate requests --------------------------------------------------------------------------

def request(names: list[x509.NameAttribute], key=None, san: str | None = None) -> bytes:
    key = key or F.SEED_KEY
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(names))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return b.sign(key, None).public_bytes(serialization.Encoding.PEM)
    # deterministic (RFC 6979): running this again rewrites the same bytes
    return b.sign(key, hashes.SHA256(), ecdsa_deterministic=True).public_bytes(serialization.Encoding.PEM)


def node(n: str) -> list[x509.NameAttribute]:
    # the kubelet's order (Go's pkix.Name puts O before CN)
    return [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{n}")]


def name_der(rdns: list[list[tuple[bytes, int, bytes]]]) -> bytes:
    """A subject Name from [[(oid, string tag, value)]]: for the subjects cryptography will not build."""
    return F.wrap(0x30, b"".join(F.wrap(0x31, b"".join(F.wrap(0x30, F.wrap(0x06, oid) + F.wrap(tag, v))
                                                       for oid, tag, v in rdn)) for rdn in rdns))


W1 = request(node("w1"))
W9 = request(node("w9"))
EC_W1 = request(node("w1"), key=ec.derive_private_key(0x1234567, ec.SECP256R1()))
DER_W1 = x509.load_pem_x509_csr(W1).public_bytes(serialization.Encoding.DER)
CN, ORG = F.OID_CN, F.OID_O
U = "system:bootstrap:abc123"      # w1's token
B64 = base64.b64encode(DER_W1)

CSRS = {
    "own-ed25519": F.encode(U, W1, keys=1),
    "own-ecdsa-any-key": F.encode(U, EC_W1),
    "own-all-usages": F.encode(U, W1, usages=0),
    "own-client-auth-only": F.encode(U, W1, usages=1),
    "own-server-auth": F.encode(U, W1, usages=4),
    "own-keys-none": F.encode(U, W1, keys=2),
    "own-keys-empty": F.encode(U, W1, keys=3),
    "own-spent": F.encode(U, W1, spent=True),
    "own-renewal-user": F.encode("system:node:w1", W1),
    "unknown-token": F.encode("system:bootstrap:zzz999", W1),
    "wrong-node-w9": F.encode(U, W9),
    "prefix-node-w10-with-w1-token": F.encode(U, request(node("w10"))),
    "w1-with-w10-token": F.encode("system:bootstrap:def456", W1),
    "cn-only": F.encode(U, request([x509.NameAttribute(NameOID.COMMON_NAME, "system:node:w1")])),
    "two-orgs": F.encode(U, request(node("w1") + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters")])),
    "extra-ou": F.encode(U, request(node("w1") + [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "x")])),
    "san": F.encode(U, request(node("w1"), san="w9")),
    "two-blocks": F.encode(U, W1 + W9),
    "two-blocks-w9-first": F.encode(U, W9 + W1),
    "headers": F.encode(U, W1.replace(b"-----\n", b"-----\nProc-Type: 4,ENCRYPTED\n\n", 1)),
    "junk-before": F.encode(U, b"x" + W1),
    "junk-before-line": F.encode(U, b"junk\n" + W1),
    "junk-after": F.encode(U, W1 + b"junk"),
    "whitespace-after": F.encode(U, W1 + b" \t\r\n\n"),
    "no-final-newline": F.encode(U, W1.rstrip(b"\n")),
    "new-type": F.encode(U, W1.replace(b"CERTIFICATE REQUEST", b"NEW CERTIFICATE REQUEST")),
    "crlf": F.encode(U, W1.replace(b"\n", b"\r\n")),
    "long-line": F.encode(U, b"-----BEGIN CERTIFICATE REQUEST-----\n" + B64
                          + b"\n-----END CERTIFICATE REQUEST-----\n"),
    "short-lines": F.encode(U, b"-----BEGIN CERTIFICATE REQUEST-----\n"
                            + b"".join(B64[i:i + 16] + b"\n" for i in range(0, len(B64), 16))
                            + b"-----END CERTIFICATE REQUEST-----\n"),
    "der-in-pem": F.encode(U, DER_W1, form=1),
    "der-trailing-bytes": F.encode(U, DER_W1 + b"\x00\x00", form=1),
    "der-raw": F.encode(U, DER_W1),
    "subject-cn-first": F.encode(U, name_der([[(CN, 0x0C, b"system:node:w1")], [(ORG, 0x0C, b"system:nodes")]]),
                                 keys=1, form=2),
    "subject-printable": F.encode(U, name_der([[(ORG, 0x13, b"system:nodes")], [(CN, 0x13, b"system:node:w1")]]),
                                  form=2),
    "subject-bmp": F.encode(U, name_der([[(ORG, 0x1E, "system:nodes".encode("utf-16-be"))],
                                         [(CN, 0x1E, "system:node:w1".encode("utf-16-be"))]]), form=2),
    "subject-multivalued-rdn": F.encode(U, name_der([[(ORG, 0x0C, b"system:nodes"), (CN, 0x0C, b"system:node:w1")]]),
                                        form=2),
    "subject-two-cns": F.encode(U, name_der([[(ORG, 0x0C, b"system:nodes")], [(CN, 0x0C, b"system:node:w1")],
                                             [(CN, 0x0C, b"system:node:w9")]]), form=2),
    "subject-empty": F.encode(U, name_der([]), form=2),
    "info-with-attributes": F.encode(
        U, x509.load_pem_x509_csr(request(node("w1"), san="w1")).tbs_certrequest_bytes, form=3),
    "info-version-1": F.encode(U, F.wrap(0x30, b"\x02\x01\x01" + name_der([[(ORG, 0x0C, b"system:nodes")],
                                                                            [(CN, 0x0C, b"system:node:w1")]])
                                         + F.SEED_SPKI + b"\xa0\x00"), form=3),
    "info-no-attributes": F.encode(U, F.wrap(0x30, b"\x02\x01\x00" + name_der([[(ORG, 0x0C, b"system:nodes")],
                                                                                [(CN, 0x0C, b"system:node:w1")]])
                                             + F.SEED_SPKI), form=3),
    "empty": b"",
}


# Seeds that failed the property when first run: kept in fuzz/crashes/<target>/ (the replay
# runs them as regression tests) instead of the corpus, which must pass.
CRASHES = {"csr": {"info-version-1", "extra-ou", "subject-multivalued-rdn"}, "inventory": {"tilde-nosuchuser-keypath"}}


def write(target: str, seeds: dict[str, bytes]) -> None:
    corpus, crashes = HERE / "corpus" / target, HERE / "crashes" / target
    for d in (corpus, crashes):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("seed-*"):
            old.unlink()
    for name, data in seeds.items():
        d = crashes if name in CRASHES.get(target, ()) else corpus
        (d / f"seed-{name}").write_bytes(data)


def main() -> None:
    write("inventory", {**{k: v.encode() for k, v in INVENTORIES.items()}, **INVENTORY_BYTES})
    write("csr", CSRS)


if __name__ == "__main__":
    main()
