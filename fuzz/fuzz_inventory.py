#!/usr/bin/env python3
"""Fuzz the inventory loader: what ``installer validate FILE`` runs on the file's bytes.

Property, for ANY bytes: ``api.validate`` either returns an Inventory whose derived values
(the ones ``installer validate`` prints, and the SSH settings ``apply`` derives per host) can be
read, or raises InventoryError (the CLI's exit-2 message) holding between 1 and MAX_PROBLEMS + 1
problems, each one line of at most MAX_LINE + 1 characters. Any other exception is a crash;
libFuzzer's -timeout and -rss_limit_mb make a hang or a memory blow-up one too.

    .venv/bin/python fuzz/fuzz_inventory.py -max_total_time=600 -rss_limit_mb=2048 -timeout=10 \\
        /tmp/new-corpus fuzz/corpus/inventory

(the first directory receives what the run finds; tests/test_fuzz.py runs it for a bounded
time and replays fuzz/corpus/inventory and fuzz/crashes/inventory through ``check`` without
atheris).
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import sys
import tempfile
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

# instrumented only when run as the fuzzer (the replay imports this module into pytest)
FUZZING = atheris is not None and __name__ == "__main__"
with atheris.instrument_imports(include=["installer"]) if FUZZING else contextlib.nullcontext():
    from installer import api
    from installer.core import inventory
    from installer.core.errors import InventoryError

# The bytes are written to a file in a directory of their own and loaded from there, as
# `installer validate` does: relative paths in the document resolve inside this empty
# directory. libFuzzer ends the process without Python's atexit: tests/test_fuzz.py points
# TMPDIR at its own temporary directory.
_DIR = Path(tempfile.mkdtemp(prefix="hiddenplane-fuzz-inv."))
_FILE = _DIR / "inventory.yaml"
atexit.register(shutil.rmtree, _DIR, True)


def check_refusal(e: InventoryError) -> None:
    problems = e.problems
    assert isinstance(problems, list) and 1 <= len(problems) <= inventory.MAX_PROBLEMS + 1, \
        f"not 1 to MAX_PROBLEMS + 1 problem lines: {len(problems) if isinstance(problems, list) else type(problems)}"
    for p in problems:
        assert isinstance(p, str), f"a problem that is not text: {p!r}"[:500]
        assert len(p.splitlines()) == 1, f"a problem that is not one line: {p!r}"[:500]
        assert len(p) <= inventory.MAX_LINE + 1, \
            f"a problem line longer than MAX_LINE + 1: {len(p)} characters, {p[:200]!r}…"
    str(e)      # what the CLI prints


def check_model(inv: inventory.Inventory) -> None:
    # what `installer validate` prints
    assert inv.metadata.name and inv.spec.kubernetes.version, "a valid inventory without a name or version: " + \
        repr((inv.metadata.name, inv.spec.kubernetes.version))
    assert inv.controls and inv.workers, \
        f"a valid inventory without a control host or a worker: {len(inv.controls)}, {len(inv.workers)}"
    assert inv.api_url.startswith("https://"), "a valid inventory's API URL is not https: " + inv.api_url
    inv.kubernetes_service_ip
    # what every command derives per host before it connects
    for h in inv.spec.hosts:
        assert inv.host(h.name) is h, "a host name that finds another host: " + h.name
        inv.ssh_for(h)
    inv.artifacts_dir()


def check(data: bytes) -> None:
    """The property for one input; an AssertionError or any other exception is a crash."""
    _FILE.write_bytes(data)
    try:
        inv = api.validate(_FILE)
    except InventoryError as e:
        check_refusal(e)
        return
    check_model(inv)


# --- a mutator that knows the document ----------------------------------------------------------
# Most byte-level mutations of YAML stop at the parser. Half of the mutations here are made on
# the document instead: one value replaced (by a value of the pool or another one of the same
# document, so that aliases and shared nodes appear), a key added or removed, a list item copied;
# the result is dumped as block or flow YAML. The other half are libFuzzer's own.

POOL = ["control", "worker", "Control", "control+worker", "", " ", None, True, False, 0, 1, -1, 22, 65535, 65536,
        2 ** 64, 1.5, float("inf"), "10.0.0.1", "10.0.0.1 ", "::1", "::", "::ffff:10.0.0.1", "0.0.0.0", "127.0.0.1",
        "224.0.0.1", "169.254.1.1", "fe80::1%eth0", "fd00::1", "10.0.0.0/8", "10.96.0.0/12", "10.244.0.0/16",
        "fd00::/48", "10.0.0.1/32", "~", "~/k", "~nosuchuser/k", "/dev/null", "/", ".", "..", "a" * 70, "x\n",
        "UPPER", "-bad", "a.b", "v1.36.5", "v1.36.5\n", "v1.37.0", "v1.30.0", "v2.0.0", "3.6.16", "api.example.com",
        "api", "cluster.local", "download", "dir", "routes", "cilium", "konnectivity", "ecdsa-p256", "rsa-2048",
        "hiddenplane/v1alpha1", "Cluster", "0" * 64, "f" * 64, {}, [], [{}], {"a": 1}, [1, [2]], "\u2028", "é"]
KEYS = ["apiVersion", "kind", "metadata", "name", "spec", "kubernetes", "version", "network", "podCIDR",
        "serviceCIDR", "clusterDNS", "clusterDomain", "resolvConf", "cni", "egress", "nodeCIDRMaskSize",
        "upstreamDNS", "apiServer", "endpoint", "port", "extraSANs", "alwaysPullImages", "ssh", "user", "keyPath",
        "knownHosts", "bastion", "address", "hosts", "role", "allowEvenControlHosts", "artifacts", "source", "path",
        "versions", "etcd", "containerd", "runc", "checksums", "cacheDir", "sandboxImage", "pki", "keyAlgorithm",
        "caValidityDays", "certValidityDays", "bootstrapTokenTTLHours", "kubeletClientCertHours", "workerHosts",
        "cgroupV1", "inContainer", "base_dir", "unknown"]


def _slots(node, out: list, seen: set) -> list:
    """Every (container, key or index) of the document, each container once (a cycle too)."""
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, dict):
        for k in list(node):
            out.append((node, k))
            _slots(node[k], out, seen)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            _slots(v, out, seen)
    return out


def mutate_document(data: bytes, rnd) -> bytes | None:
    import yaml
    try:
        doc = yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except Exception:
        return None
    if not isinstance(doc, dict | list):
        return None
    slots = _slots(doc, [], set())
    containers = [doc] + [c[k] for c, k in slots if isinstance(c[k], dict | list)]
    for _ in range(rnd.randint(1, 3)):
        op = rnd.randrange(4)
        if op == 0 and slots:                        # replace a value
            c, k = rnd.choice(slots)
            c[k] = rnd.choice(POOL) if rnd.random() < 0.7 else rnd.choice(slots)[0]
        elif op == 1:                                # add a key
            d = rnd.choice([c for c in containers if isinstance(c, dict)] or [{}])
            d[rnd.choice(KEYS)] = rnd.choice(POOL)
        elif op == 2 and slots:                      # remove a key or an item
            c, k = rnd.choice(slots)
            with contextlib.suppress(KeyError, IndexError):
                del c[k]
        else:                                        # copy an item of a list (a second host, say)
            lists = [c for c in containers if isinstance(c, list) and c]
            if lists:
                c = rnd.choice(lists)
                c.insert(rnd.randrange(len(c) + 1), rnd.choice(c))
        slots = _slots(doc, [], set())
    try:
        return yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
                         default_flow_style=rnd.random() < 0.3, allow_unicode=rnd.random() < 0.5).encode()
    except Exception:
        return None


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    import random
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        out = mutate_document(data, rnd)
        if out is not None and len(out) <= max_size:
            return out
    return atheris.Mutate(data, max_size)


def main(argv: list[str]) -> None:
    _harness.run(check, argv, atheris, custom_mutator=custom_mutator)


if __name__ == "__main__":
    main(sys.argv)
