"""Checkpoint save and load times and bytes on disk for the demo GPT, against the formula; with
``--async`` and ``--recovery``, what asynchronous saves and in-memory snapshots cost and save.

    python bench/checkpoint_io.py [--model demo] [--world 2] [--reshard-world 1]
    python bench/checkpoint_io.py --async --recovery [--models demo 100m]   # issue 42's tables
    python bench/checkpoint_io.py --sync --async --recovery                 # all three tables

Sync (the default, ``--sync``): launches ``--world`` ranks (torchrun, gloo) that build the GPT
``--model`` at every ZeRO stage in fp32 and bf16, run one optimizer step (so Adam's moments
exist), save a checkpoint and load it back in a fresh engine; then ``--reshard-world`` ranks load
each checkpoint at stage 3 - S (another world size and stage); then one process consolidates one
checkpoint to safetensors. A checkpoint holds the fp32 master weights and Adam's two moments:
12 bytes per parameter (ZeRO's K=12 of arXiv:1910.02054 §3.1), 12Ψ/N per rank file; the
gradients and the 16-bit weights are not saved (they are derived). Times are wall-clock on rank
0, files fsynced. Writes bench/results/checkpoint_io.json.

Async (``--async``): for each of ``--models`` (GPT presets of examples/gpt/model.py: ``demo``
4.8M parameters, ``100m`` 99.5M) one torchrun launch of ``--world`` ranks trains at ZeRO stages
1, 2 and 3 in fp32 (micro-batch 1 x ``--seq`` tokens, two warm-up steps) and, ``--repeats``
times: runs ``--steps`` steps with no save pending, saves with
``save_checkpoint(async_save=False)``, saves with ``save_checkpoint(async_save=True)``, runs
steps while ``engine.checkpoint_pending()`` is true on some rank (at most 10 x ``--steps``), then
``wait_for_checkpoint()`` (``keep_last: 1``; files in ``--disk-dir``). A save's time is how long
the call blocked on the slowest rank: sync, the median of the repeats; async, the first apart
(it allocates the host buffers the later ones reuse) and the median of the others, whose ratio
to sync is ``async/sync``. ``async done s``: from the async call to ``wait_for_checkpoint``'s
return (the write and commit, at the granularity of the steps run meanwhile). Step times are
rank 0's medians: with no save pending, and while one is written (``pending/idle``). Writes
bench/results/checkpoint_io_async.json.

Recovery (``--recovery``): for each of ``--models``, two jobs under ``zerotrain run
--nproc-per-node WORLD --max-restarts 1`` at ZeRO stage ``--stage`` in fp32, each a worker
script (written to a temporary folder) that calls ``engine.load_checkpoint(save_dir)`` at start
and trains to step ``--kill-at`` + 3; on the first attempt, at step ``--kill-at``, rank 1 notes
the time and kills itself with SIGKILL, and the agent restarts both ranks. ``memory``: in-memory
snapshots every step (``ZEROTRAIN_SNAPSHOT_DIR`` a temporary folder under /dev/shm, removed
after), nothing on disk, so the restart resumes from the snapshot of the kill's step. ``disk``:
no snapshots, a synchronous save into ``--disk-dir`` (default: the system's temporary folder; its
file system is printed) at the kill's step, so the restart resumes from the same step, read back
from the disk (from the page cache, most likely: the files were just written). Measured: the
seconds from the kill to the first step after recovery (the slowest rank), split into the
restart (kill to the new process's first line), the imports, building the engine
(init_distributed, the model, initialize), the load, and the first step (with snapshots, it
takes one); rank 0's median step time (every step but each attempt's first) with snapshots every
step (the ``memory`` job) and without (the ``disk`` job); and the bytes under the snapshot folder
just before the kill, per snapshot kept (``keep``: 2), against 12Ψ (one node: no buddy copies).
Writes bench/results/checkpoint_io_recovery.json.

Rough durations on 2 busy CPU cores with the defaults: sync 1 min (demo); async 40 s (demo) and
5 min (100m); recovery 50 s (demo) and 2 min (100m).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
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
ASYNC_STAGES = (1, 2, 3)
RESULTS = ROOT / "bench" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sync", action="store_true", help="the sync table (the default)")
    parser.add_argument(
        "--async", dest="async_", action="store_true", help="async save against sync save"
    )
    parser.add_argument(
        "--recovery", action="store_true", help="kill -9 to the next step, snapshot against disk"
    )
    parser.add_argument("--model", default="demo", help="--sync: the GPT preset")
    parser.add_argument(
        "--models", nargs="+", default=["demo", "100m"], help="--async, --recovery: GPT presets"
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reshard-world", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32, help="--async, --recovery: tokens a step")
    parser.add_argument("--steps", type=int, default=5, help="--async: idle steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="--async: saves of each kind")
    parser.add_argument("--stage", type=int, default=2, help="--recovery: the ZeRO stage")
    parser.add_argument("--kill-at", type=int, default=5, help="--recovery: the killed step")
    parser.add_argument(
        "--disk-dir", default=None, help="--async, --recovery: where checkpoints go"
    )
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_io.json"))
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.sync or args.async_ or args.recovery):
        args.sync = True
    if args.kill_at < 3:
        parser.error("--kill-at must be at least 3 (two snapshots are kept before the kill)")
    return args


def _out(args, suffix: str) -> Path:
    """``--out`` for the sync table, its sibling ``<stem>_<suffix>.json`` for the others."""
    path = Path(args.out)
    return path if not suffix else path.with_name(f"{path.stem}_{suffix}{path.suffix}")


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"written {path}")


def _engine(model_name: str, stage: int, precision: str, checkpoint: dict | None = None):
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
            "checkpoint": checkpoint or {},
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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- sync: save, load, resharded load ----------------------------------------------------------
def run_phase(args) -> None:
    """Runs on every rank; rank 0 appends its rows to DIR/<phase>.json."""
    import zerotrain

    zerotrain.init_distributed()
    if args.phase == "async":
        run_async_phase(args)
        return
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


def _launch(world: int, phase: str, directory: str, argv: list[str]) -> list[dict]:
    """``world`` ranks run ``phase`` with the options ``argv``; rank 0's rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(world), __file__, *argv]
    subprocess.run([*cmd, "--phase", phase, "--dir", directory], env=env, check=True)
    return json.loads((Path(directory) / f"{phase}.json").read_text())


