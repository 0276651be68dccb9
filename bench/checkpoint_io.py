"""Checkpoint save and load times and bytes on disk for the demo GPT, against the formula.

    python bench/checkpoint_io.py [--model demo] [--world 2] [--reshard-world 1]

Launches ``--world`` ranks (torchrun, gloo) that build the demo GPT at every ZeRO stage in fp32
and bf16, run one optimizer step (so Adam's moments exist), save a checkpoint and load it back
in a fresh engine; then ``--reshard-world`` ranks load each checkpoint at stage 3 - S (another
world size and stage); then one process consolidates one checkpoint to safetensors. A
checkpoint holds the fp32 master weights and Adam's two moments: 12 bytes per parameter
(ZeRO's K=12 of arXiv:1910.02054 §3.1), 12Ψ/N per rank file; the gradients and the 16-bit
weights are not saved (they are derived). Times are wall-clock on rank 0, files fsynced.
Writes bench/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from zerotrain.fmt import MB  # noqa: E402

GRID = [(stage, precision) for precision in ("fp32", "bf16") for stage in (0, 1, 2, 3)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reshard-world", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_io.json"))
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def _engine(model_name: str, stage: int, precision: str):
    from gpt.model import GPT, gpt_config

    import zerotrain

    torch.manual_seed(0)
    cfg = gpt_config(model_name)
    model = GPT(cfg)
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": precision == "bf16"},
            "steps_per_print": 10**9,
        },
    )
    return engine, cfg


def _timed(engine, call) -> float:
    engine.comm.barrier()
    start = time.perf_counter()
    call()
    engine.comm.barrier()
    return time.perf_counter() - start


def run_phase(args) -> None:
    """Runs on every rank; rank 0 appends its rows to DIR/<phase>.json."""
    import zerotrain

    zerotrain.init_distributed()
    rows = []
    for stage, precision in GRID:
        ckpt = Path(args.dir) / f"stage{stage}-{precision}"
        if args.phase == "save":
            engine, cfg = _engine(args.model, stage, precision)
            x = torch.randint(0, cfg.vocab_size, (1, 8))
            engine.backward(engine(x, x))
            engine.step()
            save_s = _timed(engine, lambda e=engine, c=ckpt: e.save_checkpoint(c))
            fresh, _ = _engine(args.model, stage, precision)
            load_s = _timed(fresh, lambda e=fresh, c=ckpt: e.load_checkpoint(c))
            row = {"save_s": save_s, "load_s": load_s, "psi": engine.optimizer.num_params}
        else:  # load at another world size and stage
            engine, _ = _engine(args.model, 3 - stage, precision)
            row = {"reshard_load_s": _timed(engine, lambda e=engine, c=ckpt: e.load_checkpoint(c))}
        rows.append({"stage": stage, "precision": precision, "world": engine.world_size, **row})
    if engine.global_rank == 0:
        (Path(args.dir) / f"{args.phase}.json").write_text(json.dumps(rows))


def _launch(world: int, phase: str, directory: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(world), __file__, *sys.argv[1:]]
    subprocess.run([*cmd, "--phase", phase, "--dir", directory], env=env, check=True)
    return json.loads((Path(directory) / f"{phase}.json").read_text())


def _disk_bytes(directory: Path) -> tuple[int, int]:
    """All bytes of the newest checkpoint, and those of the largest rank file."""
    from zerotrain.checkpoint import resolve

    manifest = resolve(directory, None)
    total = sum(f["bytes"] for f in manifest["files"].values())
    largest = max(manifest["files"][name]["bytes"] for name in manifest["roles"]["shard"])
    return total, largest


def main() -> None:
    args = parse_args()
    if args.phase:
        run_phase(args)
        return
    from zerotrain.checkpoint.export import consolidate

    with tempfile.TemporaryDirectory() as tmp:
        saved = _launch(args.world, "save", tmp)
        resharded = _launch(args.reshard_world, "reshard", tmp)
        for row, other in zip(saved, resharded, strict=True):
            row["reshard_world"], row["reshard_load_s"] = other["world"], other["reshard_load_s"]
            row["disk_bytes"], row["largest_rank_file"] = _disk_bytes(
                Path(tmp) / f"stage{row['stage']}-{row['precision']}"
            )
            row["formula_bytes"] = 12 * row["psi"]
        start = time.perf_counter()
        consolidate(Path(tmp) / "stage3-bf16", Path(tmp) / "export", progress=False)
        consolidate_s = time.perf_counter() - start

    header = (
        f"{'precision':<9} {'stage':>5} {'N':>2} {'save s':>7} {'load s':>7} "
        f"{'reshard load s':>15} {'disk MB':>8} {'12Ψ MB':>7} {'disk/12Ψ':>9} "
        f"{'rank file MB':>13} {'rank/(12Ψ/N)':>13}"
    )
    print(header)
    print("-" * len(header))
    for row in saved:
        per_rank = row["formula_bytes"] / row["world"]
        reshard = (
            f"{row['reshard_load_s']:.3f} (N={row['reshard_world']}, stage {3 - row['stage']})"
        )
        print(
            f"{row['precision']:<9} {row['stage']:>5} {row['world']:>2} {row['save_s']:>7.3f} "
            f"{row['load_s']:>7.3f} {reshard:>15} {row['disk_bytes'] / MB:>8.2f} "
            f"{row['formula_bytes'] / MB:>7.2f} {row['disk_bytes'] / row['formula_bytes']:>9.4f} "
            f"{row['largest_rank_file'] / MB:>13.2f} {row['largest_rank_file'] / per_rank:>13.4f}"
        )
    print(f"\nconsolidate (stage 3 bf16 checkpoint -> fp32 safetensors): {consolidate_s:.3f} s")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": saved, "consolidate_s": consolidate_s}, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
