"""What one kube-apiserver restart costs a cluster with one control host (no other apiserver to
serve meanwhile): a real 1 control + 1 worker cluster on the lab, the API read every 0.2 s from
here (`kubectl get --raw /readyz`) while `systemctl restart kube-apiserver` runs on cp1.

Printed beside its anchor, measured in the same run on the same cluster: the same restart with
the apiserver's upstream default for watches at shutdown (the rendered unit without
--shutdown-watch-termination-grace-period): its HTTP server then waits for the watches it
serves (the kubelet's, kube-proxy's, the controllers') until --request-timeout (60 s) runs out,
with its port already closed. Never fails on a time. The lab is removed at the end.

Needs root and the built artifacts (scripts/test builds them). Run:
sudo .venv/bin/python benchmarks/apiserver_restart.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from lab import real_lab  # noqa: E402

from installer.lab import lab as lab_mod  # noqa: E402
from tests.builtfixtures import artifacts_dir  # noqa: E402

NAME, SUBNET = "bapi", "10.213.215.0/24"
INSTALLER = str(Path(sys.executable).with_name("installer"))
UNIT = "/etc/systemd/system/kube-apiserver.service"
FLAG = "--shutdown-watch-termination-grace-period"
RUNS = 2


def run(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([INSTALLER, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"installer {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def restart(ssh: list[str], read: list[str]) -> tuple[float, float, int]:
    """(seconds `systemctl restart` took, seconds from the first to the last failed read, reads failed)."""
    failed: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            at = time.time()
            if subprocess.run(read, capture_output=True, timeout=30).returncode:
                failed.append(at)
            time.sleep(0.2)
    reader = threading.Thread(target=loop)
    reader.start()
    time.sleep(2)
    began = time.time()
    subprocess.run([*ssh, "systemctl restart kube-apiserver"], check=True, timeout=300)
    took = time.time() - began
    while not failed or time.time() - failed[-1] < 5:      # answering again for 5 s
        time.sleep(1)
        if time.time() - began > 300:
            break
    stop.set()
    reader.join()
    return took, (failed[-1] - failed[0] + 0.2) if failed else 0.0, len(failed)


def main() -> None:
    artifacts = artifacts_dir()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 1, tmp) as (inv, _):
        ssh_config = Path(tmp) / "ssh_config"
        ssh_config.write_text(lab_mod.ssh_config(NAME))
        run("apply", str(inv), "--wait-timeout", "900")
        kubeconfig = Path(tmp) / "admin.kubeconfig"
        run("kubeconfig", str(inv), "-o", str(kubeconfig))
        read = [str(artifacts / "kubectl"), "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz",
                "--request-timeout=2s"]
        ssh = ["ssh", "-F", str(ssh_config), "cp1"]
        ours = [restart(ssh, read) for _ in range(RUNS)]
        # the anchor: the flag taken out of the rendered unit (the upstream default), then
        # restarted once so the running apiserver has it, then measured
        subprocess.run([*ssh, f"sed -i 's/ *{FLAG}=[^ ]*//' {UNIT} && ! grep -q -- {FLAG} {UNIT} && "
                              "systemctl daemon-reload && systemctl restart kube-apiserver"], check=True, timeout=300)
        time.sleep(20)
        upstream = [restart(ssh, read) for _ in range(RUNS)]
        print("one kube-apiserver restart, 1 control host (API read every 0.2 s):")
        for label, got in (("rendered unit", ours), (f"anchor: without {FLAG} (upstream default)", upstream)):
            for took, gone, n in got:
                print(f"  {label}: systemctl restart {took:.1f} s; API not answering {gone:.1f} s ({n} reads failed)")


if __name__ == "__main__":
    main()
