"""Write tests/refdata/: the flag and config-field lists the contract stand-ins embed.

    .venv/bin/python tools/refdata/generate.py ARTIFACTS            (re)write tests/refdata
    .venv/bin/python tools/refdata/generate.py ARTIFACTS --check    exit 1 if it would change

ARTIFACTS is a directory built by ``scripts/build-kubernetes default DIR``. The lists come from
our own build, not from upstream prose:

- ``flags/<component>.txt``: every flag the built binary's ``--help`` lists, ``deprecated`` after
  the ones whose text says DEPRECATED (flags hidden with pflag's MarkDeprecated are not listed,
  so a stand-in refuses them as unknown);
- ``config/<Kind>.txt`` and ``config/opaque-fields.txt``: every JSON field path of each config
  kind, read by reflection (tools/refdata/fields.go) from the Go types the binaries decode them
  into, compiled inside a copy of the wrapper module that pins them
  (tools/kubebuild/kubernetes-<version>); maps and raw objects are opaque.

The format is that of the stand-ins' reader (tests/standins/runtime.py): line 1 names the source
(and for a Kind its apiVersion), line 2 the Kubernetes version, then one entry per line, sorted.
Test-side tooling only: nothing here ships.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.reference import REFDATA, deprecated_mark, listed_flags  # noqa: E402
from tests.standins import COMPONENTS, CONFIG_KINDS  # noqa: E402

FIELDS_GO = Path(__file__).resolve().with_name("fields.go")
PINS = ROOT / "tools" / "kubebuild"
HELP_TIMEOUT = 60            # a hang guard: --help answers at once


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=HELP_TIMEOUT, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def binary_version(artifacts: Path) -> str:
    """``v1.36.5`` from ``kube-apiserver --version`` (``Kubernetes v1.36.5``)."""
    out = _run([str(artifacts / "kube-apiserver"), "--version"]).stdout.split()
    if len(out) != 2 or out[0] != "Kubernetes":
        raise SystemExit(f"refdata: {artifacts}/kube-apiserver --version said {' '.join(out)!r}")
    return out[1]


def flags_text(artifacts: Path, component: str, version: str) -> str:
    proc = _run([str(artifacts / component), "--help"])
    if proc.returncode != 0:
        raise SystemExit(f"refdata: {component} --help exited {proc.returncode}: {proc.stderr[-500:]}")
    listed = listed_flags(proc.stdout + proc.stderr)
    if len(listed) < 20:         # a parser that found nothing would make every flag "unknown"
        raise SystemExit(f"refdata: {component} --help parsed into only {sorted(listed)}")
    mark = deprecated_mark(component)
    lines = [f"{name} deprecated" if mark.search(text) else name for name, text in sorted(listed.items())]
    return (f"# source: `{component} --help` of the binary built by tools/kubebuild "
            f"(tools/refdata/generate.py)\n# kubernetes-version: {version}\n" + "\n".join(lines) + "\n")


def _kubebuild():
    spec = importlib.util.spec_from_file_location("kubebuild_build", PINS / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def go_fields(version: str) -> dict:
    """What fields.go prints, built in a copy of the pinned wrapper module (its go.sum holds
    every module it imports, so -mod=readonly needs no network once the modules are cached)."""
    pins = PINS / f"kubernetes-{version}"
    if not (pins / "go.mod").is_file():
        raise SystemExit(f"refdata: no wrapper module {pins.relative_to(ROOT)} for the built {version}")
    go_env = _kubebuild().go_env             # the same Go settings as the binaries' build

    with tempfile.TemporaryDirectory(prefix="refdata-") as tmp:
        for name in ("go.mod", "go.sum"):
            shutil.copy(pins / name, Path(tmp) / name)
        shutil.copy(FIELDS_GO, Path(tmp) / "main.go")
        proc = subprocess.run(["go", "run", "."], cwd=tmp, env=go_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"refdata: go run fields.go failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def config_texts(fields: dict, version: str) -> dict[str, str]:
    wanted = sorted({k for kinds in CONFIG_KINDS.values() for k in kinds})
    if sorted(fields) != wanted:
        raise SystemExit(f"refdata: fields.go describes {sorted(fields)}, the stand-ins check {wanted}")
    out = {}
    for kind in wanted:
        f = fields[kind]
        out[f"config/{kind}.txt"] = (
            f"# apiVersion: {f['apiVersion']}  source: Go type {f['package']}.{kind} "
            f"(tools/refdata/fields.go)\n# kubernetes-version: {version}\n" + "\n".join(sorted(f["paths"])) + "\n")
    opaque = [f"{kind} {path} {why.replace(' ', '')}" for kind in wanted
              for path, why in sorted(fields[kind]["opaque"].items())]
    out["config/opaque-fields.txt"] = (
        "# <Kind> <dotted path> <Go type>: free-form below the path (a map, a raw or external object)\n"
        f"# kubernetes-version: {version}\n" + "\n".join(opaque) + "\n")
    return out


def generate(artifacts: Path) -> dict[str, str]:
    """``{path under tests/refdata: text}``."""
    version = binary_version(artifacts)
    texts = {f"flags/{c}.txt": flags_text(artifacts, c, version) for c in COMPONENTS}
    texts.update(config_texts(go_fields(version), version))
    return texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", type=Path, help="built by scripts/build-kubernetes default DIR")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if tests/refdata differs")
    args = p.parse_args(argv)
    texts = generate(args.artifacts)
    stale = sorted(set(str(q.relative_to(REFDATA)) for q in REFDATA.rglob("*.txt")) - set(texts))
    if args.check:
        diff = []
        for name, text in sorted(texts.items()):
            have = (REFDATA / name).read_text() if (REFDATA / name).is_file() else ""
            diff += difflib.unified_diff(have.splitlines(True), text.splitlines(True), f"a/{name}", f"b/{name}")
        diff += [f"stale: {name}\n" for name in stale]
        sys.stdout.writelines(diff)
        return 1 if diff else 0
    for name in stale:
        (REFDATA / name).unlink()
    for name, text in texts.items():
        (REFDATA / name).parent.mkdir(parents=True, exist_ok=True)
        (REFDATA / name).write_text(text)
    print(f"refdata: wrote {len(texts)} files to {REFDATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
