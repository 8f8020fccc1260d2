"""A rolling upgrade of a real 1 control + 2 worker cluster on the lab, timed: `installer upgrade`
from the default version to tests/builtfixtures.UPGRADE_TO while the workload of
tests/test_real_upgrade.py (two replicas behind a NodePort, a PodDisruptionBudget) is probed
from the control host every 200 ms. Prints the total, each step, where a worker's turn spends
its time (drain, new binaries and restarts, Ready wait) and the failed probes.

Needs root and both built artifact sets (scripts/test builds them; or scripts/build-kubernetes
default DIR and scripts/build-kubernetes v1.37.2 DIR). Never fails on a time.
Run: sudo .venv/bin/python benchmarks/upgrade.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from installer.lab import lab as lab_mod  # noqa: E402
from installer.lab.model import LabPaths  # noqa: E402
from tests.builtfixtures import UPGRADE_TO, artifacts_dir, upgrade_artifacts_dir  # noqa: E402
from tests.realcluster import echo_workload  # noqa: E402
from tests.test_real_upgrade import NODE_PORT, PROBER  # noqa: E402

NAME, SUBNET = "bupg", "10.213.212.0/24"
INSTALLER = str(Path(sys.executable).with_name("installer"))


def run(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"installer {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    source, target = artifacts_dir(), upgrade_artifacts_dir()
    quiet = lambda *_: None  # noqa: E731
    lab_mod.down(NAME, quiet)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inv = tmp / "bupg.inventory.yaml"
        try:
            lab_mod.up(NAME, 1, 2, 0, SUBNET, inv, quiet, artifacts=source)
            paths = LabPaths.of(NAME)
            ssh_config = tmp / "ssh_config"
            ssh_config.write_text(lab_mod.ssh_config(NAME))
            doc = yaml.safe_load(inv.read_text())
            doc["spec"]["kubernetes"]["version"], doc["spec"]["artifacts"]["path"] = UPGRADE_TO, str(target)
            new = tmp / "target.yaml"
            new.write_text(yaml.safe_dump(doc, sort_keys=False))
            run("apply", str(inv), "--wait-timeout", "900")
            kubeconfig = tmp / "admin.kubeconfig"
            run("kubeconfig", str(inv), "-o", str(kubeconfig))
            kubectl = [str(source / "kubectl"), "--kubeconfig", str(kubeconfig)]
            for obj in echo_workload(NODE_PORT):
                subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps(obj), text=True, check=True,
                               capture_output=True)
            subprocess.run([*kubectl, "rollout", "status", "deployment/echo", "--timeout=600s"], check=True,
                           capture_output=True)
            spec = lab_mod.load_spec(paths)
            targets = " ".join(f"{h.address}:{NODE_PORT}" for h in spec.hosts if h.role == "worker")
            ssh = ["ssh", "-F", str(ssh_config), "cp1"]
            subprocess.run([*ssh, "cat > /root/prober.py"], input=PROBER, text=True, check=True)
            subprocess.run([*ssh, f"systemd-run --unit=hp-prober /usr/bin/python3 /root/prober.py /root/probe.json "
                                  f"{targets}"], check=True, capture_output=True)
            time.sleep(5)
            t = time.perf_counter()
            report = json.loads(run("upgrade", str(new), "--output", "json", "--wait-timeout", "900").stdout)
            total = time.perf_counter() - t
            time.sleep(3)
            probes = json.loads(subprocess.run([*ssh, "cat /root/probe.json"], capture_output=True, text=True,
                                               check=True).stdout)
            print(f"upgrade {report['from']} -> {report['to']}, 1 control + 2 workers: {total:.1f} s")
            for step in report["timings"]:
                print(f"  {step['seconds']:6.1f} s  {step['step'][:110]}")
            for part in report["parts"]:
                print(f"    {part['seconds']:6.1f} s  {part['part']}")
            print(f"probes every 200 ms (alternating over both workers' NodePort): ok {sum(probes['ok'].values())}, "
                  f"failed {sum(probes['failed'].values())} {probes['failed']}")
            for line in probes["failures"][-10:]:
                print(f"  {line}")
        finally:
            lab_mod.down(NAME, quiet)


if __name__ == "__main__":
    main()
