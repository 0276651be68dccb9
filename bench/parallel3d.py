"""Tensor and pipeline parallelism composed with ZeRO, against data parallelism alone, torch
DDP, torchtitan-style FSDP2 + TP and DeepSpeed (its engine and its PipelineModule), in one run.

    python bench/parallel3d.py [--model 30m] [--stage 2] [--steps 3] [--warmup 1]
                               [--schedule 1f1b|gpipe|interleaved_1f1b|zbv]
                               [--layouts dp4 tp2xdp2 tp2xdp2-sp tp4 pp2xdp2 pp2xtp2 ...]

Each layout trains the GPT of examples/gpt/model.py on 4 ranks (one torchrun job per layout, one
after the other; gloo, fp32, CPU, clipping at 1.0) from the same weights on the same global
batch (`--micro` x dp x accumulation, the accumulation chosen so that every layout sees 8
sequences per step) and reports: median seconds per step over `--steps` timed steps after
`--warmup`; peak RSS of the busiest rank; model states per rank (zerotrain's
`memory_breakdown()['total']`, and its ratio to the ZeRO formula over this rank's parameters);
activation bytes per rank (the tensors autograd saves for backward in one micro-batch's forward,
each storage counted once, parameters left out); and bytes per axis per rank per step as
zerotrain's communicators counted them, against the formulas ([Note: bytes per axis]). The loss
after the last step shows that the layouts train the same model.

`pp*` rows train the GPT as a PipelineModule (embeddings, blocks, final norm, and the head tied
to the embeddings across the first and last stage; the blocks spread evenly) with `--schedule`
(interleaved and ZBV with two stages per rank); a stage's activations are not measured alone
(its forward runs inside the schedule). `tp2xdp2-sp` adds sequence parallelism. `ddp-dp4` is
torch's DistributedDataParallel; `fsdp2-*` rows are torch's `fully_shard` (and, with tp,
`parallelize_module` ColwiseParallel/RowwiseParallel over a 2-D DeviceMesh; with pp, stages of
fully-sharded layers under torch's 1F1B, the head untied: torchtitan's compositions);
`dtensor-tp4` is torch's tensor parallelism alone (`parallelize_module` on DTensor, the same
plan, no data parallelism), against zerotrain's `tp4`;
`deepspeed-*` rows are DeepSpeed's engine at `--stage` and its PipelineModule (ZeRO stage 1:
its pipelines refuse 2) on the same layers, when deepspeed is installed. Their bytes are not
counted. Writes bench/results/parallel3d.json.

[Note: the bubble measured]
A pipeline stage waits while the pipeline fills and drains: with m micro-batches over p ranks of
equal cost it computes m / (m + p - 1) of the step under 1F1B and GPipe (see busy_formula for
the others). The measured share is a rank's forward and backward seconds (the engine's own
timings) over the step time. On this machine 4 processes share 2 cores, so a waiting stage
gives its core to the others: the measured share mixes the bubble with that sharing, and the
stage-to-stage traffic counts as waiting. The order alone is tested exactly in
tests/test_pipeline.py (zerotrain/pipe/timeline.py replays it).

[Note: bytes per axis]
TP: the tensor-parallel group's own count (payload, and what this rank sent). Per block and micro-batch it all-reduces the
activations after the attention output and the MLP in forward and the input gradients of the
two column-split layers (fused q/k/v and the MLP's first) in backward: 4 x micro x tokens x
width x 4 bytes (payload; a ring sends 2(tp-1)/tp of it). With sequence parallelism those are
an all-gather and a reduce-scatter each, 8 payloads per block, plus 2 per micro-batch at the
edges of the blocks, and the blocks' unsplit gradients summed once per step: twice the payload
of the all-reduces, the same bytes sent ((tp-1)/tp of each, against 2(tp-1)/tp); without pipelines
the gradient norm's 4 bytes go over the same group. PP: the activations a stage sends to the
next and the gradients it sends back, micro x tokens x width x 4 bytes per micro-batch each.
DP: ZeRO stages 1-2 reduce-scatter the gradients and all-gather the parameters over the
data-parallel group: (1 + 1) x Ψ_rank x 4 bytes at stage 1, (accumulation + 1) x Ψ_rank x 4 at
stage 2 (which reduce-scatters every micro-batch; a parameter that two of the rank's stages use,
ZBV's tied embedding, once in each stage's backward), Ψ_rank the parameters this rank holds after
the tensor-parallel split (payload; a ring sends (dp-1)/dp of it each way).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from launch import run_all, run_ranks

from zerotrain.pipe.module import MULTI_STAGE_PLACEMENT, rank_of_stage, stage_options

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

SEQUENCES_PER_STEP = 8


class Layout(NamedTuple):
    system: str  # zerotrain, fsdp2, dtensor, ddp, deepspeed
    tp: int
    pp: int
    sequence_parallel: bool = False


LAYOUTS = {
    "dp4": Layout("zerotrain", 1, 1),
    "tp2xdp2": Layout("zerotrain", 2, 1),
    "tp2xdp2-sp": Layout("zerotrain", 2, 1, sequence_parallel=True),
    "tp4": Layout("zerotrain", 4, 1),
    "pp2xdp2": Layout("zerotrain", 1, 2),
    "pp2xtp2": Layout("zerotrain", 2, 2),
    "ddp-dp4": Layout("ddp", 1, 1),
    "fsdp2-dp4": Layout("fsdp2", 1, 1),
    "fsdp2-tp2xdp2": Layout("fsdp2", 2, 1),
    "fsdp2-pp2xdp2": Layout("fsdp2", 1, 2),
    "dtensor-tp4": Layout("dtensor", 4, 1),
    "deepspeed-dp4": Layout("deepspeed", 1, 1),
    "deepspeed-pp2xdp2": Layout("deepspeed", 1, 2),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="30m", help="GPT preset (examples/gpt/model.py)")
    parser.add_argument(
        "--stage",
        type=int,
        choices=(1, 2),
        default=2,
        help="ZeRO stage of zerotrain and DeepSpeed (whose pipelines take stage 1 at most)",
    )
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--schedule",
        choices=sorted(["1f1b", "gpipe", *MULTI_STAGE_PLACEMENT]),
        default="1f1b",
        help="pipeline schedule",
    )
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one layout, on every rank of a torchrun job --------------------------------------------------
def activation_bytes(model, x, y) -> int:
    """Bytes of the tensors autograd saves in one forward (each storage once), parameters
    left out."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        base = tensor if tensor._base is None else tensor._base
        if base.is_leaf and base.requires_grad:  # a parameter or a view of one (weight.t())
            return tensor
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's piece on this rank
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()  # the gradients are dropped below: this forward is not a step
    return sum(seen.values())


