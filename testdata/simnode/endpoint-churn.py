"""The endpoint controller's churn on a busy cluster (simnode endpoint-churn-start, real parts):
RATE EndpointSlice changes a second through the API server, each moving one endpoint of one
of the COUNT Services of namespace `busy` to another address and back, round robin, on one
kept-alive HTTPS connection (a PATCH, merge-patch+json, as the admin). Writes READY (its pid)
after the first change is accepted, and on each change the total to COUNT_FILE. Exits on
SIGTERM; any refused change is fatal (the test bed says so, never a silent stop)."""
import http.client
import json
import os
import signal
import ssl
import sys
import time

server, ca, cert, key, count, rate, ready, count_file = sys.argv[1:9]
count, rate = int(count), float(rate)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
context = ssl.create_default_context(cafile=ca)
context.load_cert_chain(cert, key)
host, port = server.rsplit(":", 1)
conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=60)
path = "/apis/discovery.k8s.io/v1/namespaces/busy/endpointslices/busy-{}"
changes, start = 0, time.monotonic()
print("endpoint-churn: pid {}, {} Services, {}/s, to {}".format(os.getpid(), count, rate, server), flush=True)
while True:
    i = changes % count
    flip = (changes // count) % 2
    address = "10.245.{}.{}".format(128 + flip * 64 + i // 250, i % 250 + 1)
    body = json.dumps({"endpoints": [
        {"addresses": ["10.245.{}.{}".format(i // 250, i % 250 + 1)], "conditions": {"ready": True}},
        {"addresses": [address], "conditions": {"ready": True}},
    ]})
    conn.request("PATCH", path.format(i), body, {"Content-Type": "application/merge-patch+json"})
    reply = conn.getresponse()
    data = reply.read()
    if reply.status != 200:
        sys.exit("endpoint-churn: PATCH busy-{} answered {}: {}".format(i, reply.status, data[:200]))
    changes += 1
    with open(count_file + ".tmp", "w") as f:
        f.write(str(changes))
    os.replace(count_file + ".tmp", count_file)
    if changes == 1:
        print("endpoint-churn: first change accepted after {:.1f} s".format(time.monotonic() - start), flush=True)
        with open(ready, "w") as f:
            f.write(str(os.getpid()))
    # Pacing a load generator, not synchronisation.
    time.sleep(max(0.0, start + changes / rate - time.monotonic()))
