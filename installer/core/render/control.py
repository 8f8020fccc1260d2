"""Files of a control host: etcd and the three control-plane components as systemd units.

No kubelet, no container runtime, no CNI: the host never becomes a node. Every flag that a
CIS check reads is on the command line (kube-bench reads the process arguments), except the
scheduler's deprecated ones, which live in its KubeSchedulerConfiguration.
"""

from __future__ import annotations

from dataclasses import replace

from installer.core import components
from installer.core.inventory import HostSpec, Inventory
from installer.core.pki import issue
from installer.core.pki.material import Material
from installer.core.pki.specs import CLUSTER_CA, ETCD_CA, FRONT_PROXY_CA, FRONT_PROXY_CLIENT_CN
from installer.core.render.addons.konnectivity import apiserver_egress_flags, render_konnectivity_server
from installer.core.render.ciphers import CIPHER_SUITES
from installer.core.render.files import (
    BIN_DIR,
    K8S_DIR,
    PKI_DIR,
    HostDir,
    HostFile,
    HostPlan,
    SystemUser,
    flags,
    to_yaml,
    unit_file,
)
from installer.core.render.kubeconfig import kubeconfig
from installer.core.render.network import add_control_network, egress

ETCD_DATA_DIR = "/var/lib/etcd"
# where a data dir is moved aside (never deleted) by a snapshot restore and a member removal
ETCD_RESTORE_ASIDE = f"{ETCD_DATA_DIR}.pre-restore-"
ETCD_REMOVED_ASIDE = f"{ETCD_DATA_DIR}.removed-"
ETCD_UNIT = components.unit("etcd")
# etcd runs as its own user and must read its member pairs: they live outside
# /etc/kubernetes/pki so that directory stays entirely root:root (CIS 1.1.19).
ETCD_PKI_DIR = "/etc/etcd/pki"
AUDIT_DIR = "/var/log/kubernetes/audit"
LOCAL_API = "https://127.0.0.1:{port}"

P = {  # host paths of PKI files, by state name
    "ca.crt": f"{PKI_DIR}/ca.crt", "ca.key": f"{PKI_DIR}/ca.key",
    "front-proxy-ca.crt": f"{PKI_DIR}/front-proxy-ca.crt",
    "etcd-ca.crt": f"{PKI_DIR}/etcd/ca.crt",
    "sa.key": f"{PKI_DIR}/sa.key", "sa.pub": f"{PKI_DIR}/sa.pub",
}


def _pem_pair(plan: HostPlan, name: str, stem: str, material: Material, owner: str = "root",
              restarts: tuple[str, ...] = ()) -> None:
    """``stem`` is the host path without extension (relative ones are under PKI_DIR)."""
    pair = material.pair(name)
    stem = stem if stem.startswith("/") else f"{PKI_DIR}/{stem}"
    plan.add(HostFile(f"{stem}.crt", issue.cert_pem(pair.cert), 0o644, owner, owner, restarts=restarts))
    plan.add(HostFile(f"{stem}.key", issue.key_pem(pair.key), 0o600, owner, owner, secret=True, restarts=restarts))


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


# Flags etcd reads only when it bootstraps an empty data dir (a new cluster, or a member
# joining one). A member with data ignores them: it knows its cluster from its WAL.
ETCD_BOOTSTRAP_FLAGS = ("--initial-cluster", "--initial-cluster-state", "--initial-cluster-token")
ETCD_RESTART_KEY = "/etc/etcd/etcd.service.restart-key"


def peer_url(address: str) -> str:
    """The etcd member's peer URL on ``address``."""
    return f"https://{_url_host(address)}:{components.port('etcd', 'peer')}"


def client_url(address: str) -> str:
    """The etcd member's client URL on ``address``."""
    return f"https://{_url_host(address)}:{components.port('etcd', 'client')}"


def initial_cluster(hosts: list[HostSpec]) -> str:
    """``name=https://address:2380,...`` of ``hosts`` (etcd's --initial-cluster)."""
    return ",".join(f"{h.name}={peer_url(h.address)}" for h in hosts)


