"""Time of one Lamb step on ZeRO masters: the demo GPT (4.8M parameters), 1 rank, CPU, fp32.

    python bench/lamb_step.py [--model demo] [--stage 1] [--steps 20] [--rounds 5] [--threads N]

Builds the engine with the config's Lamb, runs one forward, backward and step (the moments
exist from then on), then times ``engine.optimizer.optimizer.step()``, the Lamb step over the
flat fp32 masters alone, with the same gradients each time: ``--rounds`` rounds of ``--steps``
steps, the median of the per-step round means. Prints one line and writes
bench/results/lamb_step.json. Run it on two versions of zerotrain (``PYTHONPATH`` at each tree)
to compare them; alternate the runs, the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt.model import GPT, gpt_config  # noqa: E402

import zerotrain  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="GPT preset of examples/gpt/model.py")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lamb_step.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    zerotrain.init_distributed()
    cfg = gpt_config(args.model)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": args.stage},
            "steps_per_print": 10**9,
        },
    )
    x = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size))
    engine.backward(engine(x, x))
    engine.step()
    engine.backward(engine(x, x))  # gradients for the timed steps (step() would clear them)
    lamb = engine.optimizer.optimizer
    means = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            lamb.step()
        means.append((time.perf_counter() - start) / args.steps)
    numel = sum(p.numel() for g in lamb.param_groups for p in g["params"])
    result = {
        "model": args.model,
        "stage": args.stage,
        "master_numel": numel,
        "threads": torch.get_num_threads(),
        "zerotrain": str(Path(zerotrain.__file__).resolve().parents[1]),
        "step_ms_median": 1e3 * statistics.median(means),
        "step_ms_rounds": [1e3 * m for m in means],
    }
    print(
        f"Lamb step, {args.model} ({numel / 1e6:.2f}M elements), stage {args.stage}, "
        f"{result['threads']} threads: median {result['step_ms_median']:.2f} ms "
        f"(rounds: {', '.join(f'{1e3 * m:.2f}' for m in means)}) [{result['zerotrain']}]"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
