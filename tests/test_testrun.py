"""tools/testrun.py, the two-process runner behind scripts/test: how it reads pytest's closing
lines and when it splits the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
