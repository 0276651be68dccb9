"""What glibc's mmap threshold costs a model trained on a CPU device: forward and backward time.

    python bench/host_allocator.py [--models demo,gpt_30m] [--rounds 3] [--steps 8]

NVMe offload fixes glibc's mmap threshold (:func:`zerotrain.accelerator.map_large_host_blocks`,
[Note: NVMe offload and freed host memory] in zerotrain/zero/nvme.py) so that the host memory it
saves stays saved. Every host block at or above the threshold is then mapped when allocated and
unmapped when freed, and on a CPU device the activations and temporaries are such blocks: each
one's pages are faulted in again every time. This trains a GPT of examples/gpt/model.py (fp32,
one thread, ZeRO stage 0, micro-batch 8 of 128 tokens, no offload, so that only the allocator
differs) in a fresh process per setting: glibc's default (a threshold that rises by itself up
to 32 MiB), and fixed at 1 MiB and at 4 MiB (``MALLOC_MMAP_THRESHOLD_``), ``--rounds`` times
alternating. Prints the median forward and backward seconds over the steps after the first two
and each setting's ratio to glibc's default in the same round; writes
bench/results/host_allocator.json.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THRESHOLDS = {"glibc default": None, "1 MiB": 1 << 20, "4 MiB": 4 << 20}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,gpt_30m", help="factories of examples/gpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "host_allocator.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def child(args: argparse.Namespace) -> None:
    """Train ``args.child`` here and print the median forward and backward seconds as JSON."""
    import torch

    import zerotrain
    from examples.gpt import model as gpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=getattr(gpt, args.child)(), config=config)
    tokens = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    forward, backward = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        middle = time.perf_counter()
        engine.backward(loss)
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        engine.step()
    warm = slice(2, None)  # the first steps grow the heaps and make the optimizer state
    medians = {"forward_s": forward[warm], "backward_s": backward[warm]}
    print(json.dumps({key: statistics.median(values) for key, values in medians.items()}))


def run_child(args: argparse.Namespace, model: str, threshold: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    command = [sys.executable, __file__, "--child", model, "--steps", str(args.steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{model} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for model in args.models.split(","):
        for round_index in range(args.rounds):
            times = {name: run_child(args, model, t) for name, t in THRESHOLDS.items()}
            base = times["glibc default"]
            for name, measured in times.items():
                rows.append(
                    {
                        "model": model,
                        "round": round_index,
                        "threshold": name,
                        **measured,
                        "forward_ratio": measured["forward_s"] / base["forward_s"],
                        "backward_ratio": measured["backward_s"] / base["backward_s"],
                    }
                )
    print(
        f"{'model':10} {'threshold':14} {'forward s':>10} {'backward s':>11} {'fwd x':>7} {'bwd x':>7}"
    )
    for model in args.models.split(","):
        for name in THRESHOLDS:
            mine = [r for r in rows if r["model"] == model and r["threshold"] == name]
            cells = [
                statistics.median(r[k] for r in mine)
                for k in ("forward_s", "backward_s", "forward_ratio", "backward_ratio")
            ]
            print(
                f"{model:10} {name:14} {cells[0]:10.3f} {cells[1]:11.3f} "
                f"{cells[2]:7.3f} {cells[3]:7.3f}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
