"""etcdctl on a control host: the command line (the health-check client certificate), bounded
retries until members answer, and the membership read. Shared by the etcd phase, the rollouts
and the etcd day-2 commands."""

from __future__ import annotations

import shlex

from installer.core.render.control import client_url, etcd_servers
from installer.host.ssh import HostError, Remote, Result

PKI = "/etc/kubernetes/pki"
ETCDCTL = "/usr/local/bin/etcdctl"     # API v3 is the default since 3.4; 3.6 warns about the variable
LOCAL = client_url("127.0.0.1")


def etcdctl(endpoints: str, timeout: str = "5s") -> str:
    """etcdctl (API v3) with the health-check client certificate."""
    return (f"{ETCDCTL} --endpoints={shlex.quote(endpoints)} "
            f"--cacert={PKI}/etcd/ca.crt --cert={PKI}/etcd/healthcheck-client.crt "
            f"--key={PKI}/etcd/healthcheck-client.key --command-timeout={timeout}")


def _retry(cmd: str, timeout: float) -> str:
    tries = max(1, int(timeout / 2))
    return (f"i=0; while [ $i -lt {tries} ]; do out=$({cmd} 2>&1) && {{ echo \"$out\"; exit 0; }}; "
            f"i=$((i+1)); sleep 2; done; echo \"$out\" >&2; exit 1")


def endpoint_health_script(endpoints: str, timeout: float) -> str:
    """Until every one of ``endpoints`` answers healthy."""
    return _retry(f"{etcdctl(endpoints)} endpoint health", timeout)


def cluster_health_script(inv, timeout: float) -> str:
    """Until every control host's member answers healthy."""
    return endpoint_health_script(etcd_servers(inv), timeout)


def status_script(timeout: float) -> str:
    """Until the local member answers (a learner answers status, not health)."""
    return _retry(f"{etcdctl(LOCAL)} endpoint status", timeout)


def error_line(r: Result) -> str:
    """The line of a failed etcdctl run that says why (its last ``Error:`` line)."""
    lines = [x for x in (r.stderr + "\n" + r.stdout).strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("Error:")]
    return (errors or lines or [f"exit {r.rc}"])[-1]


def member_list(remotes: list[Remote], timeout: str = "5s") -> tuple[Remote | None, str, str]:
    """``etcdctl member list -w json`` asked of the local member on the first of ``remotes``
    whose member answers: (that remote, its output, "") or (None, "", why none did)."""
    why = []
    for remote in remotes:
        try:
            r = remote.run(f"{etcdctl(LOCAL, timeout)} member list -w json", check=False, what="etcd member list")
        except HostError as e:
            why.append(str(e))
            continue
        if r.rc == 0:
            return remote, r.stdout, ""
        why.append(f"{remote.name}: {error_line(r)}")
    return None, "", "; ".join(why)
