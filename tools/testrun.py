"""Run the test suite as two pytest processes side by side: the real-cluster lab and the rest.

The real-cluster lab (tests/test_real_cluster.py, test_real_conformance.py, test_real_ha.py, test_real_hosted.py
and test_real_day2.py: one session fixture, three control hosts and two workers, three more lab hosts for the
hosted tenants whose control planes that cluster runs) is the long pole of the suite, and most of its
time is spent waiting for restarted components, not on this machine's two cores. Everything
else (pure tests, stand-in labs, the README walkthrough) runs in a second process meanwhile.
Each gets its own --basetemp: pytest prunes old numbered temp directories, and two processes
sharing /tmp/pytest-of-root would prune each other's.

The real lab's output streams live (it is the one still running when a CI limit strikes); the
rest's is printed once it ends. The last line adds both up in the plain "N passed, N failed"
form. Exit status: the first failing process's code; 5 (nothing collected) only if neither
process ran a test, since a selection like ``-k pki`` leaves the real lab empty.

    python tools/testrun.py [pytest arguments]
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL = ("tests/test_real_cluster.py", "tests/test_real_conformance.py", "tests/test_real_ha.py",
        "tests/test_real_hosted.py", "tests/test_real_day2.py")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
CLOSING = re.compile(r"\bin [\d.]+s\b")
NO_TESTS = 5


def explicit_selection(args: list[str]) -> bool:
    """Whether the arguments name test files or node ids themselves (then one process runs them)."""
    return any(a.startswith("tests") or a.endswith(".py") or "::" in a for a in args)


def counts(log: str) -> dict[str, int]:
    """The numbers on pytest's closing line ("== 3 passed, 1 skipped in 2.1s ==", or bare with -q)."""
    for line in reversed(log.splitlines()):
        if CLOSING.search(line) and COUNT.search(line):
            found: dict[str, int] = {}
            for n, word in COUNT.findall(line):
                word = "errors" if word.startswith("error") else word
                found[word] = found.get(word, 0) + int(n)
            return found
    return {}


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if explicit_selection(args):
        return subprocess.call([*pytest, *args], cwd=ROOT)
    work = Path(tempfile.mkdtemp(prefix="hiddenplane-tests."))
    rest_log = work / "rest.log"
    ignore = [f"--ignore={p}" for p in REAL]
    # the two processes' tests that allow no failed request take turns (tests/quiet.py)
    quiet_lock = work / "quiet.lock"
    env = {**os.environ, "HIDDENPLANE_QUIET_LOCK": str(quiet_lock)}
    with open(rest_log, "w") as out:
        rest = subprocess.Popen([*pytest, "--basetemp", str(work / "rest"), *args, *ignore], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    real = subprocess.Popen([*pytest, "--basetemp", str(work / "real"), *args, *REAL], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def forward(signum, _frame):
        # the tests tear their labs down on SIGTERM as on Ctrl-C (tests/labfixtures.py)
        for proc in (real, rest):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum != signal.SIGINT else signal.SIGINT)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    print(f"==> the real-cluster lab ({', '.join(REAL)}) below; the rest of the suite runs beside it "
          f"(its output follows at the end; live in {rest_log})", flush=True)
    real_out: list[bytes] = []

    def pump() -> None:
        # chunks, not lines: pytest's progress dots stay on one line until a test file ends
        while chunk := os.read(real.stdout.fileno(), 65536):
            real_out.append(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    real_rc = real.wait()
    reader.join()
    if rest.poll() is None:
        print("==> the real-cluster lab is done; waiting for the rest of the suite", flush=True)
    rest_rc = rest.wait()
    rest_text = rest_log.read_text(errors="replace")
    print("\n==> the rest of the suite\n" + rest_text, end="", flush=True)
    windows = Path(f"{quiet_lock}.log")
    if windows.exists():
        print("==> quiet windows (tests/quiet.py):\n" + windows.read_text(), end="", flush=True)

    total: dict[str, int] = {}
    for part in (counts(b"".join(real_out).decode(errors="replace")), counts(rest_text)):
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    failed = total.get("failed", 0) + total.get("errors", 0)
    line = f"tests: {total.get('passed', 0)} passed, {failed} failed"
    if total.get("skipped"):
        line += f", {total['skipped']} skipped"
    codes = [rc for rc in (real_rc, rest_rc) if rc not in (0, NO_TESTS)]
    rc = codes[0] if codes else (NO_TESTS if real_rc == rest_rc == NO_TESTS else 0)
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"==> kept for a look: {work} (each process's temp directory; the rest's log)")
    print(f"==> real-cluster lab: exit {real_rc}; the rest: exit {rest_rc}")
    print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
