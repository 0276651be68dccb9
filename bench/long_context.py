"""Long sequences on this machine: the longest sequence a Llama-shaped model trains within a
memory budget per rank, at each of zerotrain's long-context features, with DeepSpeed's ALST on
the same job; and Ulysses' all-to-all bytes and time against the formula and an all-reduce.

    python bench/long_context.py [--model 100m] [--budget-mib 3072] [--max-tokens 8192]
    python bench/long_context.py --report                             # the saved run's tables
    python bench/long_context.py --rows +sp2 --max-tokens 32768 --merge   # rerun some rows
    python bench/long_context.py --rows zero3 sp2 deepspeed-sp2      # some rows

Every row is one torchrun job of 2 ranks (gloo, one thread each, fp32, ZeRO stage 3, SGD, one
sample per step) training transformers' LlamaForCausalLM built from a config (``--model``:
``100m`` is hidden 768, 12 layers, 12 query and 4 key/value heads, MLP 2048, vocabulary 32000,
124M parameters; ``small`` is a 4-layer, 256-wide one for a quick look). For each sequence length
of a ladder (512, 1024, 2048, ... up to ``--max-tokens``) a row runs one step and measures, per
rank, the step's time and the process's peak resident memory during it (``VmHWM``, reset with
/proc/self/clear_refs after glibc returned what it held): everything a rank holds, as a
device's memory would (the runtime, the model states, ZeRO-3's gathered parameters and
gradient buckets, the activations); a row stops at the first length over ``--budget-mib`` on
some rank. Its ``max tokens`` is the longest length that stayed within
the budget, tokens/s that step's (all ranks' tokens over the slowest rank's time). The sp rows
are compared with DeepSpeed at the longest length both ran: tokens/s and peak memory, ratios.

Rows, each adding to the one before (data-parallel rows: each rank trains its own sample):
``zero3`` a transformers model under ZeRO-3 (2 data-parallel ranks); ``+tiled-loss``
(``tiled_compute.loss``); ``+tiled-mlp`` (``tiled_compute.mlp``); ``+checkpointing`` (the
model's gradient checkpointing, non-reentrant; activation offload is not built yet, and a CPU
has no device memory to offload from); ``+sp2`` (``sequence_parallel_size`` 2: both ranks
share each sample). ``sp2`` is ``+sp2`` without the tiles, ``deepspeed-sp2`` the same job on
DeepSpeed 0.19.8's ALST (its registration and adapter, the loss aggregated by the script, as
its tutorial; DS_ACCELERATOR=cpu; skipped without ``pip install deepspeed==0.19.8``).

The all-to-all table: in the ``+sp2`` row at 2048 tokens, the bytes one forward's Ulysses
all-to-alls carried per layer (zerotrain's counters) against the formula (per rank, the q, k, v
and output shares: b x s/sp x (2 h + 2 h_kv) values, h_kv the key/value width) and the time of
one all-to-all of 8 MiB against a ring all-reduce of the same bytes on the same group (median
of 9). Writes every rank's measurements to bench/results/long_context.json. About 20 minutes
with the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import run_all, run_ranks  # noqa: E402

WORLD = 2
MODELS = {
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, intermediate_size=2048, vocab_size=32000),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=704, vocab_size=8000),
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    system: str = "zerotrain"
    tiled_loss: bool = False
    tiled_mlp: bool = False
    checkpointing: bool = False
    sp: int = 1


ROWS = {
    "zero3": Row(),
    "+tiled-loss": Row(tiled_loss=True),
    "+tiled-mlp": Row(tiled_loss=True, tiled_mlp=True),
    "+checkpointing": Row(tiled_loss=True, tiled_mlp=True, checkpointing=True),
    "+sp2": Row(tiled_loss=True, tiled_mlp=True, checkpointing=True, sp=2),
    "sp2": Row(checkpointing=True, sp=2),
    "deepspeed-sp2": Row("deepspeed", checkpointing=True, sp=2),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--budget-mib", type=int, default=3072, help="peak memory per rank")
    parser.add_argument("--max-tokens", type=int, default=8192, help="the ladder's top")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--report", action="store_true", help="print the saved run's tables")
    parser.add_argument(
        "--merge", action="store_true", help="keep the saved run's other rows (rerun some rows)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one row, on every rank of a torchrun job -----------------------------------------------------
def build_model(args, row: Row):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **MODELS[args.model], max_position_embeddings=1 << 20, attn_implementation="sdpa"
    )
    model = transformers.LlamaForCausalLM(config)
    if row.checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def engine_config(row: Row) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
        "zero_allow_untested_optimizer": True,  # DeepSpeed's ZeRO tests SGD less than Adam
        # buckets and live gathers of 50M/100M parameters (DeepSpeed's defaults are 500M and
        # 1B, the whole model here), the same for every row
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e8,
        },
        "steps_per_print": 10**6,
    }
    if row.system == "zerotrain":
        config["tiled_compute"] = {"loss": row.tiled_loss, "mlp": row.tiled_mlp}
        if row.sp > 1:
            config["sequence_parallel_size"] = row.sp
    return config


def step_memory(run) -> tuple[float, int]:
    """Seconds and the peak resident bytes of one call of ``run``."""
    from zerotrain.accelerator import peak_rss, release_free_host_memory

    release_free_host_memory()
    with open("/proc/self/clear_refs", "w") as reset:  # VmHWM back to the current RSS
        reset.write("5")
    start = time.perf_counter()
    run()
    return time.perf_counter() - start, peak_rss() or 0


def worker(args) -> None:
    import torch.distributed as dist

    from zerotrain.accelerator import map_large_host_blocks

    # blocks of 1 MiB or more mapped and unmapped on their own, so the resident memory follows
    # the bytes in use as a device allocator's count does (glibc's heap otherwise keeps what a
    # step freed between live blocks, and the peak measures its fragments: 2x at 8K tokens)
    map_large_host_blocks(1 << 20)
    row = ROWS[args.worker]
    model = build_model(args, row)
    if row.system == "zerotrain":
        import zerotrain
        from zerotrain.sequence import shard_batch

        zerotrain.init_distributed(verbose=False)
        engine, *_ = zerotrain.initialize(model=model, config=engine_config(row))
        sp = engine.layout.sequence

        def train(sample):
            batch = shard_batch(sample, sp.rank, sp.world_size) if row.sp > 1 else sample
            engine.backward(engine(**batch).loss)
            engine.step()

        comm = engine.comm
    else:
        train, comm = deepspeed_trainer(model, row), None
    rank = dist.get_rank()
    vocab = model.config.vocab_size
    budget = args.budget_mib * 2**20
    results = []
    length = 512
    train(_sample(256, vocab, rank, row))  # optimizer state and buffers exist from here
    while length <= args.max_tokens:
        if comm is not None:
            comm.reset_stats()
        sample = _sample(length, vocab, rank, row)
        seconds, peak = step_memory(lambda: train(sample))  # noqa: B023 (called here)
        a2a = comm.stats.get("sequence_all_to_all") if comm is not None else None
        sent = a2a.bytes if a2a is not None else 0
        measured = {"tokens": length, "seconds": seconds, "peak": peak, "a2a_bytes": sent}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measured)
        results.append(everyone)
        if max(r["peak"] for r in everyone) > budget:
            break
        length *= 2
    timing = exchange_timing(row) if row.sp > 1 and row.system == "zerotrain" else None
    if rank == 0:
        Path(args.out).write_text(json.dumps({"steps": results, "exchange": timing}))
    dist.barrier()


def _sample(length: int, vocab: int, rank: int, row: Row) -> dict[str, torch.Tensor]:
    """One sample of ``length`` tokens: the same on the ranks that share it (sp), each rank its
    own otherwise."""
    seed = 0 if row.sp > 1 else rank
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def deepspeed_trainer(model, row: Row):
    """DeepSpeed's ALST as its tutorial writes it: register, initialize with the mpu, the
    sample cut by its adapter's rules, the loss aggregated over the group by the script."""
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from zerotrain.sequence import shard_batch  # the same cut as DeepSpeed's adapter

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa",
        sequence_parallel_size=row.sp, micro_batch_size=1, seq_length_is_variable=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=engine_config(row), mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    rank, world = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()

    def train(sample):
        batch = shard_batch(sample, rank, world)
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits
        loss = engine.module.loss_function(
            logits=logits, labels=None, shift_labels=shift_labels, vocab_size=logits.shape[-1]
        )
        good = (shift_labels != -100).sum()
        losses = dist_fn.all_gather(loss, group=group)
        goods = dist_fn.all_gather(good, group=group)
        total = sum(losses[r] * goods[r] for r in range(world)) / sum(goods)
        engine.backward(total)
        engine.step()

    return train


