"""The planner's predictions against measurements, and its pick against exhaustive trial.

    python bench/plan.py [--part predictions|pick|confirm|deepspeed|both]
                         [--models demo 30m llama moe]
                         [--only pipeline|tensor|optimizers|sequence|tiled|compression]

- ``predictions``: a fixed list of configs (ZeRO stages 0-3 x optimizer offload none / cpu /
  nvme x activation checkpointing x micro-batch x 1-2 ranks, tensor-parallel or pipeline
  degree 2 on 2 ranks, SGD, Lion and Muon in place of AdamW, and communication compression:
  PowerSGD, top-k, int8 gradients and parameters) of the GPTs of examples/gpt,
  fp32 on this machine: each predicted by the cost model (zerotrain/plan/cost.py, with its
  default corrections, not refined by earlier trials, and the model probed just before its
  trial) and measured by a trial
  (zerotrain/plan_trial.py: peak memory per rank above start-up, model-state bytes, median
  step time). Prints each config's errors and their distribution. ``--only pipeline``,
  ``--only tensor``, ``--only optimizers``, ``--only sequence``, ``--only tiled`` or
  ``--only compression`` runs those rows alone.
  ``--models llama``: transformers' Llama (examples/llama/model.py's ``small``) at 1024 tokens,
  its own rows: Ulysses sequence parallelism at degree 2 on 2 ranks (stages 0-3, offload,
  checkpointing, micro-batches 1 and 2) and data parallelism, two rows with ``tiled_compute``
  (the MLPs and the loss over tiles). ``--models moe``: the demo GPT
  with MoE layers of 4 experts, top-2, spread over the 2 ranks (``moe_demo``: expert
  parallelism at degree 2), stages 0-3, offload, checkpointing.
- ``pick``: the demo GPT on 2 ranks, global batch 16, sequence 128: every candidate the planner
  weighs (tensor-parallel degree 1 or 2, stages 0-3, offload none / cpu, checkpointing,
  micro-batches 2, 4, 8; pipeline degree 2 at stages 0-2, as ``--pipeline`` weighs it) run as
  a trial, the way DeepSpeed's autotuner tries configs; the
  planner's choice against the fastest found, and the time each way took to decide.
- ``confirm`` (run after ``pick``, and by it): the pick's choice and the fastest trial's config
  measured again 3 times each, alternating, compared by their medians (one trial's step varies
  by 15-20% between runs here, so the fastest of 90 single trials is partly the luckiest).
- ``deepspeed``: DeepSpeed 0.19.8's own autotuner (``deepspeed --autotuning tune``, fast mode:
  ZeRO stage and micro-batch; the planner's side weighs the same, without tensor parallelism)
  on the same job, a DeepSpeed script training the demo GPT on its CPU accelerator
  (``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=2`` for its 2 "devices"): its experiments and wall time
  to a decision, and its choice trained as a zerotrain trial beside the planner's. Needs
  ``pip install -r requirements-bench.txt tabulate`` (uninstall DeepSpeed before the tests);
  its clean-up calls ``pdsh``, which this machine lacks (the error is logged and the tuning
  goes on).

Each trial is a torchrun job of its own, one at a time (2 ranks on this 2-core machine). Writes
bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "demo": ("examples/gpt/model.py:demo", 128),
    "30m": ("examples/gpt/model.py:gpt_30m", 256),
    "llama": ("examples/llama/model.py:small", 1024),
    "moe": ("examples/gpt/model.py:moe_demo", 128),
}


class Row(NamedTuple):
    """A fixed config: a pipeline runs 2 micro-batches a step, the others one."""

    stage: int
    offload: str | None
    checkpointing: bool
    micro: int
    ranks: int
    tp: int = 1
    pp: int = 1
    optimizer: str | None = None
    """Another optimizer than AdamW, by its key in OPTIMIZERS."""
    sp: int = 1
    tiled: bool = False
    """With TILES as its ``tiled_compute`` section."""
    compression: str | None = None
    """A ``comm_compression`` section, by its key in COMPRESSIONS."""


# (stage, offload, activation checkpointing, micro-batch, ranks, tensor-parallel degree, pipeline
# degree); the pipeline and tensor-parallel rows first
FIXED = [
    (1, None, False, 4, 2, 1, 2),
    (2, None, False, 8, 2, 1, 2),
    (0, None, False, 8, 2, 2, 1),
    (1, None, False, 4, 2, 2, 1),
    (2, None, True, 4, 2, 2, 1),
    (3, "cpu", False, 8, 2, 2, 1),
    (0, None, False, 8, 1, 1, 1),
    (0, None, True, 4, 2, 1, 1),
    (1, None, False, 4, 2, 1, 1),
    (1, None, True, 8, 1, 1, 1),
    (2, None, False, 8, 2, 1, 1),
    (2, None, True, 4, 1, 1, 1),
    (3, None, False, 4, 2, 1, 1),
    (3, None, True, 8, 2, 1, 1),
    (1, "cpu", False, 8, 2, 1, 1),
    (2, "cpu", True, 4, 2, 1, 1),
    (3, "cpu", False, 8, 1, 1, 1),
    (3, "cpu", True, 4, 2, 1, 1),
    (1, "nvme", False, 4, 2, 1, 1),
    (2, "nvme", False, 8, 1, 1, 1),
    (2, "nvme", True, 4, 2, 1, 1),
    (3, "nvme", True, 8, 2, 1, 1),
]
BASE = {
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "steps_per_print": 10**9,
}
# rows of another optimizer (the row's eighth field names it): AdamW's fields, then the name
OPTIMIZERS = {
    "SGD": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "Lion": {"type": "Lion", "params": {"lr": 1e-4}},
    "Muon": {"type": "Muon", "params": {"lr": 0.02}},
}
FIXED += [
    (1, None, False, 8, 2, 1, 1, "SGD"),
    (0, None, False, 8, 1, 1, 1, "Lion"),
    (2, None, False, 8, 2, 1, 1, "Muon"),
    (1, "cpu", False, 4, 1, 1, 1, "Muon"),
]
# the Llama's rows: Ulysses (sequence-parallel degree 2) on 2 ranks, and data parallelism
LONG = [
    Row(0, None, False, 1, 2, sp=2),
    Row(1, None, False, 2, 2, sp=2),
    Row(2, None, True, 1, 2, sp=2),
    Row(3, None, False, 1, 2, sp=2),
    Row(3, None, True, 2, 2, sp=2),
    Row(2, "cpu", False, 1, 2, sp=2),
    Row(1, None, False, 1, 2),
    Row(3, None, True, 1, 2),
    Row(0, None, False, 1, 1),
    Row(1, None, False, 2, 2, tiled=True),
    Row(3, None, True, 2, 2, sp=2, tiled=True),
]
# the tiled rows' section: the MLPs and the loss over tiles (the loss's of 256 tokens)
TILES = {"mlp": True, "loss": True, "loss_tile_tokens": 256}
# the MoE GPT's rows: its experts spread over the 2 ranks (the model's ep_size)
EXPERTS = [
    Row(0, None, False, 8, 2),
    Row(1, None, False, 4, 2),
    Row(1, None, True, 8, 2),
    Row(2, None, False, 8, 2),
    Row(2, "cpu", True, 4, 2),
    Row(3, None, False, 4, 2),
    Row(3, None, True, 8, 2),
]
# the compressed rows (of the two GPTs): each codec family, at the stages it works at
COMPRESSIONS = {
    "int8": {"gradients": {"method": "int8"}, "parameters": {"method": "int8"}},
    "powersgd": {"gradients": {"method": "powersgd", "rank": 4}},
    "topk": {"gradients": {"method": "topk", "ratio": 0.01}},
}
COMPRESSED = [
    Row(0, None, False, 8, 2, compression="powersgd"),
    Row(1, None, False, 4, 2, compression="topk"),
    Row(2, None, False, 8, 2, compression="int8"),
    Row(3, None, True, 8, 2, compression="int8"),
]
ROWS = {
    "demo": [Row(*row) for row in FIXED] + COMPRESSED,
    "30m": [Row(*row) for row in FIXED] + COMPRESSED,
    "llama": LONG,
    "moe": EXPERTS,
}
ONLY = {
    "pipeline": lambda row: row.pp > 1,
    "tensor": lambda row: row.tp > 1,
    "optimizers": lambda row: row.optimizer is not None,
    "sequence": lambda row: row.sp > 1,
    "tiled": lambda row: row.tiled,
    "compression": lambda row: row.compression is not None,
}


def _facts(
    spec: str,
    seq: int,
    machine,
    sizes: list[int],
    tp_degrees=(),
    pp_degrees=(),
    sp_degrees=(),
    whole=True,
    tiles=None,
):
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.planner import model_facts, with_profiles

    model = build_on_meta(spec)
    facts = model_facts(
        model, seq_len=seq, dtype="fp32", tp_degrees=tp_degrees, sp_degrees=sp_degrees
    )
    return with_profiles(
        load_factory(spec),
        facts,
        machine,
        sizes=lambda *_: sizes,
        vocab=256,
        failed=_failed,
        whole=whole,
        pipeline_degrees=pp_degrees,
        tiles=tiles,
    )


def _failed(what: str, why: str):
    raise SystemExit(f"bench/plan.py: the model probe of {what} failed: {why}")


def predictions(models: list[str], nvme: str, only: str | None = None) -> list[dict]:
    from zerotrain.config.schema import TiledComputeConfig
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict
    from zerotrain.plan.planner import with_compression, with_optimizer
    from zerotrain.plan.probe import probe_machine
    from zerotrain.plan_trial import TrialSpec, run_trial

    rows = []
    for name in models:
        spec, seq = MODELS[name]
        fixed = [row for row in ROWS[name] if not only or ONLY[only](row)]
        for world in sorted({row.ranks for row in fixed}):
            machine = probe_machine(dtype="fp32", world=world, nvme_path=nvme, threads=1)
            for row in fixed:
                if row.ranks != world:
                    continue
                # the model probed just before its trial: this VM's speed drifts by 15-25%
                # from one minute to the next (bench/README.md), more than the model misses by
                tp, pp, sp = row.tp, row.pp, row.sp
                split = (tp,) * (tp > 1), (pp,) * (pp > 1), (sp,) * (sp > 1)
                base = {**BASE, "optimizer": OPTIMIZERS[row.optimizer]} if row.optimizer else BASE
                base = {**base, "tiled_compute": TILES} if row.tiled else base
                if row.compression:
                    base = {**base, "comm_compression": COMPRESSIONS[row.compression]}
                tiles = TiledComputeConfig(**TILES) if row.tiled else None
                facts = _facts(
                    spec, seq, machine, [row.micro], *split, whole=tp == pp == sp == 1, tiles=tiles
                )
                points = facts.pipelines[pp].split_points if pp > 1 else ()
                candidate = Candidate(
                    row.stage, row.offload, row.checkpointing, row.micro, pp, world, tp, pp,
                    points, sp,
                )  # fmt: skip
                config = candidate.config(base, nvme)
                priced = with_optimizer(facts, base, machine.threads)
                priced = with_compression(priced, build_on_meta(spec), base, machine)
                predicted = predict(candidate, priced, machine, Corrections(), config)
                trial = TrialSpec(spec, config, world, seq, 256, row.checkpointing, points, steps=5)
                measured = run_trial(trial).as_dict()
                row = {
                    "model": name,
                    "config": candidate.label()
                    + f", {world} rank{'s' if world > 1 else ''}"
                    + (f", {row.optimizer}" if row.optimizer else "")
                    + (", tiled" if row.tiled else "")
                    + (f", {row.compression}" if row.compression else ""),
                    "predicted": predicted.as_dict(),
                    "measured": measured,
                }
                rows.append(row)
                _print_row(row)
    _print_summary(rows)
    return rows


def _errors(row: dict) -> tuple[float, float, float]:
    p, m = row["predicted"], row["measured"]
    return tuple(
        p[key] / m[key] - 1 for key in ("peak_memory_bytes", "model_state_bytes", "step_time_s")
    )


def _print_row(row: dict) -> None:
    memory, states, step = _errors(row)
    p, m = row["predicted"], row["measured"]
    print(
        f"{row['model']:>5} {row['config']:<62} peak {p['peak_memory_bytes'] / 1e6:7.1f} / "
        f"{m['peak_memory_bytes'] / 1e6:7.1f} MB ({memory:+6.1%})  states {states:+.4%}  "
        f"step {p['step_time_s']:6.3f} / {m['step_time_s']:6.3f} s ({step:+6.1%}), "
        f"steal {m.get('steal_fraction', 0.0):.0%}",
        flush=True,
    )


STEADY = 0.05
"""The most CPU time stolen by the hypervisor while a trial's steps ran (``steal_fraction``)
for its step time to count as this machine's (see [Note: what a trial measures])."""


