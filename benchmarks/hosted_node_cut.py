"""A hosting node lost, not drained, under a hosted tenant that serves (docs/hosted.md, "A lost
hosting node"): what its users, its workers and its writers see.

The lab: 1 control host and 3 nspawn workers as the hosting cluster (local-path-provisioner),
a 4th worker the tenant's (`installer lab up --hosting --tenant-workers 1` writes its inventory:
3 etcd members and 3 apiserver replicas, one of each on every hosting worker, spread required,
the API exposed on the 3 workers' addresses). Then, while probes run:

- through each exposed address from this machine, a read of the tenant's API every 0.5 s
  (5 s timeout), as the admin;
- a write (a ConfigMap made, then deleted) every second through an address that stays up;
- on the tenant's worker, through its API balancer (HAProxy on 127.0.0.1:6443) and the
  kubernetes Service, a read every 0.5 s as the kubelet (tests/hostprobes.py), and when the
  balancer marked the lost address down and up again;
- the hosting node's Ready condition and the tenant's Node, every second;

the first hosting worker's link is cut (its bridge port down: a pulled cable, no RST, no ICMP) for
``--cut`` seconds, then restored; the probes go on ``--after`` seconds. Then a second
`installer apply` of the tenant, whose changes are counted (goal: 0).

Printed beside the goals the issue sets (0 failed requests through the addresses that stay up,
writes succeed, tenant Nodes Ready, a second apply changes nothing) and the anchor before this
change (about one request in four through the addresses that stayed up timed out for ~50 s,
until the node went NotReady). Needs root and the built artifacts (scripts/build-kubernetes).
Prints figures; never fails on them.
Run: sudo .venv/bin/python benchmarks/hosted_node_cut.py [--cut 120] [--after 90] [--keep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosted_density import INSTALLER, apply_hosting, run  # noqa: E402 - benchmarks/hosted_density.py
from lab import real_lab  # noqa: E402 - benchmarks/lab.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from installer.lab import lab as lab_mod  # noqa: E402
from installer.lab import net  # noqa: E402
from installer.lab.model import LabPaths  # noqa: E402
from tests import hostprobes  # noqa: E402 - probes run on the tenant's worker as transient units
from tests.probeloop import Loop, admin_context, api, by_node, columns, when  # noqa: E402 - timed requests from here

NAME, SUBNET = "bcut", "10.213.216.0/24"
ANCHOR = "before: ~1 in 4 requests through the addresses that stayed up timed out for ~50 s (until NotReady)"


def ready_since(pod: dict, since: float) -> bool:
    """``pod`` Ready, that condition set at or after ``since`` (unix time), not being deleted."""
    cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    if cond is None or cond["status"] != "True" or pod["metadata"].get("deletionTimestamp"):
        return False
    at = dt.datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00")).timestamp()
    return at >= since


def etcd_leader(kubectl: list[str], ns: str) -> str:
    """The member leading the tenant's etcd, as its members report it."""
    pki = "/etc/etcd/pki"
    proc = subprocess.run([*kubectl, "exec", "-n", ns, "etcd-0", "-c", "etcd", "--", "/usr/local/bin/etcdctl",
                           "--endpoints=https://127.0.0.1:2379", f"--cacert={pki}/ca.crt", f"--cert={pki}/peer.crt",
                           f"--key={pki}/peer.key", "endpoint", "status", "--cluster", "-w", "json"],
                          capture_output=True, text=True, timeout=60)
    try:
        rows = json.loads(proc.stdout)
        members = {m["ID"]: m["name"] for m in json.loads(subprocess.run(
            [*kubectl, "exec", "-n", ns, "etcd-0", "-c", "etcd", "--", "/usr/local/bin/etcdctl",
             "--endpoints=https://127.0.0.1:2379", f"--cacert={pki}/ca.crt", f"--cert={pki}/peer.crt",
             f"--key={pki}/peer.key", "member", "list", "-w", "json"],
            capture_output=True, text=True, timeout=60).stdout)["members"]}
        return members.get(rows[0]["Status"]["leader"], "?")
    except (ValueError, KeyError, IndexError):
        return f"unknown ({proc.stderr.strip()[-100:]})"


