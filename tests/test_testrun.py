"""tools/testrun.py, the two-process runner behind scripts/test: how it reads pytest's closing
lines and when it splits the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("testrun", ROOT / "tools" / "testrun.py")
testrun = importlib.util.module_from_spec(spec)
spec.loader.exec_module(testrun)


def test_counts_read_the_closing_line_in_both_forms():
    log = ("tests/test_x.py ..F\n= slowest =\n"
           "====== 986 passed, 1 skipped, 2 failed, 11 errors in 5366.15s (1:29:26) ======\n")
    assert testrun.counts(log) == {"passed": 986, "skipped": 1, "failed": 2, "errors": 11}
    assert testrun.counts("....\n11 passed, 1113 deselected in 14.28s\n") == {"passed": 11}
    assert testrun.counts("1 error in 0.40s\n") == {"errors": 1}


def test_a_line_that_only_mentions_passed_is_not_the_closing_line():
    assert testrun.counts("the probe passed 3 passed checks\n") == {}


def test_named_files_or_node_ids_run_in_one_process():
    assert testrun.explicit_selection(["tests/test_pki.py"])
    assert testrun.explicit_selection(["-q", "test_pki.py::test_x"])
    assert not testrun.explicit_selection(["-ra", "--durations=40", "-k", "pki", "-m", "not real"])


def test_a_fixture_waits_for_scripts_tests_background_build_and_fails_with_its_log(tmp_path, monkeypatch):
    """scripts/test builds the upgrade's version beside the tests; a test needing it waits for
    the build's exit status, and a failed build fails the test with its log's end."""
    import subprocess
    import time

    from . import builtfixtures

    monkeypatch.setattr(builtfixtures, "_config", None)          # its reports stay in this test's output
    monkeypatch.delenv(builtfixtures.BUILDING_ENV, raising=False)
    builtfixtures.wait_for_background_build("upgrade", "v0")       # run alone: nothing to wait for
    monkeypatch.setenv(builtfixtures.BUILDING_ENV, str(tmp_path))
    (tmp_path / "upgrade.log").write_text("==> building kubernetes v0\n")
    # the way scripts/test ends it: the status renamed into place by another process
    proc = subprocess.Popen(["/bin/sh", "-c", f"sleep 1; echo 0 > {tmp_path}/rc.part; "
                                              f"mv {tmp_path}/rc.part {tmp_path}/upgrade.rc"])
    start = time.monotonic()
    builtfixtures.wait_for_background_build("upgrade", "v0")
    assert time.monotonic() - start >= 0.9 and proc.wait() == 0
    (tmp_path / "upgrade.log").write_text("go: module lookup disabled\nexit status 1\n")
    (tmp_path / "upgrade.rc").write_text("1\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)v0 .in the background. failed:\n.*exit status 1"):
        builtfixtures.wait_for_background_build("upgrade", "v0")
