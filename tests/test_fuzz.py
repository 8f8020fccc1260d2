"""Fuzzing (fuzz/, issue 21): the inventory loader and the CSR judge.

Two kinds of tests. The replay runs every committed input (fuzz/corpus/<target>/*, the seeds
plus what fuzzing runs kept, and fuzz/crashes/<target>/*, every input that ever failed) through
the harness's property check in this process, without atheris: a crash once found stays a
regression test. The fuzz run starts each harness under atheris (libFuzzer) on the committed
corpus for a fixed number of inputs from a fixed seed (RUNS, HIDDENPLANE_FUZZ_SEED, default 1:
the same inputs in every CI run, so a new failure comes with the change that caused it, never at
random; about 20 s each here), at most HIDDENPLANE_FUZZ_SECONDS (default 120) on a slow machine,
writing what it finds to a temp directory, and fails naming the crash input and quoting the
harness's output. Exploring further is a local, longer run with other seeds (fuzz/README.md).

A crash whose fix is not in yet is listed in OPEN: its replay is a strict xfail (it turns into a
failure once the fix lands: then remove the entry), and the fuzz run is told its signature so it
keeps looking for other failures instead of stopping at that one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"
TARGETS = ("inventory", "csr")
SECONDS = int(os.environ.get("HIDDENPLANE_FUZZ_SECONDS", "120"))   # a bound, not the aim: RUNS is
SEED = int(os.environ.get("HIDDENPLANE_FUZZ_SEED", "1"))
# about 20 s each at the measured 900 / 10,000 exec/s (2026-12-06, alone on a 2-core machine; about
# twice that beside the real-cluster lab in CI): a smoke run that meets every change; exploring
# further is the longer local runs of fuzz/README.md
RUNS = {"inventory": 20_000, "csr": 200_000}
REPLAY_LIMIT = 20       # seconds for one input in the replay: the fuzz run's -timeout is 10

# crash inputs whose fix is pending (path under fuzz/crashes/) -> what fails; none now
OPEN: dict[str, str] = {}


def harness(target: str):
    name = f"fuzz_{target}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FUZZ / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextmanager
def time_limit(seconds: int, what: str):
    def expired(_signum, _frame):
        raise TimeoutError(f"{what}: still running after {seconds}s (a hang)")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def committed() -> list:
    params = []
    for kind in ("corpus", "crashes"):
        for target in TARGETS:
            for path in sorted((FUZZ / kind / target).glob("*")):
                rel = f"{target}/{path.name}"
                marks = [pytest.mark.xfail(strict=True, reason=OPEN[rel])] if kind == "crashes" and rel in OPEN else []
                params.append(pytest.param(target, path, id=f"{kind}/{rel}", marks=marks))
    return params


@pytest.mark.parametrize("target,path", committed())
def test_replay(target, path):
    check = harness(target).check
    with time_limit(REPLAY_LIMIT, str(path.relative_to(ROOT))):
        check(path.read_bytes())


def test_the_corpus_is_committed_and_small():
    for target in TARGETS:
        files = [p for p in (FUZZ / "corpus" / target).iterdir() if p.is_file()]
        assert 10 <= len(files) <= 200, (target, len(files))
        assert sum(p.stat().st_size for p in files) <= 400 * 1024, target
    for rel in OPEN:
        assert (FUZZ / "crashes" / rel).is_file(), f"OPEN names {rel}, which is not in fuzz/crashes/"


def open_signatures(target: str) -> list[str]:
    """The signatures of the OPEN crashes of ``target`` that still fail."""
    module = harness(target)
    out = []
    for rel in OPEN:
        if rel.startswith(f"{target}/"):
            try:
                module.check((FUZZ / "crashes" / rel).read_bytes())
            except Exception as e:
                out.append(module._harness.signature(e))
    return out


def stat(output: str, name: str) -> int | None:
    m = re.search(rf"^stat::{name}:\s+(\d+)", output, re.M)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target, tmp_path):
    try:
        import atheris  # noqa: F401
    except ImportError:
        pytest.fail("atheris is not installed, so the fuzzers cannot run: .venv/bin/python -m pip install -e "
                    "'.[test]' (CI installs the test extras; atheris has manylinux wheels for CPython 3.11+)")
    new, artifacts = tmp_path / "new", tmp_path / "artifacts"
    new.mkdir()
    artifacts.mkdir()
    env = {**os.environ, "HIDDENPLANE_FUZZ_OPEN": "\n".join(open_signatures(target)), "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, str(FUZZ / f"fuzz_{target}.py"), f"-seed={SEED}", f"-runs={RUNS[target]}",
           f"-max_total_time={SECONDS}", "-rss_limit_mb=2048",
           "-timeout=10", f"-dict={FUZZ / f'{target}.dict'}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
           str(new),
           str(FUZZ / "corpus" / target)]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, errors="replace",
                              timeout=SECONDS + 180, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fuzz_{target} still running {SECONDS + 180}s after it started (asked for {SECONDS}s):\n"
                    f"{(e.stderr or b'')[-4000:]!r}")
    output = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines()
                       if not ln.startswith("INFO: Instrumenting"))
    found = sorted(p for p in artifacts.iterdir() if not p.name.startswith("slow-unit-"))
    written = re.findall(r"Test unit written to (\S+)", output)
    if proc.returncode != 0 or found:
        inputs = ", ".join(dict.fromkeys([*written, *map(str, found)])) or "(none written)"
        pytest.fail(f"fuzz_{target} failed (exit {proc.returncode}); the input: {inputs}\n"
                    f"keep it as fuzz/crashes/{target}/<what-fails> (test_replay then runs it for good).\n"
                    f"{' '.join(cmd)}\n--- output (last 6000 characters) ---\n{output[-6000:]}")
    runs, rate = stat(output, "number_of_executed_units"), stat(output, "average_exec_per_sec")
    assert runs, f"fuzz_{target} ran no input:\n{output[-3000:]}"
    print(f"fuzz_{target}: {runs} inputs (seed {SEED}, asked for {RUNS[target]}) at {rate} exec/s, "
          f"{len(list(new.iterdir()))} new corpus files (not kept)")
