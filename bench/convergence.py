"""Compressed training against uncompressed, as the slow test in tests/test_compression.py
runs it (300 steps by default, or longer): the tiny GPT (``--model``: another preset of
examples/gpt) on the embedded corpus, on 2 and 4
ranks (gloo, this machine). The final loss is the trained model's on held-out text, against
the same optimizer uncompressed, with rank 0's bytes in the median step. ``--rows``:
- ``convergence``: each method of the slow test's CONVERGENCE (AdamW; the 1-bit optimizers
  against OneBitAdam's update never frozen);
- ``sgd``: the low-rank and sparse methods under SGD with momentum;
- ``onebit``: OneBitAdam and ZeroOneAdam, each also with every gradient exact (their
  variance schedules alone), which tells the schedule's part of a 1-bit gap from the
  compression's; ZeroOneAdam also at DeepSpeed's default ``var_update_scaler``;
- ``local``: ZeroOneAdam at stage 0 with local steps after the freeze, and without;
- ``less``: PowerSGD at rank 8, ACP-SGD at ranks 4 and 16, top-k and gTop-k at 25%: what
  compressing less buys back;
- ``sparse``: top-k and gTop-k under AdamW with and without catching up, and at 1%;
- ``demo``: for ``--model demo``: PowerSGD at ranks 4-32, ACP-SGD at 4-64, and the quantized
  methods;
- ``seeds``: uncompressed from 4 model seeds: how far apart runs end by chance alone.

``--warmup-steps`` sets the exact steps before gradient compression starts (the 1-bit
optimizers keep their own).

    python bench/convergence.py [--steps 300] [--worlds 4 2] [--warmup-steps 20]
                                [--micro-batch 16] [--lr 1e-3] [--model tiny]
                                [--rows convergence|sgd|onebit|local|less|sparse|demo|seeds]
                                [--only ROW ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_distributed  # noqa: E402
from test_compression import (  # noqa: E402
    CONVERGENCE,
    Training,
    convergence_baseline,
    median_sent,
    train_gpt,
)

# the gradient methods under SGD with momentum (lr 0.1): without Adam's per-coordinate scaling
SGD = {
    "SGD uncompressed s1": (1, {}, "SGD"),
    "SGD powersgd r4 s1": (1, {"method": "powersgd", "rank": 4}, "SGD"),
    "SGD acp_sgd r8 s1": (1, {"method": "acp_sgd", "rank": 8}, "SGD"),
    "SGD topk 10% s2": (2, {"method": "topk", "ratio": 0.1}, "SGD"),
    "SGD gtopk 10% s2": (2, {"method": "gtopk", "ratio": 0.1}, "SGD"),
}


DEEPSPEED_SCALER = {"optimizer_params": {"var_update_scaler": 16}}
ONE_BIT = {
    "OneBitAdam uncompressed s1": (1, {}, "OneBitAdam uncompressed"),
    "OneBitAdam, exact s1": (1, {}, "OneBitAdam, exact"),
    "OneBitAdam s1": (1, {}, "OneBitAdam"),
    "ZeroOneAdam, exact s1": (1, {}, "ZeroOneAdam, exact"),
    "ZeroOneAdam s1": (1, {}, "ZeroOneAdam"),
    # DeepSpeed's default var_update_scaler: 1-bit steps from step 17, inside the lr warm-up
    "ZeroOneAdam, exact, var_update_scaler 16 s1": (1, DEEPSPEED_SCALER, "ZeroOneAdam, exact"),
    "ZeroOneAdam, var_update_scaler 16 s1": (1, DEEPSPEED_SCALER, "ZeroOneAdam"),
}
# 0/1 Adam at stage 0 with and without local steps after the freeze (their interval doubling
# every 50 steps up to 8)
LOCAL = {
    "OneBitAdam uncompressed s0": (0, {}, "OneBitAdam uncompressed"),
    "ZeroOneAdam s0": (0, {}, "ZeroOneAdam"),
    "ZeroOneAdam, local steps to 8 s0": (
        0,
        {"optimizer_params": {"local_step_clipper": 8, "local_step_scaler": 50}},
        "ZeroOneAdam",
    ),
}
# the low-rank and sparse methods compressing less, under AdamW
LESS = {
    "uncompressed s1": CONVERGENCE["uncompressed s1"],
    "powersgd r8 s1": (1, {"method": "powersgd", "rank": 8}, "AdamW"),
    # ACP-SGD at PowerSGD's rank (half its bytes), and at twice its bytes
    "acp_sgd r4 s1": (1, {"method": "acp_sgd", "rank": 4}, "AdamW"),
    "acp_sgd r16 s1": (1, {"method": "acp_sgd", "rank": 16}, "AdamW"),
    "topk 25% s2": (2, {"method": "topk", "ratio": 0.25}, "AdamW"),
    "gtopk 25% s2": (2, {"method": "gtopk", "ratio": 0.25}, "AdamW"),
}
# top-k and gTop-k under AdamW catching up (the default; zerotrain/optim/catch_up.py) and not,
# and at a tenth of the ratio
SPARSE = {
    "uncompressed s1": CONVERGENCE["uncompressed s1"],
    "topk 10% s2": CONVERGENCE["topk 10% s2"],
    "topk 10%, catch_up false s2": (
        2,
        {"method": "topk", "ratio": 0.1, "catch_up": False},
        "AdamW",
    ),
    "gtopk 10% s2": CONVERGENCE["gtopk 10% s2"],
    "gtopk 10%, catch_up false s2": (
        2,
        {"method": "gtopk", "ratio": 0.1, "catch_up": False},
        "AdamW",
    ),
    "topk 1% s2": (2, {"method": "topk", "ratio": 0.01}, "AdamW"),
    "gtopk 1% s2": (2, {"method": "gtopk", "ratio": 0.01}, "AdamW"),
}
# for --model demo, whose 256-wide matrices leave the low ranks a smaller share than the tiny
# GPT's 64-wide ones: PowerSGD and ACP-SGD at ranks up to a quarter of the width, and the
# quantized methods auto picks from
DEMO = {
    "uncompressed s1": CONVERGENCE["uncompressed s1"],
    **{
        f"{method} r{rank} s1": (1, {"method": method, "rank": rank}, "AdamW")
        for method, ranks in (("powersgd", (4, 16, 32)), ("acp_sgd", (4, 8, 32, 64)))
        for rank in ranks
    },
    "int8 + int8 params s1": CONVERGENCE["int8 + int8 params s1"],
    "int4 + int4 params s3": CONVERGENCE["int4 + int4 params s3"],
}
ROWS = {
    "convergence": CONVERGENCE,
    "sgd": SGD,
    "onebit": ONE_BIT,
    "local": LOCAL,
    "less": LESS,
    "sparse": SPARSE,
    "demo": DEMO,
}
SEEDS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Training.steps)
    parser.add_argument("--worlds", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--rows", choices=[*ROWS, "seeds"], default="convergence")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=Training.compression_warmup,
        help="exact steps before gradient compression",
    )
    parser.add_argument("--micro-batch", type=int, default=Training.micro_batch)
    parser.add_argument("--lr", type=float, default=Training.lr, help="the Adam family's")
    parser.add_argument("--model", default=Training.model, help="the examples' GPT preset")
    parser.add_argument(
        "--only", nargs="+", default=[], help="these rows of --rows' set (and their baselines)"
    )
    args = parser.parse_args()
    rows = ROWS.get(args.rows, {})
    if unknown := [name for name in args.only if name not in rows]:
        parser.error(f"--only: {unknown} not in --rows {args.rows}'s {list(rows)}")
    if args.only:
        chosen = {*args.only, *map(convergence_baseline, args.only)}
        rows = {name: run for name, run in rows.items() if name in chosen}
    training = Training(
        steps=args.steps,
        compression_warmup=args.warmup_steps,
        micro_batch=args.micro_batch,
        lr=args.lr,
        model=args.model,
    )
    if args.rows != "seeds" and args.steps <= training.compressed_from:
        parser.error(f"--steps: the bytes are taken after step {training.compressed_from}")
    print(f"{args.model} GPT, {training}, held-out loss of the final model\n")
    print(
        "| method | ranks | final loss | vs its baseline | MB/step | bytes vs baseline "
        "| mean bytes vs baseline |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        started = time.perf_counter()
        if args.rows == "seeds":
            seeds(world, training)
        else:
            runs = run_distributed(train_gpt, world, rows, training, timeout=20 * args.steps)
            final = {name: held for name, (_, held) in runs[0].items()}
            sent = {name: median_sent(sent, training) for name, (sent, _) in runs[0].items()}
            mean = {  # once every method compresses: most local steps send a 4-byte flag only
                name: sum(s[training.compressed_from :]) / (args.steps - training.compressed_from)
                for name, (s, _) in runs[0].items()
            }
            baseline = convergence_baseline(next(iter(rows)))
            for name in rows:
                change = final[name] / final[convergence_baseline(name)] - 1
                print(
                    f"| {name} | {world} | {final[name]:.4f} | {change:+.1%} "
                    f"| {sent[name] / 1e6:.2f} | {sent[name] / sent[baseline]:.3f} "
                    f"| {mean[name] / mean[baseline]:.3f} |"
                )
        print(f"({world} ranks: {time.perf_counter() - started:.0f} s)", flush=True)


def seeds(world: int, training: Training) -> None:
    """The baseline from model seeds 0..SEEDS-1, each against seed 0's, and their spread."""
    baseline = {"uncompressed s1": CONVERGENCE["uncompressed s1"]}
    final = []
    for seed in range(SEEDS):
        runs = run_distributed(
            train_gpt,
            world,
            baseline,
            replace(training, seed=seed),
            timeout=20 * training.steps,
        )
        final.append(runs[0]["uncompressed s1"][1])
        print(
            f"| uncompressed s1, seed {seed} | {world} | {final[-1]:.4f} | "
            f"{final[-1] / final[0] - 1:+.1%} | | |"
        )
    print(f"spread (max - min) / min: {max(final) / min(final) - 1:.1%}")


if __name__ == "__main__":
    main()
