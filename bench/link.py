"""gloo all-reduces on the emulated link of bench/compression.py: one rank in each of two
network namespaces (tests/netns.py), timed for a few buffer sizes, on the veth and through the
delay line at each given delay.

    sudo python bench/link.py [--rate 1gbit] [--delays 0ms 0.1ms 1ms]

Per link, the median of 5 repetitions of: one all-reduce of the demo GPT's 4.83M fp32
elements, 5 of 1M, 48 of 100K, and one of a single element (the link's latency as a
collective sees it). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CASES = ((4_830_000, 1), (1_000_000, 5), (100_000, 48), (1, 1))  # (elements, all-reduces)
PORT = 29555


def worker(master: str, rank: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=2)
    cells = []
    for numel, count in CASES:
        buffers = [torch.ones(numel) for _ in range(count)]
        for buffer in buffers:  # the connections' first use, outside the timing
            dist.all_reduce(buffer)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for buffer in buffers:
                dist.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        cells.append(f"{sorted(times)[2] * 1e3:.2f}")
    if rank == 0:
        print(" | ".join(cells))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way (tc)")
    parser.add_argument("--delays", nargs="*", default=["0ms", "0.1ms", "1ms"])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    from launched import output_or_kill
    from netns import available, two_namespaces

    if not available():
        sys.exit("bench/link.py needs root, ip and tc (network namespaces)")
    header = " | ".join(f"{count} x {numel:,} (ms)" for numel, count in CASES)
    print(f"| link, {args.rate} | {header} |\n|---|{'---|' * len(CASES)}")
    for delay in [None, *args.delays]:
        with two_namespaces(args.rate, delay) as nodes:
            processes = [
                node.python(__file__, "--worker", nodes[0].address, str(rank))
                for rank, node in enumerate(nodes)
            ]
            outputs = [output_or_kill(p, 300, f"rank {r}") for r, p in enumerate(processes)]
            if any(p.returncode for p in processes):
                sys.exit("\n".join(outputs))
            row = outputs[0].strip().splitlines()[-1]
            print(f"| {'veth' if delay is None else f'delay line, {delay} each way'} | {row} |")


if __name__ == "__main__":
    main()
