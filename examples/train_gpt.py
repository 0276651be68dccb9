"""Train a small GPT on the Python standard library's source code with ZeRO.

    zerotrain run --nproc-per-node 2 examples/train_gpt.py --steps 200

Every rank holds the whole model; ZeRO stage 1 partitions the optimizer states across the
ranks, stage 2 the gradients as well. The engine prints a throughput line every --print-every
steps (its `steps_per_print`: loss, lr, samples/s, tokens/s, TFLOP/s, memory) and the script a
summary at the end. The script uses only zerotrain's public, DeepSpeed-compatible API.
--inner-steps H [--ranks-per-site K] [--fragments F] [--exchange-timeout S]
[--outer-compression C] [--site-clusters auto|none|0,1/2] trains as sites that meet every H
steps (docs/sites.md).
--compress METHOD [--compress-rank R | --compress-ratio F] [--compress-params int8|int4]
compresses what the ranks exchange (docs/compression.md; the summary shows the bytes sent per
step). --activation-checkpointing [--ac-every K] recomputes the activations of every K-th
block in backward instead of keeping them (zerotrain.checkpointing.wrap). --profile prints the
flops profiler's per-module profile of one step (--profile-step); --tensorboard DIR writes the
per-step scalars for TensorBoard (`pip install tensorboard`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

import torch
from gpt.data import TokenWindows, train_val_datasets
from gpt.model import GPT, PRESETS, Block, gpt_config

import zerotrain
from zerotrain.fmt import MiB, quantity
from zerotrain.observability.metrics import memory_use

KEEP_CHECKPOINTS = 2  # with --checkpoint-dir: the newest kept, older ones deleted


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows the defaults
    )
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: ranks that split each block's attention and MLP (ZeRO "
        "shards over the world size / (tp x pp) data-parallel ranks)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and residuals between the split layers run on 1/tp of the "
        "sequence each (the windows' length must divide by tp)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: the blocks are spread over them (train_batch with 1F1B; ZeRO "
        "stages 0-2)",
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="Mixture-of-Experts: every other block's MLP becomes this many experts",
    )
    parser.add_argument("--top-k", type=int, choices=(1, 2), default=2, help="experts per token")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="with --experts: ranks the experts are spread over (expert parallelism; ZeRO "
        "shards each expert over the world size / ep ranks holding it)",
    )
    parser.add_argument(
        "--moe-dedup",
        action="store_true",
        help="with --experts: send a token to a rank once for all its experts there",
    )
    parser.add_argument(
        "--moe-overlap",
        type=int,
        default=1,
        help="with --experts: exchange each MoE layer's tokens in this many parts, overlapping "
        "the all-to-all with expert compute",
    )
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="training dtype"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--model", choices=sorted(PRESETS), default="demo", help="GPT preset")
    parser.add_argument("--micro-batch", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument(
        "--data", default=None, help="text file or directory (default: the stdlib's sources)"
    )
    parser.add_argument("--print-every", type=int, default=10, help="steps between lines")
    parser.add_argument("--val-batches", type=int, default=8, help="held-out batches at the end")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here, and resume from the newest complete one on start; the "
        f"newest {KEEP_CHECKPOINTS} are kept, older ones deleted (checkpoint.keep_last)",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between checkpoints"
    )
    parser.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="with --checkpoint-dir: also keep the training state in memory every this many "
        "steps, a copy on another node, and resume from it when it is newer "
        "(checkpoint.in_memory_snapshots, docs/checkpoints.md); 0: none",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute the activations of every --ac-every-th block in backward instead of "
        "keeping them",
    )
    parser.add_argument(
        "--ac-every", type=int, default=1, help="checkpoint every K-th block (1: all)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print the flops profile of one step (rank 0)"
    )
    parser.add_argument(
        "--profile-step",
        type=int,
        default=5,
        help="profile the step that starts after this many steps (flops_profiler.profile_step)",
    )
    parser.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars under DIR"
    )
    parser.add_argument(
        "--compress",
        choices=("none", "powersgd", "acp_sgd", "topk", "gtopk", "int8", "int4", "auto"),
        default="none",
        help="compress the gradients' exchange (comm_compression.gradients.method), or let "
        "the engine measure the link and choose (auto)",
    )
    parser.add_argument(
        "--compress-rank", type=int, help="powersgd/acp_sgd: the factors' rank (default 4)"
    )
    parser.add_argument(
        "--compress-ratio", type=float, help="topk/gtopk: the share of elements (default 0.01)"
    )
    parser.add_argument(
        "--compress-params",
        choices=("none", "int8", "int4"),
        default="none",
        help="quantize the parameter all-gather (ZeRO stages 1-3)",
    )
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=0,
        help="train as sites that meet every this many steps (the sites section: DiLoCo's "
        "outer steps, docs/sites.md); 0: one site",
    )
    parser.add_argument(
        "--ranks-per-site",
        type=int,
        help="with --inner-steps: ranks of each site (default: a node's, torchrun's "
        "--nproc-per-node)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="with --inner-steps: stream the outer steps in this many fragments of the model, "
        "each exchanged while the next inner step trains (sites.streaming); 0: whole",
    )
    parser.add_argument(
        "--outer-compression",
        choices=("none", "int8", "int4", "topk", "auto"),
        help="with --inner-steps: the codec of the outer exchange between the sites "
        "(sites.compression.method; auto: chosen from the measured link)",
    )
    parser.add_argument(
        "--site-clusters",
        metavar="auto|none|0,1/2",
        type=site_clusters,
        help="with --inner-steps: sites joined by fast links, which exchange whole among "
        "themselves (sites.clusters: auto, measured with --outer-compression auto; none; or "
        "the sites' numbers, a cluster's joined by commas, clusters by slashes)",
    )
    parser.add_argument(
        "--exchange-timeout",
        type=float,
        metavar="SECONDS",
        help="with --inner-steps: how long a collective between the sites may take before the "
        "lost-site error (sites.exchange_timeout_s; default: the collective timeout)",
    )
    parser.add_argument(
        "--plan",
        metavar="JSON",
        help="a ds_config written by `zerotrain plan`: its ZeRO section (stage, offload), "
        "micro-batch, accumulation, activation checkpointing and tensor-parallel degree replace "
        "those flags",
    )
    args = parser.parse_args()
    args.zero = {"stage": args.stage}
    if args.plan:
        apply_plan(args, parser)
    for name in (
        "steps",
        "micro_batch",
        "grad_accum",
        "print_every",
        "val_batches",
        "checkpoint_every",
        "ac_every",
        "tp",
        "pp",
        "ep",
        "moe_overlap",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.pp > 1 and args.grad_accum < args.pp:
        parser.error(
            f"--grad-accum ({args.grad_accum}) must be at least --pp ({args.pp}): a pipeline "
            "step's micro-batches fill the stages"
        )
    if args.ac_every != 1 and not args.activation_checkpointing:
        parser.error("--ac-every applies only with --activation-checkpointing")
    for flag, value, methods in (
        ("rank", args.compress_rank, ("powersgd", "acp_sgd")),
        ("ratio", args.compress_ratio, ("topk", "gtopk")),
    ):
        if value is not None and args.compress not in methods:
            parser.error(f"--compress-{flag} applies only with --compress {' or '.join(methods)}")
    for name in ("snapshot_every", "fragments"):  # 0: off
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more")
    if args.snapshot_every and not args.checkpoint_dir:
        parser.error("--snapshot-every applies only with --checkpoint-dir (what a restart loads)")
    if args.exchange_timeout is not None and args.exchange_timeout <= 0:
        parser.error("--exchange-timeout must be more than 0 seconds")
    for flag, given in (
        ("ranks-per-site", args.ranks_per_site is not None),
        ("fragments", args.fragments),
        ("exchange-timeout", args.exchange_timeout is not None),
        ("outer-compression", args.outer_compression is not None),
        ("site-clusters", args.site_clusters is not None),
    ):
        if given and args.inner_steps < 1:
            parser.error(f"--{flag} applies only with --inner-steps")
    if args.compress == "auto" and args.compress_params != "none":
        parser.error("--compress-params: --compress auto chooses the parameter gathers' too")
    if args.profile and not 0 <= args.profile_step < args.steps:
        parser.error(f"--profile-step must be in 0..{args.steps - 1} (--steps {args.steps})")
    return args


def apply_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The choices of a config written by `zerotrain plan` (docs/plan.md), in place of the
    flags."""
    try:
        with open(args.plan) as file:
            plan = json.load(file)
        args.zero = dict(plan["zero_optimization"])
        args.stage = args.zero["stage"]
        args.micro_batch = plan["train_micro_batch_size_per_gpu"]
        args.grad_accum = plan.get("gradient_accumulation_steps", 1)
        args.tp = plan.get("tensor_parallel", {}).get("autotp_size", 1)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        parser.error(f"--plan {args.plan}: not a config `zerotrain plan` wrote ({error!r})")
    args.activation_checkpointing = "activation_checkpointing" in plan


