"""Run the Kubernetes e2e conformance tests against a cluster, with no registry: the air-gapped
alternative to Sonobuoy (``scripts/conformance``).

    scripts/conformance --kubeconfig admin.kubeconfig [--selection all|ci] [--focus RE] [--skip RE]
                        [--nodes N] [--report-dir DIR] [--e2e DIR]

``e2e.test`` and ``ginkgo`` come from ``--e2e DIR`` or are built for the cluster's version
(``scripts/build-kubernetes VERSION DIR --only e2e``, cached). The tests' images must be on
the workers already, under their upstream names (``image-e2e.tar`` from that build: put it in the
inventory's artifacts directory and ``installer apply`` imports it on every worker); the images
the build could not make are named, with the tests they would fail. Writes a JUnit report and
a one-line summary; exits 0 when every selected test passed, 1 when one failed, 2 on a usage or
setup error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The CI selection: what a hidden control plane puts at risk, one row per area (the test names
# are upstream's; a row's regular expression matches within the [Conformance] set).
CI_SELECTION: tuple[tuple[str, str], ...] = (
    ("admission webhooks (apiserver -> pod)",
     r"AdmissionWebhook .*should (be able to deny pod and configmap creation"
     r"|mutate pod and apply defaults after mutation)"),
    ("CRD conversion webhook (apiserver -> pod)",
     r"CustomResourceConversionWebhook .*should be able to convert from CR v1 to CR v2"),
    ("aggregated API (apiserver -> pod)", r"Aggregator Should be able to support the 1\.17 Sample API Server"),
    ("logs and exec through the kubelet",
     r"Pods should support (remote command execution|retrieving logs from the container) over websockets"
     r"|Kubectl logs logs should be able to retrieve and filter logs"),
    ("apiserver proxy to pods and services",
     r"Proxy version v1 (should proxy through a service and a pod|A set of valid responses)"),
    ("DNS", r"DNS should provide DNS for (the cluster|services) "),
    ("Services: ClusterIP, NodePort, session affinity",
     r"Services should (serve a basic endpoint from pods|be able to create a functioning NodePort service"
     r"|have session affinity work for service with type clusterIP)"),
    ("pod networking: node-pod and pod-pod, TCP and UDP",
     r"Networking Granular Checks: Pods should function for (intra|node)-pod communication: (http|udp)"),
    ("Secrets and ConfigMaps: volumes and environment",
     r"(Secrets should be consumable (from pods in (volume \[|env vars)|as environment variable names variable names "
     r"with various prefixes)|ConfigMap should be consumable (from pods in volume \[|via environment variable"
     r"|via the environment))"),
    ("probes and lifecycle hooks",
     r"(Probing container should be restarted with a /healthz http liveness probe|Container Lifecycle Hook .*should "
     r"execute poststart http hook properly)"),
    ("Jobs, Deployments, StatefulSets",
     r"(Job should run a job to completion when tasks sometimes fail|RollingUpdateDeployment should delete old pods"
     r"|StatefulSet Basic StatefulSet functionality .*should have a working scale subresource)"),
    ("ServiceAccounts (pods reach the apiserver)",
     r"ServiceAccounts (should mount an API token into pods"
     r"|ServiceAccountIssuerDiscovery should support OIDC discovery)"),
    ("certificates API", r"Certificates API .*should support CSR API operations"),
    ("the kubernetes Service (its endpoints: the workers' balancer address)",
     r"API Server should (have Endpoints and EndpointSlices pointing to API Server|provide secure master service)"),
)
# upstream e2e tests outside [Conformance] that the CI selection adds: no conformance test
# covers kubectl port-forward (the apiserver's streaming path to the kubelet)
CI_EXTRA: tuple[tuple[str, str], ...] = (
    ("kubectl port-forward (upstream e2e, not [Conformance])",
     r"Kubectl Port forwarding With a server listening on localhost (that expects a client request should support "
     r"a client that connects, sends DATA, and disconnects|should support forwarding over websockets)"),
)


# [Conformance] tests that cannot pass without a registry, whatever the images on the workers:
# left out unless --registry says one is reachable (the summary names them)
NEEDS_REGISTRY: tuple[tuple[str, str], ...] = (
    ("pulls its image volume with imagePullPolicy Always",
     r"ImageVolume .*should succeed with pod and pull policy of Always"),
)


@dataclass
class Summary:
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def line(self, version: str) -> str:
        total = len(self.passed) + len(self.failed) + len(self.skipped)
        return (f"conformance {version}: {total} selected, {len(self.passed)} passed, {len(self.failed)} failed, "
                f"{len(self.skipped)} skipped in {int(self.seconds // 60)}m{int(self.seconds % 60):02d}s")


def read_junit(path: Path) -> Summary:
    """The specs of a ginkgo JUnit report that were selected: passed, failed (with the first
    line of the failure), skipped at run time (``Skip`` inside the test, with its reason).
    Specs the focus/skip filter left out are not counted."""
    out = Summary()
    for case in ET.parse(path).getroot().iter("testcase"):
        name, status = case.get("name", ""), case.get("status", "")
        if name.startswith(("[SynchronizedBeforeSuite]", "[SynchronizedAfterSuite]", "[BeforeSuite]",
                            "[AfterSuite]", "[ReportAfterSuite]", "[ReportBeforeSuite]", "[DeferCleanup")):
            if status == "failed":
                out.failed.append((name, _message(case, "failure")))
            continue
        name = name.removeprefix("[It] ")
        if status == "passed":
            out.passed.append(name)
        elif status in ("failed", "panicked", "interrupted", "timedout", "aborted"):
            out.failed.append((name, _message(case, "failure") or _message(case, "error") or status))
        elif status == "skipped" and _message(case, "skipped").startswith("skipped - "):
            # Skip(reason) inside the test; a spec the filters left out says just "skipped"
            out.skipped.append((name, _message(case, "skipped").removeprefix("skipped - ")))
    return out


def _message(case: ET.Element, tag: str) -> str:
    el = case.find(tag)
    if el is None:
        return ""
    text = (el.get("message") or el.text or "").strip()
    return text.splitlines()[0][:300] if text else ""


def ci_rows() -> list[tuple[str, str]]:
    """The CI selection's areas and the regular expression each puts in the focus: a
    conformance test's own text ends in [Conformance], so a row never reaches past the set
    (e.g. the SCTP variant of a networking test); CI_EXTRA's rows name tests outside it."""
    return [(area, rf"(?:{regex}).*\[Conformance\]") for area, regex in CI_SELECTION] + list(CI_EXTRA)


