"""The planner on one GPU: transformers' GPT-2 from 350M to 2.7B parameters (sequences of 1024
tokens, bf16), each fixed config predicted by the cost model and measured by a trial, the 2.7B
with optimizer offload too; the planner's own pick of one model tried; and the largest GPT-2
shaped model the planner finds a config for on this machine.

    python3 bench/plan_gpu.py --out DIR [--budget-s 300]   # on the GPU machine
    python3 bench/plan_gpu.py --dry-run --out DIR          # the same steps, tiny, on a CPU
    python3 bench/plan_gpu.py --report DIR/plan_gpu.json   # predicted again from what it saved

Rows run in order, each model probed (zerotrain/plan/model_probe.py) before its first row; no
row starts once ``--budget-s`` is spent. DIR/plan_gpu.json is rewritten after every row: the
machine probe, per model the facts the cost model reads (pickled, so that ``--report``
prices the rows again with the cost model of the checkout it runs in, without a GPU), and per
row its config, the prediction and the trial's measurements ([Note: what a trial measures] in
zerotrain/plan_trial.py: on a GPU, ``torch.cuda.max_memory_allocated``). See bench/README.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ = 1024
# width, blocks, heads: GPT-2 medium, large, XL, and the 2.7B of GPT-3's table
SHAPES = {
    "gpt2-350m": (1024, 24, 16),
    "gpt2-774m": (1280, 36, 20),
    "gpt2-1.5b": (1600, 48, 25),
    "gpt2-2.7b": (2560, 32, 32),
}
DRY_SHAPES = dict.fromkeys(SHAPES, (64, 2, 4))  # --dry-run: every model tiny
DRY_SEQ = 64


def _gpt2(name: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    dry = os.environ.get("PLAN_GPU_DRY") == "1"
    width, blocks, heads = (DRY_SHAPES if dry else SHAPES)[name]
    seq = DRY_SEQ if dry else SEQ
    config = GPT2Config(n_embd=width, n_layer=blocks, n_head=heads, n_positions=seq)
    if dry or not torch.cuda.is_available():
        return GPT2LMHeadModel(config)
    # initialized on the GPU (seconds; the CPU's generator fills a 2.7B model serially in about
    # a minute), then handed over on the host as a CPU-built model is: the build is not
    # training memory ([Note: what a trial measures] in zerotrain/plan_trial.py)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(config)
    model = model.cpu()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return model


# the factories the trials build (``bench/plan_gpu.py:gpt2_350m``)
def gpt2_350m():
    return _gpt2("gpt2-350m")


def gpt2_774m():
    return _gpt2("gpt2-774m")


def gpt2_1_5b():
    return _gpt2("gpt2-1.5b")


def gpt2_2_7b():
    return _gpt2("gpt2-2.7b")


FACTORIES = {
    "gpt2-350m": "gpt2_350m",
    "gpt2-774m": "gpt2_774m",
    "gpt2-1.5b": "gpt2_1_5b",
    "gpt2-2.7b": "gpt2_2_7b",
}


class GpuRow(NamedTuple):
    model: str
    stage: int
    offload: str | None
    checkpointing: bool
    micro: int
    cpu_checkpointing: bool = False
    """Activation checkpointing's inputs kept in host memory (``cpu_checkpointing``)."""


# in the order they run: each size in memory first, then offload, checkpointing, stage 3
ROWS = [
    GpuRow("gpt2-350m", 0, None, False, 8),
    GpuRow("gpt2-774m", 0, None, False, 8),
    GpuRow("gpt2-1.5b", 0, None, False, 4),
    GpuRow("gpt2-2.7b", 0, None, False, 4),
    GpuRow("gpt2-2.7b", 2, "cpu", False, 4),
    GpuRow("gpt2-1.5b", 2, None, True, 8),
    GpuRow("gpt2-1.5b", 2, None, True, 8, cpu_checkpointing=True),
    GpuRow("gpt2-2.7b", 3, None, True, 8),
    GpuRow("gpt2-350m", 1, "cpu", True, 16),
]
PICK = ("gpt2-1.5b", 16)  # the model and global batch the planner chooses a config for
# the largest-model search: GPT-2 shaped models of these widths and depths, built on the meta
# device (nothing allocated), smallest first
LADDER = [(2560, 32), (4096, 32), (4096, 40), (4096, 48), (5120, 40), (5120, 48), (6144, 48)]


