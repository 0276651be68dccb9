"""Time from ``zerotrain.initialize`` to the first finished optimizer step, stages 0-3.

    zerotrain run --nproc-per-node 2 bench/startup_time.py [--model demo]

zerotrain compiles nothing at start-up (torch's fused AdamW kernels ship with torch), so the
first step costs about one ordinary step plus the first use of each collective. Each stage
builds a fresh model in the same processes; the first stage also pays the process group's first
collectives. Rank 0 prints one line per stage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt.model import GPT, gpt_config  # noqa: E402

import zerotrain  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="GPT preset of examples/gpt/model.py")
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    zerotrain.init_distributed()
    cfg = gpt_config(args.model)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(cfg)
        start = time.perf_counter()
        engine, *_ = zerotrain.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": args.micro_batch,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage},
                "steps_per_print": 10**9,
            },
        )
        initialized = time.perf_counter() - start
        x = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size))
        engine.backward(engine(x, x))
        engine.step()
        if engine.global_rank == 0:
            print(
                f"GPT '{args.model}', world {engine.world_size}, stage {stage}: initialize "
                f"{initialized:.2f} s, initialize to first finished step "
                f"{time.perf_counter() - start:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
