"""Bytes per parameter, step time and convergence of the precision recipes and optimizers.

    python bench/precision.py --part memory [--models demo 100m] [--steps 4]
    python bench/precision.py --part newton-schulz [--worlds 1 2 4]
    python bench/precision.py --part convergence [--steps 300]

Every row is a torchrun job of 2 ranks (gloo, this machine, bf16 training of the GPT of
examples/gpt), one at a time:

- ``memory``: per (model, optimizer, precision, ZeRO stage): the model-state bytes per trained
  parameter on a rank (``engine.memory_breakdown()``) against the formula, the rank's peak RSS
  (``ru_maxrss``), and the median step time against AdamW's with fp32 masters at the same
  stage. The precisions: ``fp32-masters`` (the bf16 default), ``bf16-states``
  (``bf16_optimizer_states``), ``bf16-masters`` (``bf16_master_weights_and_grads``) and
  ``bf16-both``. DeepSpeed's rows (``--deepspeed``: the same configs through DeepSpeed 0.19.8 on
  CPU, ``DS_ACCELERATOR=cpu``) where they run.
- ``newton-schulz``: Muon's step on the 100m GPT (``--ns-model``) at each world size: the time in
  the whole-matrix exchange and Newton-Schulz (``ShardedMatrices.orthogonalize``) per step, and
  the share of the matrices' Newton-Schulz work each rank does.
- ``convergence``: ``--steps`` steps (300) of the demo GPT on the embedded corpus (2 ranks,
  micro-batch 16, lr warm-up over 20 steps): the final training loss (mean of the last 20
  steps) and the held-out loss, for AdamW, Muon and Lion with fp32 masters, and AdamW with bf16
  masters (to nearest, stochastically rounded) and bf16 states; the drift is against AdamW with
  fp32 masters.

Writes bench/results/precision.json (one entry per part run).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

sys.path.insert(0, str(ROOT / "tests"))

from launch import run_all, run_ranks  # noqa: E402
from test_compression import HELD_OUT, held_out_loss  # noqa: E402

WORLD = 2
PRECISIONS = {
    "fp32-masters": {},
    "bf16-states": {"bf16_optimizer_states": True},
    "bf16-masters": {"bf16_master_weights_and_grads": True},
    "bf16-both": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "bf16-both-sr": {
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
        "stochastic_rounding": True,
    },
}
OPTIMIZERS = {
    "AdamW": {"lr": 1e-3, "weight_decay": 0.01},
    "Muon": {"lr": 1e-3, "muon_lr": 0.02, "weight_decay": 0.01},
    "Lion": {"lr": 3e-4, "weight_decay": 0.03},  # the paper's advice: 3-10x smaller lr
    # Muon with torch's (and DeepSpeed's) bf16 Newton-Schulz instead of zerotrain's fp32
    "Muon@bf16ns": {"lr": 1e-3, "muon_lr": 0.02, "weight_decay": 0.01, "ns_dtype": "bf16"},
}


def engine_config(optimizer: str, precision: str, stage: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": optimizer.split("@")[0], "params": OPTIMIZERS[optimizer]},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True, **PRECISIONS[precision]},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


# -- memory and step time -----------------------------------------------------------------------
def memory_rows(models: list[str], deepspeed: bool) -> list[str]:
    rows = []
    for model in models:
        optimizers = [name for name in OPTIMIZERS if "@" not in name]
        precisions = [p for p in PRECISIONS if p != "bf16-both-sr"]
        stages = (1, 2, 3) if model == "demo" else (3,)
        for stage in stages:
            for optimizer in optimizers:
                for precision in precisions:
                    if model != "demo" and precision in ("bf16-states", "bf16-masters"):
                        continue
                    rows.append(f"zerotrain:{model}:{optimizer}:{precision}:{stage}")
        if deepspeed:
            for precision in ("fp32-masters", "bf16-both"):
                rows.append(f"deepspeed:{model}:AdamW:{precision}:{stages[-1]}")
            rows.append(f"deepspeed:{model}:Muon:fp32-masters:2")
        # DeepSpeed runs Muon at stages 1-2 only: zerotrain's at stage 2 beside it, with
        # Newton-Schulz in fp32 (zerotrain's default) and in bf16 (DeepSpeed's)
        rows.append(f"zerotrain:{model}:AdamW:fp32-masters:2")
        rows.append(f"zerotrain:{model}:Muon:fp32-masters:2")
        rows.append(f"zerotrain:{model}:Muon@bf16ns:fp32-masters:2")
        if deepspeed:
            rows.append(f"deepspeed:{model}:AdamW:fp32-masters:2")
    return list(dict.fromkeys(rows))


def memory_worker(name: str, steps: int) -> dict:
    system, model_name, optimizer, precision, stage = name.split(":")
    import torch.distributed as dist
    from gpt.model import GPT, gpt_config

    config = gpt_config(model_name)
    torch.manual_seed(0)
    model = GPT(config)
    psi = sum(p.numel() for p in model.parameters())
    settings = engine_config(optimizer, precision, int(stage), micro=4)
    if system == "zerotrain":
        import zerotrain

        zerotrain.init_distributed(verbose=False)
        engine, *_ = zerotrain.initialize(model=model, config=settings)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, config=settings)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps + 1):
        idx = torch.randint(0, config.vocab_size, (4, config.block_size), generator=generator)
        start = time.perf_counter()
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    out = {
        "step_s": statistics.median(times[1:]),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": psi,
    }
    if system == "zerotrain":
        breakdown = engine.memory_breakdown()
        out["state_bytes"] = breakdown["total"]
        out["formula_bytes"] = breakdown["formula_total"]
    return out


# -- Newton-Schulz -----------------------------------------------------------------------------
def newton_schulz_worker(model_name: str, steps: int) -> dict:
    import torch.distributed as dist
    from gpt.model import GPT, gpt_config

    import zerotrain
    from zerotrain.zero.whole_matrices import ShardedMatrices

    spent = []
    original = ShardedMatrices.orthogonalize

    def timed(self, updates, fn):
        start = time.perf_counter()
        original(self, updates, fn)
        spent.append(time.perf_counter() - start)

    ShardedMatrices.orthogonalize = timed
    zerotrain.init_distributed(verbose=False)
    config = gpt_config(model_name)
    torch.manual_seed(0)
    model = GPT(config)
    engine, *_ = zerotrain.initialize(
        model=model, config=engine_config("Muon", "fp32-masters", 2, micro=1)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    matrices = [m for g in engine.optimizer.groups for m in _layouts(g)]
    work = [0.0] * world
    for layout in matrices:
        for matrix in layout._matrices:
            rows, cols = matrix.shape
            work[matrix.owner] += rows * cols * min(rows, cols)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps + 1):
        idx = torch.randint(0, config.vocab_size, (1, config.block_size), generator=generator)
        engine.backward(engine(idx, idx))
        engine.step()
    sent = engine.comm.stats.get("muon_matrices")
    return {
        "orthogonalize_s": statistics.median(spent[1:]),
        "work_share": work[rank] / sum(work),
        "sent_bytes_per_step": (sent.sent / (steps + 1)) if sent is not None else 0,
    }


def batched_vs_single(model_name: str, repeats: int = 3) -> tuple[float, float, int]:
    """Newton-Schulz (fp32, 5 iterations) over every Muon matrix of the model in this process:
    seconds batched by shape (as zerotrain runs it) and one matrix at a time, best of
    ``repeats``; and the number of matrices."""
    from gpt.model import GPT, gpt_config

    from zerotrain.optim.muon import NS_COEFFICIENTS, newton_schulz, uses_muon

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config(model_name))
    shapes = [p.shape for n, p in model.named_parameters() if uses_muon(n, p.shape, p)]
    by_shape: dict[torch.Size, int] = {}
    for shape in shapes:
        by_shape[shape] = by_shape.get(shape, 0) + 1
    batches = [torch.randn(count, *shape) for shape, count in by_shape.items()]
    singles = [m[None] for batch in batches for m in batch]

    def best(tensors: list[torch.Tensor]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for tensor in tensors:
                newton_schulz(tensor, 5, NS_COEFFICIENTS, 1e-7)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(batches), best(singles), len(shapes)


def _layouts(group) -> list:
    optimizer = group.store.optimizer
    return [optimizer.layout(i) for i, g in enumerate(optimizer.param_groups) if g["use_muon"]]


# -- convergence ---------------------------------------------------------------------------------
CONVERGENCE = {
    "AdamW fp32-masters": ("AdamW", "fp32-masters"),
    "Muon fp32-masters": ("Muon", "fp32-masters"),
    "Lion fp32-masters": ("Lion", "fp32-masters"),
    "AdamW bf16-states": ("AdamW", "bf16-states"),
    "AdamW bf16-masters": ("AdamW", "bf16-masters"),
    "AdamW bf16-both": ("AdamW", "bf16-both"),
    "AdamW bf16-both-sr": ("AdamW", "bf16-both-sr"),
    "Muon bf16-both": ("Muon", "bf16-both"),
}
MICRO = 16


def convergence_worker(name: str, steps: int) -> dict:
    import torch.distributed as dist
    from gpt.data import train_val_datasets
    from gpt.model import GPT, gpt_config

    import zerotrain

    optimizer, precision = CONVERGENCE[name]
    zerotrain.init_distributed(verbose=False)
    config = gpt_config("demo")
    train_set, val_set = train_val_datasets(config.block_size)
    held_out = [val_set[i * len(val_set) // HELD_OUT] for i in range(HELD_OUT)]
    settings = engine_config(optimizer, precision, 1, MICRO)
    lr = OPTIMIZERS[optimizer]["lr"]
    settings["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_max_lr": lr, "warmup_num_steps": 20},
    }
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(config), config=settings)
    rank, world = dist.get_rank(), dist.get_world_size()
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(1))
    losses, started = [], time.perf_counter()
    for step in range(steps):
        first = (step * world + rank) * MICRO
        batch = [train_set[int(i)] for i in order[first : first + MICRO]]
        loss = engine(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "held_out_loss": held_out_loss(engine, held_out),
        "seconds": time.perf_counter() - started,
    }


# -- the parent ----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.part == "memory":
        result = memory_worker(args.worker, args.steps)
    elif args.part == "newton-schulz":
        result = newton_schulz_worker(args.ns_model, args.steps)
    else:
        result = convergence_worker(args.worker, args.steps)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.barrier()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["memory", "newton-schulz", "convergence"], required=True)
    parser.add_argument("--models", nargs="+", default=["demo", "100m"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--ns-model", default="100m")
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeed's rows")
    parser.add_argument("--only", default=None, help="memory: the rows whose name has this")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = {"memory": 4, "newton-schulz": 4, "convergence": 300}[args.part]
    return args


def _options(args, name: str) -> list[str]:
    return ["--part", args.part, "--steps", str(args.steps), "--ns-model", args.ns_model]


def report_memory(results: dict, skipped: dict) -> list[str]:
    lines = [
        "| row | state bytes / param | / formula | peak RSS (GiB) | step (s) | vs AdamW fp32-masters |",
        "|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        system, model, optimizer, precision, stage = name.split(":")
        base = results.get(f"{system}:{model}:AdamW:fp32-masters:{stage}")
        step = max(r["step_s"] for r in ranks)
        ratio = step / max(r["step_s"] for r in base) if base else float("nan")
        rss = max(r["peak_rss"] for r in ranks) / 2**30
        if "state_bytes" in ranks[0]:
            per = ranks[0]["state_bytes"] / ranks[0]["params"]
            formula = ranks[0]["state_bytes"] / ranks[0]["formula_bytes"]
            bytes_cells = f"{per:.2f} | {formula:.3f}"
        else:
            bytes_cells = "- | -"
        lines.append(f"| {name} | {bytes_cells} | {rss:.2f} | {step:.3f} | {ratio:.2f} |")
    lines += [f"| {name} | not run: {why} | | | | |" for name, why in skipped.items()]
    return lines


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.part == "memory":
        names = memory_rows(args.models, args.deepspeed)
        if args.only:
            names = [name for name in names if args.only in name]
        port = 29800

        def run(name: str):
            return run_ranks(__file__, name, WORLD, port + names.index(name), _options(args, name))

        results, skipped = run_all(names, lambda n: n.startswith("deepspeed"), run)
        lines = report_memory(results, skipped)
    elif args.part == "newton-schulz":
        results, skipped, lines = (
            {},
            {},
            [
                "| world | orthogonalize (ms/step) | rank 0's share of the work | sent (MB/step) |",
                "|---|---|---|---|",
            ],
        )
        for world in args.worlds:
            got = run_ranks(__file__, f"ns{world}", world, 29900 + world, _options(args, ""))
            if isinstance(got, str):
                skipped[world] = got
                continue
            results[world] = got
            worst = max(r["orthogonalize_s"] for r in got)
            lines.append(
                f"| {world} | {1000 * worst:.0f} | {got[0]['work_share']:.2f} | "
                f"{got[0]['sent_bytes_per_step'] / 1e6:.1f} |"
            )
        lines += [f"| {world} | not run: {why} | | |" for world, why in skipped.items()]
        torch.set_num_threads(1)
        batched, single, count = batched_vs_single(args.ns_model)
        lines.append(
            f"Newton-Schulz of the {count} matrices of {args.ns_model} in one process (1 thread, "
            f"fp32): batched by shape {batched:.2f} s, one at a time {single:.2f} s "
            f"({single / batched:.2f}x)"
        )
        results["batched_vs_single_s"] = [batched, single, count]
    else:
        names = list(CONVERGENCE)

        def run(name: str):
            return run_ranks(__file__, name, WORLD, 29950 + names.index(name), _options(args, name))

        results, skipped = run_all(names, lambda n: False, run)
        base = results.get("AdamW fp32-masters")
        lines = [
            "| run | train loss | held-out loss | vs AdamW fp32-masters (held-out) | s |",
            "|---|---|---|---|---|",
        ]
        for name, ranks in results.items():
            held = ranks[0]["held_out_loss"]
            drift = held / base[0]["held_out_loss"] - 1 if base else float("nan")
            lines.append(
                f"| {name} | {ranks[0]['train_loss']:.4f} | {held:.4f} | {100 * drift:+.2f}% | "
                f"{ranks[0]['seconds']:.0f} |"
            )
        lines += [f"| {name} | not run: {why} | | | |" for name, why in skipped.items()]
    print("\n".join(lines))
    path = ROOT / "bench" / "results" / "precision.json"
    path.parent.mkdir(exist_ok=True)
    everything = json.loads(path.read_text()) if path.exists() else {}
    key = args.part + (f"[{args.only}]" if args.only else "")
    everything[key] = {
        "args": vars(args),
        "results": {str(k): v for k, v in results.items()},
        "table": lines,
    }
    path.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
