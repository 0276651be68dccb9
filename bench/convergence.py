"""Compressed training against uncompressed over a longer run than the slow test's 300 steps:
the tiny GPT on the embedded corpus, on 2 and 4 ranks (gloo, this machine), the mean loss of
the last 10% of the steps against the same optimizer uncompressed. ``--rows``:
- ``convergence``: each method of tests/test_compression.py's CONVERGENCE (AdamW; the 1-bit
  optimizers against OneBitAdam's update uncompressed);
- ``sgd``: the low-rank and sparse methods under SGD with momentum;
- ``onebit``: OneBitAdam with its variance frozen at step 100 but every gradient exact, which
  tells the freeze's part of the 1-bit gap from the compression's.

    python bench/convergence.py [--steps 1000] [--worlds 4 2] [--rows convergence|sgd|onebit]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_distributed  # noqa: E402
from test_compression import CONVERGENCE, convergence_baseline, train_gpt_losses  # noqa: E402

# the gradient methods under SGD with momentum (lr 0.1): without Adam's per-coordinate scaling
SGD = {
    "SGD uncompressed s1": (1, {}, "SGD"),
    "SGD powersgd r4 s1": (1, {"method": "powersgd", "rank": 4}, "SGD"),
    "SGD acp_sgd r8 s1": (1, {"method": "acp_sgd", "rank": 8}, "SGD"),
    "SGD topk 10% s2": (2, {"method": "topk", "ratio": 0.1}, "SGD"),
    "SGD gtopk 10% s2": (2, {"method": "gtopk", "ratio": 0.1}, "SGD"),
}


ONE_BIT = {
    "OneBitAdam uncompressed s1": (1, {}, "OneBitAdam uncompressed"),
    "OneBitAdam frozen, uncompressed s1": (1, {}, "OneBitAdam frozen, uncompressed"),
    "OneBitAdam s1": (1, {}, "OneBitAdam"),
}
ROWS = {"convergence": CONVERGENCE, "sgd": SGD, "onebit": ONE_BIT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--worlds", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--rows", choices=list(ROWS), default="convergence")
    args = parser.parse_args()
    rows = ROWS[args.rows]
    tail = max(1, args.steps // 10)
    print(f"tiny GPT, {args.steps} steps, mean loss of the last {tail}\n")
    print("| method | ranks | final loss | vs its baseline |\n|---|---|---|---|")
    for world in args.worlds:
        started = time.perf_counter()
        runs = run_distributed(train_gpt_losses, world, rows, args.steps, timeout=6 * args.steps)[0]
        final = {name: sum(losses[-tail:]) / tail for name, (losses, _) in runs.items()}
        for name in rows:
            change = final[name] / final[convergence_baseline(name)] - 1
            print(f"| {name} | {world} | {final[name]:.4f} | {change:+.1%} |")
        print(f"({world} ranks: {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
