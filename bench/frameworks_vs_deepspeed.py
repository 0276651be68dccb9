"""The HuggingFace Trainer and Accelerate on zerotrain against the same scripts on DeepSpeed,
one run.

    .venv/bin/pip install -r requirements-bench.txt     # DeepSpeed 0.19.8 (or --deepspeed-path)
    .venv/bin/python bench/frameworks_vs_deepspeed.py [--stages 2 3] [--steps 8]

Two scripts, each run on 2 CPU ranks twice per ZeRO stage, unchanged: under DeepSpeed on its
CPU accelerator (`DS_ACCELERATOR=cpu`), and under zerotrain through `zerotrain run
--deepspeed-compat=shadow` (shadow: DeepSpeed is importable here, and the alias must take its
place):
- bench/frameworks/hf_trainer.py: a 4-layer GPT-2 from a config, HF's "auto" DeepSpeed config,
  AdamW with WarmupDecayLR, clipping 1.0, accumulation 2;
- bench/frameworks/accelerate_loop.py: the same model and data in an Accelerate loop with a
  DeepSpeed plugin, a torch AdamW, clipping 1.0, accumulation 2.
Printed per script and stage: the largest relative difference of the per-micro-batch losses
(rank 0), of the evaluation loss and of the saved weights, and the training time of zerotrain
over DeepSpeed's. The Lightning Trainer cannot be compared here: its DeepSpeed strategy refuses
accelerators other than CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "hf_trainer": ROOT / "bench" / "frameworks" / "hf_trainer.py",
    "accelerate": ROOT / "bench" / "frameworks" / "accelerate_loop.py",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", choices=sorted(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument(
        "--deepspeed-path",
        help="a directory on which `import deepspeed` finds DeepSpeed (default: installed)",
    )
    return parser.parse_args()


def run(
    framework: str, system: str, stage: int, steps: int, out: Path, deepspeed_path: str | None
) -> dict:
    # ACCELERATE_USE_DEEPSPEED: what `accelerate launch --use_deepspeed` sets (the Trainer
    # sets it itself)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_DEEPSPEED": "true"}
    if deepspeed_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [deepspeed_path, env.get("PYTHONPATH")]))
    script = [str(SCRIPTS[framework]), str(stage), str(steps), str(out)]
    if system == "DeepSpeed":
        env["DS_ACCELERATOR"] = "cpu"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *script,
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "zerotrain.cli",
            "run",
            "--deepspeed-compat=shadow",
            "--nproc-per-node",
            "2",
            *script,
        ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(
            f"{framework} on {system}, stage {stage}, failed:\n{done.stderr[-3000:]}"
        )
    result = json.loads((out / "result.json").read_text())
    result["weights"] = load_file(next((out / "model").glob("*.safetensors")))
    return result


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main() -> None:
    args = parse_args()
    import deepspeed  # noqa: F401  (fails early, naming what is missing)

    print(
        f"GPT-2 4x128 from a config, 2 CPU ranks, {args.steps} steps x accumulation 2 "
        f"x micro-batch 4 x 64 tokens; torch {torch.__version__}\n"
    )
    print(
        f"{'script':>10} {'stage':>5} {'max Δloss/loss':>15} {'Δeval/eval':>11} "
        f"{'max Δw/|w|':>11} {'time zt/DS':>11}"
    )
    with tempfile.TemporaryDirectory(prefix="zerotrain-frameworks-") as tmp:
        for framework, stage in [(f, s) for f in args.frameworks for s in args.stages]:
            results = {}
            for system in ("DeepSpeed", "zerotrain"):
                out = Path(tmp) / f"{framework}-{system}-{stage}"
                results[system] = run(
                    framework, system, stage, args.steps, out, args.deepspeed_path
                )
                shutil.rmtree(out / "trainer", ignore_errors=True)
            ds, zt = results["DeepSpeed"], results["zerotrain"]
            # each ran the engine it is meant to (not, say, plain DDP for both)
            assert ds["engine"].startswith("deepspeed.") and zt["engine"].startswith(
                "zerotrain."
            ), (
                ds["engine"],
                zt["engine"],
            )
            assert len(ds["losses"]) == len(zt["losses"]) == 2 * args.steps
            losses = max(relative(z, d) for z, d in zip(zt["losses"], ds["losses"], strict=True))
            weights = max(
                (
                    (zt["weights"][k].float() - w.float()).norm()
                    / w.float().norm().clamp_min(1e-30)
                ).item()
                for k, w in ds["weights"].items()
            )
            print(
                f"{framework:>10} {stage:>5} {losses:>15.2e} {relative(zt['eval_loss'], ds['eval_loss']):>11.2e} "
                f"{weights:>11.2e} {zt['train_s'] / ds['train_s']:>11.3f}"
            )
    print(
        "\nΔ: zerotrain's value against DeepSpeed's, relative; losses per micro-batch on rank 0; "
        "Δw: the largest per-tensor relative norm difference of the weights saved (save_model, "
        "get_state_dict); "
        "time: the training loop's wall time (trainer.train(), or the Accelerate loop), one run "
        "each (trainer.train() includes the engine's start-up)."
    )


if __name__ == "__main__":
    main()
