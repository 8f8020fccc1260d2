"""A hosted tenant's control plane as the objects of its namespace in the hosting cluster
(docs/hosted.md), from the same plan a control host gets.

``render_control`` renders one virtual control host named ``hosted``: its files are what the
components read (their etcd pairs are the ``etcd/*-hosted`` rows of the certificate table, which
name every member's pod), and its flags are the containers' args, changed only where a pod is
not a host: addresses (pods have their own, etcd members are named by their pods' DNS names),
the API the controller-manager and scheduler dial (the Service's in-cluster name), etcd's
endpoints, the konnectivity socket (a shared ``emptyDir``: the projected files are read-only).

Pure: no cluster is reached here; the hosted executor sends these objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from installer.core import components
from installer.core.etcd_rules import RESTORE_FLAGS
from installer.core.inventory import HostSpec, Inventory
from installer.core.inventory_hosted import API_SERVICE, hosted_images
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.pki.specs import CLUSTER_CA, ETCD_NEAR, ETCD_SERVICE, HOSTED_ETCD, HOSTED_PEER_CN
from installer.core.render import control
from installer.core.render import tenant_sizing as sizing
from installer.core.render.addons import konnectivity
from installer.core.render.files import K8S_DIR, HostFile, HostPlan, to_yaml
from installer.core.render.kubeconfig import kubeconfig
from installer.core.render.manifests import LABELS
from installer.core.render.pods import INPUTS_ANNOTATION, PodParts, pod_parts
from installer.core.render.tenant_etcd_names import (
    ETCD_PORT,
    PEER_PORT,
    legacy_peer_url,
    member_client_url,
    member_peer_url,
    near_url,
)
from installer.core.render.tenant_network import NAME_LABEL, TENANT_LABEL, network_policies, selector
from installer.core.render.tenant_placement import TRAFFIC_POLICY, Placement, affinity, spread
from installer.core.shellfiles import SH_DIR

API_UNIT, CM_UNIT, SCHED_UNIT, ETCD_UNIT = components.units(
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
KONNECTIVITY_UNIT = konnectivity.UNIT
BIN = "/usr/local/bin"
# etcd's volume; its data one level below, which etcd creates 0700 itself (a provisioner's
# directory may be 0777, which etcd refuses)
ETCD_VOLUME, ETCD_DATA = "/var/lib/etcd", "/var/lib/etcd/data"
# where `etcd snapshot restore` leaves the snapshot and its cluster token for the member's next
# start (installer/sh/etcd-member-start.sh); written first beside it as RESTORE.part
ETCD_RESTORE = "/var/lib/etcd/restore"
START_SCRIPT = "etcd-member-start.sh"
MEMBER_LIST = "etcd-members"       # ConfigMap: cluster (name=peer URL, ...) and endpoints (client URLs)
SCRIPTS = "/scripts"
SOCKET_DIR = "/run/konnectivity"
SOCKET = f"{SOCKET_DIR}/konnectivity-server.socket"
# every control-plane pod runs as this user and group, not root (Pod Security "restricted",
# which the namespace enforces): the projected files and etcd's volume are the group's through
# fsGroup (the kubelet sets it on secret, configMap, projected and emptyDir volumes, and on
# volumes whose driver manages ownership: CSI with fsGroupPolicy File, local volumes)
RUN_AS = 65532
POD_SECURITY = {"pod-security.kubernetes.io/enforce": "restricted"}
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"    # the StatefulSet controller labels each pod so
API_READY_FAILURES = 10             # an apiserver replica's failed /readyz checks before it leaves (_apiserver)


@dataclass
class TenantPlan:
    """What the hosting cluster holds for one tenant, in the order it is applied."""
    namespace: str
    objects: list[dict] = field(default_factory=list)

    def workloads(self) -> list[tuple[str, str]]:
        return [(o["kind"], o["metadata"]["name"]) for o in self.objects
                if o["kind"] in ("StatefulSet", "Deployment")]


def virtual_host(inv: Inventory) -> HostSpec:
    # the address is never used by a pod: every flag naming it is replaced below
    return HostSpec(name=HOSTED_ETCD, address=inv.balancer_address, role="control")


def member_names(inv: Inventory) -> list[str]:
    assert inv.hosted is not None
    return [f"{ETCD_SERVICE}-{i}" for i in range(inv.hosted.etcdReplicas)]


def near_service(inv: Inventory) -> dict:
    """The Service the apiservers dial (``near_url``; tenant_etcd_names.py says why)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(inv, ETCD_NEAR, "etcd"),
            "spec": {"type": "ClusterIP", "trafficDistribution": "PreferSameNode",
                     "selector": _selector(inv, "etcd")["matchLabels"],
                     "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT}]}}


def member_service(inv: Inventory, member: str) -> dict:
    """Member ``member``'s Service: its pod alone, listed before it is ready (a new member must
    be reached by its peers to become ready)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(inv, member, "etcd"),
            "spec": {"type": "ClusterIP", "publishNotReadyAddresses": True,
                     "selector": {**_selector(inv, "etcd")["matchLabels"], POD_NAME_LABEL: member},
                     "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT},
                               {"name": "peer", "port": PEER_PORT, "targetPort": PEER_PORT}]}}


def _member_list_env(key: str) -> dict:
    return {"name": key, "valueFrom": {"configMapKeyRef": {"name": MEMBER_LIST, "key": key}}}


def deployment_replicas(inv: Inventory) -> dict[str, int]:
    """The tenant's Deployments and how many replicas each runs (leader-elected: two)."""
    assert inv.hosted is not None
    return {"kube-apiserver": inv.hosted.apiServerReplicas, "kube-controller-manager": 2, "kube-scheduler": 2}


def component_selector(inv: Inventory, component: str) -> str:
    """A label selector (query form) for the pods of one of the tenant's components."""
    return f"{TENANT_LABEL}={inv.metadata.name},app.kubernetes.io/name={component}"


def api_in_cluster(inv: Inventory) -> str:
    """The API as the tenant's own pods in the hosting cluster reach it (the Service)."""
    assert inv.hosted is not None
    return f"https://{API_SERVICE}.{inv.hosted_namespace}.svc:{inv.hosted.expose.port}"


def _replace(args: list[str], values: dict[str, str | None]) -> list[str]:
    """``args`` with each named flag set to its value (None: dropped); flags not there yet are added."""
    out, seen = [], set()
    for a in args:
        name = a.partition("=")[0]
        if name in values:
            seen.add(name)
            if values[name] is not None:
                out.append(f"{name}={values[name]}")
        else:
            out.append(a)
    return out + [f"{k}={v}" for k, v in values.items() if k not in seen and v is not None]


def _labels(inv: Inventory, component: str) -> dict[str, str]:
    return {**LABELS, TENANT_LABEL: inv.metadata.name, NAME_LABEL: component}


def _meta(inv: Inventory, name: str, component: str) -> dict:
    return {"name": name, "namespace": inv.hosted_namespace, "labels": _labels(inv, component)}


def _container(inv: Inventory, component: str, image_key: str, args: list[str], parts: PodParts,
               command: list[str] | None = None) -> dict:
    c = {"name": component, "image": _images(inv)[image_key], "imagePullPolicy": "IfNotPresent",
         "command": command or [f"{BIN}/{component}"], "args": args, "volumeMounts": list(parts.mounts),
         "resources": sizing.resources(inv, component),
         "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                             "capabilities": {"drop": ["ALL"]}}}
    return c


def _images(inv: Inventory) -> dict[str, str]:
    assert inv.hosted is not None
    return hosted_images(inv.hosted.imageRegistry, inv.spec.kubernetes.version,
                         inv.spec.artifacts.versions.etcd)


def _template(inv: Inventory, component: str, containers: list[dict], volumes: list[dict],
              digests: list[str], placement: Placement = Placement()) -> dict:
    digest = hashlib.sha256("\n".join(digests + [json.dumps(containers, sort_keys=True)]).encode()).hexdigest()
    return {"metadata": {"labels": _labels(inv, component), "annotations": {INPUTS_ANNOTATION: digest}},
            "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
                     "securityContext": pod_security_context(), "priorityClassName": sizing.priority_class(inv),
                     "affinity": affinity(inv, component, placement),
                     "topologySpreadConstraints": spread(inv, component, placement),
                     "containers": containers, "volumes": volumes,
                     "terminationGracePeriodSeconds": 30}}


def root_workloads(live: list[dict]) -> list[str]:
    """The live workloads of a tenant (its StatefulSet and Deployments as the hosting API returns
    them) whose pods run as root: applied by a release before Pod Security "restricted". Rolling
    them would start etcd as a user that cannot read its members' data, which root wrote."""
    return [f"{o['kind']} {o['metadata']['name']}" for o in live
            if not ((o.get("spec") or {}).get("template", {}).get("spec", {}).get("securityContext") or {})
            .get("runAsNonRoot")]


def pod_security_context() -> dict:
    # OnRootMismatch: a volume already the group's is not walked again at every start (etcd's data)
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def _selector(inv: Inventory, component: str) -> dict:
    return selector(inv, (component,))


def _readyz(port: int, path: str = "/readyz") -> dict:
    # a probe answered late is not a failed one (kubeadm's static pods wait 15 s): with the
    # default second, a busy hosting node took both replicas out of the Service at once (the
    # lab: 13 refused requests while another tenant's pods restarted in a loop beside them)
    return {"httpGet": {"path": path, "port": port, "scheme": "HTTPS"}, "periodSeconds": 2, "timeoutSeconds": 15,
            "failureThreshold": 3}


# --- the components ---------------------------------------------------------------------------

def _etcd(inv: Inventory, plan: HostPlan) -> list[dict]:
    ns, members = inv.hosted_namespace, member_names(inv)
    me = "$(member)"
    base = [a for a in control.etcd_flags(inv, virtual_host(inv))
            if a.partition("=")[0] not in ("--name", "--data-dir", "--initial-advertise-peer-urls",
                                           "--initial-cluster", "--initial-cluster-state")]
    args = _replace(base, {
        "--listen-client-urls": f"https://0.0.0.0:{ETCD_PORT}",
        "--advertise-client-urls": member_client_url(inv, me),
        "--listen-peer-urls": f"https://0.0.0.0:{PEER_PORT}",
        # a peer's client certificate is the etcd CA's all the same (every member shares one: the
        # pods of a StatefulSet); its names are not matched against the connecting address in
        # DNS, which the hosting cluster's caches for 30 s: a member back with a new pod address
        # was refused by the others until then (seen on the real lab: 2-3 restarts of its start)
        "--peer-skip-client-san-verification": "true",
        # so a peer is known by its certificate's name instead: the etcd CA also signs the
        # apiservers' client certificate (and the server one), which every apiserver pod holds;
        # without this, any of them could join or talk to the members as a peer
        "--peer-cert-allowed-cn": HOSTED_PEER_CN,
        **sizing.etcd_flags(inv),
    })
    parts = pod_parts(plan, ETCD_UNIT, ETCD_SERVICE, ns, args, _labels(inv, "etcd"))
    pki = control.ETCD_PKI_DIR
    env = [{"name": "member", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "etcd", "value": f"{BIN}/etcd"}, {"name": "etcdctl", "value": f"{BIN}/etcdctl"},
           {"name": "peer_url", "value": member_peer_url(inv, me)},
           {"name": "legacy_peer_url", "value": legacy_peer_url(inv, me)},
           _member_list_env("cluster"),
           {"name": "data", "value": ETCD_DATA}, {"name": "etcdutl", "value": f"{BIN}/etcdutl"},
           {"name": "restore", "value": ETCD_RESTORE}, {"name": "restore_flags", "value": " ".join(RESTORE_FLAGS)},
           _member_list_env("endpoints"),
           {"name": "cacert", "value": f"{pki}/ca.crt"}, {"name": "cert", "value": f"{pki}/peer.crt"},
           {"name": "key", "value": f"{pki}/peer.key"}]
    script = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(inv, "etcd-start", "etcd"),
              "data": {START_SCRIPT: (SH_DIR / START_SCRIPT).read_text()}}
    # the member list, read by each start from here and not written into the pod template: a
    # member count change (host/tenant_members.py) then restarts no member, and no apiserver
    # either: they dial the near Service, which follows the ready members
    member_list = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(inv, MEMBER_LIST, "etcd"),
                   "data": {"cluster": ",".join(f"{m}={member_peer_url(inv, m)}" for m in members),
                            "endpoints": ",".join(member_client_url(inv, m) for m in members)}}
    c = _container(inv, "etcd", "etcd", args, parts, command=["/bin/sh", f"{SCRIPTS}/{START_SCRIPT}"])
    c["env"] = env
    c["volumeMounts"] += [{"name": "data", "mountPath": ETCD_VOLUME},
                          {"name": "start", "mountPath": SCRIPTS, "readOnly": True}]
    c["ports"] = [{"name": "client", "containerPort": ETCD_PORT}, {"name": "peer", "containerPort": PEER_PORT}]
    c["readinessProbe"] = {"exec": {"command": [
        f"{BIN}/etcdctl", f"--endpoints=https://127.0.0.1:{ETCD_PORT}", f"--cacert={pki}/ca.crt",
        f"--cert={pki}/peer.crt", f"--key={pki}/peer.key", "--command-timeout=3s", "endpoint", "health"]},
        "periodSeconds": 5, "timeoutSeconds": 5}
    volumes = parts.volumes + [{"name": "start", "configMap": {"name": "etcd-start", "defaultMode": 0o555}}]
    template = _template(inv, "etcd", [c], volumes, [parts.inputs_sha256, script["data"][START_SCRIPT]])
    claim = {"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"],
                                                    "resources": {"requests": {"storage": inv.hosted.etcdStorage}}}}
    if inv.hosted.storageClass:
        claim["spec"]["storageClassName"] = inv.hosted.storageClass
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(inv, ETCD_SERVICE, "etcd"),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                         "selector": _selector(inv, "etcd")["matchLabels"],
                         "ports": [{"name": "client", "port": ETCD_PORT}, {"name": "peer", "port": PEER_PORT}]}}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(inv, ETCD_SERVICE, "etcd"),
           "spec": {"serviceName": ETCD_SERVICE, "replicas": inv.hosted.etcdReplicas,
                    "podManagementPolicy": "Parallel", "selector": _selector(inv, "etcd"), "template": template,
                    "volumeClaimTemplates": [claim]}}
    out = [*parts.objects, script, member_list, headless, *(member_service(inv, m) for m in members),
           near_service(inv), sts]
    if inv.hosted.etcdReplicas > 1:
        # a drain takes one member at a time: a hosting node holding two must wait for the first
        # to run elsewhere (its volume is that node's with a local provisioner: until uncordoned)
        out.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(inv, "etcd", "etcd"),
                    "spec": {"maxUnavailable": 1, "selector": _selector(inv, "etcd")}})
    return out


