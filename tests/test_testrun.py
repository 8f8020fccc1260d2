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


def _hold(lock: str, lab: str, out: str) -> None:
    import os
    import time

    from tests import quiet
    os.environ[quiet.LOCK_ENV] = lock
    with quiet.window(lab, f"holder {lab}"):
        with open(out, "a") as f:
            f.write(f"in {time.monotonic()}\n")
        time.sleep(0.5)
        with open(out, "a") as f:
            f.write(f"out {time.monotonic()}\n")


def test_quiet_windows_of_two_processes_take_turns(tmp_path):
    """Two processes' windows (tests/quiet.py) never overlap, and each is logged; a lab this
    machine has no cgroup for leaves the CPU weights alone."""
    import multiprocessing

    lock, out = tmp_path / "quiet.lock", tmp_path / "order"
    procs = [multiprocessing.get_context("spawn").Process(target=_hold, args=(str(lock), f"none-{i}", str(out)))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events = [line.split() for line in out.read_text().splitlines()]
    assert [e[0] for e in events] == ["in", "out", "in", "out"], events
    assert float(events[1][1]) <= float(events[2][1])
    logged = (tmp_path / "quiet.lock.log").read_text().splitlines()
    assert len(logged) == 2 and all("waited" in x and "held it" in x for x in logged), logged


def test_quiet_within_tells_the_times_inside_a_labs_windows(monkeypatch):
    from tests import quiet
    monkeypatch.delenv(quiet.LOCK_ENV, raising=False)
    monkeypatch.setattr(quiet, "HELD", [])
    with quiet.window("none-a", "first"):
        inside = __import__("time").time()
        assert quiet.within("none-a", inside)            # the open window counts
    assert quiet.within("none-a", inside) and not quiet.within("none-b", inside)
    assert not quiet.within("none-a", inside - 3600) and not quiet.within("none-a", quiet.HELD[0][2] + 1)