def selection_focus(selection: str) -> str | None:
    """The ginkgo focus of a named selection (within the Conformance label); None: all of it."""
    if selection == "all":
        return None
    if selection == "ci":
        return "|".join(f"(?:{regex})" for _, regex in ci_rows())
    raise SystemExit(f"conformance: --selection: unknown {selection!r} (all, ci)")


def server_version(kubeconfig: Path, kubectl: str) -> str:
    proc = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), "version", "-o", "json"],
                          capture_output=True, text=True, timeout=60)
    try:
        return json.loads(proc.stdout)["serverVersion"]["gitVersion"]
    except (ValueError, KeyError):
        raise SystemExit(f"conformance: cannot read the cluster's version with {kubectl}: "
                         f"{proc.stderr.strip()[-300:] or proc.stdout[-300:]}") from None


def e2e_dir(args, version: str) -> Path:
    if args.e2e:
        return args.e2e
    cache = Path(os.environ.get("HIDDENPLANE_CACHE_DIR", "/var/cache/hiddenplane")) / "build" / f"e2e-{version}"
    print(f"==> scripts/build-kubernetes {version} {cache} --only e2e", flush=True)
    proc = subprocess.run([sys.executable, str(ROOT / "tools/kubebuild/build.py"), version, str(cache),
                           "--only", "e2e"])
    if proc.returncode != 0:
        raise SystemExit(2)
    return cache


def image_notes(directory: Path) -> list[str]:
    """Why some listed images are missing (e2e-images.json of the build)."""
    path = directory / "e2e-images.json"
    if not path.is_file():
        return [f"{path} not found: which images the tests need is unknown; a test whose image is not on the "
                "workers fails with ErrImageNeverPull or ImagePullBackOff"]
    not_made = json.loads(path.read_text())["notMade"]
    return [f"{image}: {why}" for image, why in sorted(not_made.items())]