def main() -> None:  # noqa: PLR0915 - one scenario, told in order
    ap = argparse.ArgumentParser()
    ap.add_argument("--cut", type=float, default=120.0, help="seconds the hosting node's link stays down")
    ap.add_argument("--after", type=float, default=90.0, help="seconds of probes after the link returns")
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    ap.add_argument("--victim", choices=("first", "leader"), default="first",
                    help="the hosting worker cut: the first exposed address's, or the one holding etcd's leader")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, real_lab(NAME, SUBNET, 1, 4, tmp, keep=args.keep, hosting=True,
                                                         tenant_workers=1) as (lab_inv, lab_seconds):
        tmp_p = Path(tmp)
        print(f"lab up {lab_seconds:.0f} s")
        tenant_inv, tenant_state = tmp_p / "tenant.yaml", tmp_p / "tenant-state"
        hosting_doc, kubectl, _ = apply_hosting(lab_inv, tmp_p)
        t = time.perf_counter()
        run(INSTALLER, "apply", str(tenant_inv), "--state", str(tenant_state), "--wait-timeout", "900")
        print(f"tenant apply {time.perf_counter() - t:.0f} s")

        doc = yaml.safe_load(tenant_inv.read_text())
        hosted, ns = doc["spec"]["controlPlane"]["hosted"], f"hp-{doc['metadata']['name']}"
        port, addresses = hosted["expose"]["port"], hosted["expose"]["addresses"]
        worker = doc["spec"]["hosts"][0]["name"]
        names = {h["address"]: h["name"] for h in hosting_doc["spec"]["hosts"]}
        pods = json.loads(run(*kubectl, "get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        on = by_node(pods)
        leader = etcd_leader(kubectl, ns)
        victim_address = addresses[0] if args.victim == "first" else next(
            (a for a in addresses if leader in on.get(names[a], [])), addresses[0])
        victim = names[victim_address]
        up = [a for a in addresses if a != victim_address]
        print(f"tenant pods by hosting node: {json.dumps(on, sort_keys=True)}")
        print(f"cut: {victim} ({victim_address}), holding {', '.join(sorted(on.get(victim, [])))}; "
              f"etcd leader {leader}")

        ctx = admin_context(tenant_state / "pki")

        reads = {a: Loop(lambda _i, a=a: api(ctx, f"https://{a}:{port}/api/v1/namespaces/default"), 0.5)
                 for a in addresses}

        def write(i: int) -> None:
            base = f"https://{up[0]}:{port}/api/v1/namespaces/default/configmaps"
            api(ctx, base, "POST", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cut-{i}"},
                                    "data": {"i": str(i)}})
            api(ctx, f"{base}/cut-{i}", "DELETE")
        writes = Loop(write, 1.0)

        def tenant_node(_i: int) -> None:
            node = api(ctx, f"https://{up[0]}:{port}/api/v1/nodes/{worker}")
            ready = next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")
            if ready != "True":
                raise RuntimeError(f"{worker} Ready={ready}")
        node_ready = Loop(tenant_node, 1.0)

        def hosting_ready(_i: int) -> None:
            proc = subprocess.run([*kubectl, "get", "node", victim, "-o", "json", "--request-timeout=5s"],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode:
                raise RuntimeError(proc.stderr.strip()[-120:])
            node = json.loads(proc.stdout)
            ready = next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")
            if ready != "True":
                raise RuntimeError(f"Ready={ready}")
        victim_ready = Loop(hosting_ready, 1.0)

        ssh_config = tmp_p / "ssh_config"
        ssh_config.write_text(run(INSTALLER, "lab", "ssh-config", "--name", NAME).stdout)
        # what the tenant worker's kubelet (its balancer) and pods (the kubernetes Service) see
        service_ip = next(ipaddress.ip_network(doc["spec"]["network"]["serviceCIDR"]).hosts())
        worker_urls = {"lb": f"https://127.0.0.1:6443/api/v1/nodes/{worker}",
                       "svc": f"https://{service_ip}:443/api/v1/nodes/{worker}"}
        for name, url in worker_urls.items():
            hostprobes.start(ssh_config, worker, f"hp-probe-{name}", url, interval=0.5, timeout=5)

        time.sleep(30)
        host = next(h for h in lab_mod.load_spec(LabPaths.of(NAME)).hosts if h.name == victim)
        cut_at = time.time()
        net.cut_link(host)
        try:
            time.sleep(args.cut)
        finally:
            net.restore_link(host)
        back_at = time.time()
        converged = None
        while time.time() - back_at < args.after:
            if converged is None:
                live = json.loads(run(*kubectl, "get", "pods", "-n", ns, "-o", "json").stdout)["items"]
                # the lost node's pods were marked not ready at NotReady: each Ready again since
                if live and all(ready_since(p, cut_at) if p["spec"].get("nodeName") == victim else ready_since(p, 0)
                                for p in live):
                    converged = time.time() - back_at
            time.sleep(2)
        end_at = time.time()

        read_rows = {a: r.end() for a, r in reads.items()}
        write_rows, node_rows, victim_rows = writes.end(), node_ready.end(), victim_ready.end()
        worker_rows = {name: [(r.start, r.ok, r.detail)
                              for r in hostprobes.rows(ssh_config, worker, f"hp-probe-{name}")]
                       for name in worker_urls}
        # the balancer's server for the lost address (api-<i>, in expose.addresses' order)
        lost = f"api-{addresses.index(victim_address)}"
        marked_down = hostprobes.marked(ssh_config, worker, lost, cut_at, "DOWN")
        marked_up = hostprobes.marked(ssh_config, worker, lost, back_at, "UP")
        not_ready = next((t - cut_at for t, ok, _ in victim_rows if not ok and t >= cut_at), None)

        t = time.perf_counter()
        second = json.loads(run(INSTALLER, "apply", str(tenant_inv), "--state", str(tenant_state), "--output",
                                "json").stdout)
        second_s = time.perf_counter() - t

        print(f"\nthe cut: {args.cut:.0f} s of {victim}'s link down; probes {end_at - cut_at + 30:.0f} s in all "
              f"(30 s before, {args.after:.0f} s after)")
        print(f"hosting node {victim} NotReady {not_ready:.0f} s after the cut" if not_ready is not None
              else f"hosting node {victim}: never seen NotReady")
        edges = (0.0, cut_at, back_at, end_at + 1)
        print(f"{'failed/requests':40} {'before':13} {'during cut':13} {'after':13}")
        paths = [(f"read via {a}" + (" (the lost node's)" if a == victim_address else ""), rows)
                 for a, rows in read_rows.items()]
        paths += [(f"write via {up[0]}", write_rows), (f"read on {worker} via its balancer", worker_rows["lb"]),
                  (f"read on {worker} via the kubernetes Svc", worker_rows["svc"]),
                  (f"tenant Node {worker} Ready", node_rows)]
        for label, rows in paths:
            print(f"{label:40} {columns(rows, *edges)}")
        print("failed at (c+: seconds after the cut, r+: after the return):")
        for label, rows in paths:
            if "lost node" not in label and (at := when(rows, cut_at, back_at)):
                print(f"  {label:38} {at}")
        print(f"etcd leader after: {etcd_leader(kubectl, ns)}")
        print(f"{worker}'s balancer marked the lost address down "
              + (f"{marked_down:.1f} s after the cut" if marked_down is not None else "never (not seen in its journal)")
              + ", up again " + (f"{marked_up:.1f} s after the link returned" if marked_up is not None else "never"))
        print(f"tenant pods all ready again {converged:.0f} s after the link returned" if converged is not None
              else f"tenant pods not all ready within {args.after:.0f} s of the link's return")
        print(f"second apply: {second['changes']} change(s), {len(second['restarts'])} restart(s), {second_s:.0f} s "
              "(goal: 0)")
        print("how they failed:")
        for label, rows in paths:
            if "lost node" not in label and (kinds := sorted({e.split(":")[0] if "Ready=" not in e else e
                                                              for _, ok, e in rows if not ok})):
                print(f"  {label:38} {', '.join(kinds)}")
        print(f"goal: 0 failed through the addresses that stay up, writes succeed, Nodes Ready; {ANCHOR}")


if __name__ == "__main__":
    main()
