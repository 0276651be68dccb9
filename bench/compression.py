"""Communication compression across two "nodes" joined by a slow link: bytes per step, step
time and time to a fixed loss, for each method and ZeRO stage, against uncompressed zerotrain
and torch DDP (with and without its PowerSGD hook) on the same link, in one run.

    sudo python bench/compression.py [--rate 1gbit] [--delay 0.5ms] [--steps 150]
                                     [--micro-batch 2] [--eval-every 10]
                                     [--ranks-per-node 1] [--rows ...]

Two network namespaces joined by a veth pair limited with `tc` (tests/netns.py; with
`--delay`, two TUN devices and the delay line of tests/delay_line.py), one rank in
each (`--ranks-per-node 2`: two, as the hpZ rows need; `zerotrain run`, torchrun's rendezvous
over the link), train the demo GPT of
examples/gpt on the embedded corpus, fp32, AdamW (lr 1e-3 after 10 warm-up steps, clipping
at 1.0), the same batches in every row. Per row:
- bytes per rank per step, the median step once compression runs (after its 10 warm-up
  steps): what zerotrain's communicator counted (bytes the rank sent), and what left the
  rank's end of the veth (`tx_bytes`: TCP/IP included; the only count DDP has); and the
  mean counted (0/1 Adam's local steps send almost nothing on most steps);
- the ratio of the counted bytes to uncompressed bf16's at the same stage (half the fp32 row's
  count: the same collectives in 2-byte elements);
- the median step time, and the time to reach the loss the uncompressed stage-1 row has after
  80% of its steps (the mean of 10 steps' losses, averaged over the ranks);
- the loss on 16 held-out windows every ``--eval-every`` steps (outside the timing), and the
  time to reach the uncompressed stage-1 row's at 80% of its steps. The training loss is of
  the same batches in every row, so a batch easier than most can carry every row below the
  target at one step; the held-out loss does not move with the batch.
A small micro-batch keeps the compute of a step near what a GPU does in the time the link
needs for the model's bytes: on 2 shared CPU cores a large batch would hide any network.
Needs root and iproute2. Writes bench/results/compression_<rate>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

from zerotrain.optim.onebit import ONE_BIT_OPTIMIZERS  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}}
ONEBIT = {"type": "OneBitAdam", "params": {"lr": 1e-3, "weight_decay": 0.01, "freeze_step": 20}}
# 0/1 Adam (its variance must settle before it freezes: beta2 0.99): 1 bit from step 33 on
# the steps that do not update the variance, frozen after step 41; with local steps,
# synchronizing every 2nd step from step 52, every 4th from 62, every 8th from 72
ZERO_ONE = {
    "type": "ZeroOneAdam",
    "params": {
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "weight_decay": 0.01,
        "var_freeze_step": 40,
        "var_update_scaler": 32,
    },
}
ZERO_ONE_LOCAL = {
    "type": "ZeroOneAdam",
    "params": {**ZERO_ONE["params"], "local_step_scaler": 10, "local_step_clipper": 8},
}


def zt(
    stage: int,
    gradients: dict | None = None,
    parameters: str = "none",
    optimizer=ADAMW,
    auto: bool = False,
    hpz: bool = False,
    zero: dict | None = None,
):
    # the 1-bit optimizers choose their exact steps themselves; uncompressed has none
    compresses = gradients or auto
    warmup = {"warmup_steps": 10} if compresses else {}
    if optimizer["type"].lower() in ONE_BIT_OPTIMIZERS:
        warmup = {}
    return {
        "kind": "zerotrain",
        "stage": stage,
        "gradients": {**warmup, **(gradients or {})},
        "parameters": parameters,
        "optimizer": optimizer,
        "auto": auto,
        "hpz": hpz,
        "zero": zero or {},  # more zero_optimization keys
    }


# stage 3 as for a model too large to keep gathered: every block gathered again for backward
# (the gathers hierarchical_partition keeps inside the node)
REGATHER = {"stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
SMALL_BUCKETS = {"reduce_bucket_size": 1_000_000}
# stages 1-2 overlapping both directions: reductions with backward, gathers with the next forward
OVERLAPPED = {**SMALL_BUCKETS, "overlap_param_gather": True}


ROWS = {
    "DDP": {"kind": "ddp"},
    "DDP + PowerSGD hook (rank 4)": {"kind": "ddp", "powersgd": 4},
    "DDP, 4 MB buckets": {"kind": "ddp", "bucket_cap_mb": 4},  # as the 1M-element rows
    "zerotrain s0": zt(0),
    "zerotrain s0 powersgd r4": zt(0, {"method": "powersgd", "rank": 4}),
    # rank 16: a sixteenth of the demo GPT's width, within 2% of uncompressed (convergence.py)
    "zerotrain s0 powersgd r16": zt(0, {"method": "powersgd", "rank": 16}),
    "zerotrain s0 auto": zt(0, auto=True),
    # buckets of 1M elements: the first ones reduce while backward goes on (the default 500M
    # makes the demo GPT one bucket, reduced after backward)
    "zerotrain s0, 1M-element buckets": zt(0, zero=SMALL_BUCKETS),
    "zerotrain s0 powersgd r4, 1M-element buckets": zt(
        0, {"method": "powersgd", "rank": 4}, zero=SMALL_BUCKETS
    ),
    "zerotrain s0 ZeroOneAdam": zt(0, optimizer=ZERO_ONE),
    "zerotrain s0 ZeroOneAdam, local steps to 8": zt(0, optimizer=ZERO_ONE_LOCAL),
    "zerotrain s1": zt(1),
    "zerotrain s1 powersgd r4 + int4 params": zt(1, {"method": "powersgd", "rank": 4}, "int4"),
    "zerotrain s1 powersgd r16 + int4 params": zt(1, {"method": "powersgd", "rank": 16}, "int4"),
    "zerotrain s1 acp_sgd r4 + int4 params": zt(1, {"method": "acp_sgd", "rank": 4}, "int4"),
    "zerotrain s1 int8 + int8 params": zt(1, {"method": "int8"}, "int8"),
    "zerotrain s1 auto": zt(1, auto=True),
    "zerotrain s1, 1M-element buckets, gathers in forward": zt(1, zero=OVERLAPPED),
    "zerotrain s1 OneBitAdam + int4 params": zt(1, None, "int4", ONEBIT),
    "zerotrain s2": zt(2),
    "zerotrain s2, 1M-element buckets, gathers in forward": zt(2, zero=OVERLAPPED),
    "zerotrain s2 int4 + int4 params": zt(2, {"method": "int4"}, "int4"),
    "zerotrain s2 int4 + int4 params, 1M-element buckets, gathers in forward": zt(
        2, {"method": "int4"}, "int4", zero=OVERLAPPED
    ),
    "zerotrain s2 topk 1% + int4 params": zt(2, {"method": "topk", "ratio": 0.01}, "int4"),
    "zerotrain s2 gtopk 1% + int4 params": zt(2, {"method": "gtopk", "ratio": 0.01}, "int4"),
    "zerotrain s2 topk 1% + int4 params, catch_up false": zt(
        2, {"method": "topk", "ratio": 0.01, "catch_up": False}, "int4"
    ),
    "zerotrain s2 topk 10% + int4 params": zt(2, {"method": "topk", "ratio": 0.1}, "int4"),
    "zerotrain s2 gtopk 10% + int4 params": zt(2, {"method": "gtopk", "ratio": 0.1}, "int4"),
    "zerotrain s3": zt(3),
    "zerotrain s3 int4 + int4 params": zt(3, {"method": "int4"}, "int4"),
    "zerotrain s3 auto": zt(3, auto=True),
    # with --ranks-per-node 2 (hpZ needs a node of several ranks)
    "zerotrain s3 re-gathered": zt(3, zero=REGATHER),
    "zerotrain s3 re-gathered + hpZ": zt(3, hpz=True, zero=REGATHER),
    "zerotrain s3 re-gathered + hpZ + int8": zt(
        3, {"method": "int8"}, "int8", hpz=True, zero=REGATHER
    ),
    # and the gradients reduce-scattered inside each node first (qgZ's hierarchy)
    "zerotrain s3 re-gathered + hpZ + int8, gradients by node": zt(
        3, {"method": "int8", "hierarchical": True}, "int8", hpz=True, zero=REGATHER
    ),
    "zerotrain s2 int4 + int4 params, gradients by node": zt(
        2, {"method": "int4", "hierarchical": True}, "int4"
    ),
}
UNCOMPRESSED = {0: "zerotrain s0", 1: "zerotrain s1", 2: "zerotrain s2", 3: "zerotrain s3"}
# held-out windows spread over the corpus's validation split, the same on every rank
HELD_OUT_WINDOWS = 16


# -- one rank of one row (inside a namespace) ----------------------------------------------------
def worker(spec: dict, out: str) -> None:
    import torch
    from gpt.data import train_val_datasets
    from gpt.model import GPT, gpt_config

    torch.manual_seed(0)
    config = gpt_config("demo")
    model = GPT(config)
    train_set, val_set = train_val_datasets(config.block_size)
    micro, steps = spec["micro_batch"], spec["steps"]
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    trainer = _trainer(spec, model)
    rank, world, mean, counted = trainer.rank, trainer.world, trainer.mean, trainer.counted
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(1))
    spread = torch.linspace(0, len(val_set) - 1, HELD_OUT_WINDOWS).long().tolist()
    held_x, held_y = (torch.stack(t) for t in zip(*(val_set[i] for i in spread), strict=True))
    losses, times, wire, counted_steps, calls_steps, held_out = [], [], [], [], [], []
    for step in range(steps):
        first = (step * world + rank) * micro
        batch = [train_set[int(i)] for i in order[first : first + micro]]
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        sent, before, calls_before = _tx_bytes(interface), counted(), trainer.calls()
        start = time.perf_counter()
        # the window closes after the ranks' mean loss, a collective: what a step leaves
        # running (a parameter gather overlapped with the next forward) is timed in a window,
        # never between two
        losses.append(mean(trainer.step(x, y)))
        times.append(time.perf_counter() - start)
        wire.append(_tx_bytes(interface) - sent)
        after = counted()
        if after is not None and before is not None:
            counted_steps.append(sum(after.values()) - sum(before.values()))
        calls_after = trainer.calls()
        if calls_after is not None and calls_before is not None:
            calls_steps.append(calls_after - calls_before)
        if (step + 1) % spec["eval_every"] == 0:  # outside the window: not a step's time
            held_out.append([step, mean(trainer.evaluate(held_x, held_y))])
    import torch.distributed as dist

    dist.barrier()  # then leave together: gloo aborts a process whose peer closed first
    if rank == 0:
        result = {
            "losses": losses,
            "times": times,
            "wire": wire,
            "counted_steps": counted_steps,
            "calls_steps": calls_steps,
            "counted": counted(),
            "held_out": held_out,
            "decisions": trainer.decisions(),
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _tx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


class Trainer(NamedTuple):
    step: Callable  # (x, y) -> this rank's loss
    evaluate: Callable  # (x, y) -> this rank's replica's loss, no gradients
    rank: int
    world: int
    mean: Callable[[float], float]  # over the ranks
    counted: Callable[[], dict | None]  # zerotrain's bytes sent so far, per operation
    calls: Callable[[], int | None]  # zerotrain's collectives launched so far
    decisions: Callable[[], list[str]]  # comm_compression.auto's


def _trainer(spec: dict, model) -> Trainer:
    import torch

    # DeepSpeed's WarmupLR, which zerotrain's reproduces: min_lr for the first two steps, then
    # linear (the zerotrain rows' schedule, so DDP trains the same model: 3e-7 measured)
    warmup = lambda step: min(1.0, max(0, step - 1) / 10)  # noqa: E731
    if spec["kind"] == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        # PowerSGD's hook issues each bucket's second all-reduce from a callback thread: with
        # several buckets on gloo the ranks can issue them in different orders (a collective
        # mismatch, measured here), so its row runs one bucket
        buckets = {"bucket_cap_mb": 1024} if "powersgd" in spec else {}
        if "bucket_cap_mb" in spec:
            buckets = {"bucket_cap_mb": spec["bucket_cap_mb"]}
        ddp = DistributedDataParallel(model, **buckets)
        if "powersgd" in spec:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power

            state = power.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=spec["powersgd"],
                start_powerSGD_iter=10,
            )
            ddp.register_comm_hook(state, power.powerSGD_hook)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

        def ddp_step(x, y):
            loss = ddp(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            return loss.item()

        def ddp_mean(value: float) -> float:
            tensor = torch.tensor([value])
            dist.all_reduce(tensor)
            return tensor.item() / dist.get_world_size()

        @torch.no_grad()
        def ddp_evaluate(x, y):
            return model(x, y).item()  # the module itself: no DDP hooks

        return Trainer(
            ddp_step,
            ddp_evaluate,
            dist.get_rank(),
            dist.get_world_size(),
            ddp_mean,
            lambda: None,
            lambda: None,
            list,
        )

    import zerotrain

    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": spec["optimizer"],
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": spec["optimizer"]["params"]["lr"],
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
        "gradient_clipping": 1.0,
        "steps_per_print": None,
        "zero_optimization": {"stage": spec["stage"], **spec["zero"]},
        "comm_compression": {
            "gradients": spec["gradients"],
            "parameters": {"method": spec["parameters"]},
            "auto": spec["auto"],
            "hierarchical_partition": spec["hpz"],
        },
    }
    engine = zerotrain.initialize(model=model, config=config)[0]
    comm = engine.optimizer.comm
    comm.reset_stats()

    def zt_step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def zt_mean(value: float) -> float:
        tensor = torch.tensor([value])
        zerotrain.comm.all_reduce(tensor)
        return tensor.item() / engine.world_size

    def counted() -> dict:
        return {op: s.sent for op, s in comm.stats.items()}

    def calls() -> int:
        return sum(s.calls for s in comm.stats.values())

    def decisions() -> list[str]:
        tuner = engine.optimizer.group.extensions.get("auto")
        return [d.line(engine.world_size) for d in tuner.decisions] if tuner else []

    @torch.no_grad()
    def zt_evaluate(x, y):
        engine.eval()
        loss = engine(x, y).item()
        engine.train()
        return loss

    return Trainer(
        zt_step,
        zt_evaluate,
        engine.global_rank,
        engine.world_size,
        zt_mean,
        counted,
        calls,
        decisions,
    )


# -- the driver (root) ---------------------------------------------------------------------------
def run_row(nodes, name: str, spec: dict, args, port: int) -> dict | str:
    from netns import run_job

    spec = {**spec, "steps": args.steps, "micro_batch": args.micro_batch}
    spec["eval_every"] = args.eval_every
    script = ["bench/compression.py", "--worker", json.dumps(spec), "--out", "{out}"]
    return run_job(nodes, script, ranks_per_node=args.ranks_per_node, port=port, name=name)


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]


def _time_to(losses_at: list, target: float, times: list[float]) -> float | None:
    """The steps' time until the first (step, loss) of ``losses_at`` at or below ``target``."""
    step = next((step for step, loss in losses_at if loss <= target), None)
    return None if step is None else sum(times[: step + 1])


