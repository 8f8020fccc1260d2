"""``installer lab up --cni cilium`` without booting anything: the spec, the inventory it writes
(valid, with the lab's values only where an nspawn worker needs them), the seed files and the
artifacts it needs. The lab itself runs in tests/test_real_cilium.py (on demand)."""

from __future__ import annotations

import hashlib

import pytest
import yaml

from installer import api
from installer.core.artifacts import read_sums, write_sums
from installer.core.render.addons.cilium import CILIUM_CHART, cilium_values
from installer.lab import cilium as lab_cilium
from installer.lab import debian_artifacts, nspawn
from installer.lab import lab as lab_mod
from installer.lab.model import DEFAULT_SUBNET, LabError, LabPaths, LabSpec


def test_an_unknown_cni_is_refused_by_name():
    with pytest.raises(LabError, match=r"--cni: 'flannel': one of routes, cilium"):
        LabSpec.create("x", cni="flannel")
    assert LabSpec.create("x", cni="cilium").cni == "cilium"
    assert LabSpec.create("x") != LabSpec.create("x", cni="cilium")      # a lab is one or the other


@pytest.mark.parametrize("vm_workers", [0, 1, 2])
def test_the_inventory_runs_cilium_with_lab_values_only_for_nspawn_workers(vm_workers, tmp_path):
    spec = LabSpec.create("cl", 1, 2, vm_workers, DEFAULT_SUBNET, "cilium")
    paths = LabPaths.of("cl")
    doc = lab_mod.inventory_doc(spec, paths)
    lab_cilium.configure(doc, spec)
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "arts").mkdir()
    doc["spec"]["artifacts"]["path"] = str(tmp_path / "arts")
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(doc))
    inv = api.validate(tmp_path / "inv.yaml")
    assert inv.spec.network.cni == "cilium"
    values = cilium_values(inv)
    if vm_workers == 2:
        # VMs have their own kernel: the chart's own capabilities
        assert "cilium" not in doc["spec"]["network"] and "securityContext" not in values
    else:
        caps = values["securityContext"]["capabilities"]
        assert "SYS_MODULE" not in caps["ciliumAgent"] and "SYS_RESOURCE" not in caps["ciliumAgent"]
        assert {"NET_ADMIN", "SYS_ADMIN", "IPC_LOCK"} <= set(caps["ciliumAgent"])
        assert caps["cleanCiliumState"] == ["NET_ADMIN", "SYS_ADMIN"]
    # the installer's own settings stay
    assert values["kubeProxyReplacement"] == "false" and values["l7Proxy"] is False


def test_a_cilium_worker_may_load_bpf_and_its_root_is_shared():
    plain, bpf = nspawn.pod_host_files(), nspawn.pod_host_files(bpf=True)
    unit = "/etc/systemd/system/hiddenplane-lab-bpf-host.service"
    assert unit not in plain and b"mount --make-rshared /" in bpf[unit][0]
    assert b"mount -t bpf bpf /sys/fs/bpf" in bpf[unit][0]
    assert nspawn.pod_host_links(bpf=True)[f"/etc/systemd/system/sysinit.target.wants/{unit.rsplit('/', 1)[1]}"] \
        == unit
    assert nspawn.pod_host_links() == nspawn.POD_HOST_LINKS
    assert "--system-call-filter=bpf perf_event_open" in lab_cilium.BPF_HOST_ARGS
    assert not set(lab_cilium.BPF_HOST_ARGS) & set(nspawn.POD_HOST_ARGS)


def _sums(d, names):
    write_sums(d, {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in names})


def test_the_lab_names_what_cilium_needs_and_how_to_build_it(tmp_path):
    (tmp_path / "helm").write_text("x")
    _sums(tmp_path, ["helm"])
    with pytest.raises(LabError) as e:
        lab_cilium.check(tmp_path)
    for name in ("image-cilium.tar", "image-cilium-operator.tar", CILIUM_CHART):
        assert name in str(e.value)
    assert "helm," not in str(e.value) and "--only cilium" in str(e.value)


def test_import_dir_sends_the_extra_images_only_when_asked(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    names = ["image-cilium.tar", "image-pause.tar", "image-etcd.tar", "kubelet"]
    for n in names:
        (src / n).write_bytes(n.encode())
    _sums(src, names)
    assert "image-cilium.tar" not in debian_artifacts.import_dir(src, dest)
    got = debian_artifacts.import_dir(src, dest, extra_images=lab_cilium.IMAGES)
    assert "image-cilium.tar" in got and "image-etcd.tar" not in got
    assert "image-cilium.tar" in read_sums(dest)