def _print_summary(rows: list[dict]) -> None:
    steady = [r for r in rows if r["measured"].get("steal_fraction", 0.0) <= STEADY]
    for index, what, bound, among in (
        (0, "peak memory", 0.05, rows),
        (1, "model states", 0.01, rows),
        (2, "step time", 0.15, rows),
        (2, f"step time, trials with at most {STEADY:.0%} stolen", 0.15, steady),
    ):
        values = sorted(abs(_errors(r)[index]) for r in among)
        if not values:
            print(f"{what}: no trial")
            continue
        within = sum(v <= bound for v in values)
        print(
            f"{what}: |error| median {statistics.median(values):.1%}, 90th percentile "
            f"{values[int(0.9 * (len(values) - 1))]:.1%}, worst {values[-1]:.1%}; "
            f"{within} of {len(values)} within {bound:.0%}"
        )


def _pick_candidates() -> list:
    """The pick's space: the planner's candidates for the demo GPT on 2 ranks that fit, at
    micro-batches 2, 4 and 8, each priced."""
    from zerotrain.plan.cost import Corrections
    from zerotrain.plan.planner import make_plan
    from zerotrain.plan.probe import probe_machine

    spec, seq = MODELS["demo"]
    machine = probe_machine(dtype="fp32", world=2, threads=1)
    facts = _facts(spec, seq, machine, [2, 4, 8], (2,), (2,))
    plan = make_plan(
        facts, machine, world=2, ranks_per_node=2, global_batch=16, base=BASE,
        corrections=Corrections(),
    )  # fmt: skip
    return [p for p in plan.candidates if p.fits and p.candidate.micro_batch in (2, 4, 8)]


