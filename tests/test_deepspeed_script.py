"""A DeepSpeed-style script runs under zerotrain with only its import lines rewritten: the
promise of the README. The script (tests/scripts/deepspeed_style_train.py) imports deepspeed,
deepspeed.comm, deepspeed.accelerator, deepspeed.pipe, deepspeed.runtime.utils,
deepspeed.utils and deepspeed.utils.zero_to_fp32, and trains with zero.Init, engine.backward or
loss.backward(), RepeatingLoader, checkpoints with client state and zero_to_fp32."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_examples import zerotrain_run

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_style_train.py"

_REWRITES = [
    (re.compile(r"^import deepspeed$"), "import zerotrain as deepspeed"),
    (re.compile(r"^import deepspeed\.([\w.]+) as (\w+)$"), r"import zerotrain.\1 as \2"),
    (re.compile(r"^from deepspeed(\.[\w.]+)? import "), r"from zerotrain\1 import "),
]


def rewrite_imports(source: str) -> str:
    """Point every ``deepspeed`` import of ``source`` at zerotrain; change nothing else."""
    lines = []
    for line in source.splitlines():
        for pattern, replacement in _REWRITES:
            line = pattern.sub(replacement, line)
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    original = SCRIPT.read_text()
    rewritten = rewrite_imports(original)
    changed = [
        (old, new)
        for old, new in zip(original.splitlines(), rewritten.splitlines(), strict=True)
        if old != new
    ]
    assert len(changed) == 7 and all(new.split()[0] in ("import", "from") for _, new in changed)
    assert not re.search(r"^(import|from) deepspeed", rewritten, re.MULTILINE)
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text(rewritten)
    return path


def _losses(output: str) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+) lr", output, re.MULTILINE)


def _run(script: Path, *args: str) -> str:
    result = zerotrain_run("--nproc-per-node", "2", str(script), "--deepspeed", *args)
    assert result.returncode == 0, result.stdout
    return result.stdout


def test_script_trains_with_engine_backward_and_resumes_exactly(script, tmp_path) -> None:
    save = ["--save_dir", str(tmp_path / "ckpt"), "--save_at", "8"]
    straight = _run(script, "--steps", "16", "--stage", "2", *save)
    losses = _losses(straight)
    early, late = (sum(map(float, part)) / 4 for part in (losses[:4], losses[-4:]))
    assert len(losses) == 16 and late < early - 0.2, straight
    assert "done: stage 2, world 2" in straight
    assert "fp32 state dict: ['blocks.0.bias', 'blocks.0.weight'" in straight
    resumed = _run(script, "--steps", "16", "--stage", "2", "--load_dir", str(tmp_path / "ckpt"))
    assert losses[:8] + _losses(resumed) == losses  # the same run, to the last digit


@pytest.mark.slow  # 36 s; tests/test_loss_backward.py compares the two backwards at stage 3
def test_script_trains_at_stage_3_with_loss_backward(script) -> None:
    engine_backward = _run(script, "--steps", "4", "--stage", "3")
    torch_backward = _run(script, "--steps", "4", "--stage", "3", "--backward", "torch")
    assert "done: stage 3, world 2" in torch_backward
    # accumulation 2 (16 = 4 x 2 x 2 ranks): a power of two, so the same bits
    assert _losses(torch_backward) == _losses(engine_backward)