def _disk_bytes(directory: Path) -> tuple[int, int]:
    """All bytes of the newest checkpoint, and those of the largest rank file."""
    from zerotrain.checkpoint import resolve

    manifest = resolve(directory, None)
    total = sum(f["bytes"] for f in manifest["files"].values())
    largest = max(manifest["files"][name]["bytes"] for name in manifest["roles"]["shard"])
    return total, largest


def run_sync(args) -> None:
    from zerotrain.checkpoint.export import consolidate

    argv = ["--model", args.model]
    with tempfile.TemporaryDirectory() as tmp:
        saved = _launch(args.world, "save", tmp, argv)
        resharded = _launch(args.reshard_world, "reshard", tmp, argv)
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
    _write(_out(args, ""), {"rows": saved, "consolidate_s": consolidate_s})


# -- async: how long a save blocks, and the steps while it is written --------------------------
def _step(engine, x: torch.Tensor) -> float:
    start = time.perf_counter()
    engine.backward(engine(x, x))
    engine.step()
    return time.perf_counter() - start


def _save_blocked(engine, save_dir: Path, async_save: bool) -> float:
    """How long ``save_checkpoint`` blocked: the slowest rank's (the ranks start together)."""
    engine.comm.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(save_dir, async_save=async_save)
    return max(engine.comm.all_gather_object(time.perf_counter() - start))


def _any_pending(engine) -> bool:
    """Whether some rank's asynchronous save is still being written (collective)."""
    return any(engine.comm.all_gather_object(engine.checkpoint_pending()))