def _base(row: GpuRow | None, dtype: str) -> dict:
    base = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    if row is not None and row.cpu_checkpointing:
        base["activation_checkpointing"] = {"cpu_checkpointing": True}
    return base


def _spec(model: str) -> str:
    return f"{Path(__file__).resolve()}:{FACTORIES[model]}"


def _failed(what: str, why: str):
    raise SystemExit(f"bench/plan_gpu.py: the model probe of {what} failed: {why}")


def _facts(model: str, machine, sizes: list[int], seq: int, dtype: str, vocab: int):
    from zerotrain.estimate.factory import build_on_meta, load_factory
    from zerotrain.plan.planner import model_facts, with_optimizer, with_profiles

    spec = _spec(model)
    facts = model_facts(build_on_meta(spec), seq_len=seq, dtype=dtype)
    facts = with_profiles(
        load_factory(spec), facts, machine, sizes=lambda *_: sizes, vocab=vocab, failed=_failed
    )
    return with_optimizer(facts, _base(None, dtype), machine.threads)


def _predict(row: GpuRow, facts, machine, dtype: str, nvme: str | None):
    from zerotrain.plan.candidates import Candidate
    from zerotrain.plan.cost import Corrections, predict

    candidate = Candidate(row.stage, row.offload, row.checkpointing, row.micro, 1, 1)
    config = candidate.config(_base(row, dtype), nvme)
    return candidate, config, predict(candidate, facts, machine, Corrections(), config)


def _label(row: GpuRow, candidate) -> str:
    return candidate.label() + (", cpu_checkpointing" if row.cpu_checkpointing else "")


def _print_row(row: dict) -> None:
    p, m = row["predicted"], row["measured"]
    errors = [p[k] / m[k] - 1 for k in ("peak_memory_bytes", "model_state_bytes", "step_time_s")]
    print(
        f"{row['model']:>9} {row['config']:<58} peak {p['peak_memory_bytes'] / 2**30:6.2f} / "
        f"{m['peak_memory_bytes'] / 2**30:6.2f} GiB ({errors[0]:+6.1%})  states "
        f"{errors[1]:+.4%}  step {p['step_time_s']:7.4f} / {m['step_time_s']:7.4f} s "
        f"({errors[2]:+6.1%})  [compute {p['compute_s']:.4f}, engine {p['engine_s']:.4f}, "
        f"optimizer {p['optimizer_s']:.4f}]",
        flush=True,
    )


