"""A measured delay on the namespace cluster: tools/delay_relay.py, a user-space relay between the
hosts' TAP devices (this kernel has no netem), checked against ping and a bulk TCP transfer."""
import statistics
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO))

BULK = """
import socket, sys, time
mode, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 5201)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); got = 0
    while got < nbytes:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.sendall(b"x")
else:
    c = socket.create_connection((addr, 5201)); buf = b"\\0" * (1 << 20); t0 = time.monotonic(); sent = 0
    while sent < nbytes:
        n = min(len(buf), nbytes - sent); c.sendall(buf[:n]); sent += n
    c.recv(1)
    print(sent * 8 / (time.monotonic() - t0))
"""


def relayed(tmp_path, rate, delay):
    from tools.netns_cluster import Cluster, unavailable_reason
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"delay relay: {reason}")
    if subprocess.run(["test", "-c", "/dev/net/tun"]).returncode:
        pytest.skip("delay relay: needs /dev/net/tun (TAP devices)")
    return Cluster.up(tmp_path / "cluster", hosts=2, slots=1, rate=rate, delay=delay)


def rtts_ms(cluster, count=10) -> list[float]:
    out = subprocess.run([*cluster.exec_prefix(0), "ping", "-c", str(count), "-i", "0.2", cluster.addresses[1]],
                         capture_output=True, text=True, check=True).stdout
    return [float(line.split("time=")[1].split()[0]) for line in out.splitlines() if "time=" in line]


def bulk_bits_per_s(cluster, nbytes) -> float:
    server = subprocess.Popen([*cluster.exec_prefix(1), sys.executable, "-c", BULK, "server", cluster.addresses[1],
                               str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = subprocess.run([*cluster.exec_prefix(0), sys.executable, "-c", BULK, "client", cluster.addresses[1],
                             str(nbytes)], capture_output=True, text=True, check=True, timeout=120)
    server.wait(timeout=30)
    return float(client.stdout)


def test_the_relay_delays_by_what_is_set_and_carries_the_set_rate(tmp_path):
    cluster = relayed(tmp_path, "100mbit", "20ms")
    try:
        rtt = rtts_ms(cluster)[1:]                                   # the first waits for ARP besides
        rate = bulk_bits_per_s(cluster, 40_000_000)
    finally:
        cluster.down()
    print(f"20 ms one way, 100 Mbit/s: ping RTT median {statistics.median(rtt):.1f} ms "
          f"(min {min(rtt):.1f}, max {max(rtt):.1f}); bulk TCP {rate / 1e6:.1f} Mbit/s")
    assert statistics.median(rtt) == pytest.approx(40.0, rel=0.10)  # two one-way delays
    assert min(rtt) >= 40.0                                         # never less than the delay
    assert 0.85 * 100e6 <= rate <= 100e6                            # the set rate, less headers and slow start


def test_the_relays_ceiling_without_a_rate(tmp_path):
    """What the relay carries at most on this machine (one Python process, jumbo frames): the
    cells a user-space delay can stand for."""
    cluster = relayed(tmp_path, None, "1ms")
    try:
        rate = bulk_bits_per_s(cluster, 200_000_000)
    finally:
        cluster.down()
    print(f"relay ceiling, 1 ms one way, no rate limit: {rate / 1e6:.0f} Mbit/s")
    assert rate > 100e6                                              # the floor: the 100 Mbit/s cells
