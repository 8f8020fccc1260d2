"""docs/hosted.md's lab walkthrough, run as written, so it cannot drift from the code.

Every line of the ```sh block after the ``<!-- walkthrough: ... -->`` marker runs verbatim with
bash in an empty directory, as the README's walkthrough does (tests/test_readme_walkthrough.py):
a lab of 3 control hosts and 4 workers, a hosting cluster of two of them, a tenant on the other
two, its reset, the lab's removal. Its promises are checked: the tenant's nodes are its two
workers, Ready; its control plane runs in the hosting namespace; `lab down` leaves only the
user's kubeconfigs.

On demand (about 10 minutes and 7 lab hosts: CI's budget has no room for a second large lab):
``HIDDENPLANE_HOSTED_WALKTHROUGH=1 scripts/test tests/test_hosted_walkthrough.py``; its last
result is in docs/testing.md. The block's shape is checked on every run.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from installer.core import versions
from installer.lab import lab as lab_mod

from .builtfixtures import default_dir
from .labfixtures import require_lab_tools
from .test_readme_walkthrough import bash_env, run_line

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "hosted.md"
MARKER = "<!-- walkthrough: tested by tests/test_hosted_walkthrough.py -->"
NAME = "hosted"
ON_DEMAND = "HIDDENPLANE_HOSTED_WALKTHROUGH"


def lines() -> list[str]:
    blocks = re.findall(re.escape(MARKER) + r"\s*\n```sh\n(.*?)\n```", PAGE.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_walkthrough_block_is_marked_and_complete():
    found = lines()
    assert found, f"docs/hosted.md has no ```sh block after {MARKER!r}"
    assert found[0].startswith(f"sudo installer lab up --name {NAME} ") and "--tenant-workers" in found[0]
    assert found[-1] == f"sudo installer lab down --name {NAME}"
    assert any(line.startswith("sudo installer reset tenant.yaml --yes") for line in found)
    assert not any("--state" in line for line in found), "the walkthrough must find the state without a flag"


def check_tenant_nodes(out: str) -> None:
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert sorted(r[0] for r in rows) == ["w3", "w4"] and all(r[1] == "Ready" for r in rows), out


def check_control_plane(out: str) -> None:
    names = [line.split()[0] for line in out.strip().splitlines()[1:]]
    assert sum(n.startswith("etcd-") for n in names) == 3, out
    assert sum(n.startswith("kube-apiserver-") for n in names) == 2, out


PROMISES = {
    re.compile(r"--kubeconfig tenant\.kubeconfig get nodes"): check_tenant_nodes,
    re.compile(r"--kubeconfig hosting\.kubeconfig -n hp-tenant get pods"): check_control_plane,
}


@pytest.mark.lab
@pytest.mark.real
@pytest.mark.skipif(os.environ.get(ON_DEMAND) != "1",
                    reason=f"on demand: {ON_DEMAND}=1 scripts/test tests/test_hosted_walkthrough.py (docs/testing.md)")
def test_the_hosted_walkthrough_runs_verbatim(tmp_path, built_artifacts):
    require_lab_tools()
    expected = Path("/var/cache/hiddenplane/build") / f"artifacts-{versions.DEFAULT_KUBERNETES_VERSION}"
    if built_artifacts.resolve() != expected or default_dir() != expected:
        pytest.skip(f"the page names the built binaries in {expected}; these are in {built_artifacts}")
    found = lines()
    env, work = bash_env(tmp_path), tmp_path / "newcomer"
    work.mkdir()
    lab_mod.down(NAME, log=lambda *_: None)
    seconds: list[tuple[float, str]] = []
    try:
        for line in found:
            start = time.monotonic()
            proc = run_line(line, work, env)
            seconds.append((time.monotonic() - start, line))
            assert proc.returncode == 0, (f"{line}\nrc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                          f"stderr:\n{proc.stderr[-3000:]}")
            print(f"$ {line}\n{proc.stdout[-2500:]}")
            for pattern, check in PROMISES.items():
                if pattern.search(line):
                    check(proc.stdout)
        assert not lab_mod.LabPaths.of(NAME).root.exists()
        # what lab up wrote went with the lab; the kubeconfigs the user asked for and the state
        # directories (the PKI: reset keeps them without --purge) stay
        assert sorted(p.name for p in work.iterdir()) == [".hiddenplane", "hosting.kubeconfig", "tenant.kubeconfig"]
    finally:
        print("\nhosted walkthrough, seconds per line:")
        for s, line in seconds:
            print(f"  {s:7.1f}  {line[:110]}")
        lab_mod.down(NAME, log=lambda *_: None)