def zerotrain_engine(model, args, tp: int, pp: int, sequence_parallel: bool):
    import zerotrain

    dp = 4 // (tp * pp)
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_batch_size": SEQUENCES_PER_STEP,
            "train_micro_batch_size_per_gpu": args.micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": args.stage},
            "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sequence_parallel},
            "pipeline": {"schedule": args.schedule},
            "steps_per_print": None,
        },
    )
    assert engine.dp_world_size == dp
    if (
        engine.layout.tensor_parallel is not None
        and engine.layout.tensor_parallel.comm is not engine.comm
    ):
        engine.layout.tensor_parallel.comm.stats = {}  # the tensor-parallel group's traffic alone
    return engine


def deepspeed_engine(model, args, pp: int):
    import deepspeed

    if pp > 1:
        from gpt.pipeline import pipeline_gpt

        model = pipeline_gpt(model, pp, pipe=deepspeed.pipe)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_batch_size": SEQUENCES_PER_STEP,
            "train_micro_batch_size_per_gpu": args.micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": args.stage if pp == 1 else 1},
            "steps_per_print": 10**9,
        },
    )
    return engine


def interleave_fused_qkv(layer: torch.nn.Linear, tp: int) -> None:
    """Reorder the fused q/k/v rows as [q_0, k_0, v_0, q_1, ...] (rank r's heads together), so
    that ColwiseParallel's contiguous split gives each rank whole heads of q, k and v: the same
    function, as torchtitan gets from separate wq/wk/wv layers."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            pieces = [block.chunk(tp) for block in param.data.chunk(3)]
            param.data = torch.cat([pieces[j][r] for r in range(tp) for j in range(3)])


def dtensor_tensor_parallel(model, tp_mesh) -> None:
    """torch's tensor parallelism on DTensor: ``parallelize_module`` with ColwiseParallel /
    RowwiseParallel on each block's attention and MLP, as torchtitan plans them."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    for block in model.blocks:
        interleave_fused_qkv(block.attn.qkv, tp)
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
        block.attn.n_head //= tp


