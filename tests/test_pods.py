"""A control-plane component as a pod's parts (installer/core/render/pods.py, docs/hosted.md):
the same host plan a control host gets, each component's files projected at the same paths, so
the flags rendered for its systemd unit work unchanged as the container's args."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from installer.core import components
from installer.core.render import control, pods
from installer.host import kube_objects

APISERVER, CM, SCHEDULER, ETCD = components.units("kube-apiserver", "kube-controller-manager", "kube-scheduler",
                                                  "etcd")
# what a pod writes: the audit log and etcd's data (an emptyDir, a volume), not files of the plan
WRITABLE = {APISERVER: {f"{control.AUDIT_DIR}/audit.log"}, ETCD: {control.ETCD_DATA_DIR}}


def _args(inv, host, unit: str) -> list[str]:
    return {APISERVER: lambda: control.apiserver_flags(inv, host),
            CM: lambda: control.controller_manager_flags(inv),
            SCHEDULER: control.scheduler_flags,
            ETCD: lambda: control.etcd_flags(inv, host)}[unit]()


@pytest.fixture(scope="module")
def parts(prepared):
    inv = prepared.inventory
    host = inv.controls[0]
    plan = prepared.plans[host.name]
    return {u: (pods.pod_parts(plan, u, u.removesuffix(".service"), "tenant-a", _args(inv, host, u),
                               {"app": u.removesuffix(".service")}), _args(inv, host, u))
            for u in (APISERVER, CM, SCHEDULER, ETCD)}


@pytest.mark.parametrize("unit", [APISERVER, CM, SCHEDULER, ETCD])
def test_every_path_a_components_flags_name_is_in_its_pod(parts, unit):
    p, args = parts[unit]
    assert pods.flag_paths(args) - p.paths() == WRITABLE.get(unit, set())
    # nothing mounted that its flags (or the files they name, e.g. a kubeconfig's) do not use
    assert p.mounts and all(m["readOnly"] for m in p.mounts)
    assert all(m["mountPath"].rstrip("/") not in ("", "/etc") for m in p.mounts)


def test_each_component_gets_only_its_own_keys(parts, prepared):
    """A hosting-cluster user who can read one component's Secret gets that component's keys:
    the cluster CA key only where kubelet certificates are signed, etcd's keys only in etcd's."""
    keys = {u: set(p.secret["data"]) for u, (p, _) in parts.items()}
    ca_key = pods.key_for(control.P["ca.key"])
    assert [u for u, k in keys.items() if ca_key in k] == [CM]
    sa_key = pods.key_for(control.P["sa.key"])
    assert sorted(u for u, k in keys.items() if sa_key in k) == sorted([APISERVER, CM])
    assert [u for u, k in keys.items() if any(x.startswith("etc_etcd_pki_") for x in k)] == [ETCD]
    assert keys[SCHEDULER] == {pods.key_for(f"{control.K8S_DIR}/scheduler.conf")}
    # no certificate or configuration in a Secret, no key in a ConfigMap
    for p, _ in parts.values():
        assert not any(k.endswith(".key") for k in p.config_map["data"])
        assert not any(k.endswith(".crt") for k in p.secret["data"])
    # the bytes are the plan's
    plan = prepared.plans[prepared.inventory.controls[0].name]
    assert base64.b64decode(parts[CM][0].secret["data"][ca_key]) == plan.files[control.P["ca.key"]].content


def test_the_inputs_digest_moves_with_what_the_component_runs_with_only(prepared, parts):
    """A pod template annotated with the digest rolls when the component's files or args change,
    and only then: not for another component's file, not for a new installer release."""
    inv = prepared.inventory
    host = inv.controls[0]
    plan = prepared.plans[host.name]
    base = parts[SCHEDULER][0].inputs_sha256
    assert pods.pod_parts(plan, SCHEDULER, "kube-scheduler", "tenant-a", _args(inv, host, SCHEDULER)) \
        .inputs_sha256 == base

    def changed(path: str, content: bytes):
        files = dict(plan.files)
        files[path] = dataclasses.replace(files[path], content=content)
        return dataclasses.replace(plan, files=files)
    other = changed(control.P["ca.key"], b"another key")          # the controller-manager's only
    assert pods.pod_parts(other, SCHEDULER, "kube-scheduler", "tenant-a",
                          _args(inv, host, SCHEDULER)).inputs_sha256 == base
    mine = changed(f"{control.K8S_DIR}/kube-scheduler.yaml", b"kind: KubeSchedulerConfiguration\n")
    assert pods.pod_parts(mine, SCHEDULER, "kube-scheduler", "tenant-a",
                          _args(inv, host, SCHEDULER)).inputs_sha256 != base
    assert pods.pod_parts(plan, SCHEDULER, "kube-scheduler", "tenant-a",
                          [*_args(inv, host, SCHEDULER), "--v=4"]).inputs_sha256 != base


def test_the_parts_make_valid_kubernetes_objects(parts, prepared):
    """The Secret, the ConfigMap and a Deployment mounting them pass the Kubernetes schemas of the
    cluster's version (strict: an unknown field fails)."""
    objects = []
    for unit, (p, args) in parts.items():
        name = unit.removesuffix(".service")
        objects += p.objects
        objects.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "tenant-a"},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name},
                                               "annotations": {pods.INPUTS_ANNOTATION: p.inputs_sha256}},
                                  "spec": {"volumes": p.volumes,
                                           "containers": [{"name": name, "image": f"registry.k8s.io/{name}:v0",
                                                           "args": args, "volumeMounts": p.mounts}]}}}})
    kube_objects.validate_objects(objects, prepared.inventory.spec.kubernetes.version)


def test_a_path_too_shallow_to_project_is_refused():
    with pytest.raises(ValueError, match="below 2 directories"):
        pods.mount_root("/etc/hosts")
    assert pods.mount_root("/etc/kubernetes/pki/ca.crt") == "/etc/kubernetes"
    assert pods.key_for("/etc/kubernetes/pki/etcd/ca.crt") == "etc_kubernetes_pki_etcd_ca.crt"
