"""The equivalence table of tests/test_tensor_parallel.py and tests/test_pipeline.py with the
errors measured, not just bounded: each configuration trained on 4 (or 2) CPU processes
against one process on the same global batch, fp32, three steps with accumulation and
clipping; the largest relative error over the parameters (Frobenius norm of the difference
over that of the reference, per tensor).

    python bench/equivalence3d.py        # about 2 minutes on 2 cores
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

import test_pipeline as pipe  # noqa: E402 (after the path)
import test_tensor_parallel as tp  # noqa: E402
from distributed import run_cases, run_distributed  # noqa: E402
from models import relative_error  # noqa: E402


def worst(state: dict, want: dict, rename=lambda key: key) -> float:
    return max(relative_error(state[rename(key)], value) for key, value in want.items())


def tensor_parallel_rows() -> list[tuple[str, float]]:
    rows = []
    cases = [
        ("gpt2", 2, [0, 3]),
        ("llama", 2, [0, 3]),
        ("gpt2", 2, [0, 3], True),
        ("llama", 2, [3], True, "torch"),
    ]
    for (kind, _, stages, *options), per_rank in zip(
        cases, zip(*run_cases(tp.train, 2, cases), strict=True), strict=True
    ):
        want, _ = tp.reference(kind, dp=1)
        label = ", sequence parallel" if options else ""
        label += ", torchtitan's plan in torch's styles" if options[1:] else ""
        for stage in stages:
            error = max(worst(r[stage][0], want) for r in per_rank)
            rows.append((f"tp2, {kind}, stage {stage}{label}", error))
    results = run_cases(tp.train, 4, [("gpt", 2, [0, 1, 2, 3]), ("gpt2", 2, [1, 2], True)])
    for index, (kind, stages, label) in enumerate(
        [("gpt", [0, 1, 2, 3], ""), ("gpt2", [1, 2], ", sequence parallel")]
    ):
        want, _ = tp.reference(kind, dp=2)
        for stage in stages:
            error = max(worst(r[index][stage][0], want) for r in results)
            rows.append((f"tp2 x dp2, {kind}, stage {stage}{label}", error))
    return rows


def pipeline_rows() -> list[tuple[str, float]]:
    rows = []
    schedules = [(0, "1f1b"), (1, "gpipe"), (2, "1f1b"), (2, "gpipe")]
    cases = [
        (schedules, 2),
        ([(1, "1f1b")], 2, 2, 4),
        ([(1, "1f1b")], 2, 2, 4, "parameters", 3, True),
        *(case for case, _, _ in pipe.MULTI_STAGE),
    ]
    labels = ["pp2 x dp2", "pp2 x tp2", "pp2 x tp2 sequence parallel"]
    labels += ["pp2 x dp2", "pp4", "pp2 x dp2", "pp4"]
    results = run_cases(pipe.train, 4, cases)
    for index, (case, label) in enumerate(zip(cases, labels, strict=True)):
        stages, tp_degree = case[1], case[2] if len(case) > 2 else 1
        blocks = case[5] if len(case) > 5 else 3
        heads = case[3] if len(case) > 3 else 5
        want, _ = pipe.reference(dp=4 // (stages * tp_degree), heads=heads, blocks=blocks)
        for run in results[0][index]:
            error = max(worst(r[index][run][0], want) for r in results)
            rows.append((f"{label}, ZeRO stage {run[0]}, {run[1]}", error))
    return rows


def split_model_rows(directory: str) -> list[tuple[str, float]]:
    """Ordinary models cut by module names (zerotrain.pipe.split_model): one without ties, and
    the example GPT, whose head is its embedding."""
    torch.manual_seed(pipe.SEED)
    untied = pipe.single_process(pipe.Untied())
    tied = pipe.single_process(pipe.tied_gpt())
    four = ["blocks.1", "blocks.2", "norm"]
    untied_runs = [(1, "1f1b", ["blocks.2"]), (1, "interleaved_1f1b", four)]
    tied_runs = [(1, "1f1b", ["blocks.1"]), (2, "zbv", ["blocks.0", "blocks.1", "ln_final"])]
    rows = []
    for runs, want, results, model in [
        (untied_runs, untied, run_distributed(pipe.split_untied, 4, untied_runs), "untied"),
        (tied_runs, tied, run_distributed(pipe.split_tied_gpt, 4, directory, tied_runs), "tied"),
    ]:
        for stage, schedule, points in runs:
            # keys <stage>.<name>, and tied_modules.<owner>.<attr>: the model's names after the
            # first dot
            error = max(
                relative_error(value, want[key.partition(".")[2]])
                for per_rank in results
                for key, value in per_rank[stage, schedule].items()
            )
            label = f"split_model, {len(points) + 1} stages, {model} head"
            rows.append((f"{label}, ZeRO stage {stage}, {schedule}", error))
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        rows = tensor_parallel_rows() + pipeline_rows() + split_model_rows(directory)
    print("| configuration | max relative error |")
    print("|---|---|")
    for label, error in rows:
        print(f"| {label} | {error:.1e} |")


if __name__ == "__main__":
    main()