def pick() -> dict:
    from zerotrain.plan_trial import TrialSpec, run_trial

    spec, seq = MODELS["demo"]
    started = time.perf_counter()
    planned = _pick_candidates()
    planner_seconds = time.perf_counter() - started
    started = time.perf_counter()
    measured, configs = {}, {}
    for p in planned:
        c = p.candidate
        configs[c.label()] = [p.config, c.activation_checkpointing, list(c.split_points)]
        trial = TrialSpec(spec, p.config, 2, seq, 256, c.activation_checkpointing, c.split_points)
        measured[p.candidate.label()] = run_trial(trial).step_time_s
        print(
            f"{p.candidate.label():<52} predicted {p.predicted.step_time_s:.3f} s, "
            f"measured {measured[p.candidate.label()]:.3f} s",
            flush=True,
        )
    trial_seconds = time.perf_counter() - started
    chosen = min(planned, key=lambda p: p.predicted.step_time_s).candidate.label()
    fastest = min(measured, key=lambda label: measured[label])
    ratio = measured[chosen] / measured[fastest]
    print(
        f"planner's pick: {chosen} ({measured[chosen]:.3f} s measured); fastest of "
        f"{len(planned)} trials: {fastest} ({measured[fastest]:.3f} s): {ratio:.3f}x; decided in "
        f"{planner_seconds:.0f} s against {trial_seconds:.0f} s of trials"
    )
    return {
        "chosen": chosen,
        "fastest": fastest,
        "ratio": ratio,
        "trials": len(planned),
        "planner_seconds": planner_seconds,
        "trial_seconds": trial_seconds,
        "measured": measured,
        "configs": configs,
    }


