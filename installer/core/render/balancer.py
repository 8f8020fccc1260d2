"""The API balancer every worker runs with ``spec.apiServer.balancer: local`` (HAProxy, a
systemd unit; why HAProxy and how it fails over: docs/ha.md).

It listens on 127.0.0.1:PORT (kubelet, kube-proxy: their kubeconfigs name it) and on
``balancerAddress``:PORT, an address the unit puts on the worker's ``lo``: the kubernetes
Service's endpoints name that address (the apiservers run with ``--endpoint-reconciler-type=
none`` and cluster-bootstrap writes the endpoints), so a pod's connection to the Service is
DNAT-ed by kube-proxy to its own node's balancer. Every control host's apiserver is a server,
checked on ``/readyz`` over TLS (the cluster CA verifies it) every second: down after 2
failures, or at once when a connection to it fails, and then its connections are closed so
that watches move at once; up after 1 success.
TCP is passed through: TLS stays end to end between the client and the apiserver.

When every apiserver is down by its checks, the balancer still tries them all (each is also a
``backup`` server without checks): an apiserver whose /readyz fails or answers late still serves
most requests (reads from its watch cache), and a balancer with no server closes every client's
connection unanswered. What set this (CI of 4c772a4): a hosted tenant's hosting node lost; the
kubelet's reads through the balancer were closed twice while reads straight to the one replica
left all succeeded (that replica marked down on a busy hosting node: docs/ha.md).

A hosted tenant's balancers check ``/readyz`` without its etcd checks (``HOSTED_READYZ``): a
control host's apiserver uses its own etcd member alone, so its etcd checks tell whether that
apiserver can serve; a tenant's replicas' etcd checks fail for reasons they share (an election,
a member roll). When every replica still used every member, with a hosting node lost, the one
replica left answered 500 to 3 of its checks in 10 s (its etcd client's health probe sent to
the lost member): each time it was marked down and its requests in flight were cut (CI of
a2cbb8f). Each replica now uses its own node's member (render/tenant.py, near_service); what a
check with etcd would cost in rolls is not measured yet (docs/hosted.md, "A lost hosting
node"). A replica that cannot reach etcd still leaves: its pod is Ready only while its
/readyz passes with etcd, and its address (``externalTrafficPolicy: Local``) forwards to Ready
replicas only.

A planned apiserver restart does not wait for the checks: the installer first takes that
apiserver out of every balancer (``hiddenplane-api-balancer-ctl leave``: drained, its checks
paused, so nothing cuts the requests it still answers) and puts it back once it is ready
(host/handover.py).
"""

from __future__ import annotations

import ipaddress

from installer.core import components
from installer.core.inventory import HostSpec, Inventory
from installer.core.render.files import BIN_DIR, K8S_DIR, PKI_DIR, HostFile, HostPlan, render_template, unit_file
from installer.core.render.network import IP_BIN

BALANCER_CONFIG = f"{K8S_DIR}/api-balancer.cfg"
ADMIN_SOCKET = "/run/hiddenplane-api-balancer/admin.sock"
# leave/back of one apiserver through the runtime API (units/hiddenplane-api-balancer-ctl.j2)
CTL = f"{BIN_DIR}/hiddenplane-api-balancer-ctl"
SOCAT = f"{BIN_DIR}/socat"
# a leave that no back followed (the run died) undoes itself after this long
LEAVE_EXPIRY_SECONDS = 300
BACKEND = "apiservers"
# the health check: every CHECK_INTERVAL, down after FALL failures (or a check that does not
# answer within CHECK_TIMEOUT), up after RISE successes
CHECK_INTERVAL, CHECK_TIMEOUT, FALL, RISE = "1s", "1s", 2, 1
# after an apiserver turned ready, every balancer has marked it up within RISE checks: a rolling
# restart waits this long before it stops the next one (actions/rollout.py)
SETTLE_SECONDS = 2.0
# how long a reloaded balancer's old process may keep the connections it carried (watches
# never end by themselves): then clients reconnect through the new one
HARD_STOP_AFTER = "30s"


# what a hosted tenant's balancers ask its replicas (the module's docstring says why)
HOSTED_READYZ = "/readyz?exclude=etcd&exclude=etcd-readiness"

# the name of an apiserver's unchecked entry, tried only when every checked one is down
FALLBACK = "-anyway"


