"""The shard group's lifecycle: tracked through a real step, transitions checked in debug mode."""

from __future__ import annotations

import pytest
import torch
from models import AwkwardModel, make_batches, param_groups

import zerotrain
from zerotrain.zero import GroupState


def _engine(stage: int):
    torch.manual_seed(0)
    model = AwkwardModel()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.0), config=config
    )
    return engine, model


@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_goes_forward_backward_step_idle(stage):
    engine, model = _engine(stage)
    group = engine.optimizer.group
    seen = []
    model.up.register_forward_hook(lambda *_: seen.append(("forward", group.state)))
    model.up.weight.register_post_accumulate_grad_hook(lambda _: seen.append(("grad", group.state)))
    idx, tgt = make_batches(1, 2)
    loss = engine(idx[0], tgt[0])
    assert group.state is GroupState.IDLE
    engine.backward(loss)
    assert group.state is GroupState.IDLE
    engine.step()
    assert group.state is GroupState.IDLE
    assert seen == [("forward", GroupState.FORWARD), ("grad", GroupState.BACKWARD)]


def test_a_step_inside_a_backward_is_refused_in_debug_mode(monkeypatch):
    engine, _ = _engine(2)
    group = engine.optimizer.group
    group.state = GroupState.BACKWARD  # as if step() were called from a gradient hook
    monkeypatch.setenv("ZEROTRAIN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="backward -> step is not allowed"):
        group.begin_step()
    monkeypatch.delenv("ZEROTRAIN_DEBUG")
    group.state = GroupState.BACKWARD
    group.begin_step()  # unchecked without debug mode: tracking costs nothing else
    assert group.state is GroupState.STEP
