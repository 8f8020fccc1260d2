"""Inventory validation: each bad document names the exact field and value, exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from installer.cli.main import cli
from installer.core import inventory
from installer.core.errors import InventoryError

from .conftest import EXAMPLE, write_inventory


def hosts(*specs):
    return [{"name": n, "address": a, "role": r} for n, a, r in specs]


def set_path(doc, path, value):
    *parents, last = path
    target = doc
    for p in parents:
        target = target[p]
    target[last] = value


# (id, mutation(doc), expected line of the report — exact text, or a prefix ending in '…')
BAD = [
    ("unknown-top", lambda d: d.update(extra=1), "extra: unknown field"),
    ("unknown-spec", lambda d: d["spec"].update(nodes=[]), "spec.nodes: unknown field"),
    ("unknown-host-field", lambda d: d["spec"]["hosts"][1].update(ip="1.2.3.4"), "spec.hosts[1].ip: unknown field"),
    ("bad-api-version", lambda d: d.update(apiVersion="v1"),
     "apiVersion: 'v1' is not allowed; expected 'hiddenplane/v1alpha1'"),
    ("bad-ip", lambda d: set_path(d, ["spec", "hosts", 2, "address"], "10.0.0"),
     "spec.hosts[2].address: '10.0.0' is not an IP address"),
    ("bad-name", lambda d: set_path(d, ["spec", "hosts", 1, "name"], "Node_2"),
     "spec.hosts[1].name: 'Node_2' is not a DNS-1123 label…"),
    ("bad-cluster-name", lambda d: set_path(d, ["metadata", "name"], "-lab"),
     "metadata.name: '-lab' is not a DNS-1123 label…"),
    ("bad-role", lambda d: set_path(d, ["spec", "hosts", 1, "role"], "master"),
     "spec.hosts[1].role: 'master' is not allowed; expected 'control' or 'worker'"),
    ("role-both", lambda d: set_path(d, ["spec", "hosts", 0, "role"], "control+worker"),
     "spec.hosts[0].role: a host cannot be both control and worker: it would run a kubelet…"),
    ("same-host-both-roles", lambda d: d["spec"]["hosts"].append(
        {"name": "cp1", "address": "192.168.56.230", "role": "worker"}),
     "spec.hosts[3].name: 'cp1' is listed as both control and worker: a host cannot be both…"),
    ("duplicate-name", lambda d: set_path(d, ["spec", "hosts", 2, "name"], "node2"),
     "spec.hosts[2].name: 'node2' duplicates spec.hosts[1].name"),
    ("duplicate-address", lambda d: set_path(d, ["spec", "hosts", 2, "address"], "192.168.56.231"),
     "spec.hosts[2].address: '192.168.56.231' of node3 duplicates spec.hosts[1].address of node2"),
    ("no-control", lambda d: set_path(d, ["spec", "hosts"], hosts(("n1", "10.1.0.1", "worker"))),
     "spec.hosts: no host has role control…"),
    ("no-worker", lambda d: set_path(d, ["spec", "hosts"], hosts(("c1", "192.168.56.230", "control"))),
     "spec.hosts: no host has role worker…"),
    ("no-hosts", lambda d: set_path(d, ["spec", "hosts"], []), "spec.hosts: no hosts…"),
    ("even-controls", lambda d: d["spec"]["hosts"].append(
        {"name": "cp2", "address": "192.168.56.240", "role": "control"}),
     "spec.hosts: 2 control hosts; each runs an etcd member…"),
    ("bad-pod-cidr", lambda d: set_path(d, ["spec", "network", "podCIDR"], "10.244.0.1/16"),
     "spec.network.podCIDR: '10.244.0.1/16' is not a network in CIDR notation…"),
    ("overlap", lambda d: set_path(d, ["spec", "network", "podCIDR"], "10.96.0.0/16"),
     "spec.network.serviceCIDR: 10.96.0.0/12 overlaps spec.network.podCIDR 10.96.0.0/16"),
    ("host-in-pod-cidr", lambda d: set_path(d, ["spec", "network", "podCIDR"], "192.168.0.0/16"),
     "spec.hosts[0].address: '192.168.56.230' lies inside spec.network.podCIDR 192.168.0.0/16"),
    ("service-too-big", lambda d: (set_path(d, ["spec", "network", "serviceCIDR"], "10.0.0.0/8"),
                                   set_path(d, ["spec", "network", "podCIDR"], "172.16.0.0/16")),
     "spec.network.serviceCIDR: 10.0.0.0/8 is too large…"),
    ("dns-outside", lambda d: set_path(d, ["spec", "network", "clusterDNS"], "10.200.0.10"),
     "spec.network.clusterDNS: '10.200.0.10' is outside spec.network.serviceCIDR 10.96.0.0/12"),
    ("dns-first-ip", lambda d: set_path(d, ["spec", "network", "clusterDNS"], "10.96.0.1"),
     "spec.network.clusterDNS: '10.96.0.1' is the first address of the service CIDR…"),
    ("version-format", lambda d: set_path(d, ["spec", "kubernetes", "version"], "1.36"),
     "spec.kubernetes.version: '1.36' is not a version of the form vMAJOR.MINOR.PATCH…"),
    ("version-eol", lambda d: set_path(d, ["spec", "kubernetes", "version"], "v1.34.2"),
     "spec.kubernetes.version: 'v1.34.2' is outside the supported range v1.35.x to v1.37.x"),
    ("family-mismatch", lambda d: set_path(d, ["spec", "apiServer", "endpoint"], "fd00::1"),
     "spec.apiServer.endpoint: 'fd00::1' is IPv6 but spec.network.serviceCIDR 10.96.0.0/12 is IPv4"),
    ("bad-endpoint", lambda d: set_path(d, ["spec", "apiServer", "endpoint"], "api_server!"),
     "spec.apiServer.endpoint: 'api_server!' is neither an IP address nor a DNS name"),
    ("bad-port", lambda d: set_path(d, ["spec", "apiServer", "port"], 70000),
     "spec.apiServer.port: 70000 is not a TCP port (1-65535)"),
    ("artifacts-dir-missing", lambda d: set_path(d, ["spec", "artifacts"], {"source": "dir", "path": "./nope"}),
     "spec.artifacts.path: './nope' is not a directory…"),
    ("artifacts-dir-no-path", lambda d: set_path(d, ["spec", "artifacts"], {"source": "dir"}),
     "spec.artifacts.path: required when spec.artifacts.source is 'dir'"),
    ("pod-cidr-full", lambda d: (set_path(d, ["spec", "network", "podCIDR"], "10.244.0.0/24"),
                                 set_path(d, ["spec", "network", "nodeCIDRMaskSize"], 25),
                                 d["spec"]["hosts"].append({"name": "node4", "address": "192.168.56.235",
                                                            "role": "worker"})),
     "spec.network.podCIDR: 10.244.0.0/24 has room for 2 worker(s) at /25 (nodeCIDRMaskSize) but the "
     "inventory has 3; use a larger podCIDR or a longer nodeCIDRMaskSize"),
    ("node-mask-too-short", lambda d: (set_path(d, ["spec", "network", "podCIDR"], "10.244.0.0/24"),
                                       set_path(d, ["spec", "network", "nodeCIDRMaskSize"], 20)),
     "spec.network.nodeCIDRMaskSize: /20 is larger than spec.network.podCIDR 10.244.0.0/24…"),
    ("cilium-with-routes", lambda d: d["spec"]["network"].update(cni="cilium", egress="routes"),
     "spec.network.egress: 'routes' needs cni: routes…"),
    ("bad-algorithm", lambda d: set_path(d, ["spec", "pki", "keyAlgorithm"], "dsa"),
     "spec.pki.keyAlgorithm: 'dsa' is not allowed; expected 'ecdsa-p256' or 'rsa-2048'"),
    # a worker's serving certificate (cluster CA) names the worker: never a name or address of the API
    ("worker-named-kubernetes", lambda d: set_path(d, ["spec", "hosts", 1, "name"], "kubernetes"),
     "spec.hosts[1].name: 'kubernetes' is a name of the API: this worker's serving certificate…"),
    ("worker-named-like-endpoint", lambda d: (set_path(d, ["spec", "apiServer", "endpoint"], "api.example.com"),
                                              set_path(d, ["spec", "hosts", 2, "name"], "api")),
     "spec.hosts[2].name: 'api' is a name of the API (the first label of 'api.example.com')…"),
    ("worker-named-like-extra-san", lambda d: (set_path(d, ["spec", "apiServer", "extraSANs"], ["node2"])),
     "spec.hosts[1].name: 'node2' is a name of the API…"),
    ("worker-at-endpoint", lambda d: set_path(d, ["spec", "apiServer", "endpoint"], "192.168.56.232"),
     "spec.hosts[2].address: '192.168.56.232' is an address of the API (spec.apiServer.endpoint "
     "'192.168.56.232')…"),
]


def _matches(expected: str, problems: list[str]) -> bool:
    if expected.endswith("…"):
        return any(p.startswith(expected[:-1]) for p in problems)
    return expected in problems


@pytest.mark.parametrize("case_id,mutate,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_inventory_names_field(doc, tmp_path, case_id, mutate, expected):
    mutate(doc)
    path = write_inventory(tmp_path, doc)
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert _matches(expected, err.value.problems), err.value.problems

    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2
    assert expected.rstrip("…") in result.output
    assert "Traceback" not in result.output


def test_every_problem_is_reported_at_once(doc, tmp_path):
    doc["spec"]["hosts"][2]["address"] = "10.0.0"
    doc["spec"]["hosts"][1]["name"] = "Bad"
    doc["spec"]["network"]["clusterDNS"] = "10.96.0.1"
    doc["spec"]["bogus"] = True
    with pytest.raises(InventoryError) as err:
        inventory.load(write_inventory(tmp_path, doc))
    problems = err.value.problems
    assert len(problems) == 4, problems
    assert {p.split(":")[0] for p in problems} == {
        "spec.hosts[2].address", "spec.hosts[1].name", "spec.network.clusterDNS", "spec.bogus"}


def test_ipv6_cluster_is_valid(doc, tmp_path):
    doc["spec"]["network"] = {"podCIDR": "fd10:244::/56", "serviceCIDR": "fd10:96::/108",
                              "clusterDNS": "fd10:96::a"}
    doc["spec"]["apiServer"]["endpoint"] = "fd00:56::230"
    doc["spec"]["hosts"] = hosts(("cp1", "fd00:56::230", "control"), ("node2", "fd00:56::231", "worker"))
    inv = inventory.load(write_inventory(tmp_path, doc))
    assert inv.api_url == "https://[fd00:56::230]:6443"
    assert inv.kubernetes_service_ip == "fd10:96::1"


def test_defaults_fill_optional_sections(tmp_path):
    minimal = {"apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster", "metadata": {"name": "mini"},
               "spec": {"hosts": hosts(("c1", "192.168.56.10", "control"), ("w1", "192.168.56.11", "worker"))}}
    inv = inventory.load(write_inventory(tmp_path, minimal))
    assert inv.endpoint == "192.168.56.10"          # first control host
    assert inv.spec.network.serviceCIDR == "10.96.0.0/12"
    assert inv.spec.kubernetes.version.startswith("v1.3")
    assert inv.spec.pki.keyAlgorithm == "ecdsa-p256"


def test_artifacts_dir_relative_to_inventory(doc, tmp_path):
    (tmp_path / "arts").mkdir()
    doc["spec"]["artifacts"] = {"source": "dir", "path": "arts"}
    inv = inventory.load(write_inventory(tmp_path, doc))
    assert inv.artifacts_dir() == (tmp_path / "arts").resolve()


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("apiVersion: hiddenplane/v1alpha1\nkind: [Cluster\n")
    result = CliRunner().invoke(cli, ["validate", str(p)])
    assert result.exit_code == 2
    assert "not valid YAML" in result.output and "line " in result.output


def test_missing_file_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(cli, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read" in result.output


def test_example_validates_via_console_script():
    # the real console script, as a user runs it
    exe = os.path.join(os.path.dirname(sys.executable), "installer")
    proc = subprocess.run([exe, "validate", str(EXAMPLE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout and "1 control host(s), 2 worker(s)" in proc.stdout


def test_schema_is_json_schema_and_matches_model():
    result = CliRunner().invoke(cli, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec"}
    host = schema["$defs"]["HostSpec"]
    assert host["properties"]["role"]["enum"] == ["control", "worker"]
    assert host["additionalProperties"] is False


def test_schema_accepts_example_with_jsonschema():
    import jsonschema
    import yaml
    schema = inventory.json_schema()
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"apiVersion": "hiddenplane/v1alpha1", "kind": "Cluster",
                             "metadata": {"name": "x"}, "spec": {"hosts": [], "zzz": 1}}, schema)


def test_ssh_settings_merge_host_overrides_and_resolve_paths(doc, tmp_path):
    doc["spec"]["ssh"] = {"user": "admin", "keyPath": "keys/id", "knownHosts": "~/kh"}
    doc["spec"]["hosts"][1]["ssh"] = {"port": 2222, "keyPath": "/abs/key"}
    inv = inventory.load(write_inventory(tmp_path, doc))
    cp1, node2 = inv.ssh_for(inv.host("cp1")), inv.ssh_for(inv.host("node2"))
    assert (cp1.user, cp1.port, cp1.keyPath) == ("admin", 22, str(tmp_path / "keys" / "id"))
    assert cp1.knownHosts == str(Path("~/kh").expanduser())
    assert (node2.user, node2.port, node2.keyPath) == ("admin", 2222, "/abs/key")
