"""The cluster checks over the whole inventory document (roles, overlaps, address families, files),
read from the raw data defensively so that a bad field elsewhere never hides them."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path
from typing import Any

from installer.core.inventory_fields import DNS1123_LABEL, HIDDEN_MSG, MAX_PATH, apiserver_san_values, as_ip, quoted
from installer.core.inventory_hosted import hosted_problems, hosted_san_values, is_hosted
from installer.core.inventory_model import NetworkSpec, SSHSpec, default_balancer_address
from installer.core.network import capacity, slice_prefix


def _get(data: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(k, int):
            if not isinstance(data, list) or k >= len(data):
                return None
            data = data[k]
        else:
            if not isinstance(data, dict):
                return None
            data = data.get(k)
    return data


def _as_net(v: Any):
    try:
        return ipaddress.ip_network(v, strict=True) if isinstance(v, str) else None
    except ValueError:
        return None


def _network_problems(data: dict, hosts: list) -> list[str]:
    out: list[str] = []
    defaults = NetworkSpec()
    net = _get(data, "spec", "network") or {}
    raw = {k: (net.get(k) if isinstance(net, dict) and k in net else getattr(defaults, k))
           for k in ("podCIDR", "serviceCIDR", "clusterDNS")}
    pod, svc, dns = _as_net(raw["podCIDR"]), _as_net(raw["serviceCIDR"]), as_ip(raw["clusterDNS"])
    endpoint = as_ip(_get(data, "spec", "apiServer", "endpoint"))

    if pod and svc:
        if pod.version != svc.version:
            out.append(f"spec.network.podCIDR: {pod} is IPv{pod.version} but serviceCIDR {svc} is "
                       f"IPv{svc.version}; dual-stack is not supported yet")
        elif pod.overlaps(svc):
            out.append(f"spec.network.serviceCIDR: {svc} overlaps spec.network.podCIDR {pod}")
    if svc:
        limit = 12 if svc.version == 4 else 108
        if svc.prefixlen < limit:
            out.append(f"spec.network.serviceCIDR: {svc} is too large; kube-apiserver accepts at "
                       f"most /{limit} for IPv{svc.version}")
    if svc and dns:
        if dns.version != svc.version or dns not in svc:
            out.append(f"spec.network.clusterDNS: '{dns}' is outside spec.network.serviceCIDR {svc}")
        elif svc.num_addresses > 1 and dns == svc[1]:     # a /32 or /128 has no second address
            out.append(f"spec.network.clusterDNS: '{dns}' is the first address of the service CIDR, "
                       "which the kubernetes Service takes; pick another (for example the tenth)")
    if svc and endpoint and endpoint.version != svc.version:
        out.append(f"spec.apiServer.endpoint: '{endpoint}' is IPv{endpoint.version} but "
                   f"spec.network.serviceCIDR {svc} is IPv{svc.version}")
    out += _pod_slice_problems(net if isinstance(net, dict) else {}, pod, hosts)
    for label, n in (("podCIDR", pod), ("serviceCIDR", svc)):
        if not n:
            continue
        for i, h in enumerate(hosts):
            ip = _comparable(as_ip(_get(h, "address")))     # ::ffff:10.244.0.5 is in 10.244.0.0/16
            if ip and ip.version == n.version and ip in n:
                out.append(f"spec.hosts[{i}].address: '{ip}' lies inside spec.network.{label} {n}")
        if endpoint and endpoint.version == n.version and endpoint in n:
            out.append(f"spec.apiServer.endpoint: '{endpoint}' lies inside spec.network.{label} {n}")
    out += _balancer_problems(data, hosts, pod, svc)
    if isinstance(net, dict) and net.get("cni") == "cilium" and net.get("policy") not in (None, "none"):
        out.append(f"spec.network.policy: {quoted(str(net.get('policy')))} is for cni: routes; Cilium "
                   "enforces NetworkPolicy itself: leave policy out (none)")
    if isinstance(net, dict) and net.get("cni") == "cilium" and net.get("egress") == "routes":
        # Cilium's pod network is not routed from hosts that are not nodes
        out.append("spec.network.egress: 'routes' needs cni: routes; with cni: cilium the control hosts "
                   "cannot route to pods: use egress: konnectivity (the default with cilium)")
    cil = net.get("cilium") if isinstance(net, dict) else None
    if isinstance(cil, dict) and (cil.get("routingMode", "tunnel") != "tunnel" or cil.get("values")) \
            and net.get("cni") != "cilium":
        # (the defaults alone are what a dumped inventory holds: not a choice)
        out.append("spec.network.cilium: set, but spec.network.cni is not cilium: remove it or set cni: cilium")
    return out


def _balancer_problems(data: dict, hosts: list, pod, svc) -> list[str]:
    """spec.apiServer.balancerAddress, checked whatever the balancer mode (a switch later must not
    meet a bad address): the kubernetes Service's endpoints name it, and the Endpoints API refuses
    loopback, link-local, multicast and unspecified addresses; every worker holds it on lo, so a
    host or a cluster network using it would become unreachable from the workers."""
    raw = _get(data, "spec", "apiServer", "balancerAddress")
    if raw is None:
        raw = default_balancer_address(svc if svc else "")
    ip = as_ip(raw)
    if ip is None:
        return []        # the field check reports it
    where = "spec.apiServer.balancerAddress"
    value = quoted(str(raw))
    c = _comparable(ip)
    if c.is_loopback or c.is_link_local or c.is_multicast or c.is_unspecified:
        return [f"{where}: {value} is a loopback, link-local, multicast or unspecified address, which the "
                "kubernetes Service's endpoints cannot name; pick a private address no network here uses"]
    out = []
    if svc and c.version != svc.version:
        out.append(f"{where}: {value} is IPv{c.version} but spec.network.serviceCIDR {svc} is IPv{svc.version}")
    for label, n in (("podCIDR", pod), ("serviceCIDR", svc)):
        if n and c.version == n.version and c in n:
            out.append(f"{where}: {value} lies inside spec.network.{label} {n}")
    for i, h in enumerate(hosts):
        if isinstance(h, dict) and _comparable(as_ip(h.get("address"))) == c:
            out.append(f"{where}: {value} is the address of spec.hosts[{i}]: every worker holds the balancer "
                       "address, and would no longer reach that host")
    endpoint = as_ip(_get(data, "spec", "apiServer", "endpoint"))
    if endpoint is not None and _comparable(endpoint) == c:
        out.append(f"{where}: {value} is spec.apiServer.endpoint; the balancer address is every worker's own")
    return out


def _pod_slice_problems(net: dict, pod, hosts: list) -> list[str]:
    """Every worker needs its own slice of podCIDR (see installer/core/network.py): its CNI config
    and routes with cni: routes, its Node.spec.podCIDR with either CNI."""
    mask = net.get("nodeCIDRMaskSize", NetworkSpec().nodeCIDRMaskSize)
    if not pod or not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask <= pod.max_prefixlen:
        return []       # the field check reports it (and 2 ** (2 ** 64 - 16) slices would never be counted)
    if pod.version == 4 and mask < pod.prefixlen:
        return [f"spec.network.nodeCIDRMaskSize: /{mask} is larger than spec.network.podCIDR {pod}; "
                f"each worker's slice must fit inside it (use {pod.prefixlen} or more)"]
    workers = sum(1 for h in hosts if isinstance(h, dict) and h.get("role") == "worker")
    room = capacity(pod, mask)
    if workers > room:
        return [f"spec.network.podCIDR: {pod} has room for {room} worker(s) at /{slice_prefix(pod, mask)} "
                f"(nodeCIDRMaskSize) but the inventory has {workers}; use a larger podCIDR or a longer "
                "nodeCIDRMaskSize"]
    return []


def _name_of(h: dict) -> str:
    name = h.get("name")
    if not isinstance(name, str):
        return ""
    return f" of {name if DNS1123_LABEL.fullmatch(name) else quoted(name)}"


def _duplicate(hosts: list, i: int, j: int, field: str, value: str) -> str:
    if (hosts[i].get("role"), hosts[j].get("role")) in (("control", "worker"), ("worker", "control")):
        return f"spec.hosts[{i}].{field}: {quoted(value)} is listed as both control and worker: {HIDDEN_MSG}"
    if field == "address":
        raw = hosts[i].get("address")
        same = "" if as_ip(raw) == as_ip(hosts[j].get("address")) else f", written as {quoted(raw)}"
        return (f"spec.hosts[{i}].address: {quoted(value)}{_name_of(hosts[i])} duplicates "
                f"spec.hosts[{j}].address{_name_of(hosts[j])}{same}")
    return f"spec.hosts[{i}].{field}: {quoted(value)} duplicates spec.hosts[{j}].{field}"


def _comparable(ip):
    """The address a socket would reach: ::ffff:10.0.0.1 is 10.0.0.1."""
    return getattr(ip, "ipv4_mapped", None) or ip


# one etcd member per control host; more than 5 makes every write wait for more members (docs/inventory.md)
CONTROL_COUNTS = (1, 3, 5)
EVEN_CONTROL_COUNTS = (2, 4)      # only while replacing a control host


def _host_problems(hosts: list, allow_even: bool = False, hosted: bool = False) -> list[str]:
    out: list[str] = []
    seen: dict[tuple[str, str], int] = {}     # (field, value) -> first index
    roles = {"control": 0, "worker": 0}
    loopback: list[int] = []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict):
            continue
        if isinstance(h.get("role"), str) and h["role"] in roles:    # a mapping or list is unhashable
            roles[h["role"]] += 1
        ip = as_ip(h.get("address"))
        keys = [("name", h["name"])] if isinstance(h.get("name"), str) else []
        keys += [("address", str(_comparable(ip)))] if ip is not None else []
        if ip is not None and _comparable(ip).is_loopback:
            loopback.append(i)
        for key in keys:
            if key in seen:
                out.append(_duplicate(hosts, i, seen[key], *key))
            else:
                seen[key] = i
    if not hosts:
        out.append("spec.hosts: no hosts; a cluster needs " + ("at least one worker" if hosted else
                                                              "at least one control host and one worker"))
        return out
    addressed = sum(1 for h in hosts if isinstance(h, dict) and as_ip(h.get("address")) is not None)
    if loopback and len(loopback) < addressed:
        # loopback is this machine: fine when every host is on it (a one-machine test), a typo otherwise
        for i in loopback:
            out.append(f"spec.hosts[{i}].address: {quoted(hosts[i]['address'])} is a loopback address: from the "
                       "other hosts it names themselves, not this one; loopback is only allowed when every "
                       "host is on it")
    count = roles["control"]
    if hosted:
        count = 1         # hosted_problems names every control host; etcd's members are pods
    allowed = CONTROL_COUNTS + (EVEN_CONTROL_COUNTS if allow_even else ())
    if count == 0:
        out.append("spec.hosts: no host has role control; the control plane needs one (or 3, 5)")
    elif count in EVEN_CONTROL_COUNTS and not allow_even:
        out.append(f"spec.hosts: {count} control hosts; each runs an etcd member and an "
                   "even count adds no fault tolerance: use 1, 3 or 5 (while replacing a control host, "
                   "set spec.allowEvenControlHosts: true)")
    elif count not in allowed:
        out.append(f"spec.hosts: {count} control hosts; each runs an etcd member and every write waits for "
                   "a majority of them: use 1, 3 or 5" + (" (2 or 4 while replacing one)" if allow_even else ""))
    if roles["worker"] == 0:
        out.append("spec.hosts: no host has role worker; workloads need at least one worker "
                   "(control hosts never run pods)")
    return out


def _artifact_problems(data: dict, base_dir: Path) -> list[str]:
    art = _get(data, "spec", "artifacts")
    if not isinstance(art, dict) or art.get("source") != "dir":
        return []
    path = art.get("path")
    if not isinstance(path, str) or not path:
        return ["spec.artifacts.path: required when spec.artifacts.source is 'dir'"]
    resolved = _resolve(base_dir, path)
    if resolved is None:
        return []        # the field check says what is wrong with it
    if not resolved.is_dir():
        return [f"spec.artifacts.path: {quoted(path)} is not a directory (resolved to {quoted(str(resolved))})"]
    return []


def _resolve(base_dir: Path, path: Any) -> Path | None:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\x00" in path:
        return None
    try:
        return (base_dir / Path(path).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError):   # e.g. ~nosuchuser, a symlink loop
        return None


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _ssh_file_problems(data: dict, hosts: list, base_dir: Path) -> list[str]:
    """A key or known_hosts path that exists but is no regular file fails only at connect time,
    host by host; say it now. A missing file stays legal here: the key's absence is reported at
    connect time, and a missing known_hosts is created by --accept-new-host-keys."""
    ssh = _get(data, "spec", "ssh")
    ssh = ssh if isinstance(ssh, dict) else {}
    defaults = SSHSpec.model_fields
    fields = [(f"spec.ssh.{k}", ssh[k] if k in ssh else defaults[k].default) for k in ("keyPath", "knownHosts")]
    fields.append(("spec.ssh.bastion.keyPath", _get(ssh, "bastion", "keyPath")))
    for i, h in enumerate(hosts):
        for k in ("keyPath", "knownHosts"):
            fields.append((f"spec.hosts[{i}].ssh.{k}", _get(h, "ssh", k)))
        fields.append((f"spec.hosts[{i}].ssh.bastion.keyPath", _get(h, "ssh", "bastion", "keyPath")))
    out = []
    for field, value in fields:
        resolved = _resolve(base_dir, value)
        if resolved is None:
            continue
        try:
            mode = os.stat(resolved).st_mode
        except OSError:
            continue
        kind = next((name for test, name in _FILE_KINDS if test(mode)), None)
        if kind is not None:
            what = "a private key" if field.endswith("keyPath") else "a known_hosts file"
            out.append(f"{field}: {quoted(value)} is {kind}, not a regular file; it must be {what}")
    return out


def cluster_problems(data: dict, base_dir: Path) -> list[str]:
    hosts = _get(data, "spec", "hosts")
    hosts = hosts if isinstance(hosts, list) else []
    allow_even = _get(data, "spec", "allowEvenControlHosts") is True
    return (_host_problems(hosts, allow_even, is_hosted(data)) + hosted_problems(data, hosts, base_dir)
            + _network_problems(data, hosts)
            + _endpoint_problems(data, hosts) + _api_name_problems(data, hosts)
            + _artifact_problems(data, base_dir) + _ssh_file_problems(data, hosts, base_dir))


def _endpoint_problems(data: dict, hosts: list) -> list[str]:
    endpoint = as_ip(_get(data, "spec", "apiServer", "endpoint"))
    if endpoint is None or not _comparable(endpoint).is_loopback:
        return []
    addresses = [as_ip(h.get("address")) for h in hosts if isinstance(h, dict)]
    if all(a is not None and _comparable(a).is_loopback for a in addresses):
        return []
    return [f"spec.apiServer.endpoint: '{endpoint}' is a loopback address: kubelets on the workers would "
            "reach themselves, not the API; use a control host's address, a VIP or a load balancer"]


def _api_name_problems(data: dict, hosts: list) -> list[str]:
    """A worker named or addressed like the API: its kubelet serving certificate (cluster CA, its
    name and address as SANs) would then name the API too, and root on that worker could pass
    as the apiserver to every client that trusts the cluster CA (kubelets, kube-proxies, pods
    through the service-account CA bundle). Refused: the names and addresses of the apiserver's
    certificate (inventory_fields.apiserver_san_values, the list pki/specs.py issues it with),
    and the first label of each of its DNS names (``api`` of ``api.example.com``: resolved
    through a search domain, the short name reaches the API, and only the worker's certificate
    would match it). Not repeated here: the service IP
    (the serviceCIDR rule refuses it), the control hosts' names and addresses, which are also
    the etcd members' (the duplicate rule), and loopback (refused unless every host is on it,
    and then they are one machine)."""
    api = _get(data, "spec", "apiServer")
    api = api if isinstance(api, dict) else {}
    domain = _get(data, "spec", "network", "clusterDomain")
    endpoint = api.get("endpoint")
    extra = api.get("extraSANs") if isinstance(api.get("extraSANs"), list) else []
    values = apiserver_san_values(domain if isinstance(domain, str) else NetworkSpec().clusterDomain, None,
                                  endpoint if isinstance(endpoint, str) else None,
                                  [v for v in extra if isinstance(v, str)], [])
    fields = {v: f"spec.apiServer.extraSANs[{k}]" for k, v in enumerate(extra) if isinstance(v, str)}
    if is_hosted(data):
        hosted = _get(data, "spec", "controlPlane", "hosted")
        name = _get(data, "metadata", "name")
        hosted_values = hosted_san_values(name if isinstance(name, str) else "", hosted)
        values += hosted_values
        fields.update({v: "spec.controlPlane.hosted.expose.addresses" for v in hosted_values})
    if isinstance(endpoint, str):
        fields[endpoint] = "spec.apiServer.endpoint"
    names: dict[str, str] = {}        # a name a worker may not have -> the API name it comes from
    addresses: dict[Any, str] = {}    # an address a worker may not have -> the field naming it
    for v in values:
        ip = as_ip(v)
        if ip is not None:
            addresses.setdefault(_comparable(ip), f"{fields.get(v, 'the apiserver certificate')} {quoted(v)}")
        else:
            names.setdefault(v.lower(), v)
            names.setdefault(v.lower().split(".")[0], v)
    out = []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or h.get("role") != "worker":
            continue
        name = h.get("name")
        if isinstance(name, str) and name.lower() in names:
            source = names[name.lower()]
            of = "" if source.lower() == name.lower() else f" (the first label of {quoted(source)})"
            out.append(f"spec.hosts[{i}].name: {quoted(name)} is a name of the API{of}: this worker's serving "
                       "certificate (signed by the cluster CA) would name the API too, so root on it could pass "
                       "as the apiserver; rename the worker")
        ip = as_ip(h.get("address"))
        if ip is not None and not _comparable(ip).is_loopback and _comparable(ip) in addresses:
            out.append(f"spec.hosts[{i}].address: {quoted(h['address'])} is an address of the API "
                       f"({addresses[_comparable(ip)]}): this worker's serving certificate (signed by the cluster "
                       "CA) would name it too, so root on it could pass as the apiserver; give the API another "
                       "address")
    return out
