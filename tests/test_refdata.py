"""tests/refdata, the lists the contract stand-ins embed: in the checkout, regenerable from our
own build, and read the way the stand-ins read them.

The lists are ours (tools/refdata/generate.py writes them from the built binaries' ``--help``
and from the Go types those binaries decode their config files into), so a clone has every
list its tests need and nothing outside the checkout is read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import ROOT
from .reference import REFDATA
from .standins import COMPONENTS, CONFIG_KINDS, find_reference, reference_data
from .standins.runtime import Reference, flatten

# a path of this machine or the steering checkout's shared folder, which a user's clone lacks
OUTSIDE = re.compile(r"shared/reference|/work/")


def test_the_stand_ins_take_their_lists_from_the_checkout():
    found = find_reference()
    assert found == REFDATA and found.is_relative_to(ROOT), found
    for component in COMPONENTS:
        data = reference_data(component, found)       # reads every file the stand-in embeds
        assert data["flags"] and all(data["configs"].values()), component


def test_no_test_or_tool_reads_outside_the_checkout():
    hits = []
    files = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "tools" / "refdata").glob("*.*")]
    for path in sorted(set(files) - {Path(__file__).resolve()}):     # this file names the pattern
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_lists_read_as_the_stand_ins_read_them():
    """A deprecated kubelet flag, a plain one, an unknown field and an opaque subtree are told
    apart, by the stand-ins' own reader (tests/standins/runtime.py)."""
    kubelet = Reference("kubelet", reference_data("kubelet", REFDATA))
    assert kubelet.flags["--read-only-port"] is True
    assert kubelet.flags["--config"] is False
    assert "--hiddenplane-no-such-flag" not in kubelet.flags
    assert re.fullmatch(r"v1\.\d+\.\d+", kubelet.flags_version), kubelet.flags_version
    api_version, paths, opaque, version = kubelet.kind("KubeletConfiguration")
    assert api_version == "kubelet.config.k8s.io/v1beta1" and version == kubelet.flags_version
    doc = {"apiVersion": api_version, "kind": "KubeletConfiguration", "featureGates": {"Anything": True},
           "authentication": {"x509": {"clientCAFile": "/a"}}, "noSuchField": 1,
           "shutdownGracePeriodByPodPriority": [{"priority": 1}, {"priority": 2}]}
    assert flatten(doc, opaque) - paths == {"noSuchField"}
    apiserver = Reference("kube-apiserver", reference_data("kube-apiserver", REFDATA))
    assert set(apiserver.configs) == set(CONFIG_KINDS["kube-apiserver"])
    api_version, paths, _, _ = apiserver.kind("EgressSelectorConfiguration")
    assert api_version == "apiserver.k8s.io/v1beta1"
    assert "egressSelections.connection.transport.uds.udsName" in paths


@pytest.fixture(scope="module")
def generated(built_artifacts) -> dict[str, str]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("refdata_generate", ROOT / "tools/refdata/generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate(built_artifacts)


def test_the_committed_lists_are_what_our_build_says(generated):
    """The committed text is exactly what tools/refdata/generate.py makes of the binaries built
    at the default version (run it, then commit, when a version bump changes this)."""
    committed = {str(p.relative_to(REFDATA)): p.read_text() for p in REFDATA.rglob("*.txt")}
    assert sorted(committed) == sorted(generated)
    stale = [name for name in sorted(generated) if committed[name] != generated[name]]
    assert not stale, f"stale in tests/refdata (run tools/refdata/generate.py ARTIFACTS): {stale}"