def _apiserver(inv: Inventory, plan: HostPlan, placement: Placement) -> list[dict]:
    ns, hosted = inv.hosted_namespace, inv.hosted
    assert hosted is not None
    args = _replace(control.apiserver_flags(inv, virtual_host(inv)), {
        # the kubernetes Service's endpoint is the workers' balancer address (no reconciler)
        "--advertise-address": inv.balancer_address,
        "--etcd-servers": near_url(inv),
        **sizing.AUDIT_FLAGS,
    })
    api = pod_parts(plan, API_UNIT, "kube-apiserver", ns, args, _labels(inv, "kube-apiserver"))
    kargs = _replace(konnectivity.server_flags(inv, virtual_host(inv)), {
        "--uds-name": SOCKET, "--agent-bind-address": None, "--health-bind-address": None,
        "--server-count": str(hosted.apiServerReplicas)})
    konn = pod_parts(plan, KONNECTIVITY_UNIT, "konnectivity-server", ns, kargs, _labels(inv, "kube-apiserver"))
    port = inv.spec.apiServer.port
    a = _container(inv, "kube-apiserver", "kube-apiserver", args, api)
    a["ports"] = [{"name": "https", "containerPort": port}]
    # Ready only once it reaches etcd: each exposed address serves its own node's replica
    # (tenant_placement), and one back from a lost node, its container running all along, was
    # Ready at once while its etcd connections still waited out their reconnect backoff.
    # Leaving it takes 10 failures 2 s apart: the replicas share one etcd, and while its members
    # restarted in a renew roll every replica failed etcd's checks for some seconds at once
    # (3 failures emptied the Service: 7-13 refused connections, 55fe824). /livez leaves etcd
    # out: a restart cures no etcd trouble.
    a["readinessProbe"] = {**_readyz(port), "failureThreshold": API_READY_FAILURES}
    a["livenessProbe"] = {**_readyz(port, "/livez?exclude=etcd"), "periodSeconds": 10, "failureThreshold": 6,
                          "initialDelaySeconds": 30}
    a["volumeMounts"] += [{"name": "konnectivity", "mountPath": SOCKET_DIR},
                          {"name": "audit", "mountPath": control.AUDIT_DIR}]
    k = _container(inv, "konnectivity-server", "konnectivity-server", kargs, konn, command=["/proxy-server"])
    k["ports"] = [{"name": "agents", "containerPort": konnectivity.AGENT_PORT}]
    # its /readyz fails until an agent connects, and agents connect through the Service, which
    # lists ready pods only: ready is healthy here
    k["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": konnectivity.HEALTH_PORT}, "periodSeconds": 5}
    k["volumeMounts"] += [{"name": "konnectivity", "mountPath": SOCKET_DIR}]
    volumes = api.volumes + konn.volumes + [{"name": "konnectivity", "emptyDir": {"sizeLimit": sizing.SOCKET_LIMIT}},
                                            {"name": "audit", "emptyDir": {"sizeLimit": sizing.AUDIT_LIMIT}}]
    template = _template(inv, "kube-apiserver", [a, k], volumes, [api.inputs_sha256, konn.inputs_sha256], placement)
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": _meta(inv, "kube-apiserver", "kube-apiserver"),
              "spec": {"replicas": deployment_replicas(inv)["kube-apiserver"],
                       "selector": _selector(inv, "kube-apiserver"),
                       "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                       "template": template}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": _meta(inv, "kube-apiserver", "kube-apiserver"),
           "spec": {"maxUnavailable": 1, "selector": _selector(inv, "kube-apiserver")}}
    ports = [{"name": "https", "port": hosted.expose.port, "targetPort": port},
             {"name": "konnectivity", "port": hosted.expose.konnectivityPort, "targetPort": konnectivity.AGENT_PORT}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(inv, API_SERVICE, "kube-apiserver"),
               "spec": {"type": hosted.expose.type, **TRAFFIC_POLICY,
                        "selector": _selector(inv, "kube-apiserver")["matchLabels"], "ports": ports}}
    if hosted.expose.type == "NodePort":
        for p in ports:
            p["nodePort"] = p["port"]
    else:
        service["spec"]["loadBalancerIP"] = hosted.expose.addresses[0]
    return [*api.objects, *konn.objects, deploy, pdb, service]