def etcd_flags(inv: Inventory, host: HostSpec, join: str | None = None) -> list[str]:
    """``join``: the --initial-cluster of a member joining a running cluster (the current
    members plus itself, as `etcdctl member add` registered them); then the state is
    ``existing``. Otherwise every control host bootstraps the inventory's cluster."""
    client, peer = client_url(host.address), peer_url(host.address)
    return flags({
        "--name": host.name,
        "--data-dir": ETCD_DATA_DIR,
        "--listen-client-urls": f"{client},{client_url('127.0.0.1')}",
        "--advertise-client-urls": client,
        "--listen-peer-urls": peer,
        "--initial-advertise-peer-urls": peer,
        "--initial-cluster": join or initial_cluster(inv.controls),
        "--initial-cluster-state": "existing" if join else "new",
        "--initial-cluster-token": f"{inv.metadata.name}-etcd",
        "--listen-metrics-urls": "http://127.0.0.1:2381",
        "--cert-file": f"{ETCD_PKI_DIR}/server.crt",
        "--key-file": f"{ETCD_PKI_DIR}/server.key",
        "--trusted-ca-file": f"{ETCD_PKI_DIR}/ca.crt",
        "--client-cert-auth": True,
        "--peer-cert-file": f"{ETCD_PKI_DIR}/peer.crt",
        "--peer-key-file": f"{ETCD_PKI_DIR}/peer.key",
        "--peer-trusted-ca-file": f"{ETCD_PKI_DIR}/ca.crt",
        "--peer-client-cert-auth": True,
        "--cipher-suites": CIPHER_SUITES,
    })


def etcd_unit_files(inv: Inventory, host: HostSpec, join: str | None = None) -> list[HostFile]:
    """etcd.service, and the key whose change restarts it.

    Adding or removing a control host changes --initial-cluster on every member. Restarting
    every member for that, all at once (the etcd phase works on all hosts in parallel), would
    drop quorum for nothing: a member with data ignores the bootstrap-only flags. So the unit
    file itself restarts nothing; its restart key, the digest of the unit *without* those
    flags, does. A real change (another flag, the binary path) still restarts etcd, one member
    at a time (phases/start_etcd.py); a membership change only rewrites the unit, which
    systemd reloads and the running member reads at its next restart. The ExecStart stays
    complete, so the unit on a host is always exactly what etcd would run.
    """
    values = dict(binary=f"{BIN_DIR}/etcd", member=host.name, cluster=inv.metadata.name, data_dir=ETCD_DATA_DIR)
    all_flags = etcd_flags(inv, host, join)
    unit = unit_file(ETCD_UNIT, "etcd.service.j2", flags=all_flags, **values)
    steady = unit_file(ETCD_UNIT, "etcd.service.j2", flags=[
        f for f in all_flags if f.partition("=")[0] not in ETCD_BOOTSTRAP_FLAGS], **values)
    key = (f"# sha256 of {unit.path} without {', '.join(ETCD_BOOTSTRAP_FLAGS)}: "
           f"a change restarts {ETCD_UNIT}\n{steady.sha256}\n").encode()
    return [replace(unit, restarts=()), HostFile(ETCD_RESTART_KEY, key, 0o600, restarts=(ETCD_UNIT,))]


def etcd_servers(inv: Inventory) -> str:
    """Every member's client URL (etcdctl's endpoints for cluster-wide health and membership)."""
    return ",".join(client_url(c.address) for c in inv.controls)


# Each apiserver talks to the etcd member on its own host only, as kubeadm's stacked control
# planes do: etcd's client balances requests over every endpoint it is given, and with a member
# lost (its host cut off) the apiservers of the other hosts kept sending a share of their
# requests to it, each waiting for its deadline, and their /readyz failed now and then, for as
# long as the outage lasted (seen on the real lab). With the local member only, a lost host takes
# its own apiserver with it and no other; a member that is down or out of quorum fails its own
# apiserver's /readyz, and the workers' balancers stop using that apiserver.
LOCAL_ETCD = client_url("127.0.0.1")


