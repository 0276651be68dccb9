"""What gloo's all-reduce puts on a slow link: a shard whole or in parts, and blocking or
overlapped with traffic inside the site, as the TCP payload the kernel counts per connection.

    sudo python bench/link_bytes.py [--rate 100mbit] [--delay 20ms] [--numel 108832]

Two network namespaces (tests/netns.py), 2 ranks each as two sites of 2: each rank all-reduces
``--numel`` fp32 elements with the rank holding its place at the other site, 4 times per case,
and the first site's TCP payload to the other site (``ss``'s bytes_sent over the connections
across) is measured around each case. Cases: whole (one all-reduce), in 5 and 20 parts, and
whole while the ranks of each site all-reduce 2M elements 5 times between themselves (blocking,
then overlapped: launched before the site's traffic, waited after). It checks what the sites'
streaming and overlap (docs/sites.md) cost on the wire, apart from training. Needs root and
iproute2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

REPEATS = 4


def worker(numel: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from sites import tcp_payload_sent

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    inside = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    shard, site_traffic = torch.randn(numel), torch.randn(2_000_000)

    def whole(parts: int = 1, overlapped: bool | None = None) -> None:
        pieces = [p.clone() for p in shard.chunk(parts)]
        works = [dist.all_reduce(p, group=across, async_op=True) for p in pieces]
        if overlapped is False:
            for work in works:
                work.wait()
        if overlapped is not None:
            for _ in range(5):
                dist.all_reduce(site_traffic, group=inside)
        for work in works:
            work.wait()

    cases = {
        "whole": lambda: whole(),
        "5 parts": lambda: whole(5),
        "20 parts": lambda: whole(20),
        "whole, then the site's traffic": lambda: whole(overlapped=False),
        "whole, overlapped with the site's traffic": lambda: whole(overlapped=True),
    }
    whole()  # connections made
    result = {}
    for name, case in cases.items():
        dist.barrier()
        time.sleep(0.5)  # what the barrier sent has left
        before = tcp_payload_sent()
        for _ in range(REPEATS):
            case()
        dist.barrier()
        time.sleep(0.5)
        result[name] = (tcp_payload_sent() - before) / REPEATS
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="20ms")
    parser.add_argument("--numel", type=int, default=108_832, help="a rank's shard (fp32)")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.out)
        return
    from netns import run_rows

    def row(nodes, name: str, port: int) -> dict | str:
        from netns import run_job

        script = ["bench/link_bytes.py", "--worker", str(args.numel), "--out", "{out}"]
        return run_job(nodes, script, ranks_per_node=2, port=port, name=name)

    results = run_rows("bench/link_bytes.py", args.rate, args.delay, ["cases"], row, 29720)
    got = results["cases"]
    if not isinstance(got, dict):
        sys.exit(got)
    print(f"\nTCP payload from the first site per repeat ({args.numel:,} fp32 per rank, 2 ranks):")
    for name, sent in got.items():
        print(f"  {name:45s} {sent:12,.0f} bytes  {sent / got['whole']:.3f}x")


if __name__ == "__main__":
    main()
