"""The examples, end to end: `zerotrain run` on 2 processes, as a user would start them."""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launched import run_in_session
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180


def zerotrain_run(*args: str) -> subprocess.CompletedProcess:
    """`zerotrain run ARGS` from the repository root; fails the test after TIMEOUT_S."""
    # `python -m zerotrain.cli` is the console script without depending on PATH, and PYTHONPATH
    # makes every process (torchrun's workers included) import this checkout's zerotrain.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    env.pop("OMP_NUM_THREADS", None)  # let `zerotrain run` split the cores
    command = [sys.executable, "-m", "zerotrain.cli", "run", *args]
    return run_in_session(command, cwd=REPO, env=env, timeout=TIMEOUT_S, what=" ".join(args))


def test_train_gpt_demo_on_two_processes(tmp_path):
    demo = ["--nproc-per-node", "2", "examples/train_gpt.py", "--model", "tiny"]
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "15"]
    result = zerotrain_run(*demo, *checkpoints, "--steps", "30", "--print-every", "10")
    assert result.returncode == 0, result.stdout
    # the engine's throughput line is the progress line, with the schedule's length
    progress = re.findall(
        r"^\[zerotrain\] step (\d+)/30 \| ETA \d+:\d\d \| loss ([\d.]+) \|",
        result.stdout,
        re.MULTILINE,
    )
    assert [int(step) for step, _ in progress] == [10, 20, 30], result.stdout
    assert result.stdout.count("tokens/s | ") == 3 and "TFLOP/s per rank | RSS" in result.stdout
    first = float(re.search(r"first loss\s+(\d+\.\d+)", result.stdout).group(1))
    final = float(re.search(r"final loss\s+(\d+\.\d+)", result.stdout).group(1))
    assert final < first - 0.5, result.stdout  # byte-level: ln(256) = 5.55 at the start
    # one loss: the summary's is the line's, the mean over the micro-batches and ranks
    assert final == pytest.approx(float(progress[-1][1]), abs=6e-4), result.stdout
    assert re.search(r"world size\s+2$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"ZeRO stage\s+2$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"validation loss\s+\d+\.\d+", result.stdout), result.stdout
    assert "saved " in result.stdout and "global_step30" in result.stdout, result.stdout

    # Started again with more steps, it resumes from its newest checkpoint (keep_last 2); with
    # activation checkpointing this time, which changes no number, the flops profiler and
    # TensorBoard.
    recompute = ["--activation-checkpointing", "--ac-every", "2"]
    monitors = ["--profile", "--profile-step", "31", "--tensorboard", str(tmp_path / "tb")]
    resumed = zerotrain_run(
        *demo, *checkpoints, *recompute, *monitors, "--steps", "40", "--print-every", "10"
    )
    assert resumed.returncode == 0, resumed.stdout
    assert "Profile of optimizer step 32 (flops_profiler.profile_step 31)" in resumed.stdout
    assert re.search(r"^      attn CausalSelfAttention: 16\.38 K params", resumed.stdout, re.M)
    events = EventAccumulator(str(tmp_path / "tb" / "gpt-tiny-stage2"))
    events.Reload()
    assert [s.step for s in events.Scalars("Train/loss")] == list(range(31, 41))
    # 10 steps of 2 checkpointed blocks (of the tiny model's 4)
    assert "every 2 of 4 blocks: 20 recomputations" in resumed.stdout, resumed.stdout
    assert "at step 30" in resumed.stdout, resumed.stdout
    progress = re.findall(r"^\[zerotrain\] step (\d+)/40 \|", resumed.stdout, re.MULTILINE)
    assert progress == ["40"], resumed.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "global_step30",
        "global_step40",
        "latest",
    ]

    # LoRA-FA fine-tuning of that model at stage 3, on other text (the email package)
    email_sources = str(Path(email.__file__).parent)
    finetune = ["--nproc-per-node", "2", "examples/finetune_lora_fa.py", "--model", "tiny"]
    tuned = zerotrain_run(*finetune, "--base", str(tmp_path / "ckpt"), "--data", email_sources)
    assert tuned.returncode == 0, tuned.stdout
    assert "lora_fa adapted 16 layers (r 8, alpha 16)" in tuned.stdout, tuned.stdout
    before = float(re.search(r"validation loss before\s+(\d+\.\d+)", tuned.stdout).group(1))
    after = float(re.search(r"validation loss after\s+(\d+\.\d+)", tuned.stdout).group(1))
    assert after < before, tuned.stdout
    held, whole = re.search(
        r"frozen parameters, this rank\s+([\d.]+) MiB \(all of them: ([\d.]+) MiB", tuned.stdout
    ).groups()
    assert abs(float(held) - float(whole) / 2) <= 0.01, tuned.stdout  # partitioned over 2


@pytest.mark.slow  # 14 s; the suite keeps expert parallelism's own tests (tests/test_moe.py)
def test_train_gpt_help_shows_the_defaults():
    result = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps at the terminal's width
    assert "optimizer steps (default: 200)" in text
    assert "training dtype (default: fp32)" in text
    assert "the newest 2 are kept, older ones deleted (checkpoint.keep_last)" in text


