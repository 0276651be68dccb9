"""The emulated link between two namespaces (tests/netns.py) that the multi-node tests and the
slow-link benchmarks run over: its rate limit, and the delay the delay line
(tests/delay_line.py) adds each way. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import json
import sys

import pytest
from launched import output_or_kill
from netns import available, two_namespaces

pytestmark = pytest.mark.skipif(
    not available(), reason="needs root and iproute2 (ip, tc) to make network namespaces"
)

PORT, MEGABYTES, ROUND_TRIPS = 5999, 10, 50

# the receiving node: echoes ROUND_TRIPS single bytes, then takes the bulk and acknowledges it
RECEIVER = f"""
import socket, sys
server = socket.create_server((sys.argv[1], {PORT}))
peer, _ = server.accept()
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range({ROUND_TRIPS}):
    peer.sendall(peer.recv(1))
left = {MEGABYTES} << 20
while left:
    left -= len(peer.recv(min(left, 1 << 20)))
peer.sendall(b"k")
"""

# the sending node: the median round trip of one byte, and the rate of the bulk, as JSON
SENDER = f"""
import json, socket, sys, time
for _ in range(100):  # the receiver's node may still be starting
    try:
        peer = socket.create_connection((sys.argv[1], {PORT}))
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
trips = []
for _ in range({ROUND_TRIPS}):
    start = time.perf_counter()
    peer.sendall(b"x")
    peer.recv(1)
    trips.append(time.perf_counter() - start)
start = time.perf_counter()
peer.sendall(bytes({MEGABYTES} << 20))
peer.recv(1)
rate = ({MEGABYTES} << 20) * 8 / (time.perf_counter() - start)
print(json.dumps({{"round_trip": sorted(trips)[len(trips) // 2], "rate": rate}}))
"""


def _measure(nodes) -> dict[str, float]:
    receiver, sender = nodes[1], nodes[0]
    server = receiver.python("-c", RECEIVER, receiver.address)
    client = sender.python("-c", SENDER, receiver.address)
    output = output_or_kill(client, 60, "the sending node")
    output_or_kill(server, 10, "the receiving node")
    assert client.returncode == 0, output
    return json.loads(output.strip().splitlines()[-1])


@pytest.mark.parametrize("delay", [None, "2ms"])
def test_the_link_has_its_rate_and_its_delay(delay):
    """200 Mbit/s each way: 10 MB travel at 50-105% of it (the token bucket lets a 256 KB burst
    through at once). A 2 ms delay each way makes a round trip take at least 4 ms (the delay
    line sleeps until each packet is due, so a loaded machine adds to it); without one, a veth
    round trip takes well under a millisecond."""
    with two_namespaces("200mbit", delay) as nodes:
        measured = _measure(nodes)
    assert 0.5 * 200e6 < measured["rate"] < 1.05 * 200e6, measured
    if delay is None:
        assert measured["round_trip"] < 1e-3, measured
    else:
        assert 4e-3 <= measured["round_trip"] < 10e-3, measured


if __name__ == "__main__":  # the link's figures: sudo python tests/test_netns.py RATE [DELAY]
    with two_namespaces(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None) as nodes:
        print(_measure(nodes))
