"""Activation memory and step time of the demo GPT with and without activation checkpointing.

    python bench/activation_memory.py [--model demo] [--batch 8] [--every 0 2 1] [--steps 5]

One process, no engine (activations do not depend on the ZeRO stage). For each setting of
``zerotrain.checkpointing.wrap(model, every=K)`` (0: no checkpointing) it measures the bytes
autograd keeps for backward after the forward (``count_saved_activations``), on CUDA also the
peak allocated during forward and backward above the model states (gradients allocated
beforehand), and the median step time. Writes bench/results/activation_memory.json.
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
sys.path.insert(0, str(ROOT))

from gpt.model import GPT, gpt_config  # noqa: E402

from zerotrain import checkpointing  # noqa: E402

MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--every", type=int, nargs="+", default=[0, 2, 1])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "activation_memory.json"))
    return parser.parse_args()


def measure(args: argparse.Namespace, every: int) -> dict:
    device = torch.device(args.device)
    cfg = gpt_config(args.model)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if every:
        checkpointing.wrap(model, every=every)
    x, y = (
        torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device) for _ in "xy"
    )
    for _ in range(3):  # warm-up; the gradients stay allocated from here on
        model(x, y).backward()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with checkpointing.count_saved_activations(model.parameters()) as saved:
        loss = model(x, y)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(x, y).backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "every": every,
        "saved_bytes": saved.nbytes,
        "peak_bytes": peak,
        "step_s": statistics.median(times),
    }


def main() -> None:
    args = parse_args()
    rows = [measure(args, every) for every in args.every]
    off = next((r for r in rows if r["every"] == 0), rows[0])
    cfg = gpt_config(args.model)
    print(
        f"GPT '{args.model}' ({cfg.n_layer} blocks), batch {args.batch} x {cfg.block_size}, "
        f"{args.device}, torch {torch.__version__}"
    )
    print(
        f"{'checkpointing':<16}{'saved MiB':>11}{'ratio':>8}{'peak MiB':>10}{'ratio':>8}{'step ms':>10}{'ratio':>8}"
    )
    for r in rows:
        name = "off" if r["every"] == 0 else f"every {r['every']}"
        peak = (
            f"{r['peak_bytes'] / MiB:>10.1f}{r['peak_bytes'] / off['peak_bytes']:>8.2f}"
            if r["peak_bytes"] is not None
            else f"{'-':>10}{'-':>8}"
        )
        print(
            f"{name:<16}{r['saved_bytes'] / MiB:>11.2f}{r['saved_bytes'] / off['saved_bytes']:>8.3f}"
            f"{peak}{r['step_s'] * 1e3:>10.1f}{r['step_s'] / off['step_s']:>8.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": args.model,
        "batch": args.batch,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