@pytest.mark.slow  # 12 s; tests/test_moe.py trains expert parallelism against one process
def test_train_gpt_with_experts_spread_over_two_processes():
    """The example GPT with MoE layers of 4 experts in every other block, 2 on each rank."""
    moe = ["examples/train_gpt.py", "--model", "tiny", "--experts", "4", "--ep", "2"]
    result = zerotrain_run("--nproc-per-node", "2", *moe, "--steps", "20", "--print-every", "10")
    assert result.returncode == 0, result.stdout
    # the whole model: the dense parameters and all 4 experts of the 2 MoE layers
    assert "GPT 'tiny': 414,784 parameters" in result.stdout, result.stdout
    first = float(re.search(r"first loss\s+(\d+\.\d+)", result.stdout).group(1))
    final = float(re.search(r"final loss\s+(\d+\.\d+)", result.stdout).group(1))
    assert final < first - 0.5, result.stdout


@pytest.mark.slow  # 8 s; the suite keeps compression's own tests (tests/test_compression.py)
def test_train_gpt_with_compression_both_ways_on_two_processes():
    """Top-k 1% gradients and int4 parameter gathers at stage 2: a third of the bytes of
    uncompressed stage 2 or less (which sends 4 bytes per parameter per step: a
    reduce-scatter and an all-gather of half the fp32 model each), and training still learns."""
    flags = ["--model", "tiny", "--compress", "topk", "--compress-ratio", "0.01"]
    flags += ["--compress-params", "int4"]
    gpt = ["examples/train_gpt.py", *flags, "--steps", "20", "--print-every", "10"]
    result = zerotrain_run("--nproc-per-node", "2", *gpt)
    assert result.returncode == 0, result.stdout
    assert "| compression topk 1% + int4 params |" in result.stdout, result.stdout
    parameters = int(
        re.search(r"GPT 'tiny': ([\d,]+) parameters", result.stdout)[1].replace(",", "")
    )
    sent = float(re.search(r"sent per step \(rank 0\)\s+(\d+\.\d+) MB", result.stdout)[1])
    assert sent * 1e6 < 4 * parameters / 3, result.stdout  # the first step travels exactly
    assert re.search(r"compression state \(rank 0\)\s+\d+\.\d MiB", result.stdout)
    first = float(re.search(r"first loss\s+(\d+\.\d+)", result.stdout).group(1))
    final = float(re.search(r"final loss\s+(\d+\.\d+)", result.stdout).group(1))
    assert final < first - 0.5, result.stdout


@pytest.mark.slow  # 8 s; the suite keeps the pipeline's own tests (tests/test_pipeline.py)
def test_train_gpt_on_two_pipeline_stages_validates_whole_steps():
    """A pipeline evaluates a step's micro-batches together: one validation batch asked for
    with 2 per step evaluates 2 (it stopped with a bare StopIteration before)."""
    flags = ["--model", "tiny", "--pp", "2", "--grad-accum", "2", "--val-batches", "1"]
    result = zerotrain_run("--nproc-per-node", "2", "examples/train_gpt.py", *flags, "--steps", "2")
    assert result.returncode == 0, result.stdout
    assert re.search(r"validation loss\s+\d+\.\d+ \(2 batches\)", result.stdout), result.stdout


def test_train_gpt_trains_the_config_zerotrain_plan_wrote(tmp_path):
    """`--plan` takes the tensor-parallel degree, stage, offload, micro-batch, accumulation and
    checkpointing of a config `zerotrain plan` writes (docs/plan.md)."""
    plan = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "activation_checkpointing": {},
        "tensor_parallel": {"autotp_size": 2},
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    flags = ["--model", "tiny", "--plan", str(tmp_path / "plan.json"), "--val-batches", "1"]
    result = zerotrain_run("--nproc-per-node", "2", "examples/train_gpt.py", *flags, "--steps", "2")
    assert result.returncode == 0, result.stdout
    assert re.search(r"ZeRO stage\s+3", result.stdout), result.stdout
    assert "| 4 windows x 64 tokens per step |" in result.stdout  # 2 x 2 on 1 data-parallel rank
    assert "tp 2" in result.stdout
    assert "optimizer states 0.0 (ZeRO formula" in result.stdout  # offloaded to the host
    assert "activation checkpointing        every 1 of 4 blocks" in result.stdout


@pytest.mark.slow  # 11 s; the suite keeps a DeepSpeed-style script (test_deepspeed_script.py)
def test_deepspeed_style_classifier_on_two_processes():
    result = zerotrain_run(
        "--nproc-per-node",
        "2",
        "examples/deepspeed_style/train_classifier.py",
        "--deepspeed",
        "--deepspeed_config",
        "examples/deepspeed_style/ds_config.json",
        "--epochs",
        "1",
        "--num-samples",
        "2048",
    )
    assert result.returncode == 0, result.stdout
    match = re.search(
        r"Finished Training: first loss (\d+\.\d+), final loss (\d+\.\d+)", result.stdout
    )
    assert match, result.stdout
    first, final = map(float, match.groups())
    assert final < first, result.stdout
    assert "Accuracy of the network on the 1000 test images" in result.stdout