REPEATS = 3


def confirm(picked: dict) -> dict:
    """The pick's chosen config and the fastest of its trials, measured again ``REPEATS``
    times each, alternating, and compared by their medians: one trial's step varies by 15-20%
    from one run to the next on this machine, so the fastest of 90 single trials is the
    luckiest as much as the fastest. The configs are the ones the pick ran (a plan made now,
    on a probe of this minute, may not hold the same candidates)."""
    from zerotrain.plan_trial import TrialSpec, run_trial

    spec, seq = MODELS["demo"]
    if "configs" not in picked:
        raise SystemExit("bench/plan.py: --part confirm needs a --part pick run of this version")
    labels = (picked["chosen"], picked["fastest"])
    times: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(REPEATS):
        for label in labels:
            config, checkpointing, split_points = picked["configs"][label]
            trial = TrialSpec(spec, config, 2, seq, 256, checkpointing, tuple(split_points))
            times[label].append(run_trial(trial).step_time_s)
    medians = {label: statistics.median(values) for label, values in times.items()}
    ratio = medians[labels[0]] / medians[labels[1]]
    for label in labels:
        shown = ", ".join(f"{t:.3f}" for t in times[label])
        print(f"{label:<52} {shown} s: median {medians[label]:.3f} s", flush=True)
    print(f"the planner's pick over the fastest trial's config, medians of {REPEATS}: {ratio:.3f}x")
    return {"times": times, "medians": medians, "ratio": ratio}


DS_SCRIPT = """
import argparse, sys
import torch
import deepspeed
sys.path.insert(0, {examples!r})
from gpt.model import demo

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
torch.manual_seed(0)
model = demo()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
generator = torch.Generator().manual_seed(engine.global_rank)
micro = engine.train_micro_batch_size_per_gpu()
for _ in range(6 * engine.gradient_accumulation_steps()):
    ids = torch.randint(0, 256, (micro, {seq} + 1), generator=generator)
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()
"""


