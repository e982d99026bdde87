"""Pods flooding the link-local forwarder to its bounds (tests/e2e_memory.rs), from the source
addresses ADDRS (comma-separated, each an address of this namespace) to SERVER:53:

* UDP: each of the first UDP_ADDRS addresses sends UDP_RATE queries a second for flood.test on
  a socket of its own (the slow upstream answers none of them), every BIG_EVERY-th of them a
  message of BIG bytes (an EDNS padding option makes it up; the slow upstream answers it with as
  many), and reads the answers;
* TCP: each address holds TCP_CONNS connections. Each sends a BIG-byte query, then a small one
  every second, and never reads: the answers pile up in the forwarder's buffers (the client's
  receive window closes). After HOLD seconds it is closed and another opened in its place (the
  first ones opened at random over HOLD seconds, so that they come and go evenly).

Runs until SIGTERM; then writes a JSON summary to OUT: UDP queries sent and answers received,
TCP connections opened, refused or closed by the forwarder before their time. Prints one line
a second: `udp_answers=N tcp_open=N`."""
import asyncio
import json
import random
import resource
import signal
import socket
import struct
import sys
import time

server, addrs, udp_addrs, udp_rate, big_every, big, tcp_conns, hold, out = sys.argv[1:10]
addrs = addrs.split(",")
udp_addrs, udp_rate, big_every = int(udp_addrs), float(udp_rate), int(big_every)
big, tcp_conns, hold = int(big), int(tcp_conns), float(hold)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

totals = {"udp_sent": 0, "udp_answers": 0, "udp_big_answers": 0, "tcp_opened": 0,
          "tcp_refused": 0, "tcp_cut": 0, "tcp_open": 0}


def query(qid, size=0):
    """A query for flood.test A; with `size`, an EDNS OPT record padding it to `size` bytes."""
    name = b"\x05flood\x04test\x00"
    header = struct.pack(">HHHHHH", qid & 0xFFFF, 0x0100, 1, 0, 0, 1 if size else 0)
    message = header + name + struct.pack(">HH", 1, 1)
    if size:
        pad = max(0, size - len(message) - 11 - 4)
        option = struct.pack(">HH", 12, pad) + bytes(pad)
        message += b"\x00" + struct.pack(">HHIH", 41, 4096, 0, len(option)) + option
    return message


class Client(asyncio.DatagramProtocol):
    def datagram_received(self, data, _):
        totals["udp_answers"] += 1
        if len(data) > 1000:
            totals["udp_big_answers"] += 1


async def udp_client(addr):
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        Client, local_addr=(addr, 0), remote_addr=(server, 53))
    sent, started = 0, time.monotonic()
    while True:
        due = int((time.monotonic() - started) * udp_rate)
        while sent < due:
            sent += 1
            totals["udp_sent"] += 1
            transport.sendto(query(sent, big if sent % big_every == 0 else 0))
        await asyncio.sleep(0.01)


async def tcp_slot(addr):
    n = 0
    # The slots' turns spread over HOLD: connections come and go evenly, not in waves.
    await asyncio.sleep(random.uniform(0, hold))
    while True:
        try:
            reader, writer = await asyncio.open_connection(server, 53, local_addr=(addr, 0))
        except OSError:
            totals["tcp_refused"] += 1
            await asyncio.sleep(1)
            continue
        totals["tcp_opened"] += 1
        totals["tcp_open"] += 1
        # Never read: the answers stay in the forwarder's buffers and this socket's.
        reader._transport.pause_reading()
        until = time.monotonic() + hold
        try:
            message = query(n, big)
            writer.write(len(message).to_bytes(2, "big") + message)
            while time.monotonic() < until:
                await asyncio.sleep(1)
                n += 1
                message = query(n)
                writer.write(len(message).to_bytes(2, "big") + message)
                if writer.is_closing():
                    raise ConnectionError
            writer.transport.abort()
        except (OSError, ConnectionError):
            totals["tcp_cut"] += 1
            writer.transport.abort()
            await asyncio.sleep(1)
        totals["tcp_open"] -= 1


async def main():
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    tasks = [asyncio.ensure_future(udp_client(a)) for a in addrs[:udp_addrs]]
    tasks += [asyncio.ensure_future(tcp_slot(a)) for a in addrs for _ in range(tcp_conns)]
    while not stop.done():
        print(f"udp_answers={totals['udp_answers']} tcp_open={totals['tcp_open']}", flush=True)
        await asyncio.wait([stop], timeout=1)
    for task in tasks:
        task.cancel()
    with open(out, "w") as f:
        json.dump(totals, f)


asyncio.run(main())