def run_async_phase(args) -> None:
    """Runs on every rank; rank 0 writes its rows to DIR/async.json."""
    import gc

    rows = []
    for stage in ASYNC_STAGES:
        save_dir = Path(args.dir) / f"{args.model}-stage{stage}"
        engine, cfg = _engine(args.model, stage, "fp32", {"keep_last": 1})
        x = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator())
        for _ in range(2):  # warm-up
            _step(engine, x)
        idle, pending, sync_s, async_s, done_s = [], [], [], [], []
        for _ in range(args.repeats):
            idle += [_step(engine, x) for _ in range(args.steps)]
            sync_s.append(_save_blocked(engine, save_dir / "sync", async_save=False))
            start = time.perf_counter()
            async_s.append(_save_blocked(engine, save_dir / "async", async_save=True))
            ran = 0
            while ran < 10 * args.steps and _any_pending(engine):
                pending.append(_step(engine, x))
                ran += 1
            engine.wait_for_checkpoint()
            done_s.append(max(engine.comm.all_gather_object(time.perf_counter() - start)))
            if ran == 0:  # the next repeat's saves are of another step
                idle.append(_step(engine, x))
        rows.append(
            {
                "model": args.model,
                "psi": engine.optimizer.num_params,
                "stage": stage,
                "world": engine.world_size,
                "seq": args.seq,
                "sync_save_s": sync_s,
                "async_save_s": async_s,
                "async_done_s": done_s,
                "idle_step_s": idle,
                "pending_step_s": pending,
            }
        )
        engine.comm.barrier()
        if engine.global_rank == 0:
            shutil.rmtree(save_dir, ignore_errors=True)
        del engine
        gc.collect()
    if rows and torch.distributed.get_rank() == 0:
        (Path(args.dir) / "async.json").write_text(json.dumps(rows))


