"""A link with a fixed one-way delay between two TUN devices, for kernels without tc's netem
(tests/netns.py puts one device in each namespace).

    python tests/delay_line.py TUN0 TUN1 DELAY_SECONDS

creates the two TUN devices, prints ``ready``, and from then on hands every packet one device
sends to the other, ``DELAY_SECONDS`` after it was sent, in order. The devices exist while this
process runs. A rate limit is the sending namespace's `tc` queueing discipline on its device, as
on a veth. The devices carry 64 KB packets (their MTU, set by the caller), so 1 Gb/s is about
2,000 packets a second each way: a small load for this loop (measured in bench/README.md).
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA  # linux/if_tun.h
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000  # IP packets, no packet-information header
LARGEST = 65536


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def forward(fds: list[int], delay: float) -> None:
    """Forever: what ``fds[i]`` sends is written into ``fds[1 - i]`` ``delay`` seconds later."""
    queues: list[deque[tuple[float, bytes]]] = [deque(), deque()]  # by the sending device
    while True:
        now = time.monotonic()
        for i, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                try:
                    os.write(fds[1 - i], queue.popleft()[1])
                except OSError:  # the receiving stack dropped it (full backlog): TCP resends
                    pass
        due = [queue[0][0] for queue in queues if queue]
        timeout = max(0.0, min(due) - now) if due else None
        readable, _, _ = select.select(fds, [], [], timeout)
        for fd in readable:
            queue = queues[fds.index(fd)]
            while True:
                try:
                    packet = os.read(fd, LARGEST)
                except BlockingIOError:
                    break
                except OSError:  # the device went with its namespace: the link is gone
                    return
                queue.append((time.monotonic() + delay, packet))


def main() -> None:
    first, second, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fds = [open_tun(first), open_tun(second)]
    try:  # wake when a packet is due, ahead of busy training ranks (it takes ~15% of a core)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except PermissionError:
        pass
    print("ready", flush=True)
    forward(fds, delay)


if __name__ == "__main__":
    main()
