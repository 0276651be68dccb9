"""Model-state bytes per rank, measured, against the ZeRO formula: stages 0-3, N = 1, 2, 4.

    python bench/memory_table.py [--model demo] [--worlds 1 2 4] [--precision bf16 fp32]

For each world size it launches that many ranks (torchrun, gloo), builds the demo GPT under every
stage and precision, runs one optimizer step (Adam's state exists only after it) and prints
``engine.memory_breakdown()`` (measured from the allocated tensors) next to the formula of
ZeRO (arXiv:1910.02054) §5. Writes bench/results/memory_table.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from zerotrain.fmt import MB  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_table.json"))
    parser.add_argument("--rank-output", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def measure(args) -> None:
    """Runs on every rank of one world size; rank 0 writes the results."""
    from gpt.model import GPT, gpt_config

    import zerotrain
    from zerotrain.comm import Communicator

    zerotrain.init_distributed()
    comm = Communicator()
    cfg = gpt_config(args.model)
    rows = []
    for precision in args.precision:
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            model = GPT(cfg)
            engine, *_ = zerotrain.initialize(
                model=model,
                config={
                    "train_micro_batch_size_per_gpu": 1,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                    # stage 3: every block sharded (no unit kept whole for being small)
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                    "bf16": {"enabled": precision == "bf16"},
                    "steps_per_print": 10**9,
                },
            )
            x = torch.randint(0, cfg.vocab_size, (1, 8))
            engine.backward(engine(x, x))
            engine.step()
            breakdown = engine.memory_breakdown()
            rows.append(
                {"precision": precision, "stage": stage, "world": comm.world_size, **breakdown}
            )
            del engine, model
    if comm.rank == 0:
        Path(args.rank_output).write_text(json.dumps(rows))


def main() -> None:
    args = parse_args()
    if args.rank_output:
        measure(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = Path(tmp) / f"world{world}.json"
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [
                "--nproc-per-node",
                str(world),
                __file__,
                *sys.argv[1:],
                "--rank-output",
                str(out),
            ]
            subprocess.run(cmd, env=env, check=True)
            rows += json.loads(out.read_text())
    header = (
        f"{'precision':<9} {'stage':>5} {'N':>3} {'params MB':>10} {'grads MB':>9} "
        f"{'optim MB':>9} {'total MB':>9} {'formula MB':>11} {'measured/formula':>17}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        row["ratio"] = row["total"] / row["formula_total"]
        print(
            f"{row['precision']:<9} {row['stage']:>5} {row['world']:>3} "
            f"{row['parameters'] / MB:>10.2f} {row['gradients'] / MB:>9.2f} "
            f"{row['optimizer_states'] / MB:>9.2f} {row['total'] / MB:>9.2f} "
            f"{row['formula_total'] / MB:>11.2f} {row['ratio']:>17.4f}"
        )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