def command(args, directory: Path, kubeconfig: Path, report: Path) -> list[str]:
    ginkgo = [str(directory / "ginkgo"), "run", f"--procs={args.nodes}", f"--timeout={args.timeout}", "--no-color",
              "--silence-skips", "--junit-report=junit.xml", f"--output-dir={report}"]
    focus = args.focus or selection_focus(args.selection)
    if focus:
        ginkgo.append(f"--focus={focus}")
    if args.focus or args.selection == "all":
        # upstream labels every [Conformance] test "Conformance" (framework.ConformanceIt); the
        # CI selection names its tests one by one (CI_EXTRA: a few outside the label)
        ginkgo.append("--label-filter=Conformance")
    skip = [args.skip] if args.skip else []
    if not args.registry:
        skip += [regex for _, regex in NEEDS_REGISTRY]
    if skip:
        ginkgo.append("--skip=" + "|".join(f"(?:{s})" for s in skip))
    return ginkgo + [str(directory / "e2e.test"), "--", f"--kubeconfig={kubeconfig}", "--provider=skeleton",
                     f"--kubectl-path={args.kubectl}", f"--report-dir={report}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"),
                   help="the cluster's admin kubeconfig (default: $KUBECONFIG)")
    p.add_argument("--selection", default="all", help="all: every [Conformance] test; ci: the CI subset")
    p.add_argument("--focus", help="a ginkgo focus regular expression instead of the selection")
    p.add_argument("--skip", help="a ginkgo skip regular expression")
    p.add_argument("--nodes", type=int, default=2, help="parallel ginkgo processes (default 2; [Serial] tests "
                   "run alone at the end)")
    p.add_argument("--timeout", default="3h", help="ginkgo's timeout for the whole run (default 3h)")
    p.add_argument("--report-dir", type=Path, help="where the JUnit report goes (default ./conformance-<time>)")
    p.add_argument("--e2e", type=Path, help="a directory with e2e.test and ginkgo (default: built for the "
                   "cluster's version, cached)")
    p.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl", help="kubectl to read the version with")
    p.add_argument("--registry", action="store_true", help="the workers can pull from registry.k8s.io: also run "
                   "the tests that need a registry (left out by default: "
                   + "; ".join(w for w, _ in NEEDS_REGISTRY) + ")")
    p.add_argument("--dry-run", action="store_true", help="list the selected tests; run none")
    args = p.parse_args(argv)
    if not args.kubeconfig or not Path(args.kubeconfig).is_file():
        p.error("--kubeconfig: a readable kubeconfig file is needed (or set KUBECONFIG)")
    kubeconfig = Path(args.kubeconfig).resolve()
    version = server_version(kubeconfig, args.kubectl) if not args.e2e else _e2e_version(args.e2e)
    directory = e2e_dir(args, version)
    for needed in ("e2e.test", "ginkgo"):
        if not (directory / needed).is_file():
            raise SystemExit(f"conformance: {directory / needed} not found (scripts/build-kubernetes VERSION DIR "
                             "--only e2e makes it)")
    report = (args.report_dir or Path(f"conformance-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    report.mkdir(parents=True, exist_ok=True)
    notes = image_notes(directory)
    if notes:
        (report / "images-not-provided.txt").write_text("\n".join(notes) + "\n")
        print(f"{len(notes)} of the suite's images are not provided by the build (a test that needs one fails "
              f"with ErrImageNeverPull unless a registry serves it): {report / 'images-not-provided.txt'}", flush=True)
    if not args.registry:
        print(f"left out (they need a registry; --registry runs them): {'; '.join(w for w, _ in NEEDS_REGISTRY)}",
              flush=True)
    cmd = command(args, directory, kubeconfig, report)
    if args.dry_run:
        cmd = cmd[:2] + ["--dry-run", "-v"] + cmd[2:]
    print("==> " + " ".join(cmd), flush=True)
    start = time.monotonic()
    # the suite's own temporary files (kubectl's kuberc tests leave test-kuberc* behind) go to a
    # directory of this run, removed after it, not to the machine's /tmp
    scratch = report / "tmp"
    scratch.mkdir(mode=0o700, exist_ok=True)
    try:
        proc = subprocess.run(cmd, cwd=report, env={**os.environ, "TMPDIR": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    junit = report / "junit.xml"
    if not junit.is_file():
        print(f"conformance: ginkgo wrote no report (exit {proc.returncode})", file=sys.stderr)
        return 2
    summary = read_junit(junit)
    summary.seconds = time.monotonic() - start
    for name, why in summary.failed:
        print(f"FAILED {name}: {why}")
    for name, why in summary.skipped:
        print(f"SKIPPED {name}: {why}")
    line = summary.line(version)
    (report / "summary.txt").write_text(line + "\n")
    print(f"{line}; report: {junit}")
    return 1 if summary.failed or proc.returncode != 0 and not args.dry_run else 0


def _e2e_version(directory: Path) -> str:
    proc = subprocess.run([str(directory / "e2e.test"), "--version"], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip().split()[-1] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


if __name__ == "__main__":
    sys.exit(main())