def summarize(results: dict, args) -> tuple[list[str], dict]:
    """The table's lines and the figures behind them."""
    reference = results.get("zerotrain s1")
    if not isinstance(reference, dict):
        raise SystemExit("the uncompressed stage-1 row did not run: no target loss")
    target = smoothed(reference["losses"])[int(0.8 * args.steps) - 1]
    # the held-out loss of the last evaluation within the same 80% of the steps
    before = [loss for step, loss in reference["held_out"] if step < 0.8 * args.steps]
    if not before:
        raise SystemExit(f"no held-out evaluation in 80% of {args.steps} steps: --eval-every")
    held_target = before[-1]
    skip = max(1, args.steps // 10)  # the first steps: warm-up, allocation
    lines = [
        f"demo GPT, fp32, 2 nodes x {args.ranks_per_node} rank(s), link {args.rate}"
        + (f", delay {args.delay}" if args.delay else "")
        + f", micro-batch {args.micro_batch}, {args.steps} steps; target loss {target:.3f}"
        + f", held-out {held_target:.3f} (every {args.eval_every} steps)",
        "",
        "| row | counted bytes/step | bf16 uncompressed / counted | on the wire/step | step time (s) "
        "| time to target (s) | to held-out target (s) | final loss (10-step mean) "
        "| final held-out loss | mean counted bytes/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    figures = {}
    for name, result in results.items():
        if not isinstance(result, dict):
            lines.append(f"| {name} | {result} | | | | | | | | |")
            continue
        # bytes once compression runs (after its 10 warm-up steps): the median step's
        compressed = result["counted_steps"][max(skip, 10) :]
        counted = statistics.median(compressed) if compressed else None
        mean = statistics.mean(compressed) if compressed else None  # local steps: most send 0
        spec = ROWS[name]
        base = results.get(UNCOMPRESSED.get(spec.get("stage", 0), ""))
        ratio = None
        if counted and isinstance(base, dict):
            ratio = statistics.median(base["counted_steps"][max(skip, 10) :]) / 2 / counted
        curve = smoothed(result["losses"])
        to_target = _time_to(enumerate(curve), target, result["times"])
        to_held_target = _time_to(result["held_out"], held_target, result["times"])
        step_time = statistics.median(result["times"][skip:])
        wire = statistics.median(result["wire"][max(skip, 10) :])
        figures[name] = {
            "counted_bytes_per_step": counted,
            "mean_counted_bytes_per_step": mean,
            "bf16_ratio": ratio,
            "wire_bytes_per_step": wire,
            "step_time": step_time,
            "time_to_target": to_target,
            "time_to_held_out_target": to_held_target,
            "final_loss": curve[-1],
            "final_held_out_loss": result["held_out"][-1][1] if result["held_out"] else None,
        }
        lines.append(
            f"| {name} | {_megabytes(counted)} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{_megabytes(wire)} | {step_time:.3f} | {_seconds(to_target)} | "
            f"{_seconds(to_held_target)} | {curve[-1]:.3f} | "
            f"{figures[name]['final_held_out_loss'] or float('nan'):.3f} | {_megabytes(mean)} |"
        )
    decided = [(name, r["decisions"]) for name, r in results.items() if isinstance(r, dict)]
    for name, decisions in decided:
        if decisions:
            lines += ["", f"{name}:", *(f"    {line}" for line in decisions)]
    figures = {"target_loss": target, "held_out_target_loss": held_target, "rows": figures}
    return lines, figures


def _megabytes(count: float | None) -> str:
    return "-" if count is None else f"{count / 1e6:.2f} MB"


def _seconds(time_to: float | None) -> str:
    return "not reached" if time_to is None else f"{time_to:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way (tc)")
    parser.add_argument(
        "--delay",
        default=None,
        help="added to each packet each way (tests/delay_line.py: up to about 2 Gbit/s here)",
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument(
        "--eval-every", type=int, default=10, help="steps between held-out evaluations"
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=1, help="ranks in each namespace (hpZ rows: 2)"
    )
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out)
        return
    from netns import run_rows

    rows = list(dict.fromkeys(["zerotrain s1", *args.rows]))  # the target loss's row first

    def row(nodes, name: str, port: int) -> dict | str:
        return run_row(nodes, name, ROWS[name], args, port)

    results = run_rows("bench/compression.py", args.rate, args.delay, rows, row, 29700)
    lines, figures = summarize(results, args)
    print("\n" + "\n".join(lines))
    slug = re.sub(r"\W+", "", args.rate)
    if args.delay:  # its own file: compression_model.py fits the runs without a delay
        slug += "_" + re.sub(r"[^\w.]+", "", args.delay)
    out = ROOT / "bench" / "results" / f"compression_{slug}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **figures, "raw": results}, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
