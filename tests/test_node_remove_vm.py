"""Removing a worker for real: a lab with one control host, one nspawn worker and one VM worker
(qemu; real containerd, shims, runc and containers). While a container runs on the VM worker
the host side of node removal leaves no containerd, shim, runc, kubelet, kube-proxy or container
process, no unit, no credential or kubeconfig, no CNI state and no route of the pod network
(checked with testinfra). Twice: once with containerd already stopped (its unit kills only the
daemon, KillMode=process: shims and containers outlive it and must be found by their cgroups),
through ``teardown.wipe_host``; then through ``installer node remove --skip-cluster`` (the
Kubernetes API part cannot run on the stand-ins), which also drops the node's routes on the
other hosts."""

from __future__ import annotations

import ipaddress
import json
import time

import pytest
import yaml

from installer import api, reset, teardown
from installer.artifacts import add_files
from installer.lab import lab as lab_mod
from installer.lab import vm
from installer.ssh import Remote

from .labfixtures import install_standins, start_lab
from .test_apply_lab import run_installer

pytestmark = [pytest.mark.lab, pytest.mark.vm]

NAME, SUBNET = "rmvm", "10.213.245.0/24"
VM = "w2"
UNITS = ("containerd", "kubelet", "kube-proxy", "hiddenplane-routes")
PROCESSES = ("containerd", "containerd-shim", "runc", "kubelet", "kube-proxy")
IMAGE = "localhost/hiddenplane/busybox:lab"
ARCHIVE = "image-busybox.tar"


def apply_images(lab, inventory) -> dict:
    proc = run_installer("apply", str(inventory), "--state", str(lab.state), "--skip", "cluster-bootstrap",
                         "--output", "json", "--wait-timeout", "120")
    return json.loads(proc.stdout)


def with_image_archive(lab, tmp) -> None:
    """Stand-ins and a busybox image archive in the lab's artifacts, and ``lab.inv_images``: the
    lab inventory with that image as sandbox image (a small one: the VM gets nothing else)."""
    install_standins(lab.paths.artifacts)
    busybox = vm.deb_tree("busybox-static", log=lambda *_: None) / "bin" / "busybox"
    vm.busybox_image_archive(lab.paths.artifacts / ARCHIVE, IMAGE, busybox.read_bytes())
    add_files(lab.paths.artifacts, [ARCHIVE])
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["spec"]["artifacts"]["sandboxImage"] = IMAGE
    lab.inv_images = tmp / f"{lab.spec.name}-images.inventory.yaml"
    lab.inv_images.write_text(yaml.safe_dump(doc))
    lab.state = tmp / "state"


@pytest.fixture(scope="module")
def rmlab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rmvm")
    t = time.monotonic()
    # workers=2 with vm_workers=1: w1 is an nspawn worker, w2 the VM
    lab = start_lab(NAME, SUBNET, tmp, controls=1, workers=2, vm_workers=1)
    try:
        assert lab.spec.host(VM).kind == "vm" and lab.spec.host("w1").kind == "nspawn"
        print(f"\nlab {NAME} up in {time.monotonic() - t:.1f} s")
        with_image_archive(lab, tmp)
        yield lab
    finally:
        lab_mod.down(NAME, log=lambda *_: None)


def apply(lab) -> dict:
    t = time.monotonic()
    report = apply_images(lab, lab.inv_images)
    print(f"\napply {time.monotonic() - t:.1f} s")
    return report


def pod_cidrs(lab) -> dict[str, str]:
    inv = api.validate(lab.inv_images)
    return api.state_for(inv, lab.state).load(inv).pod_cidrs


def start_container(host, cid: str, seconds: int) -> None:
    host.run_expect([0], f"ctr -n k8s.io run -d {IMAGE} {cid} /bin/busybox sleep {seconds}")
    running(host, cid, seconds)


def running(host, cid: str, seconds: int) -> None:
    ps = host.check_output("ps -eo args=")
    assert f"containerd-shim-runc-v2 -namespace k8s.io -id {cid} " in ps, ps
    assert f"/bin/busybox sleep {seconds}" in ps, ps


