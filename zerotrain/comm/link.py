"""How long a collective takes on a group's links: the alpha-beta model, measured by probes.

[Note: the alpha-beta model]
A collective of N ranks runs in hops, each one message from every rank to a neighbour: a
ring all-reduce takes 2(N-1), a reduce-scatter, all-gather or all-to-all N-1. Each hop
costs a latency alpha, and the bytes a rank sends cost 1/beta each, so

    seconds = hops * alpha + sent / beta

with ``sent`` the bytes this rank transmits (``OpStats.sent``, [Note: bytes sent] in
communicator.py). :func:`probe_link` fits alpha and beta from all-reduces of a small and a
large message on the group itself, so beta includes what the backend does locally per byte
(gloo's sums and copies), and alpha the per-message cost of its transport.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from zerotrain.comm.communicator import Communicator, ring_sent

# the probes: small enough to time the latency, large enough that bandwidth dominates; the
# large one grown from GROWN_FROM_BYTES 4x at a time until one takes LARGE_PROBE_SECONDS, at
# most LARGE_PROBE_BYTES: on a 10 Mbit/s link 4 MiB sent four times took 27 s of a 38 s job
# (bench/sites.py's auto rows), and a 64 KiB message passed in the shaper's burst, too fast
# to tell the link's rate
SMALL_PROBE_BYTES = 1 << 10
GROWN_FROM_BYTES = 64 << 10
LARGE_PROBE_BYTES = 4 << 20
LARGE_PROBE_SECONDS = 0.25
PROBE = "link_probe"
"""The name the probes' collectives are counted under (not training traffic)."""


def settle(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA collectives and kernels return before
    they ran, and a timing must include them (CUDA only; CPU work is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hops(op: str, world: int) -> int:
    """Messages in a row on each rank for the collective ``op`` over ``world`` ranks."""
    return 2 * (world - 1) if op == "all_reduce" else world - 1


@dataclass(frozen=True)
class Link:
    """A group's links as the alpha-beta model sees them (see [Note: the alpha-beta model])."""

    alpha: float  # seconds per hop
    beta: float  # bytes per second a rank sends
    resolved: bool = True  # False: the large probe took no longer than the small one

    def seconds(self, op: str, sent: int, world: int) -> float:
        """The model's time for one collective ``op`` in which this rank sends ``sent`` bytes."""
        return hops(op, world) * self.alpha + sent / self.beta

    def rate(self) -> str:
        """The bandwidth in bits a second (or that the probe could not resolve it)."""
        bits = self.beta * 8
        if not self.resolved:
            return "beyond the probe"
        return f"{bits / 1e9:.3g} Gb/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mb/s"

    def describe(self) -> str:
        rate = self.rate()
        if not self.resolved:
            rate = (
                f"bandwidth beyond what the probe resolves (a {LARGE_PROBE_BYTES >> 20} MiB "
                f"all-reduce took no longer than a {SMALL_PROBE_BYTES >> 10} KiB one)"
            )
        return f"{self.alpha * 1e6:.0f} us per hop, {rate}"


def probe_link(comm: Communicator, repeats: int = 3) -> Link:
    """Alpha and beta of ``comm``'s links, from timed all-reduces of a small and a large message
    (the median of ``repeats`` each, the slowest rank's); the large one the first of 64 KiB,
    256 KiB, ... 4 MiB that takes ``LARGE_PROBE_SECONDS``, so that a slow link is probed in
    seconds, its timed run the first of the ``repeats``: each size crosses the link twice and
    the large one ``repeats`` + 1 times (a 3-rank ring at 10 Mbit/s sent 9.3 MB when the large
    one crossed it 6 times). Collective over ``comm``; every rank returns the same link (and,
    comparing the same slowest times, sends the same messages)."""
    world = comm.world_size
    small = _slowest(comm, _median_time(comm, SMALL_PROBE_BYTES, repeats, warm_up=True))
    nbytes = GROWN_FROM_BYTES
    # each size timed after one untimed run: a shaper lets its burst through at once (a
    # 256 KiB message passed the emulated 10 Mbit/s link's in a quarter of its time)
    runs = [_median_time(comm, nbytes, 1, warm_up=True)]
    while nbytes < LARGE_PROBE_BYTES and _slowest(comm, runs[0]) < LARGE_PROBE_SECONDS:
        nbytes *= 4
        runs = [_median_time(comm, nbytes, 1, warm_up=True)]
    runs += [_median_time(comm, nbytes, 1) for _ in range(repeats - 1)]
    large = _slowest(comm, statistics.median(runs))
    sent_small = ring_sent("all_reduce", SMALL_PROBE_BYTES, world)
    sent_large = ring_sent("all_reduce", nbytes, world)
    # a large message no slower than a small one (noise on a fast link): beta is then the
    # clamp's, effectively unlimited, and describe() says so rather than print it
    beta = (sent_large - sent_small) / max(large - small, 1e-9)
    alpha = max(0.0, small - sent_small / beta) / max(hops("all_reduce", world), 1)
    return Link(alpha, beta, resolved=large > small)


def _median_time(comm: Communicator, nbytes: int, repeats: int, warm_up: bool = False) -> float:
    """This rank's median time of ``repeats`` all-reduces of ``nbytes`` (``warm_up``: after
    one that makes the connections and buffers)."""
    message = torch.zeros(nbytes // 4, device=comm.device)
    if warm_up:
        comm.all_reduce(message, name=PROBE)
    runs = []
    for _ in range(repeats):
        settle(comm.device)
        start = time.perf_counter()
        comm.all_reduce(message, name=PROBE)
        settle(comm.device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _slowest(comm: Communicator, seconds: float) -> float:
    """The largest of the ranks' ``seconds``."""
    slowest = torch.tensor([seconds], dtype=torch.float64, device=comm.device)
    comm.all_reduce(slowest, op="max", name=PROBE)
    return slowest.item()