def _pickled(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def _unpickled(text: str):
    return pickle.loads(base64.b64decode(text))


def largest(machine, dtype: str, seq: int, nvme: str | None) -> dict:
    """The planner over LADDER's models (memory and FLOPs from their shapes: none is built):
    the largest it finds a config for on ``machine``, and the first it finds none for."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotrain.plan.planner import PlanError, make_plan, model_facts, with_optimizer

    found: dict = {"fits": None, "fails": None}
    for width, blocks in LADDER:
        with torch.device("meta"):
            model = GPT2LMHeadModel(
                GPT2Config(n_embd=width, n_layer=blocks, n_head=width // 128, n_positions=seq)
            )
        facts = model_facts(model, seq_len=seq, dtype=dtype)
        facts = with_optimizer(facts, _base(None, dtype), machine.threads)
        size = {"width": width, "blocks": blocks, "parameters": facts.count.trainable}
        try:
            plan = make_plan(
                facts, machine, world=1, ranks_per_node=1, global_batch=8,
                base=_base(None, dtype), nvme_path=nvme,
            )  # fmt: skip
        except PlanError as error:
            found["fails"] = {**size, "why": str(error).splitlines()[0]}
            break
        best = plan.best
        found["fits"] = {
            **size,
            "config": best.candidate.label(),
            "peak_memory_bytes": best.predicted.peak_memory_bytes,
            "budget_bytes": plan.budget,
        }
        print(
            f"largest: {facts.count.trainable / 1e9:.1f}B fits: {best.candidate.label()}",
            flush=True,
        )
    return found


@dataclass(frozen=True)
class Job:
    """What every row of a run shares: the probed machine, the training dtype, the sequence
    and vocabulary of the trials, the NVMe folder, a trial's timeout."""

    machine: Any
    dtype: str
    seq: int
    vocab: int
    nvme: str
    timeout_s: float


def _tried(job: Job, entry: dict, trial, predicted) -> dict:
    """``entry`` with the prediction and what ``trial`` measured, printed; or with why it
    failed (a failed trial is a result: the next rows still run)."""
    from zerotrain.plan_trial import run_trial

    try:
        measured = run_trial(trial, timeout=job.timeout_s).as_dict()
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {error}"[-2000:]
        print(f"{entry['model']} {entry['config']}: {entry['error'][-300:]}", flush=True)
        return entry
    entry.update(predicted=predicted.as_dict(), measured=measured)
    _print_row(entry)
    return entry


def _row(job: Job, row: GpuRow, facts) -> dict:
    """A fixed row predicted and tried."""
    from zerotrain.plan_trial import TrialSpec

    candidate, config, predicted = _predict(row, facts, job.machine, job.dtype, job.nvme)
    trial = TrialSpec(_spec(row.model), config, 1, job.seq, job.vocab, row.checkpointing, steps=4)
    entry = {"model": row.model, "row": list(row), "config": _label(row, candidate)}
    return _tried(job, entry, trial, predicted)


def _pick(job: Job, facts) -> dict:
    """The planner's choice for PICK's model and global batch, tried, with its runners-up."""
    from zerotrain.plan.planner import make_plan
    from zerotrain.plan_trial import TrialSpec

    model, batch = PICK
    plan = make_plan(
        facts, job.machine, world=1, ranks_per_node=1, global_batch=batch,
        base=_base(None, job.dtype), nvme_path=job.nvme,
    )  # fmt: skip
    best = plan.best
    trial = TrialSpec(
        _spec(model), best.config, 1, job.seq, job.vocab,
        best.candidate.activation_checkpointing, steps=4,
    )  # fmt: skip
    entry = {"model": model, "config": best.candidate.label(), "pick": batch}
    entry["ranked"] = [
        {"config": p.candidate.label(), "step_time_s": p.predicted.step_time_s}
        for p in plan.ranked()[:5]
    ]
    return _tried(job, entry, trial, best.predicted)


def _profiled_sizes(model: str) -> list[int]:
    """The micro-batches the model probe times for ``model``: its rows', and for PICK's model
    every one the planner's candidates take."""
    from zerotrain.plan.candidates import micro_batches

    sizes = {r.micro for r in ROWS if r.model == model}
    if model == PICK[0]:
        sizes |= set(micro_batches(world=1, global_batch=PICK[1], base={}))
    return sorted(sizes)


def run(args: argparse.Namespace, nvme: str) -> dict:
    from zerotrain.plan.probe import probe_machine

    dtype = "fp32" if args.dry_run else "bf16"
    seq, vocab = (DRY_SEQ, 256) if args.dry_run else (SEQ, 50257)
    started = time.monotonic()
    out = args.out / "plan_gpu.json"
    # a CPU trial's rank computes on one thread (zerotrain/plan/jobs.py), as bench/plan.py probes
    threads = 1 if args.dry_run else None
    machine = probe_machine(dtype=dtype, world=1, nvme_path=nvme, threads=threads, refresh=True)
    job = Job(machine, dtype, seq, vocab, nvme, args.row_timeout_s)
    results: dict = {"dtype": dtype, "seq": seq, "machine": machine.to_json(), "facts": {}}
    results["rows"] = []

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))

    def over_budget(what: str) -> bool:
        spent = time.monotonic() - started
        if spent > args.budget_s:
            print(f"{what}: not run, --budget-s {args.budget_s:.0f} spent", flush=True)
        return spent > args.budget_s

    results["largest"] = largest(machine, dtype, seq, nvme)
    save()
    facts = {}
    for row in [ROWS[i] for i in args.rows] if args.rows else ROWS:
        if over_budget(f"{row.model} {row}"):
            break
        if row.model not in facts:
            sizes = _profiled_sizes(row.model)
            facts[row.model] = _facts(row.model, machine, sizes, seq, dtype, vocab)
            results["facts"][row.model] = _pickled(facts[row.model])
        results["rows"].append(_row(job, row, facts[row.model]))
        save()
    if PICK[0] in facts and not over_budget("the planner's pick"):
        results["pick"] = _pick(job, facts[PICK[0]])
    results["seconds"] = time.monotonic() - started
    save()
    return results


