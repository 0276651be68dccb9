"""Step time of zerotrain stages 0-2 against torch DDP and the compute floor, in one run.

    python bench/step_time.py [--model demo] [--micro-batch 8] [--rounds 5] [--steps 4]

Launches itself on 2 ranks (torchrun, gloo, fp32). Every system trains its own copy of the same
GPT (same initial weights, same synthetic tokens); the systems are timed in alternating rounds so
that machine noise falls on all of them alike. The compute floor is forward + backward on every
rank with no communication and no optimizer step. Prints a table of median step times and ratios
and writes bench/results/step_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

LR, CLIP = 1e-3, 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="GPT preset of examples/gpt/model.py")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_time.json"))
    return parser.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(args.nproc), __file__, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


class System:
    """One way of training: a step function over the same model and batches."""

    def __init__(self, name: str, step, model):
        self.name, self.step, self.model = name, step, model
        self.times: list[float] = []
        self.loss = float("nan")


def build_systems(args):
    from gpt.model import GPT, gpt_config
    from torch.nn.parallel import DistributedDataParallel

    import zerotrain

    def fresh_model():
        torch.manual_seed(0)
        return GPT(gpt_config(args.model))

    systems = []

    floor_model = fresh_model()

    def floor_step(x, y):
        loss = floor_model(x, y)
        loss.backward()
        floor_model.zero_grad(set_to_none=False)
        return loss

    systems.append(System("compute floor", floor_step, floor_model))

    ddp_model = fresh_model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=LR, fused=True)

    def ddp_step(x, y):
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), CLIP)
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=False)
        return loss

    systems.append(System("torch DDP", ddp_step, ddp_model))

    for stage in (0, 1, 2):
        model = fresh_model()
        engine, *_ = zerotrain.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": args.micro_batch,
                "gradient_clipping": CLIP,
                "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                "zero_optimization": {"stage": stage},
                "steps_per_print": 10**9,
            },
        )

        def zt_step(x, y, engine=engine):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

        systems.append(System(f"zerotrain stage {stage}", zt_step, engine))
    return systems


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(relaunch(args))
    from gpt.model import gpt_config

    import zerotrain
    from zerotrain.comm import Communicator

    zerotrain.init_distributed()
    comm = Communicator()
    cfg = gpt_config(args.model)
    gen = torch.Generator().manual_seed(1234 + comm.rank)
    total = 1 + args.rounds * args.steps  # one warm-up step per system
    tokens = torch.randint(
        0, cfg.vocab_size, (total, args.micro_batch, cfg.block_size + 1), generator=gen
    )
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    systems = build_systems(args)
    params = sum(p.numel() for p in systems[0].model.parameters())

    for system in systems:  # warm-up: allocations, first optimizer state
        system.step(*batches[0])
    for round_index in range(args.rounds):
        for system in systems:
            for i in range(args.steps):
                x, y = batches[1 + round_index * args.steps + i]
                comm.barrier()
                start = time.perf_counter()
                loss = system.step(x, y)
                system.times.append(time.perf_counter() - start)
                system.loss = loss.item()

    # A step's time is the slowest rank's.
    rows = []
    for system in systems:
        times = torch.tensor(system.times)
        comm.all_reduce(times, op="max")
        loss = torch.tensor([system.loss])
        comm.all_reduce(loss)
        rows.append(
            {
                "system": system.name,
                "median_s": statistics.median(times.tolist()),
                "loss": loss.item() / comm.world_size,
            }
        )
    if comm.rank != 0:
        return
    floor = rows[0]["median_s"]
    ddp = rows[1]["median_s"]
    tokens_per_step = args.micro_batch * cfg.block_size * comm.world_size
    print(
        f"\nGPT '{args.model}' ({params / 1e6:.2f}M params), {comm.world_size} ranks, fp32, "
        f"micro-batch {args.micro_batch}x{cfg.block_size}, {args.rounds} rounds x {args.steps} steps\n"
    )
    header = f"{'system':<20} {'median s/step':>14} {'vs DDP':>8} {'efficiency':>11} {'tokens/s':>10} {'loss':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        row["vs_ddp"] = row["median_s"] / ddp
        row["efficiency"] = floor / row["median_s"]
        row["tokens_per_s"] = tokens_per_step / row["median_s"]
        print(
            f"{row['system']:<20} {row['median_s']:>14.4f} {row['vs_ddp']:>8.3f} "
            f"{row['efficiency']:>11.3f} {row['tokens_per_s']:>10.0f} {row['loss']:>8.4f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "params": params, "rows": rows}, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
