"""What the self-describing messages between pipeline stages cost (zerotrain/comm/stage_messages.py).

    zerotrain run --nproc-per-node 2 bench/pipeline_messages.py [--model demo] [--steps 10]
                  [--trips 300] [--only trips|steps|messages]

Two ranks, gloo, fp32, CPU. `trips`: round trips of one activation ([micro-batch, block size,
width] of the GPT preset) between the ranks, torch's isend/irecv with the receive posted first
(what torch's stages do with their fixed buffers) against StageMessages (the header first, then
the tensors' operations, as a schedule posts them) with the shapes fixed and with a new shape
every message. `steps`: pp 2 steps of the example GPT (examples/gpt/pipeline.py) under 1F1B,
every micro-batch at the block size, then with the sequence length changing every step.
`messages`: under each schedule, 3 pp 2 steps of the tiny GPT at a fixed length: the messages
both ranks sent (headers alone, headers packed with their tensors, fillers, tensor messages;
torch's start-up exchange adds a few packed and tensor ones), and with 8 micro-batches (1F1B,
ZBV) the most bytes that only unfinished sends kept alive on a rank, sampled after each forward
and backward (a sent activation still held for its backward is not counted). Rank 0 prints
medians and minimums; the steps and messages parts also run on an older tree (they hook
torch.distributed's isend, not zerotrain), for a before/after:

    git archive REV zerotrain | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old zerotrain run --nproc-per-node 2 bench/pipeline_messages.py --only steps

Writes bench/results/pipeline_messages.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt.model import GPT, gpt_config  # noqa: E402
from gpt.pipeline import pipeline_gpt  # noqa: E402

import zerotrain  # noqa: E402
from zerotrain.comm import Communicator  # noqa: E402

MICRO, ACCUM = 4, 4


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times)}


def round_trips(shape: tuple[int, ...], trips: int) -> dict[str, dict[str, float]]:
    """Seconds per round trip of a ``shape`` tensor: raw, messages (fixed), messages (changing),
    one trip of each in turn, so that the machine's noise falls on each alike."""
    from zerotrain.comm.stage_messages import MessageKey, StageMessages

    comm = Communicator()
    peer = 1 - comm.rank
    ways = ("torch isend/irecv", "messages, fixed shapes", "messages, changing shapes")
    messages = {way: StageMessages(comm, torch.device("cpu")) for way in ways}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for trip in range(trips + 10):
        for way in ways:
            rows = shape[0] - trip % 2 if way.endswith("changing shapes") else shape[0]
            x = torch.randn(rows, *shape[1:])
            comm.barrier()
            start = time.perf_counter()
            if way.startswith("torch"):
                into = torch.empty_like(x)
                if comm.rank == 0:
                    back = dist.irecv(into, src=peer)
                    dist.isend(x, dst=peer).wait()
                    back.wait()
                else:
                    dist.irecv(into, src=peer).wait()
                    dist.isend(into, dst=peer).wait()
            else:  # as a schedule posts what the stages return
                link = messages[way]
                there = MessageKey("activations", 1, trip)
                back = MessageKey("gradients", 0, trip)
                if comm.rank == 0:
                    works = dist.batch_isend_irecv(link.send_ops(peer, there, [x]))
                    works += dist.batch_isend_irecv(link.recv_ops(peer, back)[1])
                else:
                    got, receives = link.recv_ops(peer, there)
                    for work in dist.batch_isend_irecv(receives):
                        work.wait()
                    works = dist.batch_isend_irecv(link.send_ops(peer, back, got))
                for work in works:
                    work.wait()
                link.finish()
            times[way].append(time.perf_counter() - start)
    return {way: summary(t[10:]) for way, t in times.items()}  # after the first messages


def steps(model: str, count: int) -> dict[str, dict[str, float]]:
    """Seconds per pp 2 train_batch, fixed and changing sequence lengths."""
    from zerotrain.pipe import stage_options

    config = gpt_config(model)
    out = {}
    for lengths in ("fixed", "changing"):
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(
            model=pipeline_gpt(GPT(config), 2, **stage_options("1f1b")),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": ACCUM,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 1},
                "pipeline": {"schedule": "1f1b"},
                "steps_per_print": 10**9,
            },
        )
        gen = torch.Generator().manual_seed(1)
        times = []
        for step in range(count + 2):  # 2 warm-up steps (the first infers the stages' shapes)
            cut = (step % 3) * config.block_size // 8 if lengths == "changing" else 0
            windows = [
                torch.randint(
                    0, config.vocab_size, (MICRO, config.block_size - cut + 1), generator=gen
                )
                for _ in range(ACCUM)
            ]
            start = time.perf_counter()
            try:
                engine.train_batch(iter([(w[:, :-1], w[:, 1:]) for w in windows]))
            except Exception as error:  # a tree from before the messages: fixed shapes only
                out[lengths] = {"error": f"{type(error).__name__}: {error}"}
                break
            times.append(time.perf_counter() - start)
        else:
            out[lengths] = summary(times[2:])
    return out


