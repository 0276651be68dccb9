"""A Mixture-of-Experts GPT on 4 processes: zerotrain's expert parallelism (ep 1, 2 and 4, with
and without token deduplication and chunked overlap) against DeepSpeed-MoE on the same job, in
one run.

    python bench/moe.py [--model tiny] [--experts 8] [--k 2] [--steps 3] [--warmup 1]
                        [--rows ep1 ep2 ep2-dedup ep4 ep4-dedup deepspeed-ep1 deepspeed-ep2 ...]

Each row trains the GPT of examples/gpt/model.py with every other block's MLP an MoE layer of
`--experts` experts (top-`--k` gating, capacity factor 1.25) on 4 ranks (one torchrun job per
row; gloo, fp32, CPU, ZeRO stage 1, clipping at 1.0), from the same data, and reports:
- tokens per second: the global batch's tokens over the slowest rank's median step;
- all-to-all bytes per rank per step, as zerotrain's communicator counted them: the hidden
  states (`all_to_all`) and the routing metadata (`all_to_all_metadata`), payload and sent;
- what a capacity-padded dispatch (DeepSpeed's) moves for the same layers: every layer sends
  experts x capacity x width values each way, in forward and in backward;
- the exposed all-to-all time: the seconds a step waits on its all-to-alls (zerotrain's
  count), a share of the step; `-overlap` rows exchange each layer's tokens in 4 chunks in
  flight (moe.overlap_chunks), so one chunk's all-to-all runs while another's experts compute;
- the loss after the last step (the rows with equal ep and gating train the same model).
`deepspeed-*` rows build the same GPT with `deepspeed.moe.layer.MoE` (DeepSpeed's engine,
ZeRO stage 1, its param groups split with split_params_into_different_moe_groups_for_optimizer)
when deepspeed is installed; their bytes and times are not counted. Writes
bench/results/moe.json.

On this 2-core machine 4 processes share the cores: the all-to-alls cost little against the
compute, and a smaller exposed time cannot shorten a compute-bound step. What carries over to
a network-bound cluster is the bytes: with top-2 routing over ep ranks a token crosses the
network k (ep - 1) / ep times each way, and deduplication removes the duplicate (token, rank)
pairs, about 1 / (number of ranks) of top-2's pairs under uniform routing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from launch import run_all, run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

SEQUENCES_PER_STEP = 16  # over the 4 ranks
WORLD = 4


class Row(NamedTuple):
    system: str  # zerotrain, deepspeed
    ep: int
    dedup: bool = False
    chunks: int = 1  # moe.overlap_chunks


ROWS = {
    "ep1": Row("zerotrain", 1),
    "ep2": Row("zerotrain", 2),
    "ep2-dedup": Row("zerotrain", 2, dedup=True),
    "ep2-overlap": Row("zerotrain", 2, chunks=4),
    "ep4": Row("zerotrain", 4),
    "ep4-dedup": Row("zerotrain", 4, dedup=True),
    "ep4-overlap": Row("zerotrain", 4, chunks=4),
    "ep4-dedup-overlap": Row("zerotrain", 4, dedup=True, chunks=4),
    "deepspeed-ep1": Row("deepspeed", 1),
    "deepspeed-ep2": Row("deepspeed", 2),
    "deepspeed-ep4": Row("deepspeed", 4),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="GPT preset (examples/gpt/model.py)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--k", type=int, choices=(1, 2), default=2, help="experts per token")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one row, on every rank of a torchrun job -----------------------------------------------------
def build_model(args, row: Row):
    from gpt.model import GPT, gpt_config

    config = gpt_config(args.model, num_experts=args.experts, moe_k=args.k, ep_size=row.ep)
    if row.system == "deepspeed":  # the same GPT, its MoE layers DeepSpeed's
        import deepspeed.moe.layer

        import zerotrain.moe

        zerotrain.moe.MoE = deepspeed.moe.layer.MoE  # gpt.model imports it when building
    torch.manual_seed(0)
    return GPT(config), config


def engine_config(args, row: Row) -> dict:
    return {
        "train_batch_size": SEQUENCES_PER_STEP,
        "train_micro_batch_size_per_gpu": SEQUENCES_PER_STEP // WORLD,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        **(
            {"moe": {"token_dedup": row.dedup, "overlap_chunks": row.chunks}}
            if row.system == "zerotrain"
            else {}
        ),
    }


def worker(args) -> None:
    import torch.distributed as dist

    row = ROWS[args.worker]
    model, config = build_model(args, row)
    if row.system == "zerotrain":
        import zerotrain

        zerotrain.init_distributed(verbose=False)
        engine, *_ = zerotrain.initialize(model=model, config=engine_config(args, row))
    else:
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        deepspeed.init_distributed(dist_backend="gloo")
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"}
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=groups, config=engine_config(args, row)
        )
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps
    data = torch.randint(
        0, config.vocab_size, (total, SEQUENCES_PER_STEP, config.block_size + 1), generator=gen
    )
    micro = SEQUENCES_PER_STEP // WORLD
    times, loss = [], 0.0
    for step in range(total):
        if step == args.warmup and row.system == "zerotrain":
            engine.comm.reset_stats()
        window = data[step][rank * micro : (rank + 1) * micro]
        dist.barrier()
        start = time.perf_counter()
        out = engine(window[:, :-1], window[:, 1:])
        engine.backward(out)
        engine.step()
        times.append(time.perf_counter() - start)
        loss = out.item()
    result = {"seconds": times[args.warmup :], "loss": loss}
    if row.system == "zerotrain":
        stats = {
            op: [st.bytes / args.steps, st.sent / args.steps, st.seconds / args.steps]
            for op, st in engine.comm.stats.items()
            if op.startswith("all_to_all")
        }
        result["all_to_all"] = stats
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()


def padded_bytes(args, config) -> float:
    """Bytes per rank per step of a capacity-padded dispatch of the same layers (DeepSpeed's
    einsum dispatch): per MoE layer, experts x capacity x width fp32 values each way (dispatch
    and combine), in forward and in backward."""
    from zerotrain.moe.gating import capacity

    tokens = SEQUENCES_PER_STEP // WORLD * config.block_size
    layers = config.n_layer // 2
    slots = args.experts * capacity(tokens, args.experts, args.k, 1.25, 4)
    return layers * slots * config.n_embd * 4 * 2 * 2


# -- the driver -----------------------------------------------------------------------------------
def run_row(name: str, args) -> list[dict] | str:
    """Every rank's result for one row, or why it did not run."""
    options = [
        "--model", args.model, "--experts", str(args.experts), "--k", str(args.k),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    return run_ranks(__file__, name, WORLD, 29700 + list(ROWS).index(name), options)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from gpt.model import gpt_config

    config = gpt_config(args.model)
    tokens = SEQUENCES_PER_STEP * config.block_size
    results, skipped = run_all(
        args.rows, lambda name: ROWS[name].system == "deepspeed", lambda name: run_row(name, args)
    )
    rows = []
    for name, got in results.items():
        row = ROWS[name]
        step = max(statistics.median(r["seconds"]) for r in got)
        a2a = got[0].get("all_to_all", {})
        hidden = a2a.get("all_to_all", [0, 0, 0])
        meta = a2a.get("all_to_all_metadata", [0, 0, 0])
        rows.append(
            {
                "row": name,
                "system": row.system,
                "ep": row.ep,
                "dedup": row.dedup,
                "s_per_step": step,
                "tokens_per_s": tokens / step,
                "hidden_bytes": hidden[0],
                "hidden_sent": hidden[1],
                "metadata_sent": meta[1],
                "exposed_s": max(sum(v[2] for v in r.get("all_to_all", {}).values()) for r in got),
                "loss": statistics.fmean(r["loss"] for r in got),
            }
        )
    padded = padded_bytes(args, gpt_config(args.model))
    mib = 2**20
    print(
        f"\nGPT {args.model}, {args.experts} experts in every other block, top-{args.k}, "
        f"{WORLD} ranks, fp32, gloo, ZeRO stage 1, {tokens} tokens per step\n"
    )
    columns = [
        "row", "s/step", "vs DeepSpeed-MoE (same ep)", "tokens/s", "hidden MiB/step (sent)",
        "vs capacity-padded", "metadata sent MiB", "exposed all-to-all s (share)", "final loss",
    ]  # fmt: skip
    deepspeed = {r["ep"]: r["s_per_step"] for r in rows if r["system"] == "deepspeed"}
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        counted = r["system"] == "zerotrain"
        anchor = deepspeed.get(r["ep"]) if counted else None
        cells = [
            r["row"],
            f"{r['s_per_step']:.3f}",
            f"{r['s_per_step'] / anchor:.2f}" if anchor else "-",
            f"{r['tokens_per_s']:.0f}",
            f"{r['hidden_bytes'] / mib:.2f} ({r['hidden_sent'] / mib:.2f})" if counted else "-",
            f"{r['hidden_bytes'] / padded:.2f} of {padded / mib:.2f}"
            if counted and r["ep"] > 1
            else "-",
            f"{r['metadata_sent'] / mib:.3f}" if counted else "-",
            f"{r['exposed_s']:.3f} ({r['exposed_s'] / r['s_per_step']:.2f})" if counted else "-",
            f"{r['loss']:.4f}",
        ]
        print("| " + " | ".join(cells) + " |")
    for name, why in skipped.items():
        print(f"- {name}: {why}")
    results = ROOT / "bench" / "results" / "moe.json"
    results.write_text(json.dumps({"args": vars(args), "rows": rows, "skipped": skipped}, indent=2))
    print(f"\nwrote {results.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
