"""Upstream's own e2e conformance tests on the real-cluster lab (tools/conformance.py).

The Kubernetes project's ``[Conformance]`` tests, built from the ``k8s.io/kubernetes`` module of
the cluster's version (tools/kubebuild/e2e.py), run against the lab cluster ``installer apply``
built: the CI selection, which covers what a hidden control plane puts at risk (the apiserver
reaching pods: webhooks, CRD conversion, the aggregator, logs/exec/port-forward, proxy; DNS;
Services; pod networking; Secrets and ConfigMaps; probes and lifecycle hooks; workloads;
ServiceAccounts; the certificates API). The images go to the workers the way a user's do:
``image-e2e.tar`` in the inventory's artifacts directory, imported by ``installer apply``.

Runs between tests/test_real_cluster.py and tests/test_real_day2.py (tools/testrun.py), while
both workers are Ready.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from installer.core.artifacts import read_sums

from .builtfixtures import ROOT, _linked_dir, e2e_dir
from .realcluster import WAIT, run_installer

pytestmark = [pytest.mark.lab, pytest.mark.real]

sys.path.insert(0, str(ROOT / "tools"))
import conformance  # noqa: E402  (tools/conformance.py)


@pytest.fixture(scope="module")
def rc(real_cluster):
    return real_cluster


def with_e2e_images(rc, e2e: Path) -> Path:
    """The cluster's inventory with an artifacts directory that also holds image-e2e.tar."""
    doc = yaml.safe_load(rc.inventory.read_text())
    src = Path(doc["spec"]["artifacts"]["path"])
    if not src.is_absolute():
        src = (rc.inventory.parent / src).resolve()
    sums = {**read_sums(src), "image-e2e.tar": read_sums(e2e)["image-e2e.tar"]}
    files = {n: (e2e if n == "image-e2e.tar" else src) / n for n in sums}
    dest = _linked_dir(src.with_name(src.name + "-e2e"), files, sums)
    doc["spec"]["artifacts"]["path"] = str(dest)
    path = rc.inventory.with_name("conformance.inventory.yaml")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_ci_conformance_selection_passes(rc, tmp_path):
    e2e = e2e_dir()
    inventory = with_e2e_images(rc, e2e)
    proc = run_installer("apply", str(inventory), "--state", str(rc.state), "--wait-timeout", WAIT)
    print(proc.stderr[-1500:])
    images = [line.split()[0] for line in rc.ssh("w1", "ctr -n k8s.io images ls -q").stdout.splitlines()]
    assert any("/e2e-test-images/agnhost:" in i for i in images), images
    report = tmp_path / "conformance"
    try:
        code = conformance.main(["--kubeconfig", str(rc.kubeconfig), "--selection", "ci", "--e2e", str(e2e),
                                 "--report-dir", str(report), "--kubectl", rc.kubectl_bin,
                                 "--nodes", os.environ.get("HIDDENPLANE_CONFORMANCE_NODES", "3")])
        summary = conformance.read_junit(report / "junit.xml")
        print(summary.line("ci") + "\n" + "\n".join(f"FAILED {n}: {w}" for n, w in summary.failed))
        assert code == 0 and not summary.failed, summary.failed
        assert not summary.skipped, summary.skipped
        # every area of the selection ran at least one test
        import re
        empty = [area for area, regex in conformance.ci_rows() if not any(re.search(regex, n) for n in summary.passed)]
        assert not empty, f"no test of {empty} ran"
    finally:
        # back to the cluster's own artifacts: the day-2 tests start from a converged cluster
        run_installer("apply", str(rc.inventory), "--state", str(rc.state), "--wait-timeout", WAIT)