def apiserver_flags(inv: Inventory, host: HostSpec) -> list[str]:
    net, api = inv.spec.network, inv.spec.apiServer
    admission = ["NodeRestriction", "DenyServiceExternalIPs", "EventRateLimit"]
    if api.alwaysPullImages:
        admission.append("AlwaysPullImages")
    return flags({
        "--advertise-address": host.address,
        "--bind-address": "0.0.0.0" if ":" not in host.address else "::",
        "--secure-port": api.port,
        "--allow-privileged": True,
        # anonymous requests refused; with the workers' balancers, but for the health endpoints
        # their checks read (the authentication config, balancer_flags)
        "--anonymous-auth": None if inv.local_balancer else False,
        "--authorization-mode": "Node,RBAC",
        "--enable-admission-plugins": admission,
        "--admission-control-config-file": f"{K8S_DIR}/admission-config.yaml",
        "--enable-bootstrap-token-auth": True,
        "--client-ca-file": P["ca.crt"],
        "--tls-cert-file": f"{PKI_DIR}/apiserver.crt",
        "--tls-private-key-file": f"{PKI_DIR}/apiserver.key",
        "--tls-cipher-suites": CIPHER_SUITES,
        "--tls-min-version": "VersionTLS12",
        "--etcd-servers": LOCAL_ETCD,
        "--etcd-cafile": P["etcd-ca.crt"],
        "--etcd-certfile": f"{PKI_DIR}/apiserver-etcd-client.crt",
        "--etcd-keyfile": f"{PKI_DIR}/apiserver-etcd-client.key",
        "--kubelet-certificate-authority": P["ca.crt"],
        "--kubelet-client-certificate": f"{PKI_DIR}/apiserver-kubelet-client.crt",
        "--kubelet-client-key": f"{PKI_DIR}/apiserver-kubelet-client.key",
        # control hosts may not resolve worker names: dial the InternalIP first
        "--kubelet-preferred-address-types": "InternalIP,ExternalIP,Hostname",
        "--proxy-client-cert-file": f"{PKI_DIR}/front-proxy-client.crt",
        "--proxy-client-key-file": f"{PKI_DIR}/front-proxy-client.key",
        "--requestheader-client-ca-file": P["front-proxy-ca.crt"],
        "--requestheader-allowed-names": FRONT_PROXY_CLIENT_CN,
        "--requestheader-username-headers": "X-Remote-User",
        "--requestheader-group-headers": "X-Remote-Group",
        "--requestheader-extra-headers-prefix": "X-Remote-Extra-",
        "--service-account-issuer": f"https://kubernetes.default.svc.{net.clusterDomain}",
        "--service-account-key-file": P["sa.pub"],
        "--service-account-signing-key-file": P["sa.key"],
        "--service-account-lookup": True,
        "--service-account-extend-token-expiration": False,
        "--service-cluster-ip-range": net.serviceCIDR,
        # once it stops accepting (after its shutdown delay), its watches end at once, rate
        # limited, and the clients watch again elsewhere; without it the HTTP server's shutdown
        # waited for them until --request-timeout (60 s) ran out: every stop took 65 s on the
        # lab, and with one control host the API was gone all that time
        "--shutdown-watch-termination-grace-period": WATCH_DRAIN,
        "--encryption-provider-config": f"{K8S_DIR}/encryption-config.yaml",
        "--audit-policy-file": f"{K8S_DIR}/audit-policy.yaml",
        "--audit-log-path": f"{AUDIT_DIR}/audit.log",
        "--audit-log-maxage": 30,
        "--audit-log-maxbackup": 10,
        "--audit-log-maxsize": 100,
        "--profiling": False,
        # with egress: routes the control host reaches pod IPs (not Service IPs: no kube-proxy
        # here), so aggregated APIs are called at their endpoints' pod addresses
        "--enable-aggregator-routing": True if egress(inv) == "routes" else None,
        # egress: konnectivity — the egress selector and the konnectivity audience
        **apiserver_egress_flags(inv),
        **balancer_flags(inv),
    })


AUTHN_CONFIG = f"{K8S_DIR}/authentication-config.yaml"
# the paths the workers' balancers check (render/balancer.py) and kubeadm's health probes read
HEALTH_PATHS = ("/livez", "/readyz", "/healthz")
# after SIGTERM the apiserver fails /readyz at once but keeps serving this long: every balancer
# marks it down (2 failed checks a second apart) before it stops accepting
SHUTDOWN_DELAY = "5s"
# the most a stopping apiserver waits for its watches to end (they end at 200 a second or more)
WATCH_DRAIN = "10s"


def balancer_flags(inv: Inventory) -> dict:
    """With the workers' balancers: the kubernetes Service's endpoints are the balancer address,
    written once by cluster-bootstrap (each apiserver would otherwise publish its own address,
    and remove it when it stops, leaving pods a dead endpoint for up to a lease's 15 s); the
    health endpoints readable without credentials; a shutdown that leaves the balancers time."""
    if not inv.local_balancer:
        return {}
    return {"--endpoint-reconciler-type": "none", "--authentication-config": AUTHN_CONFIG,
            "--shutdown-delay-duration": SHUTDOWN_DELAY}


