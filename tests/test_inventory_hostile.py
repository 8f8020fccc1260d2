"""Hostile and careless inventories: each is refused by `installer validate` with exit 2 and one
short line per problem naming the field, never a traceback, a hang or a 5 MB message."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core import inventory, yamlsafe

from .conftest import EXAMPLE, write_inventory

# a problem line quotes at most a short prefix of any value
LINE_LIMIT = inventory.MAX_LINE + 1


def refused(path: Path, *args: str) -> list[str]:
    """Run `installer validate PATH` (or another command); assert the refusal's shape; return its
    problem lines."""
    result = CliRunner().invoke(cli, list(args or ["validate"]) + [str(path)])
    assert result.exit_code == 2, result.output[:2000]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [ln.strip() for ln in result.output.splitlines() if ln.startswith("  ")]
    assert lines, result.output[:2000]
    assert all(len(ln) <= LINE_LIMIT for ln in lines), max(lines, key=len)[:200]
    return lines


def write_text(tmp_path: Path, text: str | bytes, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def has(lines: list[str], prefix: str) -> bool:
    return any(ln.startswith(prefix) for ln in lines)


# --- the YAML itself: size, encoding, aliases, depth, duplicate keys ---------------------------

def bomb_text() -> str:
    """Billion laughs: nine levels of nine aliases, 9**9 strings once expanded, placed where the
    model walks every element (extraSANs is a list of names)."""
    lines = ['x: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n" + EXAMPLE.read_text().replace("extraSANs: []", "extraSANs: *i")


def test_alias_bomb_is_refused_by_the_real_console_script(tmp_path):
    path = write_text(tmp_path, bomb_text())
    assert len(bomb_text().split("apiVersion")[0]) < 600
    exe = os.path.join(os.path.dirname(sys.executable), "installer")
    # the timeout only keeps a regression from hanging the suite (it took minutes before)
    proc = subprocess.run([exe, "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[:2000]
    assert "Traceback" not in proc.stderr
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
    assert len(lines) == 1 and f"expands to more than {yamlsafe.MAX_NODES} nodes" in lines[0], lines


def test_alias_expansion_is_counted_not_just_aliases(tmp_path):
    # a few aliases of a big node are as costly as many aliases of a small one
    big = "[" + ",".join(["x"] * (yamlsafe.MAX_NODES // 3)) + "]"
    text = f"a: &a {big}\nb: [*a, *a, *a, *a]\n"
    with pytest.raises(yamlsafe.InputError, match="expands to more than"):
        yamlsafe.load(text.encode())
    # and a modest use of anchors (shared ssh settings) still loads
    ok = "common: &c {user: ops, port: 2222}\nhosts:\n" + "".join(f"  - {{name: h{i}, ssh: *c}}\n" for i in range(200))
    doc, dups = yamlsafe.load(ok.encode())
    assert doc["hosts"][199]["ssh"] == {"user": "ops", "port": 2222} and dups == []


def test_alias_cycle_is_refused(tmp_path):
    text = EXAMPLE.read_text().replace("extraSANs: []", "extraSANs: &loop [*loop]")
    lines = refused(write_text(tmp_path, text))
    assert lines == ["spec.apiServer.extraSANs[0] (line 18): an alias is used inside the node it names (a cycle)"]


def test_binary_garbage_is_refused_naming_the_byte(tmp_path):
    lines = refused(write_text(tmp_path, b"apiVersion: x\nkind: \xff\xfe\x00\x80garbage" * 3))
    assert lines == ["line 2, column 7: not UTF-8 text (byte 0xff); save the inventory as UTF-8"]


def test_control_characters_are_refused(tmp_path):
    text = EXAMPLE.read_text().replace("name: lab", "name: la\x01b")
    lines = refused(write_text(tmp_path, text))
    assert len(lines) == 1 and lines[0].endswith("control character U+0001 is not allowed in YAML"), lines


def test_100k_deep_flow_nesting_is_refused(tmp_path):
    lines = refused(write_text(tmp_path, "[" * 100_000 + "]" * 100_000))
    assert len(lines) == 1 and "nest" in lines[0], lines


def test_deep_block_nesting_is_refused_at_the_bound(tmp_path):
    depth = yamlsafe.MAX_DEPTH + 1
    text = "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)) + "  " * depth + "v\n"
    lines = refused(write_text(tmp_path, text))
    assert len(lines) == 1 and f"nested deeper than {yamlsafe.MAX_DEPTH} levels" in lines[0], lines
    assert lines[0].startswith("k0.k1.k2"), lines


def test_huge_file_is_refused_before_parsing(tmp_path):
    text = EXAMPLE.read_text().replace("name: lab", 'name: "' + "x" * 5_000_000 + '"')
    lines = refused(write_text(tmp_path, text))
    assert lines == [f"(file): larger than {yamlsafe.MAX_BYTES // 1024} KiB; an inventory is a few KiB, refusing it"]


def test_a_long_value_is_quoted_as_a_short_prefix(tmp_path, doc):
    doc["metadata"]["name"] = "x" * 300_000
    doc["spec"]["hosts"][1]["address"] = "y" * 300_000
    doc["spec"]["z" * 100_000] = 1
    lines = refused(write_inventory(tmp_path, doc))
    quoted = "'" + "x" * yamlsafe.QUOTE_CHARS + "'…"
    assert has(lines, f"metadata.name: {quoted} is not a DNS-1123 label"), lines
    assert has(lines, "spec.hosts[1].address: '" + "y" * yamlsafe.QUOTE_CHARS + "'… is not an IP address"), lines
    assert f"spec.'{'z' * yamlsafe.QUOTE_CHARS}'…: unknown field" in lines, lines


def test_problems_are_capped(tmp_path, doc):
    doc["spec"]["hosts"] += [{"name": f"Bad_{i}", "address": f"10.9.{i // 250}.{i % 250 + 1}", "role": "worker"}
                             for i in range(200)]
    lines = refused(write_inventory(tmp_path, doc))
    assert len(lines) == inventory.MAX_PROBLEMS + 1
    assert lines[-1] == "(document): 150 more problem(s) not shown"


def test_duplicate_top_level_keys_name_both_lines(tmp_path):
    text = EXAMPLE.read_text() + ("  hosts:\n    - {name: c1, address: 192.168.56.230, role: control}\n"
                                  "    - {name: w1, address: 192.168.56.231, role: worker}\n")
    lines = refused(write_text(tmp_path, text))
    assert lines == ["spec.hosts: duplicate key (lines 24 and 35); YAML would silently keep only the last one"]


def test_duplicate_keys_anywhere_are_all_reported(tmp_path):
    text = (EXAMPLE.read_text()
            .replace("{name: node2, address: 192.168.56.231, role: worker}",
                     "{name: node2, address: 192.168.56.231, role: worker, name: node9}")
            .replace("    port: 22\n", "    port: 22\n    port: 2222\n"))
    lines = refused(write_text(tmp_path, text))
    assert lines == ["spec.ssh.port: duplicate key (lines 21 and 22); YAML would silently keep only the last one",
                     "spec.hosts[1].name: duplicate key (twice on line 27); YAML would silently keep only the last one"]


def test_out_of_range_scalars_are_yaml_errors_not_tracebacks(tmp_path):
    for old, new in (("port: 6443", "port: " + "1" * 5000), ("name: lab", "name: 2001-02-30")):
        lines = refused(write_text(tmp_path, EXAMPLE.read_text().replace(old, new)))
        assert len(lines) == 1 and "cannot read this value" in lines[0] and lines[0].startswith("line "), lines


def test_every_command_that_loads_an_inventory_refuses_the_same_way(tmp_path):
    path = write_text(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00")
    for args in (["plan", "--state", str(tmp_path / "s")], ["kubeconfig", "--state", str(tmp_path / "s")],
                 ["verify", "--state", str(tmp_path / "s")]):
        result = CliRunner().invoke(cli, [args[0], str(path), *args[1:]])
        assert result.exit_code == 2, (args, result.output)
        assert "not UTF-8" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "s").exists()


# --- fields: full matches, addresses, strict types, counts, files ------------------------------

NEWLINE = [
    (["metadata", "name"], "lab\n", "metadata.name: 'lab\\n' is not a DNS-1123 label"),
    (["spec", "hosts", 1, "name"], "node2\n", "spec.hosts[1].name: 'node2\\n' is not a DNS-1123 label"),
    (["spec", "network", "clusterDomain"], "cluster.local\n",
     "spec.network.clusterDomain: 'cluster.local\\n' is not a DNS-1123 subdomain"),
    (["spec", "apiServer", "endpoint"], "api.example.com\n",
     "spec.apiServer.endpoint: 'api.example.com\\n' is neither an IP address nor a DNS name"),
    (["spec", "apiServer", "extraSANs"], ["ok.example", "bad.example\n"],
     "spec.apiServer.extraSANs[1]: 'bad.example\\n' is neither"),
    (["spec", "ssh", "user"], "root\n", "spec.ssh.user: 'root\\n' is not a user name"),
    (["spec", "ssh", "keyPath"], "/root/.ssh/id\n", "spec.ssh.keyPath: '/root/.ssh/id\\n' is not a usable path"),
    (["spec", "kubernetes", "version"], "v1.36.5\n", "spec.kubernetes.version: 'v1.36.5\\n' is not a version"),
]


@pytest.mark.parametrize("where,value,expected", NEWLINE, ids=[".".join(map(str, n[0])) for n in NEWLINE])
def test_a_trailing_newline_is_not_a_valid_name(tmp_path, doc, where, value, expected):
    *parents, last = where
    target = doc
    for p in parents:
        target = target[p]
    target[last] = value
    assert has(refused(write_inventory(tmp_path, doc)), expected)


BAD_ADDRESSES = [
    ("0.0.0.0", "is the unspecified address"),
    ("::", "is the unspecified address"),
    ("224.0.0.1", "is a multicast address"),
    ("ff02::1", "is a multicast address"),
    ("255.255.255.255", "is the broadcast address"),
    ("169.254.10.1", "is link-local"),
    ("fe80::1", "is link-local"),
    ("240.0.0.7", "is in the reserved range"),
    ("fd00::1%eth0", "has an interface zone"),
]


@pytest.mark.parametrize("address,why", BAD_ADDRESSES, ids=[a for a, _ in BAD_ADDRESSES])
def test_a_host_address_that_reaches_no_host_is_refused(tmp_path, doc, address, why):
    doc["spec"]["hosts"][2]["address"] = address
    assert has(refused(write_inventory(tmp_path, doc)), f"spec.hosts[2].address: '{address}' {why}")


@pytest.mark.parametrize("where", [["spec", "apiServer", "endpoint"], ["spec", "ssh", "bastion"],
                                   ["spec", "network", "upstreamDNS"]])
def test_endpoint_bastion_and_upstream_dns_refuse_the_same_addresses(tmp_path, doc, where):
    value = {"endpoint": "0.0.0.0", "bastion": {"address": "0.0.0.0"}, "upstreamDNS": ["0.0.0.0"]}[where[-1]]
    doc["spec"][where[1]][where[2]] = value
    field = {"endpoint": "spec.apiServer.endpoint", "bastion": "spec.ssh.bastion.address",
             "upstreamDNS": "spec.network.upstreamDNS[0]"}[where[-1]]
    assert has(refused(write_inventory(tmp_path, doc)), f"{field}: '0.0.0.0' is the unspecified address")


def test_the_same_ipv4_written_as_ipv4_mapped_ipv6_is_a_duplicate(tmp_path, doc):
    doc["spec"]["hosts"][2]["address"] = "::ffff:192.168.56.231"
    lines = refused(write_inventory(tmp_path, doc))
    assert "spec.hosts[2].address: '192.168.56.231' of node3 duplicates spec.hosts[1].address of node2, " \
           "written as '::ffff:192.168.56.231'" in lines, lines


def test_loopback_among_real_hosts_is_refused_and_an_all_loopback_test_cluster_is_not(tmp_path, doc):
    doc["spec"]["apiServer"].pop("endpoint")
    mixed = copy.deepcopy(doc)
    mixed["spec"]["hosts"][1]["address"] = "127.0.0.1"
    mixed["spec"]["apiServer"]["endpoint"] = "127.0.0.1"
    lines = refused(write_inventory(tmp_path, mixed))
    assert has(lines, "spec.hosts[1].address: '127.0.0.1' is a loopback address"), lines
    assert has(lines, "spec.apiServer.endpoint: '127.0.0.1' is a loopback address"), lines
    # tests/test_kube.py's single-machine cluster: every host on loopback
    for i, h in enumerate(doc["spec"]["hosts"]):
        h["address"] = f"127.0.0.{i + 1}"
    assert inventory.load(write_inventory(tmp_path, doc)).api_url == "https://127.0.0.1:6443"


INT_FIELDS = [
    ["spec", "ssh", "port"], ["spec", "hosts", 0, "ssh", "port"], ["spec", "ssh", "bastion", "port"],
    ["spec", "apiServer", "port"], ["spec", "network", "nodeCIDRMaskSize"],
    ["spec", "pki", "caValidityDays"], ["spec", "pki", "certValidityDays"],
    ["spec", "pki", "bootstrapTokenTTLHours"], ["spec", "pki", "kubeletClientCertHours"],
]


def _set(doc, where, value):
    target = doc
    for p in where[:-1]:
        if isinstance(p, str) and p not in target:
            target[p] = {"address": "10.0.0.9"} if p == "bastion" else {}
        target = target[p]
    target[where[-1]] = value


@pytest.mark.parametrize("where", INT_FIELDS, ids=[".".join(map(str, w)) for w in INT_FIELDS])
@pytest.mark.parametrize("value,shown", [(True, "True is not a whole number"), ("22", "'22'")])
def test_int_fields_take_no_booleans_or_strings(tmp_path, doc, where, value, shown):
    _set(doc, where, value)
    field = ".".join(str(p) for p in where).replace(".0.", "[0].")
    assert has(refused(write_inventory(tmp_path, doc)), f"{field}: {shown}")


@pytest.mark.parametrize("where", [["spec", "allowEvenControlHosts"], ["spec", "apiServer", "alwaysPullImages"]])
def test_bool_fields_take_no_numbers(tmp_path, doc, where):
    _set(doc, where, 1)
    assert has(refused(write_inventory(tmp_path, doc)), f"{'.'.join(where)}: 1 is not true or false")


def test_validity_days_are_bounded(tmp_path, doc):
    doc["spec"]["pki"]["caValidityDays"] = 10 ** 9
    assert has(refused(write_inventory(tmp_path, doc)), "spec.pki.caValidityDays: 1000000000: Input should be "
                                                         "less than or equal to 36500")


def _controls(n: int) -> list[dict]:
    return [{"name": f"cp{i}", "address": f"192.168.57.{i + 1}", "role": "control"} for i in range(n)]


@pytest.mark.parametrize("count,allow_even", [(7, False), (51, False), (6, True), (7, True)])
def test_control_host_count_follows_the_readme(tmp_path, doc, count, allow_even):
    doc["spec"]["hosts"] = _controls(count) + doc["spec"]["hosts"][1:]
    doc["spec"]["allowEvenControlHosts"] = allow_even
    lines = refused(write_inventory(tmp_path, doc))
    assert lines == [f"spec.hosts: {count} control hosts; each runs an etcd member and every write waits for a "
                     "majority of them: use 1, 3 or 5" + (" (2 or 4 while replacing one)" if allow_even else "")]


@pytest.mark.parametrize("count,allow_even", [(1, False), (3, False), (5, False), (2, True), (4, True)])
def test_allowed_control_host_counts(tmp_path, doc, count, allow_even):
    doc["spec"]["hosts"] = _controls(count) + doc["spec"]["hosts"][1:]
    doc["spec"]["allowEvenControlHosts"] = allow_even
    assert len(inventory.load(write_inventory(tmp_path, doc)).controls) == count


def test_key_path_that_is_a_directory_is_refused_at_validation(tmp_path, doc):
    (tmp_path / "keys").mkdir()
    doc["spec"]["ssh"]["keyPath"] = "keys"
    doc["spec"]["hosts"][1]["ssh"] = {"keyPath": "."}
    doc["spec"]["hosts"][2]["ssh"] = {"bastion": {"address": "10.0.0.9", "keyPath": "keys"}}
    lines = refused(write_inventory(tmp_path, doc))
    assert lines == [
        "spec.ssh.keyPath: 'keys' is a directory, not a regular file; it must be a private key",
        "spec.hosts[1].ssh.keyPath: '.' is a directory, not a regular file; it must be a private key",
        "spec.hosts[2].ssh.bastion.keyPath: 'keys' is a directory, not a regular file; it must be a private key"]


def test_known_hosts_that_is_a_device_is_refused_at_validation(tmp_path, doc):
    doc["spec"]["ssh"]["knownHosts"] = "/dev/zero"
    doc["spec"]["hosts"][0]["ssh"] = {"knownHosts": "."}
    lines = refused(write_inventory(tmp_path, doc))
    assert lines == [
        "spec.ssh.knownHosts: '/dev/zero' is a character device, not a regular file; it must be a known_hosts file",
        "spec.hosts[0].ssh.knownHosts: '.' is a directory, not a regular file; it must be a known_hosts file"]


def test_missing_key_and_known_hosts_files_stay_valid(tmp_path, doc):
    # a missing key is reported when connecting; a missing known_hosts is what
    # --accept-new-host-keys creates
    doc["spec"]["ssh"].update(keyPath="nope/id", knownHosts="nope/known_hosts")
    (tmp_path / "real_key").write_text("not checked here")
    doc["spec"]["hosts"][1]["ssh"] = {"keyPath": "real_key"}
    assert inventory.load(write_inventory(tmp_path, doc)).metadata.name == "lab"


def test_schema_types_ports_as_integers_that_exclude_booleans():
    import jsonschema
    schema = inventory.json_schema()
    example = yaml.safe_load(EXAMPLE.read_text())
    jsonschema.validate(example, schema)
    example["spec"]["ssh"]["port"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(example, schema)


# --- PyYAML without libyaml: the pure Python parser gets the same bounds ------------------------

@pytest.fixture
def pure_python_yamlsafe(monkeypatch):
    import importlib
    monkeypatch.setitem(sys.modules, "yaml.cyaml", None)      # `from yaml.cyaml import ...` fails
    mod = importlib.reload(yamlsafe)
    assert mod._Parser.__module__ == "installer.core.yamlsafe"
    yield mod
    monkeypatch.undo()
    importlib.reload(yamlsafe)


def test_the_pure_python_parser_is_bounded_too(pure_python_yamlsafe):
    y = pure_python_yamlsafe
    cases = [
        ("[" * 100_000 + "]" * 100_000, f"line 1: nested deeper than {y.MAX_DEPTH} levels"),
        (bomb_text(), f"e (line 5): expands to more than {y.MAX_NODES} nodes"),
        ("a: &x [*x]\n", "a[0] (line 1): an alias is used inside the node it names"),
    ]
    for text, expected in cases:
        with pytest.raises(y.InputError) as err:
            y.load(text.encode())
        assert err.value.problems[0].startswith(expected), err.value.problems
    doc, dups = y.load(b"a: 1\nb: {c: 2, c: 3}\n")
    assert doc == {"a": 1, "b": {"c": 3}}
    assert dups == ["b.c: duplicate key (twice on line 2); YAML would silently keep only the last one"]


def test_a_duplicate_key_with_a_newline_is_quoted_on_one_line():
    doc, dups = yamlsafe.load(b'spec: {"a\\nb": 1, "a\\nb": 2}\n')
    assert dups == ["spec.'a\\nb': duplicate key (twice on line 1); YAML would silently keep only the last one"]


def test_apply_stops_at_a_directory_key_path_before_connecting(tmp_path, doc):
    # before: apply went past validation (to the artifacts, then SSH: "cannot reach …: Is a directory")
    (tmp_path / "keys").mkdir()
    doc["spec"]["ssh"]["keyPath"] = "keys"
    path = write_inventory(tmp_path, doc)
    result = CliRunner().invoke(cli, ["apply", str(path), "--state", str(tmp_path / "state")])
    assert result.exit_code == 2, result.output
    assert "spec.ssh.keyPath: 'keys' is a directory" in result.output
    assert not (tmp_path / "state").exists()


def test_a_second_document_says_what_was_expected(tmp_path):
    lines = refused(write_text(tmp_path, EXAMPLE.read_text() + "---\nkind: Cluster\n"))
    assert lines == ["line 35, column 1: not valid YAML: expected a single document in the stream, "
                     "but found another document"], lines