def run_async(args) -> list[dict]:
    rows = []
    for model in args.models:
        argv = ["--model", model, "--seq", str(args.seq), "--steps", str(args.steps)]
        argv += ["--repeats", str(args.repeats)]
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
            rows += _launch(args.world, "async", tmp, argv)
    for row in rows:
        # the first asynchronous save allocates the host buffers (and the background group):
        # its time is apart; the later ones reuse them
        first, *warm = row["async_save_s"]
        sync, asyn = _median(row["sync_save_s"]), _median(warm or [first])
        idle, pending = _median(row["idle_step_s"]), _median(row["pending_step_s"])
        row["sync_save_median_s"], row["async_save_median_s"] = sync, asyn
        row["async_over_sync"], row["first_async_over_sync"] = asyn / sync, first / sync
        row["idle_step_median_s"], row["pending_step_median_s"] = idle, pending
        row["pending_over_idle"] = pending / idle if pending is not None else None
    later = f"median of saves 2-{args.repeats}" if args.repeats > 2 else "the 2nd save"
    print(
        f"\nasync save: how long save_checkpoint blocks, the slowest rank (sync: median of "
        f"{args.repeats}; async: the first, which allocates the buffers, and "
        f"{later if args.repeats > 1 else 'the same'}); fp32, {args.world} ranks; "
        f"steps of 1 x {args.seq} tokens, rank 0's median\n"
    )
    print(
        "| model | Ψ | stage | sync save s | async save s (first) | async save s "
        "| async/sync | async done s | step s | step s, save pending | steps pending "
        "| pending/idle |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        pending = row["pending_step_median_s"]
        ratio = row["pending_over_idle"]
        print(
            f"| {row['model']} | {row['psi'] / 1e6:.1f}M | {row['stage']} "
            f"| {row['sync_save_median_s']:.3f} | {row['async_save_s'][0]:.3f} "
            f"| {row['async_save_median_s']:.3f} "
            f"| {row['async_over_sync']:.3f} | {_median(row['async_done_s']):.3f} "
            f"| {row['idle_step_median_s']:.3f} "
            f"| {'-' if pending is None else f'{pending:.3f}'} | {len(row['pending_step_s'])} "
            f"| {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    _write(_out(args, "async"), {"rows": rows})
    return rows


# -- recovery: kill -9, restart, the first step after it -----------------------------------------
WORKER = r"""
import time

STARTED = time.time()  # before the imports: they are part of a restart's cost

import json
import os
import signal
import sys
from pathlib import Path

import torch
from checkpoint_io import _engine  # this file, the benchmark's own engine

import zerotrain

IMPORTED = time.time()
model_name, variant, save_dir, out = sys.argv[1:5]
stage, seq, kill_at, total = (int(a) for a in sys.argv[5:9])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
out = Path(out)
zerotrain.init_distributed(verbose=False)
rank = torch.distributed.get_rank()
snapshots = {"enabled": variant == "memory", "every_steps": 1}
engine, cfg = _engine(model_name, stage, "fp32", {"in_memory_snapshots": snapshots})
built = time.time()
path, _ = engine.load_checkpoint(save_dir)
report = {
    "attempt": attempt,
    "rank": rank,
    "psi": engine.optimizer.num_params,
    "started": STARTED,
    "imported": IMPORTED,
    "built": built,
    "loaded": time.time(),
    "path": None if path is None else str(path),
    "start_step": engine.global_steps,
    "step_s": [],
}


def write(name):
    (out / name).write_text(json.dumps(report))


while engine.global_steps < total:
    g = torch.Generator().manual_seed(engine.global_steps)
    x = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    start = time.perf_counter()
    engine.backward(engine(x, x))
    engine.step()
    report["step_s"].append(time.perf_counter() - start)
    report.setdefault("first_step_done", time.time())
    if attempt == 0 and engine.global_steps == kill_at - 1:
        if rank == 0 and variant == "memory":  # the snapshots kept, before the kill
            root = Path(os.environ["ZEROTRAIN_SNAPSHOT_DIR"])
            files = [p for p in root.rglob("*") if p.is_file()]
            report["snapshot_bytes"] = sum(p.stat().st_size for p in files)
            report["snapshots"] = {
                d.name: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
                for d in sorted(root.rglob("global_step*"))
                if d.is_dir()
            }
        write(f"attempt0-rank{rank}.json")
    if attempt == 0 and engine.global_steps == kill_at:
        if variant == "disk":
            engine.save_checkpoint(save_dir, async_save=False)
        if rank == 1:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
write(f"attempt{attempt}-rank{rank}.json")
"""


def _mount_of(path: Path) -> str:
    """The file system type ``path`` lives on (Linux), for the record."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    path = path.resolve()
    best = max(
        (m for m in mounts if path == Path(m[0]) or Path(m[0]) in path.parents),
        key=lambda m: len(m[0]),
        default=None,
    )
    return f"{best[1]} at {best[0]}" if best else "unknown"


def _recovery_job(args, model: str, variant: str, folder: Path, shm: Path) -> dict:
    """One ``zerotrain run`` job of the worker, killed once; what its ranks reported."""
    save_dir = folder / "ckpt"
    save_dir.mkdir(parents=True)
    script = folder / "worker.py"
    script.write_text(WORKER)
    total = args.kill_at + 3
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        ZEROTRAIN_SNAPSHOT_DIR=str(shm),
        PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), str(ROOT), str(ROOT / "bench")]),
    )
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    cmd = [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", str(args.world)]
    cmd += ["--max-restarts", "1", str(script), model, variant, str(save_dir), str(folder)]
    cmd += [str(n) for n in (args.stage, args.seq, args.kill_at, total)]
    log_path = folder / "job.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:  # a file: the killed worker's children may hold a pipe
        job = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            job.wait(timeout=1800)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)  # its own session: the agent and its ranks
                job.wait()
    wall_s = time.perf_counter() - started
    log = log_path.read_text()
    if job.returncode != 0:
        raise RuntimeError(f"{model} {variant}: exit status {job.returncode}\n{log[-4000:]}")
    before = json.loads((folder / "attempt0-rank0.json").read_text())
    after = [json.loads(p.read_text()) for p in sorted(folder.glob("attempt1-rank*.json"))]
    if len(after) != args.world:
        raise RuntimeError(f"{model} {variant}: no restart reported\n{log[-4000:]}")
    killed = float((folder / "killed").read_text())
    rank0 = next(r for r in after if r["rank"] == 0)
    return {
        "model": model,
        "variant": variant,
        "psi": before["psi"],
        "stage": args.stage,
        "world": args.world,
        "seq": args.seq,
        "killed_at_step": args.kill_at,
        "resumed_at_step": rank0["start_step"],
        "resumed_from": rank0["path"],
        "kill_to_first_step_s": max(r["first_step_done"] for r in after) - killed,
        "restart_s": max(r["started"] for r in after) - killed,
        "import_s": max(r["imported"] - r["started"] for r in after),
        "build_s": max(r["built"] - r["imported"] for r in after),
        "load_s": max(r["loaded"] - r["built"] for r in after),
        "first_step_s": max(r["first_step_done"] - r["loaded"] for r in after),
        # every step but each attempt's first (a warm-up), rank 0's
        "step_s": before["step_s"][1:] + rank0["step_s"][1:],
        "snapshot_bytes": before.get("snapshot_bytes"),
        "snapshots": before.get("snapshots"),
        "job_wall_s": wall_s,
    }


def run_recovery(args) -> list[dict]:
    rows = []
    disk_dir = Path(args.disk_dir or tempfile.gettempdir())
    for model in args.models:
        for variant in ("memory", "disk"):
            shm = Path(tempfile.mkdtemp(prefix="zerotrain-bench-", dir="/dev/shm"))
            try:
                with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
                    rows.append(_recovery_job(args, model, variant, Path(tmp), shm))
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            rows[-1]["disk_fs"] = _mount_of(disk_dir)
    by = {(r["model"], r["variant"]): r for r in rows}
    for row in rows:
        row["step_median_s"] = _median(row["step_s"])
    print(
        f"\nrecovery: kill -9 of rank 1 at step {args.kill_at} to the first step after the "
        f"restart, {args.world} ranks on one node, stage {args.stage} fp32, steps of "
        f"1 x {args.seq} tokens; disk checkpoint on {rows[0]['disk_fs']}\n"
    )
    print(
        "| model | Ψ | resume from | resumed at step | kill -> first step s | restart s "
        "| import s | build s | load s | first step s | step s | disk/memory |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        memory = by[row["model"], "memory"]
        ratio = (
            f"{row['kill_to_first_step_s'] / memory['kill_to_first_step_s']:.2f}"
            if row["variant"] == "disk"
            else ""
        )
        print(
            f"| {row['model']} | {row['psi'] / 1e6:.1f}M | {row['variant']} "
            f"| {row['resumed_at_step']} | {row['kill_to_first_step_s']:.2f} "
            f"| {row['restart_s']:.2f} | {row['import_s']:.2f} | {row['build_s']:.2f} "
            f"| {row['load_s']:.2f} "
            f"| {row['first_step_s']:.2f} | {row['step_median_s']:.3f} | {ratio} |"
        )
    print(
        "\nsnapshots every step: step time, and host memory under the snapshot folder "
        "(2 kept; one node, no buddy copies)\n"
    )
    print(
        "| model | Ψ | step s, no snapshots | step s, snapshots | ratio | snapshots kept "
        "| MB per snapshot | 12Ψ MB | per snapshot / 12Ψ | folder MB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models:
        memory, disk = by[model, "memory"], by[model, "disk"]
        snaps = memory["snapshots"] or {}
        per = _median(list(snaps.values())) or 0
        formula = 12 * memory["psi"]
        memory["snapshot_formula_bytes"] = formula
        print(
            f"| {model} | {memory['psi'] / 1e6:.1f}M | {disk['step_median_s']:.3f} "
            f"| {memory['step_median_s']:.3f} "
            f"| {memory['step_median_s'] / disk['step_median_s']:.2f} | {len(snaps)} "
            f"| {per / MB:.2f} | {formula / MB:.2f} | {per / formula:.4f} "
            f"| {(memory['snapshot_bytes'] or 0) / MB:.2f} |"
        )
    _write(_out(args, "recovery"), {"rows": rows})
    return rows


def main() -> None:
    args = parse_args()
    if args.phase:
        run_phase(args)
        return
    if args.sync:
        run_sync(args)
    if args.async_:
        run_async(args)
    if args.recovery:
        run_recovery(args)


if __name__ == "__main__":
    main()