def authentication_config() -> dict:
    """Anonymous requests only to the health endpoints (AnonymousAuthConfigurableEndpoints, GA
    in 1.34): everything else still needs a credential, as with --anonymous-auth=false."""
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AuthenticationConfiguration",
        "anonymous": {"enabled": True, "conditions": [{"path": p} for p in HEALTH_PATHS]},
    }


def controller_manager_flags(inv: Inventory) -> list[str]:
    kc = f"{K8S_DIR}/controller-manager.conf"
    return flags({
        "--bind-address": "127.0.0.1",
        "--kubeconfig": kc,
        "--authentication-kubeconfig": kc,
        "--authorization-kubeconfig": kc,
        "--client-ca-file": P["ca.crt"],
        "--requestheader-client-ca-file": P["front-proxy-ca.crt"],
        "--cluster-name": inv.metadata.name,
        "--cluster-signing-cert-file": P["ca.crt"],
        "--cluster-signing-key-file": P["ca.key"],
        "--cluster-signing-duration": f"{inv.spec.pki.kubeletClientCertHours}h0m0s",
        "--controllers": "*,bootstrapsigner,tokencleaner",
        # the installer allocates pod CIDRs (state network.yaml) and renders them into each
        # worker's CNI config and every host's routes before any Node exists; the node IPAM
        # controller stays off (so --cluster-cidr would do nothing) and the workers phase sets
        # Node.spec.podCIDR to the same allocation on a real cluster
        "--allocate-node-cidrs": False,
        "--leader-elect": True,
        "--profiling": False,
        "--root-ca-file": P["ca.crt"],
        "--service-account-private-key-file": P["sa.key"],
        "--service-cluster-ip-range": inv.spec.network.serviceCIDR,
        "--terminated-pod-gc-threshold": 1000,
        "--use-service-account-credentials": True,
        "--tls-cipher-suites": CIPHER_SUITES,
        "--tls-min-version": "VersionTLS12",
    })


def scheduler_flags() -> list[str]:
    kc = f"{K8S_DIR}/scheduler.conf"
    return flags({
        "--config": f"{K8S_DIR}/kube-scheduler.yaml",
        "--bind-address": "127.0.0.1",
        "--authentication-kubeconfig": kc,
        "--authorization-kubeconfig": kc,
        "--tls-cipher-suites": CIPHER_SUITES,
        "--tls-min-version": "VersionTLS12",
    })


def scheduler_config() -> dict:
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        # the --kubeconfig and --profiling flags are deprecated upstream: set them here
        "clientConnection": {"kubeconfig": f"{K8S_DIR}/scheduler.conf"},
        "enableProfiling": False,
        "leaderElection": {"leaderElect": True},
    }


def encryption_config(material: Material) -> dict:
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "EncryptionConfiguration",
        "resources": [{
            "resources": ["secrets"],
            "providers": [
                {"secretbox": {"keys": [{"name": "key1", "secret": material.encryption_key_b64}]}},
                {"identity": {}},   # reads objects written before encryption was on
            ],
        }],
    }


def audit_policy() -> dict:
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            # never log secret payloads: Metadata only
            {"level": "Metadata", "resources": [
                {"group": "", "resources": ["secrets", "configmaps"]},
                {"group": "authentication.k8s.io", "resources": ["tokenreviews"]}]},
            {"level": "None", "users": ["system:kube-proxy"], "verbs": ["watch"],
             "resources": [{"group": "", "resources": ["endpoints", "services", "services/status"]}]},
            {"level": "None", "nonResourceURLs": ["/healthz*", "/livez*", "/readyz*", "/version"]},
            {"level": "Request", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
            {"level": "Metadata"},
        ],
    }


def admission_config() -> dict:
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [{
            "name": "EventRateLimit",
            "configuration": {
                "apiVersion": "eventratelimit.admission.k8s.io/v1alpha1",
                "kind": "Configuration",
                "limits": [{"type": "Server", "qps": 50, "burst": 100},
                           {"type": "Namespace", "qps": 10, "burst": 50, "cacheSize": 2000}],
            },
        }],
    }