def _leader(inv: Inventory, plan: HostPlan, unit: str, component: str, args: list[str]) -> list[dict]:
    parts = pod_parts(plan, unit, component, inv.hosted_namespace, args, _labels(inv, component))
    c = _container(inv, component, component, args, parts)
    template = _template(inv, component, [c], parts.volumes, [parts.inputs_sha256])
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(inv, component, component),
              "spec": {"replicas": deployment_replicas(inv)[component], "selector": _selector(inv, component),
                       "template": template}}
    return [*parts.objects, deploy]


# --- the plan ---------------------------------------------------------------------------------

def tenant_plan_files(inv: Inventory, material: Material) -> HostPlan:
    """The virtual control host's plan, its kubeconfigs dialing the Service and its egress
    selector naming the pod's socket."""
    plan = control.render_control(inv, virtual_host(inv), material)
    ca_pem = issue.cert_pem(material.pair(CLUSTER_CA).cert)
    for conf, cert, user, unit in (("controller-manager.conf", "controller-manager",
                                    "system:kube-controller-manager", CM_UNIT),
                                   ("scheduler.conf", "scheduler", "system:kube-scheduler", SCHED_UNIT)):
        plan.files[f"{K8S_DIR}/{conf}"] = HostFile(
            f"{K8S_DIR}/{conf}", kubeconfig(inv.metadata.name, api_in_cluster(inv), ca_pem, user,
                                            client=material.pair(cert)), 0o600, secret=True, restarts=(unit,))
    egress = konnectivity.egress_selector_config(SOCKET, controlplane=True)
    plan.files[konnectivity.EGRESS_CONFIG] = HostFile(konnectivity.EGRESS_CONFIG, to_yaml(egress), 0o600,
                                                      restarts=(API_UNIT,))
    return plan


def namespace_object(inv: Inventory) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": inv.hosted_namespace,
                         "labels": {**LABELS, TENANT_LABEL: inv.metadata.name, **POD_SECURITY}}}


def render_tenant(inv: Inventory, material: Material, placement: Placement = Placement()) -> TenantPlan:
    """``placement``: the hosting nodes behind the exposed addresses (tenant_placement.py), read
    from the hosting cluster by apply; without them the apiservers are not pinned."""
    assert inv.hosted is not None, "render_tenant is for spec.controlPlane.mode: hosted"
    plan = tenant_plan_files(inv, material)
    # the priority, quota and policies before the pods they govern: no pod is open while its
    # policy is to come, none admitted before its quota is in place
    objects = [namespace_object(inv), sizing.priority_class_object(inv), sizing.quota_object(inv),
               sizing.limit_range_object(inv), *network_policies(inv), *_etcd(inv, plan),
               *_apiserver(inv, plan, placement),
               *_leader(inv, plan, CM_UNIT, "kube-controller-manager", control.controller_manager_flags(inv)),
               *_leader(inv, plan, SCHED_UNIT, "kube-scheduler", control.scheduler_flags())]
    return TenantPlan(inv.hosted_namespace, objects)