def site_clusters(text: str) -> str | list[list[int]]:
    """--site-clusters: auto, none, or ``0,1/2`` as [[0, 1], [2]]."""
    if text in ("auto", "none"):
        return text
    try:
        return [[int(site) for site in cluster.split(",")] for cluster in text.split("/")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: auto, none, or site numbers such as 0,1/2"
        ) from None


def sites(args: argparse.Namespace) -> dict:
    """The sites section for --inner-steps, --ranks-per-site, --fragments, --exchange-timeout,
    --outer-compression and --site-clusters."""
    section = {"inner_steps": args.inner_steps, "ranks_per_site": args.ranks_per_site}
    section["exchange_timeout_s"] = args.exchange_timeout
    if args.outer_compression:
        section["compression"] = {"method": args.outer_compression}
    if args.site_clusters is not None:
        section["clusters"] = args.site_clusters
    if args.fragments:
        section["streaming"] = {"fragments": args.fragments, "overlap_steps": 1}
    return section


def engine_config(args: argparse.Namespace) -> dict:
    """DeepSpeed-style config for the flags."""
    warmup = max(1, min(100, args.steps // 10))
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": warmup,
                "cos_min_ratio": 0.1,
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": args.zero,
        "tensor_parallel": {"autotp_size": args.tp, "sequence_parallel": args.sequence_parallel},
        "moe": {"token_dedup": args.moe_dedup, "overlap_chunks": args.moe_overlap},
        "checkpoint": {
            "keep_last": KEEP_CHECKPOINTS,
            "in_memory_snapshots": {
                "enabled": args.snapshot_every > 0,
                "every_steps": max(1, args.snapshot_every),
            },
        },
        "comm_compression": compression(args),
        **({"sites": sites(args)} if args.inner_steps else {}),
        # profile: the summary reports the time spent recomputing
        **(
            {"activation_checkpointing": {"profile": True}} if args.activation_checkpointing else {}
        ),
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16"},
        # the engine's throughput line is the progress line
        "steps_per_print": args.print_every,
        "flops_profiler": {
            "enabled": args.profile,
            "profile_step": args.profile_step,
            "module_depth": 3,  # model, blocks, block, attention/MLP
            "top_modules": 3,
        },
        "tensorboard": {
            "enabled": args.tensorboard is not None,
            "output_path": args.tensorboard or "",
            "job_name": f"gpt-{args.model}-stage{args.stage}",
        },
    }


def compression(args: argparse.Namespace) -> dict:
    """The comm_compression section for the flags: gradients compressed after the warm-up's
    exact steps, as the learning rate's."""
    if args.compress == "auto":
        return {"auto": True}
    gradients = {"method": args.compress}
    if args.compress != "none":
        gradients["warmup_steps"] = max(1, min(100, args.steps // 10))
    if args.compress_rank is not None:  # else the config's default
        gradients["rank"] = args.compress_rank
    if args.compress_ratio is not None:
        gradients["ratio"] = args.compress_ratio
    return {"gradients": gradients, "parameters": {"method": args.compress_params}}


def described(compression: dict) -> str:
    """A comm_compression section in a few words, for the first line."""
    if compression.get("auto"):
        return "auto"
    gradients, words = compression["gradients"], [compression["gradients"]["method"]]
    if "rank" in gradients:
        words.append(f"rank {gradients['rank']}")
    if "ratio" in gradients:
        words.append(f"{gradients['ratio']:.0%}")
    if compression["parameters"]["method"] != "none":
        words.append(f"+ {compression['parameters']['method']} params")
    return " ".join(words)


def sent_bytes(engine) -> int:
    """What this rank has sent over all its collectives so far."""
    return sum(stats.sent for stats in engine.comm.stats.values())


def layout(args: argparse.Namespace, engine) -> str:
    """The mesh, as the summary shows it: pipeline x tensor x data parallel."""
    return f"pp {args.pp} x tp {args.tp} x dp {engine.dp_world_size}"


def forever(loader) -> Iterator:
    """Batches of `loader`, epoch after epoch. The loader initialize() returns shuffles each
    epoch anew and continues where a loaded checkpoint left off."""
    while True:
        yield from loader


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each of ``values`` averaged over all ranks (collective): the loss the throughput line
    shows, for the summary."""
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    zerotrain.comm.all_reduce(summed)
    return (summed / zerotrain.comm.get_world_size()).tolist()


def print_summary(rows: list[tuple[str, object]]) -> None:
    """The end-of-run summary: one aligned ``name  value`` line per row."""
    width = max(len(name) for name, _ in rows)
    print("summary")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


@torch.no_grad()
def validation_loss(
    engine, val_set: TokenWindows, batches: int, batch_size: int
) -> tuple[float, int]:
    """Mean loss over `batches` batches (whole pipeline steps) of windows spread evenly over
    `val_set`; returns (loss, batches used). Every rank evaluates the same windows, so rank
    0's value is the global one."""
    # a pipeline evaluates micro-batches in groups of a step's: whole groups, at least one
    group = engine.gradient_accumulation_steps() if hasattr(engine, "eval_batch") else 1
    batches = -(-batches // group) * group
    count = min(batches * batch_size, len(val_set))
    if count < group * batch_size:
        raise ValueError(
            f"the validation split has {len(val_set)} windows, fewer than a pipeline step's "
            f"{group} micro-batches of {batch_size}"
        )
    indices = torch.linspace(0, len(val_set) - 1, count).long().tolist()
    engine.eval()
    pairs = []
    for start in range(0, count, batch_size):
        xs, ys = zip(*(val_set[i] for i in indices[start : start + batch_size]), strict=True)
        pairs.append((torch.stack(xs).to(engine.device), torch.stack(ys).to(engine.device)))
    if hasattr(engine, "eval_batch"):
        pairs = pairs[: len(pairs) // group * group]
        losses = [
            engine.eval_batch(iter(pairs[i : i + group])).item()
            for i in range(0, len(pairs), group)
        ]
        engine.train()
        return sum(losses) / len(losses), len(losses) * group
    losses = [engine(x, y).item() for x, y in pairs]
    engine.train()
    return sum(losses) / len(losses), len(losses)


def main() -> None:
    args = parse_args()
    zerotrain.init_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    config = gpt_config(
        args.model,
        num_experts=args.experts,
        moe_k=args.top_k,
        ep_size=args.ep if args.experts else 1,
    )
    model = GPT(config)
    if args.activation_checkpointing:
        zerotrain.checkpointing.wrap(model, block_type=Block, every=args.ac_every)
    train_set, val_set = train_val_datasets(config.block_size, args.data)
    num_parameters = model.num_parameters()  # whole: initialize may split and shard them
    # a rank builds 1/ep of the experts: the others are the other ranks'
    experts = sum(p.numel() for p in model.parameters() if zerotrain.moe.utils.is_moe_param(p))
    num_parameters += experts * (config.ep_size - 1)
    if args.pp > 1:
        from gpt.pipeline import pipeline_gpt

        model = pipeline_gpt(model, args.pp)
    engine, _, train_loader, _ = zerotrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=train_set,
        config=engine_config(args),
    )
    engine.total_steps = args.steps  # the line's N/total (a resumed schedule keeps its own)
    is_rank0 = engine.global_rank == 0
    tokens_per_step = engine.train_batch_size() * config.block_size  # over all ranks
    if is_rank0:
        print(
            f"GPT '{args.model}': {num_parameters:,} parameters | ZeRO stage "
            f"{engine.zero_optimization_stage()} | {args.precision} | world {engine.world_size} "
            + (f"({layout(args, engine)}) " if args.tp * args.pp > 1 else "")
            + (f"| compression {described(compression(args))} " if args.compress != "none" else "")
            + f"| {engine.train_batch_size()} windows x {config.block_size} tokens per step | "
            f"{len(train_set):,} training windows",
            flush=True,
        )

    first_step = 1
    if args.checkpoint_dir:  # resume from the newest complete checkpoint, if there is one
        path, _ = engine.load_checkpoint(args.checkpoint_dir)
        first_step = engine.global_steps + 1
        if is_rank0 and path:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    batches = forever(train_loader)
    step_losses: list[float] = []
    sent_before = sent_bytes(engine)
    start = time.perf_counter()
    for step in range(first_step, args.steps + 1):
        # each step's loss on this rank: the mean over its micro-batches (over all ranks at the
        # end, as the engine's line prints it)
        if args.pp > 1:  # the schedule runs the step's micro-batches through the stages
            pairs = ((x.to(engine.device), y.to(engine.device)) for x, y in batches)
            step_losses.append(engine.train_batch(pairs).item())
        micro_losses = []
        for _ in range(engine.gradient_accumulation_steps() if args.pp == 1 else 0):
            x, y = (t.to(engine.device) for t in next(batches))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.item())
        if micro_losses:
            step_losses.append(sum(micro_losses) / len(micro_losses))
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
            saved = time.perf_counter()
            path = engine.save_checkpoint(args.checkpoint_dir)
            if is_rank0:
                print(f"saved {path} in {time.perf_counter() - saved:.2f} s", flush=True)
    train_seconds = time.perf_counter() - start
    sent = sent_bytes(engine) - sent_before  # checkpoints' gathers included
    engine.destroy()  # flush the TensorBoard file
    steps_run = args.steps - first_step + 1
    if steps_run < 1:
        if is_rank0:
            print(f"nothing to do: the checkpoint is at step {first_step - 1} >= --steps")
        return

    val_loss, val_batches = validation_loss(engine, val_set, args.val_batches, args.micro_batch)
    step_losses = mean_over_ranks(step_losses, engine.device)
    if is_rank0:
        last = step_losses[-10:]
        memory = engine.memory_breakdown()
        rows = [
            ("ZeRO stage", engine.zero_optimization_stage()),
            ("world size", engine.world_size),
            *([("parallelism", layout(args, engine))] if args.tp * args.pp > 1 else []),
            ("parameters", f"{num_parameters:,}"),
            ("precision", args.precision),
            ("first loss", f"{step_losses[0]:.4f}"),
            ("final loss", f"{step_losses[-1]:.4f}"),
            (f"mean loss, last {len(last)} steps", f"{sum(last) / len(last):.4f}"),
            ("validation loss", f"{val_loss:.4f} ({val_batches} batches)"),
            ("training time", f"{train_seconds:.1f} s ({train_seconds / steps_run:.3f} s/step)"),
            ("tokens/s (all ranks)", f"{tokens_per_step * steps_run / train_seconds:,.0f}"),
            ("sent per step (rank 0)", f"{sent / steps_run / 1e6:.3f} MB"),
            (
                "model states per rank (rank 0)",
                f"{memory['total'] / MiB:.1f} MiB: parameters {memory['parameters'] / MiB:.1f}, "
                f"gradients {memory['gradients'] / MiB:.1f}, "
                f"optimizer states {memory['optimizer_states'] / MiB:.1f} "
                f"(ZeRO formula: {memory['formula_total'] / MiB:.1f} MiB)",
            ),
            (
                "peak RSS (rank 0)",
                quantity(
                    memory_use(torch.device("cpu")).peak_bytes or 0, "B", prefix="Mi", digits=0
                ),
            ),
        ]
        if memory["compression"]:  # error feedback, factors, counts
            rows.append(("compression state (rank 0)", f"{memory['compression'] / MiB:.1f} MiB"))
        if memory["sites"]:  # the outer steps' anchor and momentum
            rows.append(("outer step state (rank 0)", f"{memory['sites'] / MiB:.1f} MiB"))
        if args.activation_checkpointing:
            stats = zerotrain.checkpointing.recompute_stats()
            rows.append(
                (
                    "activation checkpointing",
                    f"every {args.ac_every} of {config.n_layer} blocks: "
                    f"{stats.recomputations} recomputations, {stats.recompute_seconds:.1f} s",
                )
            )
        print_summary(rows)


if __name__ == "__main__":
    main()