def render_control(inv: Inventory, host: HostSpec, material: Material, etcd_join: str | None = None) -> HostPlan:
    plan = HostPlan(host.name, "control")
    plan.users.append(SystemUser("etcd", ETCD_DATA_DIR))
    for d in (HostDir(K8S_DIR, 0o755), HostDir(PKI_DIR, 0o755), HostDir(f"{PKI_DIR}/etcd", 0o755),
              HostDir("/etc/etcd", 0o755), HostDir(ETCD_PKI_DIR, 0o700, "etcd", "etcd"),
              HostDir(ETCD_DATA_DIR, 0o700, "etcd", "etcd"), HostDir("/var/log/kubernetes", 0o755),
              HostDir(AUDIT_DIR, 0o700)):
        plan.mkdir(d)

    api, cm, sched, etcd = components.units("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
    ca = material.pair(CLUSTER_CA)
    plan.add(HostFile(P["ca.crt"], issue.cert_pem(ca.cert), 0o644, restarts=(api, cm, sched), trust=True))
    # the controller-manager signs kubelet client certificates with the cluster CA
    plan.add(HostFile(P["ca.key"], issue.key_pem(ca.key), 0o600, secret=True, restarts=(cm,)))
    plan.add(HostFile(P["front-proxy-ca.crt"], issue.cert_pem(material.pair(FRONT_PROXY_CA).cert), 0o644,
                      restarts=(api, cm), trust=True))
    etcd_ca = issue.cert_pem(material.pair(ETCD_CA).cert)
    plan.add(HostFile(P["etcd-ca.crt"], etcd_ca, 0o644, restarts=(api,), trust=True))
    plan.add(HostFile(f"{ETCD_PKI_DIR}/ca.crt", etcd_ca, 0o644, "etcd", "etcd", restarts=(etcd,), trust=True))
    plan.add(HostFile(P["sa.key"], issue.key_pem(material.sa_key), 0o600, secret=True, restarts=(api, cm)))
    plan.add(HostFile(P["sa.pub"], issue.public_pem(material.sa_key), 0o644, restarts=(api,)))
    for name in ("apiserver", "apiserver-kubelet-client", "apiserver-etcd-client", "front-proxy-client"):
        _pem_pair(plan, name, name, material, restarts=(api,))
    _pem_pair(plan, "etcd/healthcheck-client", "etcd/healthcheck-client", material)
    _pem_pair(plan, f"etcd/server-{host.name}", f"{ETCD_PKI_DIR}/server", material, owner="etcd", restarts=(etcd,))
    _pem_pair(plan, f"etcd/peer-{host.name}", f"{ETCD_PKI_DIR}/peer", material, owner="etcd", restarts=(etcd,))

    local = LOCAL_API.format(port=inv.spec.apiServer.port)
    ca_pem = issue.cert_pem(ca.cert)
    for conf, cert, user, unit in (("admin.conf", "admin", "kubernetes-admin", ()),
                                   ("controller-manager.conf", "controller-manager",
                                    "system:kube-controller-manager", (cm,)),
                                   ("scheduler.conf", "scheduler", "system:kube-scheduler", (sched,))):
        plan.add(HostFile(f"{K8S_DIR}/{conf}", kubeconfig(inv.metadata.name, local, ca_pem, user,
                                                          client=material.pair(cert)),
                          0o600, secret=True, restarts=unit))

    plan.add(HostFile(f"{K8S_DIR}/encryption-config.yaml", to_yaml(encryption_config(material)), 0o600,
                      secret=True, restarts=(api,)))
    plan.add(HostFile(f"{K8S_DIR}/audit-policy.yaml", to_yaml(audit_policy()), 0o600, restarts=(api,)))
    plan.add(HostFile(f"{K8S_DIR}/admission-config.yaml", to_yaml(admission_config()), 0o600, restarts=(api,)))
    if inv.local_balancer:
        plan.add(HostFile(AUTHN_CONFIG, to_yaml(authentication_config()), 0o600, restarts=(api,)))
    plan.add(HostFile(f"{K8S_DIR}/kube-scheduler.yaml", to_yaml(scheduler_config()), 0o600, restarts=(sched,)))

    for f in etcd_unit_files(inv, host, join=etcd_join):
        plan.add(f)
    plan.add(unit_file(api, "kube-apiserver.service.j2", binary=f"{BIN_DIR}/kube-apiserver",
                       flags=apiserver_flags(inv, host)))
    plan.add(unit_file(cm, "kube-controller-manager.service.j2", binary=f"{BIN_DIR}/kube-controller-manager",
                       flags=controller_manager_flags(inv)))
    plan.add(unit_file(sched, "kube-scheduler.service.j2", binary=f"{BIN_DIR}/kube-scheduler",
                       flags=scheduler_flags()))
    plan.units += [etcd, api, cm, sched]
    add_control_network(plan, inv, host, material)
    render_konnectivity_server(plan, inv, host, material)     # nothing with egress: routes
    return plan