def assert_nothing_left(lab, host, seconds: int) -> None:
    # processes: no runtime, shim, runc, component or container
    ps = host.check_output("ps -eo comm=,args=")
    for line in ps.splitlines():
        comm = line.split()[0]
        assert not comm.startswith(PROCESSES), line
        assert f"sleep {seconds}" not in line, line
    for p in PROCESSES:
        assert not host.process.filter(comm=p), p
    # units: no file, not enabled, not running
    files = host.check_output("systemctl list-unit-files --no-legend --no-pager")
    for u in UNITS:
        s = host.service(u)
        assert not host.file(f"/etc/systemd/system/{u}.service").exists, u
        assert f"{u}.service" not in files, u
        assert not s.is_running and not s.is_enabled, u
    assert host.check_output("ls /etc/systemd/system/*.wants/ | grep -cE 'containerd|kube|hiddenplane' || true") == "0"
    # credentials and kubeconfigs, CNI state, runtime state and mounts
    for path in ("/etc/kubernetes", "/var/lib/kubelet", "/var/lib/kube-proxy", "/var/lib/cni", "/etc/cni/net.d",
                 "/etc/cni", "/run/containerd", "/var/lib/containerd", "/var/lib/hiddenplane",
                 "/usr/local/bin/kubelet", "/usr/local/bin/containerd", "/usr/local/bin/runc",
                 "/usr/local/bin/containerd-shim-runc-v2", "/opt/cni/bin/bridge", "/etc/containerd/config.toml",
                 "/etc/sysctl.d/90-hiddenplane.conf", "/sys/fs/cgroup/k8s.io"):
        assert not host.file(path).exists, path
    assert host.check_output("find / -xdev \\( -name '*.kubeconfig' -o -name 'kubelet*.conf' "
                             "-o -name 'kube-proxy.conf' -o -name 'kubelet-client*' \\) -print") == ""
    mounts = host.check_output("awk '{print $5}' /proc/self/mountinfo")
    assert not [m for m in mounts.split() if m.startswith(("/run/containerd", "/var/lib/kubelet", "/run/netns/cni-"))]
    assert "cni0" not in host.check_output("ip -br link")
    # routes: none of ours, none to any pod CIDR
    assert host.check_output("ip -4 route show proto 199; ip -6 route show proto 199") == ""
    pod_net = ipaddress.ip_network(yaml.safe_load(lab.inv_images.read_text())["spec"].get("network", {})
                                   .get("podCIDR", "10.244.0.0/16"))
    for line in host.check_output("ip -4 route").splitlines():
        dst = line.split()[0]
        if dst != "default":
            assert not ipaddress.ip_network(dst, strict=False).overlaps(pod_net), line
    assert "HIDDENPLANE" not in host.check_output("iptables-save")
    assert host.check_output("cat /proc/sys/net/ipv4/ip_forward") == "0"


def test_containerd_stopped_first_shims_and_containers_are_still_found(rmlab):
    report = apply(rmlab)
    assert report["changes"] > 0
    w2 = rmlab.host(VM)
    start_container(w2, "c1", 1001)
    # containerd's unit kills only the daemon: its shim and the container outlive it
    w2.run_expect([0], "systemctl stop containerd")
    running(w2, "c1", 1001)

    inv = api.validate(rmlab.inv_images)
    plans = reset.cluster_plans(inv, rmlab.state)
    t = time.monotonic()
    with Remote(inv.host(VM), inv) as remote:
        done = teardown.wipe_host(inv, inv.host(VM), plans, remote, data=True, log=lambda m: None)
    print(f"\nwipe_host {time.monotonic() - t:.1f} s")
    assert any(line.startswith("killed ") and "leftover process(es)" in line for line in done), done
    assert "unmounted /run/containerd/io.containerd.runtime.v2.task/k8s.io/c1/rootfs" in done, done
    assert_nothing_left(rmlab, w2, 1001)
    # the other hosts are untouched
    assert rmlab.host("w1").service("kubelet").is_running and rmlab.host("cp1").service("etcd").is_running


def test_node_remove_while_a_container_runs(rmlab):
    apply(rmlab)                     # w2 comes back
    w2 = rmlab.host(VM)
    start_container(w2, "c2", 1002)
    cidrs = pod_cidrs(rmlab)
    w2_cidr, w2_addr = cidrs[VM], rmlab.spec.host(VM).address
    for other in ("cp1", "w1"):
        assert f"{w2_cidr} via {w2_addr}" in rmlab.host(other).check_output("ip route show proto 199"), other

    t = time.monotonic()
    proc = run_installer("node", "remove", str(rmlab.inv_images), VM, "--state", str(rmlab.state),
                         "--skip-cluster", "--yes", timeout=900)
    print(f"\nnode remove {time.monotonic() - t:.1f} s")
    assert f"{VM}: killed container k8s.io/c2" in proc.stderr, proc.stderr
    assert f"{VM}: stopped kubelet.service" in proc.stderr
    assert_nothing_left(rmlab, w2, 1002)
    # its routes are gone from the other hosts, which keep working
    for other in ("cp1", "w1"):
        assert w2_cidr not in rmlab.host(other).check_output("ip route show proto 199"), other
    assert rmlab.host("w1").service("kubelet").is_running and rmlab.host("cp1").service("kube-apiserver").is_running