def deepspeed_autotuning() -> dict:
    """DeepSpeed's autotuner on the pick's job; its choice and the planner's, each measured
    as a zerotrain trial."""
    import subprocess

    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.planner import make_plan
    from zerotrain.plan.probe import probe_machine
    from zerotrain.plan_trial import TrialSpec, run_trial

    spec, seq = MODELS["demo"]
    tuned = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": "auto",
        "zero_allow_untested_optimizer": True,
        "autotuning": {"enabled": True, "fast": True, "max_train_micro_batch_size_per_gpu": 8},
    }
    with tempfile.TemporaryDirectory(prefix="zerotrain-dsat-") as work:
        Path(work, "ds_train.py").write_text(
            DS_SCRIPT.format(examples=str(ROOT / "examples"), seq=seq)
        )
        Path(work, "ds_config.json").write_text(json.dumps(tuned))
        bin_dir = str(Path(sys.executable).parent)
        env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1")
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        command = [str(Path(bin_dir) / "deepspeed"), "--autotuning", "tune", "--num_gpus", "2"]
        command += ["ds_train.py", "--deepspeed", "--deepspeed_config", "ds_config.json"]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        ds_seconds = time.perf_counter() - started
        optimal = Path(work, "autotuning_results", "ds_config_optimal.json")
        if done.returncode != 0 or not optimal.exists():
            raise SystemExit(
                f"DeepSpeed's autotuner failed:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        chosen = json.loads(optimal.read_text())
        experiments = [
            d for d in Path(work, "autotuning_results").iterdir()
            if d.is_dir() and d.name != "profile_model_info" and (d / "metrics.json").exists()
        ]  # fmt: skip
    stage = chosen.get("zero_optimization", {}).get("stage", 0)
    micro = chosen["train_micro_batch_size_per_gpu"]
    ds_candidate = Candidate(stage, None, False, micro, 8 // micro, 2)
    started = time.perf_counter()
    machine = probe_machine(dtype="fp32", world=2, threads=1)
    facts = _facts(spec, seq, machine, [1, 2, 4, 8])
    plan = make_plan(facts, machine, world=2, ranks_per_node=2, global_batch=16, base=BASE)
    planner_seconds = time.perf_counter() - started
    measured = {}
    for who, candidate in (
        ("DeepSpeed's autotuner", ds_candidate),
        ("zerotrain plan", plan.best.candidate),
    ):
        trial = TrialSpec(
            spec, candidate.config(BASE), 2, seq, 256, candidate.activation_checkpointing
        )
        measured[who] = (candidate.label(), run_trial(trial).step_time_s)
    for who, (label, step) in measured.items():
        print(f"{who:<22} chose {label:<40} measured {step:.3f} s a step (zerotrain trial)")
    print(
        f"DeepSpeed's autotuner: {len(experiments)} experiments, {ds_seconds:.0f} s to decide; "
        f"zerotrain plan: {planner_seconds:.0f} s, no trial"
    )
    return {
        "deepspeed": {"chosen": measured["DeepSpeed's autotuner"][0], "experiments": len(experiments),
                      "seconds": ds_seconds, "step_time_s": measured["DeepSpeed's autotuner"][1]},
        "planner": {"chosen": measured["zerotrain plan"][0], "seconds": planner_seconds,
                    "step_time_s": measured["zerotrain plan"][1]},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=["predictions", "pick", "confirm", "deepspeed", "both"],
        default="both",
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["demo", "30m"])
    parser.add_argument(
        "--only",
        choices=list(ONLY),
        help="predictions: the pipeline rows, or the other optimizers'",
    )
    args = parser.parse_args()
    out = ROOT / "bench" / "results" / "plan.json"
    try:  # each part's results kept beside the others' (confirm reads pick's)
        results = json.loads(out.read_text())
    except (OSError, ValueError):
        results = {}
    # a probe of its own, not a cache refined by earlier --verify runs
    with (
        tempfile.TemporaryDirectory(prefix="zerotrain-plan-cache-") as cache,
        tempfile.TemporaryDirectory(prefix="zerotrain-plan-nvme-") as nvme,
    ):
        os.environ["ZEROTRAIN_CACHE_DIR"] = cache
        if args.part in ("predictions", "both"):
            results["predictions"] = predictions(args.models, nvme, args.only)
        if args.part in ("pick", "both"):
            results["pick"] = pick()
        if args.part in ("pick", "confirm", "both"):
            if "pick" not in results:
                raise SystemExit("bench/plan.py: --part confirm needs --part pick's results")
            results["pick"]["confirm"] = confirm(results["pick"])
        if args.part == "deepspeed":
            results["deepspeed"] = deepspeed_autotuning()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