def server_lines(backends: list[tuple[str, str, int]]) -> list[str]:
    """``backends`` (name, address, port; Inventory.api_backends) as the backend's servers: each
    checked, then each again as an unchecked backup (the module's docstring says why)."""
    return ([f"    server {name} {_addr(address)}:{port}" for name, address, port in backends]
            + [f"    server {name}{FALLBACK} {_addr(address)}:{port} backup no-check"
               for name, address, port in backends])


def _addr(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def check_path(inv: Inventory) -> str:
    return HOSTED_READYZ if inv.hosted else "/readyz"


def haproxy_config(inv: Inventory) -> str:
    port = inv.spec.apiServer.port
    address = inv.balancer_address
    lines = [
        "# Managed by hiddenplane: changes are overwritten by `installer apply`.",
        "# kube-apiserver on every control host, for this worker's kubelet, kube-proxy and pods.",
        "global",
        "    log stderr format short daemon notice",
        f"    stats socket {ADMIN_SOCKET} mode 600 level admin",
        f"    hard-stop-after {HARD_STOP_AFTER}",
        "    maxconn 4000",
        "",
        "defaults",
        "    mode tcp",
        "    log global",
        "    option dontlognull",
        # a refused or timed-out connect is tried again on another apiserver: clients never see it
        "    retries 3",
        "    option redispatch 1",
        # an apiserver on the same network answers a SYN within milliseconds
        "    timeout connect 1s",
        # watches and exec streams are long: the clients' own keepalives (HTTP/2 pings) end dead ones
        "    timeout client 1h",
        "    timeout server 1h",
        f"    timeout check {CHECK_TIMEOUT}",
        "",
        "frontend apiserver",
        f"    bind 127.0.0.1:{port}",
        # the unit puts the address on lo before it starts haproxy
        f"    bind {_addr(address)}:{port}",
        f"    default_backend {BACKEND}",
        "",
        f"backend {BACKEND}",
        "    balance leastconn",
        # the backups all share the connections, not the first alone: one of them may be lost
        "    option allbackups",
        "    option httpchk",
        f"    http-check send meth GET uri {check_path(inv)} ver HTTP/1.1 hdr Host kubernetes",
        "    http-check expect status 200",
        # checks over TLS, the apiserver's certificate verified against the cluster CA and its
        # name 'kubernetes' (a SAN of every apiserver certificate); the data path stays TCP
        f"    default-server check check-ssl verify required ca-file {PKI_DIR}/ca.crt verifyhost kubernetes "
        f"check-sni kubernetes inter {CHECK_INTERVAL} fall {FALL} rise {RISE} on-marked-down shutdown-sessions "
        # a connection made on an unchecked backup is never closed by a mark-down: it is closed
        # once a checked server is up again, and its client reconnects there (CI of 61f8458: a
        # kubelet's connection made on a backup while a snapshot restore restarted both
        # replicas was still there minutes later; its pods never started, which the restored
        # revision explained since: core/etcd_rules.py, RESTORE_FLAGS)
        "on-marked-up shutdown-backup-sessions "
        # and a connection that fails marks it down at once, before its next checks do (a lost
        # host: the client's connection is retried on another apiserver after timeout connect)
        "observe layer4 error-limit 1 on-error mark-down",
        *server_lines(inv.api_backends),
    ]
    return "\n".join(lines) + "\n"


def ctl_script() -> bytes:
    return render_template("hiddenplane-api-balancer-ctl.j2", path=CTL, socket=ADMIN_SOCKET, backend=BACKEND,
                           socat=SOCAT, expiry=LEAVE_EXPIRY_SECONDS)


def add_balancer(plan: HostPlan, inv: Inventory, host: HostSpec) -> None:
    """The balancer's config and unit on a worker, started before the other worker units."""
    if not inv.local_balancer:
        return
    unit = components.unit("api-balancer")
    address = inv.balancer_address
    plan.add(HostFile(BALANCER_CONFIG, haproxy_config(inv).encode(), 0o644, restarts=(unit,)))
    plan.add(HostFile(CTL, ctl_script(), 0o755))
    plan.add(unit_file(unit, "hiddenplane-api-balancer.service.j2", binary=f"{BIN_DIR}/haproxy",
                       config=BALANCER_CONFIG, ip=IP_BIN, address=address, port=inv.spec.apiServer.port,
                       prefix=ipaddress.ip_address(address).max_prefixlen))
    plan.units.append(unit)