def exchange_timing(row: Row) -> dict[str, float]:
    """One all-to-all of 8 MiB against an all-reduce of the same tensor over the sequence-parallel
    group (zerotrain's Communicator: pairwise exchange and gloo's ring), median of 9."""
    from zerotrain.comm import Communicator

    comm = Communicator()
    x = torch.randn(2 * 2**20)  # 8 MiB of fp32
    out = torch.empty_like(x)
    times: dict[str, list[float]] = {"all_to_all": [], "all_reduce": []}
    for _ in range(9):
        for name in times:
            comm.barrier()
            start = time.perf_counter()
            comm.all_to_all(out, x) if name == "all_to_all" else comm.all_reduce(x.clone())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


# -- the driver -----------------------------------------------------------------------------------
def run_row(name: str, args) -> list | str:
    options = ["--model", args.model, "--budget-mib", str(args.budget_mib)]
    options += ["--max-tokens", str(args.max_tokens)]
    return run_ranks(__file__, name, WORLD, 29750 + list(ROWS).index(name), options)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(__file__).parent / "results" / "long_context.json"
    if not args.report:
        results, skipped = run_all(
            args.rows,
            lambda name: ROWS[name].system == "deepspeed",
            lambda name: run_row(name, args),
        )
        out.parent.mkdir(exist_ok=True)
        raw = {"args": vars(args), "results": results, "skipped": skipped}
        if args.merge and out.exists():  # the saved rows, these replacing theirs
            saved = json.loads(out.read_text())
            raw["results"] = {**saved["results"], **results}
            raw["skipped"] = {**saved["skipped"], **skipped}
            raw["args"] = {**saved["args"], "merged": vars(args)}
        out.write_text(json.dumps(raw, indent=1))
    report(json.loads(out.read_text()))
    print(f"\n{out}")


