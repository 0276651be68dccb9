"""What the self-describing messages between pipeline stages cost (zerotrain/comm/stage_messages.py).

    zerotrain run --nproc-per-node 2 bench/pipeline_messages.py [--model demo] [--steps 10]
                  [--trips 300] [--only trips|steps]

Two ranks, gloo, fp32, CPU. `trips`: round trips of one activation ([micro-batch, block size,
width] of the GPT preset) between the ranks, torch's isend/irecv with the receive posted first
(what torch's stages do with their fixed buffers) against StageMessages with the shapes fixed
(receives posted ahead) and with a new shape every message (header first, then the receive).
`steps`: pp 2 steps of the example GPT (examples/gpt/pipeline.py) under 1F1B, every micro-batch
at the block size, then with the sequence length changing every step. Rank 0 prints medians and
minimums; the steps part also runs on a tree from before the messages (no `trips` there), for a
before/after:

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
            else:
                link = messages[way]
                there = MessageKey("activations", 1, trip)
                back = MessageKey("gradients", 0, trip)
                if comm.rank == 0:
                    link.expect(peer, back)
                    link.send(peer, there, [x])
                    link.receive(peer, back)
                else:
                    link.expect(peer, there)
                    link.send(peer, back, link.receive(peer, there))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="GPT preset of examples/gpt/model.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--only", choices=["trips", "steps"])
    args = parser.parse_args()
    zerotrain.init_distributed()
    config = gpt_config(args.model)
    results: dict = {"model": args.model, "zerotrain": zerotrain.__file__}
    if args.only != "steps":
        shape = (MICRO, config.block_size, config.n_embd)
        results["round_trips"] = round_trips(shape, args.trips)
    if args.only != "trips":
        results["pp2_steps"] = steps(args.model, args.steps)
    if dist.get_rank() != 0:
        return
    print(f"zerotrain from {Path(zerotrain.__file__).parent}, GPT '{args.model}'")
    for part, rows in results.items():
        if not isinstance(rows, dict) or part == "zerotrain":
            continue
        first = next(iter(rows.values())).get("median_s")
        for name, row in rows.items():
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
