"""What DeepSpeed's clients observe: the ``DeepSpeed info`` line at initialize on
``deepspeed.utils.logger``, ``save_checkpoint``'s refusal of an empty or None ``save_dir``, and
tag validation failures raised as DeepSpeed raises them."""

from __future__ import annotations

import os
import re
import unittest
from pathlib import Path

import torch
from torch import nn

import zerotrain
from tests.distributed import run_distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}


def test_initialize_logs_deepspeeds_info_line_once_on_its_logger() -> None:
    # transformers' DeepSpeed tests capture `from deepspeed.utils import logger` around training
    from zerotrain.utils import logger

    with unittest.TestCase().assertLogs(logger, "INFO") as logged:
        zerotrain.initialize(model=nn.Linear(4, 4), config=CONFIG)
    lines = [m for m in logged.output if "DeepSpeed info" in m]
    assert len(lines) == 1, logged.output
    version = re.escape(zerotrain.__version__)
    assert re.fullmatch(
        rf"INFO:zerotrain:\[Rank 0\] DeepSpeed info: version={version}, git-hash=\S+, "
        r"git-branch=\S+",
        lines[0],
    ), lines[0]


def _refusals(root: str) -> dict:
    rank = torch.distributed.get_rank()
    os.chdir(root)  # where an empty save_dir would write
    engine, *_ = zerotrain.initialize(
        model=nn.Linear(4, 4), config={**CONFIG, "checkpoint": {"tag_validation": "Fail"}}
    )
    cases = {
        "empty": ("", "t"),
        "none": (None, "t"),
        "one_rank_empty": ("" if rank == 1 else f"{root}/ok", "t"),
        "tags_differ": (f"{root}/ok", f"tag-{rank}"),
    }
    out = {}
    for name, (save_dir, tag) in cases.items():
        try:
            engine.save_checkpoint(save_dir, tag=tag)
            out[name] = None
        except Exception as exc:
            out[name] = (type(exc).__name__, isinstance(exc, AssertionError), str(exc))
    return out


def test_save_checkpoint_refuses_no_save_dir_and_different_tags_on_every_rank(tmp_path) -> None:
    # collective_timeout_s: a rank left alone in a collective fails the test in seconds
    results = run_distributed(_refusals, 2, str(tmp_path), collective_timeout_s=20)
    for rank, got in enumerate(results):
        for name, where in (("empty", "[0, 1]"), ("none", "[0, 1]"), ("one_rank_empty", "[1]")):
            kind, _, message = got[name]
            assert kind == "ValueError", (rank, name, got[name])
            assert "save_dir" in message and f"on rank(s) {where}" in message, message
        kind, is_assertion, message = got["tags_differ"]
        assert is_assertion and isinstance(message, str), got["tags_differ"]  # as DeepSpeed
        assert "not consistent across all ranks" in message and "tag-1" in message, message
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == []  # nothing written anywhere


def _warned_tags(root: str) -> dict:
    import logging

    rank = torch.distributed.get_rank()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = zerotrain.utils.logger  # deepspeed.utils.logger, where DeepSpeed warns
    logger.addHandler(handler)
    try:
        engine, *_ = zerotrain.initialize(model=nn.Linear(4, 4), config=CONFIG)  # Warn
        engine.save_checkpoint(root, tag=f"tag-{rank}")
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    return {"warned": warned, "saved": sorted(p.name for p in Path(root).iterdir())}


def test_tags_that_differ_under_warn_are_logged_on_every_rank_and_saved_under_rank_0s(tmp_path):
    results = run_distributed(_warned_tags, 2, str(tmp_path), collective_timeout_s=20)
    for rank, got in enumerate(results):
        (message,) = [m for m in got["warned"] if "not consistent across all ranks" in m]
        assert message.startswith(f"[rank={rank}]") and f"passed 'tag-{rank}'" in message
        assert "saving under rank 0's tag 'tag-0'" in message, message
        assert "tag-0" in got["saved"] and "tag-1" not in got["saved"], got["saved"]