class _SentTensors:
    """torch.distributed's isend, hooked: counts what this rank sends (a 32-slot int64 tensor
    is a header, a uint8 one a header packed with its tensors) and keeps a weak reference to
    each tensor sent, to see how long the sends keep it."""

    def __init__(self) -> None:
        import weakref

        from torch.distributed import distributed_c10d

        self.counts = {"headers": 0, "packed": 0, "tensors": 0}
        self.sent: list[weakref.ref] = []
        original = distributed_c10d.isend

        def isend(tensor: torch.Tensor, *args, **kwargs):
            if tensor.dtype == torch.int64 and tensor.numel() == 32:
                self.counts["headers"] += 1
            else:
                self.counts["packed" if tensor.dtype == torch.uint8 else "tensors"] += 1
            self.sent.append(weakref.ref(tensor))
            return original(tensor, *args, **kwargs)

        isend.__name__ = "isend"  # torch.distributed.P2POp names its op
        # both names: P2POp checks its op against distributed_c10d's, the schedules call dist's
        dist.isend = distributed_c10d.isend = isend

    def held(self, cached: set[int]) -> int:
        """Bytes of the sent tensors still alive whose memory is not in ``cached`` (the data
        pointers of the stages' saved outputs)."""
        alive = {}
        for ref in self.sent:
            tensor = ref()
            if tensor is not None and tensor.data_ptr() not in cached:
                alive[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return sum(alive.values())


def messages(count: int) -> dict[str, dict[str, float]]:
    """Per schedule: the messages the ranks sent in ``count`` pp 2 steps of the tiny GPT at a
    fixed length; for 1F1B and ZBV at 8 micro-batches, the peak bytes that unfinished sends
    alone kept alive."""
    from zerotrain.comm import pipeline
    from zerotrain.pipe import stage_options

    sent = _SentTensors()
    peak = [0]
    stages: list = []
    record = pipeline._Stage._record

    def sampled(stage, *args, **kwargs):  # after each forward, backward, weight step
        if stage not in stages:
            stages.append(stage)
        cached = {
            t.data_ptr()
            for s in stages
            for outputs, _ in s.fwd_cache.values()
            for t in outputs
            if isinstance(t, torch.Tensor)
        }
        peak[0] = max(peak[0], sent.held(cached))
        return record(stage, *args, **kwargs)

    pipeline._Stage._record = sampled
    config = gpt_config("tiny")
    out = {}
    runs = [(s, ACCUM) for s in ("1f1b", "gpipe", "interleaved_1f1b", "zbv")]
    for schedule, accum in [*runs, ("1f1b", 8), ("zbv", 8)]:
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(
            model=pipeline_gpt(GPT(config), 2, **stage_options(schedule)),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": accum,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 1},
                "pipeline": {"schedule": schedule},
                "steps_per_print": 10**9,
            },
        )
        gen = torch.Generator().manual_seed(1)
        fillers = engine.comm.stats.get("send_filler")
        before, stages[:], peak[0] = dict(sent.counts), [], 0
        filled = fillers.calls if fillers is not None else 0
        for _ in range(count):
            windows = [
                torch.randint(0, config.vocab_size, (MICRO, config.block_size + 1), generator=gen)
                for _ in range(accum)
            ]
            engine.train_batch(iter([(w[:, :-1], w[:, 1:]) for w in windows]))
        fillers = engine.comm.stats.get("send_filler")
        row: dict[str, float] = {k: v - before[k] for k, v in sent.counts.items()}
        row["fillers"] = (fillers.calls if fillers is not None else 0) - filled
        if accum != ACCUM:
            row["held_by_sends_bytes"] = peak[0]
        ranks = Communicator().all_gather_object(row)  # both ranks: summed, the peak's maximum
        out[f"{schedule} x{accum}"] = {
            k: (max if k.startswith("held") else sum)(r[k] for r in ranks) for k in row
        }
        sent.sent.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="GPT preset of examples/gpt/model.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--only", choices=["trips", "steps", "messages"])
    args = parser.parse_args()
    zerotrain.init_distributed()
    config = gpt_config(args.model)
    results: dict = {"model": args.model, "zerotrain": zerotrain.__file__}
    if args.only in (None, "trips"):
        shape = (MICRO, config.block_size, config.n_embd)
        results["round_trips"] = round_trips(shape, args.trips)
    if args.only in (None, "steps"):
        results["pp2_steps"] = steps(args.model, args.steps)
    if args.only in (None, "messages"):
        results["messages"] = messages(3)
    if dist.get_rank() != 0:
        return
    print(f"zerotrain from {Path(zerotrain.__file__).parent}, GPT '{args.model}'")
    for part, rows in results.items():
        if not isinstance(rows, dict) or part == "zerotrain":
            continue
        first = next(iter(rows.values())).get("median_s")
        for name, row in rows.items():
            if "median_s" not in row and "error" not in row:  # counts
                print(f"{part:12} {name:28} " + "  ".join(f"{k} {v:g}" for k, v in row.items()))
                continue
            if "error" in row:
                print(f"{part:12} {name:28} {row['error'][:100]}")
                continue
            ratio = f"{row['median_s'] / first:5.2f}x" if first else ""
            print(
                f"{part:12} {name:28} median {row['median_s'] * 1e3:9.2f} ms  "
                f"min {row['min_s'] * 1e3:9.2f} ms  {ratio}"
            )
    path = Path(__file__).resolve().parent / "results" / "pipeline_messages.json"
    path.parent.mkdir(exist_ok=True)
    history = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*history, {"time": time.time(), **results}], indent=1))


if __name__ == "__main__":
    main()
