"""tools/conformance.py without a cluster: the CI selection against upstream's conformance
list, and reading ginkgo's JUnit report (the real run: tests/test_real_conformance.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from .builtfixtures import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import conformance  # noqa: E402

# ginkgo v2's JUnit reporter (reporters/junit_report.go): "[It] <full text> [<labels>]", status
# = the spec's state, <skipped message="skipped"> for a spec the filters left out and
# "skipped - REASON" for Skip(REASON) inside it
JUNIT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="5" disabled="3" errors="0" failures="1" time="12.5">
  <testsuite name="Kubernetes e2e suite" package="/e2e" tests="5" disabled="0" skipped="2" errors="0" failures="1">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="0.4"></testcase>
    <testcase name="[It] [sig-network] DNS should provide DNS for services [Conformance] [Conformance]"
              classname="Kubernetes e2e suite" status="passed" time="8.1"></testcase>
    <testcase name="[It] [sig-node] Kubelet when scheduling a read only busybox container should not write to \
root filesystem [LinuxOnly] [NodeConformance] [Conformance] [Conformance, NodeConformance]"
              classname="Kubernetes e2e suite" status="failed" time="60.0">
      <failure message="Timed out after 60.000s.&#xA;Expected ..." type="failed">details</failure>
    </testcase>
    <testcase name="[It] [sig-apps] Job should delete a job [Conformance] [Conformance]"
              classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"></skipped></testcase>
    <testcase name="[It] [sig-node] RuntimeClass should run [Conformance] [Conformance]"
              classname="Kubernetes e2e suite" status="skipped" time="0.1">
      <skipped message="skipped - Only supported for providers [gce]"></skipped></testcase>
  </testsuite>
</testsuites>
"""


def test_a_junit_report_counts_what_ran_and_why_it_failed_or_skipped(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    s = conformance.read_junit(path)
    assert s.passed == ["[sig-network] DNS should provide DNS for services [Conformance] [Conformance]"]
    [(name, why)] = s.failed
    assert (name.startswith("[sig-node] Kubelet when scheduling a read only busybox")
            and why == "Timed out after 60.000s.")
    assert s.skipped == [("[sig-node] RuntimeClass should run [Conformance] [Conformance]",
                          "Only supported for providers [gce]")]
    s.seconds = 75
    assert s.line("v1.36.5") == "conformance v1.36.5: 3 selected, 1 passed, 1 failed, 1 skipped in 1m15s"


def upstream_names() -> list[str]:
    """The [Conformance] tests of the default version, from the k8s.io/kubernetes module."""
    import os
    import subprocess

    from installer.core.versions import DEFAULT_KUBERNETES_VERSION
    pin = ROOT / f"tools/kubebuild/kubernetes-e2e-{DEFAULT_KUBERNETES_VERSION}"
    proc = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"], cwd=pin, capture_output=True,
                          text=True, env={**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"})
    src = Path(proc.stdout.strip())
    if proc.returncode != 0 or not (src / "test/conformance/testdata/conformance.yaml").is_file():
        pytest.skip("the k8s.io/kubernetes module is not in the Go module cache (scripts/test downloads it)")
    return [t["codename"] for t in yaml.safe_load((src / "test/conformance/testdata/conformance.yaml").read_text())]


def test_every_row_of_the_ci_selection_names_conformance_tests():
    names = upstream_names()
    extra = {area for area, _ in conformance.CI_EXTRA}
    for area, regex in conformance.ci_rows():
        if area not in extra:       # as the focus has it (ginkgo matches the test's text)
            assert [n for n in names if re.search(regex, n)], f"{area}: {regex} matches no [Conformance] test"
    selected = [n for n in names if re.search(conformance.selection_focus("ci"), n)]
    assert not [n for n in selected if "[Serial]" in n or "[Disruptive]" in n], selected
    assert 25 <= len(selected) <= 40, len(selected)


def test_the_tests_left_out_for_want_of_a_registry_exist_and_are_not_in_the_ci_selection():
    names = upstream_names()
    for why, regex in conformance.NEEDS_REGISTRY:
        matched = [n for n in names if re.search(regex, n)]
        assert matched, f"{why}: {regex} matches no [Conformance] test"
        assert not [n for n in matched if re.search(conformance.selection_focus("ci"), n)], matched
