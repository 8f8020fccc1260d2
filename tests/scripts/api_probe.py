"""A request probe for a lab host (test scaffolding, copied to a host and run with its python3):
GET ``URL`` every ``INTERVAL`` seconds, each on a new connection with a ``TIMEOUT``; for https
the server's certificate is verified against ``CA`` (``-`` for plain http), and with ``CERT`` (a
PEM file holding a certificate and its key, read again for each request: the kubelet rotates
its own) the request is made as that client. One line per request to stdout:
``<unix time> ok|fail <seconds> <detail>``. Runs until killed.

    python3 api_probe.py URL CA [INTERVAL] [TIMEOUT] [CERT]
"""

import ssl
import sys
import time
import urllib.request

url, ca = sys.argv[1], sys.argv[2]
interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
cert = sys.argv[5] if len(sys.argv) > 5 else None
while True:
    start = time.time()
    try:
        # the chain and the address (127.0.0.1 and the kubernetes Service's IP are SANs) are checked
        context = ssl.create_default_context(cafile=ca) if ca != "-" else None
        if cert:
            context.load_cert_chain(cert)
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            r.read()
            line = f"{start:.3f} ok {time.time() - start:.3f} {r.status}"
    except Exception as e:  # noqa: BLE001 - every failure is a line
        line = f"{start:.3f} fail {time.time() - start:.3f} {type(e).__name__}: {str(e)[:120]}"
    print(line, flush=True)
    time.sleep(max(0.0, interval - (time.time() - start)))