def fsdp2_model(model, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4 // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        dtensor_tensor_parallel(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


class FSDP2Pipeline:
    """torchtitan's composition for pp x dp: each stage's layers fully_shard over the dp axis
    of a (pp, dp) DeviceMesh, run by torch.distributed.pipelining's 1F1B, with the interface
    the step loop uses (``train_batch``, ``zero_grad``). The head is a copy of the token
    embedding, trained apart (torchtitan's models do not tie weights across stages)."""

    def __init__(self, gpt, pp: int, micro_batches: int):
        from gpt.pipeline import Embeddings, lm_loss
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        mesh = init_device_mesh("cpu", (pp, 4 // pp), mesh_dim_names=("pp", "dp"))
        stage = mesh.get_local_rank("pp")
        blocks = list(gpt.blocks)
        per_stage = len(blocks) // pp
        mine = blocks[stage * per_stage : (stage + 1) * per_stage]
        layers: list[torch.nn.Module] = [*mine]
        if stage == 0:
            layers.insert(0, Embeddings(gpt))
        if stage == pp - 1:
            head = torch.nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
            head.weight.data.copy_(gpt.token_embedding.weight.data)
            layers += [gpt.ln_final, head]
        module = torch.nn.Sequential(*layers)
        for block in mine:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        self.module = module
        self.first, self.last = stage == 0, stage == pp - 1
        self.pp_group = mesh["pp"].get_group()
        self.last_rank = torch.distributed.get_global_rank(self.pp_group, pp - 1)
        self.schedule = Schedule1F1B(
            PipelineStage(module, stage, pp, torch.device("cpu"), group=self.pp_group),
            n_microbatches=micro_batches,
            loss_fn=lm_loss,
        )
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def train_batch(self, data_iter) -> torch.Tensor:
        pairs = list(data_iter)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(torch.cat([x for x, _ in pairs]))
        else:
            self.schedule.step(target=torch.cat([y for _, y in pairs]), losses=losses)
        clip_dtensor_grads(list(self.module.parameters()), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        torch.distributed.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return loss


def clip_dtensor_grads(params: list[torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ for gradients on different device meshes (TP blocks on dp x tp, the rest
    on dp), which torch's refuses to stack: a total per mesh, as torchtitan computes it."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    total_sq = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += norm.item() ** 2
    coefficient = min(1.0, max_norm / (total_sq**0.5 + 1e-6))
    for grads in by_mesh.values():
        for grad in grads:
            grad.mul_(coefficient)


def count_compute(engine) -> list[float]:
    """The seconds of every forward and backward the engine runs from now on, appended to the
    returned list: the engine's own timings (what its throughput line reports), tapped."""
    seconds: list[float] = []
    metrics = engine.metrics
    observe_forward, add_time = metrics.observe_forward, metrics.add_time

    def forward_timed(args, kwargs, spent):
        seconds.append(spent)
        observe_forward(args, kwargs, spent)

    def backward_timed(phase, spent):
        if phase == "backward":
            seconds.append(spent)
        add_time(phase, spent)

    metrics.observe_forward, metrics.add_time = forward_timed, backward_timed
    return seconds


def worker(args) -> None:
    import torch.distributed as dist
    from gpt.model import GPT, gpt_config

    system, tp, pp, sequence_parallel = LAYOUTS[args.worker]
    torch.manual_seed(0)
    config = gpt_config(args.model)
    model = GPT(config)
    engine = optimizer = None
    if system == "zerotrain":
        import zerotrain

        zerotrain.init_distributed(verbose=False)
        if pp > 1:
            from gpt.pipeline import pipeline_gpt

            model = pipeline_gpt(model, pp, **stage_options(args.schedule))
        engine = zerotrain_engine(model, args, tp, pp, sequence_parallel)
        dp, dp_rank = engine.dp_world_size, engine.optimizer.comm.rank
        accum = engine.gradient_accumulation_steps()
    elif system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine = deepspeed_engine(model, args, pp)
        dp = 4 // pp
        dp_rank = dist.get_rank() % dp
        accum = engine.gradient_accumulation_steps()
    else:
        dist.init_process_group("gloo")
        dp = 4 // (tp * pp)
        accum = SEQUENCES_PER_STEP // (args.micro * dp)
        if pp > 1:  # pp outermost, as zerotrain's mesh
            engine = FSDP2Pipeline(model, pp, accum)
            dp_rank = dist.get_rank() % dp
        else:
            if system == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            elif system == "dtensor":  # tensor parallelism alone: every rank one batch
                from torch.distributed.device_mesh import init_device_mesh

                dtensor_tensor_parallel(model, init_device_mesh("cpu", (tp,)))
            else:
                model = fsdp2_model(model, tp)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            dp_rank = dist.get_rank() // tp
    forward = engine if engine is not None else model
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps
    data = torch.randint(
        0, config.vocab_size, (total, SEQUENCES_PER_STEP, config.block_size + 1), generator=gen
    )

    def micro_batch(step: int, micro: int):
        chunk = micro * dp + dp_rank
        window = data[step][chunk * args.micro : (chunk + 1) * args.micro]
        return window[:, :-1], window[:, 1:]

    x, y = micro_batch(0, 0)
    # a pipeline stage's forward is run by its schedule: not measured alone
    activations = activation_bytes(forward, x, y) if pp == 1 else None
    if engine is not None:
        engine.zero_grad()
    else:
        optimizer.zero_grad()
    times = []
    busy = count_compute(engine) if pp > 1 and system == "zerotrain" else None
    for step in range(total):
        losses = []  # this rank's micro-batch losses of the step
        if step == args.warmup and system == "zerotrain":
            for comm in _counting_comms(engine):
                comm.reset_stats()
            if busy is not None:
                busy.clear()
        dist.barrier()
        start = time.perf_counter()
        if pp > 1:  # the schedule runs every micro-batch and steps
            loss = engine.train_batch(iter([micro_batch(step, m) for m in range(accum)]))
            losses.append(loss.item())
        for micro in range(accum if pp == 1 else 0):
            x, y = micro_batch(step, micro)
            if engine is not None:
                out = engine(x, y)
                engine.backward(out)
                engine.step()
                losses.append(out.item())
            else:
                last = micro == accum - 1
                with model.no_sync() if system == "ddp" and not last else nullcontext():
                    out = model(x, y) / accum
                    out.backward()
                losses.append(out.item() * accum)
        if engine is None:
            if system == "ddp":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                clip_dtensor_grads(list(model.parameters()), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    result = {
        "seconds": times[args.warmup :],
        # a stage's forward and backward seconds per timed step ([Note: the bubble measured])
        "busy": None if busy is None else sum(busy) / args.steps,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "activation_bytes": activations,
        "loss": sum(losses) / len(losses),  # of the last step
    }
    if system == "zerotrain":
        memory = engine.memory_breakdown()
        stats = engine.comm.stats
        tp_stats = (
            {}
            if engine.layout.tensor_parallel is None
            else engine.layout.tensor_parallel.comm.stats
        )
        blocks = [m for m in engine.module.modules() if type(m).__name__ == "Block"]
        result.update(
            ops={op: [st.calls, st.bytes] for op, st in stats.items()},
            model_states=memory["total"],
            formula=memory["formula_total"],
            tp_bytes=sum(st.bytes for st in tp_stats.values()) / args.steps,
            tp_sent=sum(st.sent for st in tp_stats.values()) / args.steps,
            pp_bytes=_payload(stats, "send") / args.steps,
            dp_bytes=(_payload(stats, "reduce_scatter") + _payload(stats, "all_gather"))
            / args.steps,
            rank_params=engine.optimizer.group.num_params,
            # parameters two of a rank's stages use (ZBV's tied embedding on the first rank):
            # stage 2 reduces them in each stage's backward
            reused_numel=_reused_numel(engine.module) if pp > 1 else 0,
            # sequence parallelism sums these gradients over the tensor-parallel group
            summed_numel=sum(p.numel() for p in engine.layout.tensor_parallel.summed)
            if engine.layout.tensor_parallel is not None
            else 0,
            blocks=len(blocks),
            accum=accum,
        )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    if system in ("zerotrain", "ddp"):
        dist.destroy_process_group()
    # else: left to exit; destroying groups torch's DeviceMesh or DeepSpeed made aborts on gloo


def _reused_numel(module) -> int:
    """Elements of the parameters several of a pipeline rank's stages use, counted once per
    extra stage."""
    chunks_of = module.chunks_of()
    trained = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() * (len(chunks_of[id(p)]) - 1) for p in trained)


def _counting_comms(engine) -> list:
    """The communicators whose counts the bench reads: the engine's, and the tensor-parallel
    group's when it counts alone (see zerotrain_engine)."""
    tp = engine.layout.tensor_parallel
    return [engine.comm] + ([tp.comm] if tp is not None and tp.comm is not engine.comm else [])


def _payload(stats, op: str) -> int:
    return stats[op].bytes if op in stats else 0


# -- the driver -----------------------------------------------------------------------------------
def run_layout(name: str, args) -> list[dict] | str:
    """Every rank's result for one layout, or why it did not run."""
    options = [
        "--model", args.model, "--stage", str(args.stage), "--micro", str(args.micro),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--schedule", args.schedule,
    ]  # fmt: skip
    return run_ranks(__file__, name, 4, 29600 + list(LAYOUTS).index(name), options)


def stage_boundaries(rank: int, pp: int, schedule: str) -> int:
    """How many activations a pipeline rank sends per micro-batch: forward to the next stage
    and backward to the previous one, when that stage is on another rank."""
    options = stage_options(schedule)
    total = pp * options.get("stages_per_rank", 1)
    placement = options.get("stage_placement", "loop")
    rank_of = [rank_of_stage(s, pp, placement) for s in range(total)]
    mine = [s for s in range(total) if rank_of[s] == rank]
    forward = sum(s + 1 < total and rank_of[s + 1] != rank for s in mine)
    return forward + sum(s > 0 and rank_of[s - 1] != rank for s in mine)


def busy_formula(m: int, p: int, schedule: str) -> float:
    """The share of a step a rank computes with m micro-batches over p ranks, forward, input
    gradient and weight gradients costing alike (zerotrain/pipe/timeline.py): 1F1B and GPipe
    m / (m + p - 1), interleaved with v stages per rank vm / (vm + p - 1), ZBV (v = 2, the
    backward split in two) 6m / (6m + p - 1) once m >= 2p."""
    if schedule == "zbv":
        return 6 * m / (6 * m + p - 1)
    v = stage_options(schedule).get("stages_per_rank", 1)
    return v * m / (v * m + p - 1)


def summarize(name: str, ranks: list[dict], args, config) -> dict:
    system, tp, pp, sequence_parallel = LAYOUTS[name]
    row = {
        "layout": name,
        "system": system,
        "tp": tp,
        "pp": pp,
        "dp": 4 // (tp * pp),
        # the slowest rank's median: a step ends when every rank is done
        "s_per_step": max(statistics.median(r["seconds"]) for r in ranks),
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "activation_bytes": None
        if ranks[0]["activation_bytes"] is None
        else max(r["activation_bytes"] for r in ranks),
        # the last step's loss over the global batch (tensor-parallel peers hold equal ones)
        "loss": statistics.fmean(r["loss"] for r in ranks),
        # pipelines: the share of the step each stage computed, the slowest stage's median step
        # as the step (the rest is the bubble, and the stage-to-stage traffic)
        "busy_share": None
        if ranks[0]["busy"] is None
        else [r["busy"] / max(statistics.median(q["seconds"]) for q in ranks) for r in ranks],
    }
    if system == "zerotrain":
        r0 = ranks[0]
        activation = args.micro * config.block_size * config.n_embd * 4  # one, whole, fp32
        per_micro = (8 * r0["blocks"] + 2) if sequence_parallel else 4 * r0["blocks"]
        tp_formula = per_micro * activation * r0["accum"] if tp > 1 else 0
        if tp > 1 and pp == 1:  # the gradient norm's square sums over the same group
            tp_formula += 4
        if sequence_parallel:  # the blocks' unsplit gradients (shards past stage 0)
            tp_formula += r0["summed_numel"] * 4 // (row["dp"] if args.stage > 0 else 1)
        row.update(
            ops=r0["ops"],
            micro_batches=r0["accum"],
            model_states=max(r["model_states"] for r in ranks),
            states_vs_formula=r0["model_states"] / r0["formula"],
            tp_bytes=r0["tp_bytes"],
            tp_sent=r0["tp_sent"],
            tp_formula=tp_formula,
            pp_bytes=r0["pp_bytes"],
            pp_formula=stage_boundaries(0, pp, args.schedule) * r0["accum"] * activation
            if pp > 1
            else 0,
            dp_bytes=r0["dp_bytes"],
            # stage 2 reduce-scatters every micro-batch (a parameter two stages of the rank use,
            # in each one's backward), stage 1 once per step
            dp_formula=(
                r0["accum"] * (r0["rank_params"] + r0["reused_numel"])
                if args.stage == 2
                else r0["rank_params"]
            )
            * 4
            + r0["rank_params"] * 4
            if row["dp"] > 1
            else 0,
        )
    return row


def ratio(a, b) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def cells(r: dict, base: dict | None) -> list[str]:
    """One table row: ratios against dp4 (zerotrain's data parallelism) and the formulas."""
    mib = 2**20

    def vs_base(key: str) -> str:
        return ratio(r[key], base[key]) if base else "-"

    def traffic(axis: str) -> str:
        measured, formula = r[f"{axis}_bytes"], r[f"{axis}_formula"]
        if not measured and not formula:
            return "0"
        return f"{measured / mib:.2f} ({ratio(measured, formula)})"

    activations = r["activation_bytes"]
    out = [
        r["layout"],
        f"{r['s_per_step']:.3f}",
        vs_base("s_per_step"),
        f"{r['peak_rss'] / mib:.0f}",
        "-" if activations is None else f"{activations / mib:.1f} ({vs_base('activation_bytes')})",
    ]
    if r["system"] == "zerotrain":
        out += [
            f"{r['model_states'] / mib:.1f} ({vs_base('model_states')})",
            f"{r['states_vs_formula']:.4f}",
            traffic("tp") + (f", sent {r['tp_sent'] / mib:.2f}" if r["tp_sent"] else ""),
            traffic("pp"),
            traffic("dp"),
        ]
    else:
        out += ["-", "-", "not counted", "not counted", "not counted"]
    return [*out, f"{r['loss']:.4f}"]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from gpt.model import gpt_config

    config = gpt_config(args.model)
    results, skipped = run_all(
        args.layouts,
        lambda name: LAYOUTS[name].system == "deepspeed",
        lambda name: run_layout(name, args),
    )
    rows = [summarize(name, got, args, config) for name, got in results.items()]
    base = next((r for r in rows if r["layout"] == "dp4"), None)
    print(
        f"\nGPT {args.model}, 4 ranks, fp32, gloo, ZeRO stage {args.stage}, "
        f"{SEQUENCES_PER_STEP} x {config.block_size} tokens per step\n"
    )
    columns = [
        "layout", "s/step", "vs dp4", "peak RSS MiB", "activations MiB (vs dp4)",
        "model states MiB (vs dp4)", "states / formula", "TP MiB/step (vs formula)",
        "PP MiB/step (vs formula)", "DP MiB/step (vs formula)", "final loss",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        print("| " + " | ".join(cells(r, base)) + " |")
    pipelines = [r for r in rows if r["pp"] > 1]
    if pipelines:
        print(f"\nPipeline busy share per rank ({args.schedule}), against the bubble formula:")
        print("| layout | micro-batches m | ranks p | measured, per rank | formula |")
        print("|---|---|---|---|---|")
        for r in pipelines:
            if r["busy_share"] is None:
                continue
            measured = ", ".join(f"{share:.2f}" for share in r["busy_share"])
            m, p = r["micro_batches"], r["pp"]
            formula = busy_formula(m, p, args.schedule)
            print(f"| {r['layout']} | {m} | {p} | {measured} | {formula:.2f} |")
    for name, why in skipped.items():
        print(f"- {name}: {why}")
    results = ROOT / "bench" / "results" / "parallel3d.json"
    results.write_text(
        json.dumps(
            {"model": args.model, "stage": args.stage, "rows": rows, "skipped": skipped}, indent=2
        )
        + "\n"
    )
    print(f"\nwrote {results.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