def report(path: Path) -> None:
    """The saved rows predicted again by this checkout's cost model, from the saved probe and
    model facts, beside the saved measurements; and the largest model planned again from the
    saved probe (host and device memory; NVMe offload left out, the run's disk not being
    saved)."""
    from zerotrain.plan.probe import Machine

    saved = json.loads(path.read_text())
    machine = Machine.from_json(saved["machine"])
    print(
        f"{machine.device}: matmul {machine.matmul_flops / 1e12:.0f} TFLOP/s, device AdamW "
        f"{(machine.device_adam_elements_per_s or 0) / 1e9:.2f} G elements/s, device copy "
        f"{(machine.device_copy_bytes_per_s or 0) / 1e12:.2f} TB/s, pinned copy "
        f"{(machine.copy_bytes_per_s or 0) / 1e9:.1f} GB/s"
    )
    facts = {name: _unpickled(text) for name, text in saved["facts"].items()}
    for entry in saved["rows"]:
        if "error" in entry:
            print(f"{entry['model']:>9} {entry['config']}: {entry['error'][-200:]}")
            continue
        row = GpuRow(*entry["row"])
        _, _, predicted = _predict(row, facts[row.model], machine, saved["dtype"], None)
        _print_row({**entry, "predicted": predicted.as_dict()})
    if "pick" in saved:
        pick = saved["pick"]
        print(f"pick ({pick['model']}, global batch {pick['pick']}): ", end="")
        if "error" in pick:
            print(f"{pick['config']}: {pick['error'][-200:]}")
        else:
            _print_row(pick)
    # again with this checkout's planner, without NVMe offload: the run's disk is not saved
    found = largest(machine, saved["dtype"], saved["seq"], None)
    fits, fails = found["fits"], found["fails"]
    if fits:
        print(
            f"largest that fits: {fits['parameters'] / 1e9:.2f}B ({fits['width']} x "
            f"{fits['blocks']}): {fits['config']}, predicted peak "
            f"{fits['peak_memory_bytes'] / 2**30:.1f} of {fits['budget_bytes'] / 2**30:.1f} GiB"
        )
    if fails:
        print(f"first that does not: {fails['parameters'] / 1e9:.2f}B: {fails['why']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_gpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, fp32, on a CPU")
    parser.add_argument("--budget-s", type=float, default=400, help="no row starts after")
    parser.add_argument("--row-timeout-s", type=float, default=240)
    parser.add_argument("--rows", type=int, nargs="+", help="indices into ROWS (default: all)")
    parser.add_argument("--report", type=Path, metavar="PLAN_GPU_JSON")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if args.dry_run:
        os.environ["PLAN_GPU_DRY"] = "1"  # the trials' ranks build the same tiny models
    with (
        tempfile.TemporaryDirectory(prefix="zerotrain-plan-cache-") as cache,
        tempfile.TemporaryDirectory(prefix="zerotrain-plan-gpu-nvme-") as nvme,
    ):
        os.environ["ZEROTRAIN_CACHE_DIR"] = cache  # a probe of its own
        run(args, nvme)
    report(args.out / "plan_gpu.json")


if __name__ == "__main__":
    main()