def _tokens_per_s(name: str, step: list[dict]) -> float:
    """All ranks' tokens over the slowest rank's time (sp ranks share their sample's)."""
    return step[0]["tokens"] * (WORLD // ROWS[name].sp) / max(r["seconds"] for r in step)


def report(raw: dict) -> None:
    """The tables of a run (``--report`` prints a saved run's again)."""
    args, results = raw["args"], raw["results"]
    budget, mib = args["budget_mib"] * 2**20, 2**20
    config = MODELS[args["model"]]
    print(
        f"\nLlama {args['model']} ({', '.join(f'{k} {v}' for k, v in config.items())}), "
        f"{WORLD} ranks, fp32, gloo, ZeRO-3; budget {args['budget_mib']} MiB of peak memory "
        "per rank\n"
    )
    peer = results.get("deepspeed-sp2", {}).get("steps", [])
    peer_at = {s[0]["tokens"]: s for s in peer}
    print(
        "| row | max tokens | peak MiB at it | tokens/s at it | vs deepspeed-sp2 at the longest "
        "length both ran (tokens/s, peak memory) |"
    )
    print("|---|---|---|---|---|")
    for name, got in results.items():
        steps = got["steps"]
        fitting = [s for s in steps if max(r["peak"] for r in s) <= budget]
        best = fitting[-1] if fitting else None
        top = " (the ladder's top)" if best is not None and len(fitting) == len(steps) else ""
        cells = ["0", "-", "-"]
        if best is not None:
            peak = max(r["peak"] for r in best)
            cells = [f"{best[0]['tokens']}{top}", f"{peak / mib:.0f}"]
            cells.append(f"{_tokens_per_s(name, best):.0f}")
        versus = ""
        common = [s for s in steps if s[0]["tokens"] in peer_at]
        if name != "deepspeed-sp2" and ROWS[name].sp > 1 and common:
            mine, theirs = common[-1], peer_at[common[-1][0]["tokens"]]
            speed = _tokens_per_s(name, mine) / _tokens_per_s("deepspeed-sp2", theirs)
            memory = max(r["peak"] for r in mine) / max(r["peak"] for r in theirs)
            versus = f"{speed:.2f}x, {memory:.2f}x at {mine[0]['tokens']}"
        print(f"| {name} | {' | '.join(cells)} | {versus} |")
    for name, why in raw["skipped"].items():
        print(f"| {name} | skipped: {why} | | | |")
    _exchange_table(results.get("+sp2"), config)


def _exchange_table(got, config: dict) -> None:
    """Ulysses' bytes per layer at 2048 tokens against the formula, and the time table."""
    if not got:
        return
    at = next((s for s in got["steps"] if s[0]["tokens"] == 2048), None)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    width = config["hidden_size"]
    kv_width = width // heads * kv
    if at is not None:
        # per rank and layer, one pass: q, k, v and the output, each of s/sp tokens
        per_layer = 2048 // 2 * (2 * width + 2 * kv_width) * 4
        measured = at[0]["a2a_bytes"] / config["num_hidden_layers"]
        print(
            f"\nall-to-all at 2048 tokens, sp 2: {measured / 2**20:.2f} MiB per layer and step "
            f"= {measured / per_layer:.2f} x the formula {per_layer / 2**20:.2f} MiB "
            "(b x s/sp x (2h + 2h_kv) x 4 bytes per rank, one pass; a step makes three: forward, "
            "the checkpointed recomputation, backward)"
        )
    timing = got["exchange"]
    print(
        f"8 MiB over 2 ranks: all-to-all {timing['all_to_all'] * 1e3:.1f} ms, ring all-reduce "
        f"{timing['all_reduce'] * 1e3:.1f} ms ({timing['all_reduce'] / timing['all_to_all']:.1f}x)"
    )


if __name__ == "__main__":
    main()
