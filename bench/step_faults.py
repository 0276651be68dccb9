"""One zerotrain stage on the demo GPT: median step time and minor page faults per step.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/step_faults.py --stage 3 [--steps 32] [--bucket 1e6] [--tree DIR] [--profile]

The quick probe behind bench/README.md's "Step-time guard" findings: the page faults a step
takes (``ru_minflt``, rank 0), how a `reduce_bucket_size` changes the step, and with `--tree` a
git worktree of another commit (``git worktree add --detach DIR COMMIT``) is imported instead of
this checkout. Runs one configuration; alternate two by hand, or use bench/step_time.py
`--reference` for the interleaved comparison. `--profile` prints rank 0's cProfile.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--steps", type=int, default=32, help="timed steps, after 4 untimed")
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--bucket", type=float, default=None, help="reduce_bucket_size")
parser.add_argument("--tree", default=None, help="import zerotrain from this worktree")
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()
sys.path.insert(0, str(ROOT / "bench"))  # step_time: the models and the config
if args.tree:
    os.environ["STEP_TIME_REFERENCE_TREE"] = str(Path(args.tree).resolve())

import step_time  # noqa: E402  (puts the tree, or this checkout, first on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerotrain  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = step_time.bench_models()["demo"]
config = step_time.zerotrain_config(args.stage, args)
if args.bucket:
    config["zero_optimization"]["reduce_bucket_size"] = int(args.bucket)
engine, *_ = zerotrain.initialize(model=model.build(), config=config)
gen = torch.Generator().manual_seed(1 + rank)
tokens = torch.randint(
    0, model.vocab_size, (4 + args.steps, args.micro_batch, model.seq_len + 1), generator=gen
)


def step(batch: torch.Tensor) -> None:
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()


for batch in tokens[:4]:
    step(batch)
profile = None
if args.profile and rank == 0:
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
times, faults = [], []
for batch in tokens[4:]:
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step(batch)
    times.append(time.perf_counter() - start)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if profile is not None:
    import pstats

    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
median = torch.tensor([statistics.median(times)])
dist.all_reduce(median, op=dist.ReduceOp.MAX)  # a step takes the slowest rank's time
if rank == 0:
    where = Path(zerotrain.__file__).parent
    print(
        f"zerotrain from {where}, stage {args.stage}, bucket {config['zero_optimization'].get('reduce_bucket_size', 'default')}: "
        f"median {median.item() * 1000:.1f} ms, minor faults per step (rank 0) "
        f"{statistics.median(faults):.0f}",
        flush=True,
    )
dist.destroy_process_group()
