"""The hosting cluster upgraded by `installer upgrade` (a Kubernetes minor, its workers drained one
at a time) while two hosted tenants serve (docs/hosted.md, "A lost hosting node"): what the
tenants' workers, their workloads and their users see.

The lab: 1 control host and 3 nspawn workers as the hosting cluster at the default version
(local-path-provisioner), 2 more workers, one for each of two tenants (3 etcd members and 3
apiserver replicas each, spread required, exposed on the 3 hosting workers' addresses); a
workload on each tenant's worker (busybox httpd behind a NodePort). While the hosting cluster
is upgraded to ``UPGRADE_TO`` (built: scripts/build-kubernetes --version it):

- on each tenant's worker, a read of its own Node every 0.5 s through its API balancer and
  through the kubernetes Service, as its kubelet (tests/hostprobes.py);
- from this machine, each tenant's workload every 0.5 s through its NodePort;
- from this machine, each tenant's API through each exposed address every 0.5 s: an address is
  expected to be dark while its node is drained (it serves its own node's replica only), so
  these are printed per address, not counted against the goal.

Goal: 0 failed probes on the tenants' workers and of their workloads; then a second `apply` of
each tenant changes nothing. Needs root and both builds. Prints figures; never fails on them.
Run: sudo .venv/bin/python benchmarks/hosted_hosting_upgrade.py [--keep]
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosted_density import INSTALLER, apply_hosting, run  # noqa: E402 - benchmarks/hosted_density.py
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import hostprobes  # noqa: E402 - probes run on the tenants' workers as transient units
from tests.builtfixtures import UPGRADE_TO, default_dir  # noqa: E402
from tests.probeloop import Loop, admin_context, api, columns  # noqa: E402 - timed requests from here
from tests.realcluster import echo_workload  # noqa: E402

NAME, SUBNET = "bhup", "10.213.217.0/24"
ECHO_PORT = 30081


def tenant_docs(doc: dict) -> list[dict]:
    """The lab's tenant of two workers as two tenants of one worker each, on ports of their own."""
    out = []
    for i, host in enumerate(doc["spec"]["hosts"]):
        d = copy.deepcopy(doc)
        d["metadata"]["name"] = f"tenant-{'ab'[i]}"
        d["spec"]["hosts"] = [host]
        expose = d["spec"]["controlPlane"]["hosted"]["expose"]
        expose["port"], expose["konnectivityPort"] = expose["port"] + i, expose["konnectivityPort"] + i
        out.append(d)
    return out


