"""A slow upstream for the link-local forwarder at its bounds (tests/e2e_memory.rs): answers a
query, over UDP and TCP, DELAY seconds after it came in: a plain query as the simulated node's
CoreDNS does, a large one (with padding) with itself marked as an answer (same id and
question, so the forwarder takes it, and as large as the query); a small query for flood.test
never (too slow for it: the forwarder holds it until its own timeout). Binds ADDR:53, UDP and TCP (any number
of connections, each kept open until its client closes it); writes READY (its pid) once both
listen. Exits on SIGTERM."""
import asyncio
import collections
import ipaddress
import os
import resource
import signal
import socket
import sys
import time

addr, delay, ready = sys.argv[1], float(sys.argv[2]), sys.argv[3]
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# What the simulated node's CoreDNS answers (testdata/simnode/common.sh).
COREDNS_A = ipaddress.ip_address("2.2.2.2").packed
COREDNS_AAAA = ipaddress.ip_address("fd00::2:2:2:2").packed


def answer(query):
    """A query of at most 512 bytes answered as the simulated node's CoreDNS answers (2.2.2.2,
    or fd00::2:2:2:2 for AAAA); a larger one (padded) as its own answer. None for a datagram too short to be a
    DNS message."""
    if len(query) < 12:
        return None
    if len(query) <= 512 and query[12:18] == b"\x05flood":
        return None
    flags = bytes([query[2] | 0x80, query[3] | 0x80])
    if len(query) > 512:
        return query[:2] + flags + query[4:]
    # The question ends 4 bytes after the name's last (empty) label; what follows (an EDNS
    # record) is dropped.
    end = query.index(b"\x00", 12) + 5
    if query[end - 4 : end - 2] == b"\x00\x1c":  # AAAA
        record = b"\xc0\x0c\x00\x1c\x00\x01\x00\x00\x00\x05\x00\x10" + COREDNS_AAAA
    else:
        record = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04" + COREDNS_A
    return query[:2] + flags + query[4:6] + b"\x00\x01\x00\x00\x00\x00" + query[12:end] + record


class Udp(asyncio.DatagramProtocol):
    """Answers wait in arrival order (every one waits as long), sent by one task as they fall
    due: no timer per query."""

    def __init__(self):
        self.waiting = collections.deque()

    def connection_made(self, transport):
        self.transport = transport
        asyncio.ensure_future(self.send_due())

    def datagram_received(self, data, peer):
        reply = answer(data)
        if reply is not None:
            self.waiting.append((time.monotonic() + delay, reply, peer))

    async def send_due(self):
        while True:
            now = time.monotonic()
            while self.waiting and self.waiting[0][0] <= now:
                _, reply, peer = self.waiting.popleft()
                self.transport.sendto(reply, peer)
            await asyncio.sleep(0.005)


async def tcp(reader, writer):
    async def later(reply):
        await asyncio.sleep(delay)
        if not writer.is_closing():
            writer.write(len(reply).to_bytes(2, "big") + reply)

    pending = set()
    try:
        while True:
            length = int.from_bytes(await reader.readexactly(2), "big")
            reply = answer(await reader.readexactly(length))
            if reply is not None:
                task = asyncio.ensure_future(later(reply))
                pending.add(task)
                task.add_done_callback(pending.discard)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    writer.close()


async def main():
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    transport, _ = await loop.create_datagram_endpoint(Udp, local_addr=(addr, 53))
    # Room for the flood's 60,000-byte queries while this (slow) process is busy: what drops
    # here is lost to the test, not to the forwarder.
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE
    server = await asyncio.start_server(tcp, addr, 53, backlog=4096)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    await stop
    server.close()


asyncio.run(main())
