"""Links with a measured delay for the namespace test cluster, in user space.

The kernel here has no netem (`tc qdisc ... netem`: unknown qdisc; only tbf and htb), so a link's
delay cannot be added by a qdisc. Instead each host's eth0 is a TAP device whose other end is
this relay, a switch in one process: it reads every Ethernet frame a host sends and delivers it
to the host it is addressed to (by the destination MAC it has learnt; a broadcast to every
other host) once the frame has left the sender's link at the set rate (a FIFO, like tbf on the
sender's eth0, dropping what would wait longer than `queue_ms`) and then the set one-way delay
has passed. Frames between two hosts keep their order. A round trip is two delays.

    ip netns exec SWITCH python tools/delay_relay.py --netns NS1,NS2 --addresses 10.0.0.1,10.0.0.2 \\
        --rate 100mbit --delay 20ms --ready FILE

tools/netns_cluster.py starts it (`Cluster.up(..., delay=...)`) in the cluster's switch
namespace, where `down` ends it with everything else. The MTU is 9000 (jumbo frames): the relay
handles a frame at a time in Python, and at 1500 bytes it would spend 6x as many reads and writes
for the same throughput; delay and rate do not depend on it. Its ceiling on this machine is
measured and printed by tests/test_delay_relay.py.
"""
from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import re
import selectors
import struct
import subprocess
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
BROADCAST_BIT = 0x01  # the first octet's low bit: a group (broadcast or multicast) address


def parse_rate(text: str) -> float:
    """'100mbit', '1gbit', '500kbit' → bits per second."""
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", text.strip().lower())
    if not m:
        raise ValueError(f"rate {text!r}: give e.g. 100mbit or 1gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_delay(text: str) -> float:
    """'20ms', '0.5ms', '1s' → seconds."""
    m = re.fullmatch(r"([\d.]+)\s*(ms|us|s)", text.strip().lower())
    if not m:
        raise ValueError(f"delay {text!r}: give e.g. 20ms")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def plug(tap: str, netns: str, address: str, mtu: int) -> None:
    """Move the TAP into the host's namespace as its eth0, addressed and up."""
    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True)
    ip("link", "set", "dev", tap, "netns", netns)
    ip("-n", netns, "link", "set", "dev", tap, "name", "eth0")
    ip("-n", netns, "link", "set", "dev", "eth0", "mtu", str(mtu))
    ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
    ip("-n", netns, "link", "set", "dev", "eth0", "up")
    ip("-n", netns, "link", "set", "dev", "lo", "up")


class Relay:
    def __init__(self, fds: list[int], rate_bps: float | None, delay_s: float, queue_s: float):
        self.fds, self.rate, self.delay, self.queue_s = fds, rate_bps, delay_s, queue_s
        self.port_of: dict[bytes, int] = {}      # MAC → host index, learnt from the frames' sources
        self.link_free = [0.0] * len(fds)        # when each host's link has sent what it holds
        self.pending: list[tuple[float, int, int, bytes]] = []  # (due, sequence, host, frame)
        self.sequence = 0
        self.dropped = 0

    def take(self, src: int, frame: bytes, now: float) -> None:
        self.port_of[frame[6:12]] = src
        if self.rate:
            start = max(now, self.link_free[src])
            if start - now > self.queue_s:       # a full queue drops, as tbf's latency limit does
                self.dropped += 1
                return
            self.link_free[src] = start + len(frame) * 8 / self.rate
            sent = self.link_free[src]
        else:
            sent = now
        dst = self.port_of.get(frame[0:6])
        targets = [dst] if dst is not None and not frame[0] & BROADCAST_BIT else \
            [i for i in range(len(self.fds)) if i != src]
        for target in targets:
            self.sequence += 1
            heapq.heappush(self.pending, (sent + self.delay, self.sequence, target, frame))

    def deliver_due(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, _, target, frame = heapq.heappop(self.pending)
            try:
                os.write(self.fds[target], frame)
            except (BlockingIOError, OSError):
                self.dropped += 1                # the host's queue is full, or its device is gone

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        for i, fd in enumerate(self.fds):
            selector.register(fd, selectors.EVENT_READ, i)
        while True:
            now = time.monotonic()
            self.deliver_due(now)
            timeout = max(0.0, self.pending[0][0] - time.monotonic()) if self.pending else None
            for key, _ in selector.select(timeout):
                while True:                      # drain: several frames may be waiting
                    try:
                        frame = os.read(key.fd, 65536)
                    except BlockingIOError:
                        break
                    self.take(key.data, frame, time.monotonic())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--netns", required=True, help="the hosts' namespaces, comma-separated")
    p.add_argument("--addresses", required=True, help="their eth0 addresses, comma-separated")
    p.add_argument("--rate", help="each host's link rate, e.g. 100mbit (default: unlimited)")
    p.add_argument("--delay", default="0ms", help="one-way delay from each host, e.g. 20ms")
    p.add_argument("--queue-ms", type=float, default=50.0, help="the longest a frame waits for its link")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--ready", type=Path, help="written once every host's eth0 is up")
    args = p.parse_args()
    namespaces, addresses = args.netns.split(","), args.addresses.split(",")
    fds = []
    for i, (ns, address) in enumerate(zip(namespaces, addresses)):
        tap = f"relaytap{os.getpid() % 10000}x{i}"[:15]
        fds.append(open_tap(tap))
        plug(tap, ns, address, args.mtu)
    if args.ready:
        args.ready.write_text(f"{os.getpid()}\n")
    Relay(fds, parse_rate(args.rate) if args.rate else None, parse_delay(args.delay), args.queue_ms / 1e3).run()


if __name__ == "__main__":
    main()