def main() -> None:  # noqa: PLR0915 - one scenario, told in order
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = ap.parse_args()
    target_artifacts = default_dir(UPGRADE_TO)
    if not (target_artifacts / "kube-apiserver").is_file():
        raise SystemExit(f"no build of {UPGRADE_TO} in {target_artifacts}: scripts/build-kubernetes --version "
                         f"{UPGRADE_TO}")
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 5, tmp, keep=args.keep, hosting=True,
                                                         tenant_workers=2) as (lab_inv, lab_seconds):
        tmp_p = Path(tmp)
        print(f"lab up {lab_seconds:.0f} s")
        state = tmp_p / "hosting-state"
        hosting_doc, kubectl, _ = apply_hosting(lab_inv, tmp_p)
        kubectl_bin = kubectl[0]
        ssh_config = tmp_p / "ssh_config"
        ssh_config.write_text(run(INSTALLER, "lab", "ssh-config", "--name", NAME).stdout)

        tenants = []
        for d in tenant_docs(yaml.safe_load((tmp_p / "tenant.yaml").read_text())):
            name, worker = d["metadata"]["name"], d["spec"]["hosts"][0]["name"]
            inv, tstate = tmp_p / f"{name}.yaml", tmp_p / f"{name}-state"
            inv.write_text(yaml.safe_dump(d, sort_keys=False))
            t = time.perf_counter()
            run(INSTALLER, "apply", str(inv), "--state", str(tstate), "--wait-timeout", "900")
            print(f"{name} apply {time.perf_counter() - t:.0f} s")
            tkube = tmp_p / f"{name}.kubeconfig"
            run(INSTALLER, "kubeconfig", str(inv), "--state", str(tstate), "-o", str(tkube))
            for obj in echo_workload(ECHO_PORT):
                if obj["kind"] == "Deployment":
                    obj["spec"]["replicas"] = 1
                if obj["kind"] == "PodDisruptionBudget":
                    continue
                run(kubectl_bin, "--kubeconfig", str(tkube), "apply", "-f", "-", stdin=json.dumps(obj))
            run(kubectl_bin, "--kubeconfig", str(tkube), "rollout", "status", "deployment/echo", "--timeout=300s")
            service_ip = next(ipaddress.ip_network(d["spec"]["network"]["serviceCIDR"]).hosts())
            urls = {"lb": f"https://127.0.0.1:6443/api/v1/nodes/{worker}",
                    "svc": f"https://{service_ip}:443/api/v1/nodes/{worker}"}
            for probe, url in urls.items():
                hostprobes.start(ssh_config, worker, f"hp-probe-{probe}", url, interval=0.5, timeout=5)
            ctx = admin_context(tstate / "pki")
            expose = d["spec"]["controlPlane"]["hosted"]["expose"]
            reads = {a: Loop(lambda _i, a=a, ctx=ctx, p=expose["port"]: api(
                ctx, f"https://{a}:{p}/api/v1/namespaces/default"), 0.5) for a in expose["addresses"]}
            address = d["spec"]["hosts"][0]["address"]
            echo = Loop(lambda _i, a=address: urllib.request.urlopen(f"http://{a}:{ECHO_PORT}/", timeout=5).read(),
                        0.5)
            tenants.append({"name": name, "worker": worker, "inv": inv, "state": tstate, "urls": urls,
                            "reads": reads, "echo": echo})

        target = tmp_p / "hosting-target.yaml"
        hosting_doc["spec"]["kubernetes"]["version"] = UPGRADE_TO
        hosting_doc["spec"]["artifacts"]["path"] = str(target_artifacts)
        target.write_text(yaml.safe_dump(hosting_doc, sort_keys=False))
        time.sleep(10)
        began = time.time()
        t = time.perf_counter()
        done = json.loads(run(INSTALLER, "upgrade", str(target), "--state", str(state), "--output", "json",
                              "--wait-timeout", "900", timeout=3600).stdout)
        upgrade_s = time.perf_counter() - t
        ended = time.time()
        time.sleep(10)

        print(f"\nhosting upgrade to {UPGRADE_TO}: {upgrade_s:.0f} s")
        for row in done.get("timings", []):
            print(f"{row['seconds']:7.1f} s  {row['step'][:110]}")
        edges = (began - 10, began, ended, ended + 11)
        print(f"\n{'failed/requests':44} {'before':13} {'upgrade':13} {'after':13}")
        for tn in tenants:
            for probe in tn["urls"]:
                found = hostprobes.rows(ssh_config, tn["worker"], f"hp-probe-{probe}")
                rows = [(r.start, r.ok, r.detail) for r in found]
                label = f"{tn['name']} on {tn['worker']} via {'its balancer' if probe == 'lb' else 'kubernetes Svc'}"
                print(f"{label:44} {columns(rows, *edges)}")
            print(f"{tn['name'] + ' workload on ' + tn['worker']:44} {columns(tn['echo'].end(), *edges)}")
            for a, loop in tn["reads"].items():
                print(f"{tn['name'] + ' API via ' + a + ' (its node drains)':44} {columns(loop.end(), *edges)}")
        for tn in tenants:
            again = json.loads(run(INSTALLER, "apply", str(tn["inv"]), "--state", str(tn["state"]), "--output",
                                   "json").stdout)
            print(f"{tn['name']}: second apply {again['changes']} change(s), {len(again['restarts'])} restart(s) "
                  "(goal: 0)")
        print("goal: 0 failed on the tenants' workers and of their workloads")


if __name__ == "__main__":
    main()
