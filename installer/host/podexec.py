"""A command in a container of a hosting cluster's pod, as ``kubectl exec`` runs it: the pod's
``exec`` subresource over a WebSocket, stdin sent and closed, stdout and stderr kept as bytes,
the exit code from the error channel.

What a hosted tenant's etcd day 2 needs (engine/planes/etcd_pods.py): etcdctl beside a member, a
snapshot read out of a pod and written into one. The hosting user needs ``create`` on
``pods/exec`` in the tenant's namespace (docs/hosted.md).

Protocol ``v5.channel.k8s.io`` (Kubernetes 1.30 on): every message is binary, its first byte the
channel (0 stdin, 1 stdout, 2 stderr, 3 the final Status, 255 a close of the channel in the next
byte). v5 is the first version that can close stdin, which ``cat > file`` needs to end. The
TLS of the connection is the hosting client's own (``ApiClient.stream_context``): the server
verified against the kubeconfig's CA and the name, its client certificate or token.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import quote, urlencode, urlsplit

from installer.core.errors import InstallerError
from installer.host.kube import ApiClient

PROTOCOL = "v5.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
CHUNK = 256 * 1024


class ExecError(InstallerError):
    """The command could not be run in the pod (not its exit code: ExecResult says that)."""


@dataclass
class ExecResult:
    rc: int
    stdout: bytes
    stderr: bytes


def exit_code(status: dict) -> int:
    """The exit code in the error channel's Status: 0 on Success; a NonZeroExitCode's cause
    ExitCode; an ExecError for any other failure (no such container, the runtime refused)."""
    if status.get("status") == "Success":
        return 0
    if status.get("reason") == "NonZeroExitCode":
        for cause in (status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                try:
                    return int(cause.get("message", ""))
                except ValueError:
                    break
    raise ExecError(f"exec failed: {status.get('message') or status}")


def exec_url(api: ApiClient, namespace: str, pod: str, container: str, argv: list[str], stdin: bool) -> str:
    query = [("container", container), ("stdout", "true"), ("stderr", "true"), ("stdin", "true" if stdin else "false")]
    query += [("command", a) for a in argv]
    path = quote(f"/api/v1/namespaces/{namespace}/pods/{pod}/exec", safe="/")
    return "wss://" + api.host.removeprefix("https://") + path + "?" + urlencode(query)


def _server_socket(api: ApiClient, timeout: float):
    """A TLS connection to the API server of ``api`` (its stream context: its CA, its client
    certificate, the name checked), nothing else in between."""
    url = urlsplit(api.host)
    raw = socket.create_connection((url.hostname, url.port or 443), timeout=timeout)
    try:
        return api.stream_context.wrap_socket(raw, server_hostname=api.tls_server_name or url.hostname)
    except BaseException:
        raw.close()
        raise


def pod_exec(api: ApiClient, namespace: str, pod: str, container: str, argv: list[str],
             stdin: bytes | None = None, timeout: float = 300.0) -> ExecResult:
    """Run ``argv`` (no shell unless it names one) in ``container`` of ``pod``; ``stdin`` sent
    then closed. Raises ExecError when the pod cannot be reached or the command not started;
    the command's own failure is its ``rc``."""
    import websocket  # lazy: only hosted tenants' etcd day 2 needs it

    if api.stream_context is None:
        raise ExecError("this API client cannot open streams")
    where = f"pod {namespace}/{pod} ({container})"
    try:
        # the connection is made here, to the API server only: the WebSocket library would take a
        # proxy from https_proxy and follow a redirect (3 by default) with the bearer token, to
        # any URL, ws:// too; the REST client does neither
        ws = websocket.create_connection(
            exec_url(api, namespace, pod, container, argv, stdin is not None),
            subprotocols=[PROTOCOL], header=[f"{k}: {v}" for k, v in api.headers.items()],
            socket=_server_socket(api, timeout), redirect_limit=0, timeout=timeout, enable_multithread=False)
    except websocket.WebSocketBadStatusException as e:
        body = e.resp_body.decode(errors="replace") if isinstance(e.resp_body, bytes) else str(e.resp_body or "")
        try:
            body = json.loads(body).get("message", body)
        except ValueError:
            pass
        raise ExecError(f"exec in {where}: {e.status_code} {body}"[:500]) from None
    except (OSError, websocket.WebSocketException) as e:
        if "Redirect" in str(e):
            raise ExecError(f"exec in {where}: the API answered with a redirect, which is not followed") from None
        raise ExecError(f"exec in {where}: cannot connect: {e}") from None
    out, err, status = bytearray(), bytearray(), None
    deadline = time.monotonic() + timeout
    try:
        if ws.subprotocol != PROTOCOL:
            raise ExecError(f"exec in {where}: the API speaks {ws.subprotocol or 'no'} stream protocol, not "
                            f"{PROTOCOL} (Kubernetes 1.30 or newer is needed)")
        if stdin is not None:
            for i in range(0, len(stdin), CHUNK):
                ws.send_binary(bytes([STDIN]) + stdin[i:i + CHUNK])
            ws.send_binary(bytes([CLOSE, STDIN]))
        while status is None:
            if time.monotonic() > deadline:
                raise ExecError(f"exec in {where}: no end after {timeout:.0f} s")
            opcode, data = ws.recv_data(control_frame=False)
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                break
            if not data:
                continue
            channel, payload = data[0], data[1:]
            if channel == STDOUT:
                out += payload
            elif channel == STDERR:
                err += payload
            elif channel == ERROR:
                status = json.loads(payload.decode() or "{}")
    except (OSError, websocket.WebSocketException) as e:
        raise ExecError(f"exec in {where}: the stream broke: {e}") from None
    finally:
        ws.close()
    if status is None:
        raise ExecError(f"exec in {where}: the stream ended without an exit status")
    return ExecResult(exit_code(status), bytes(out), bytes(err))
