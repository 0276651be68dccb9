"""DeepSpeed's smaller public utilities as their users call them: deepspeed.OnDevice, the
zero_optimization config classes (deepspeed.runtime.zero.config / offload_config) and the
schedule names and flags of deepspeed.runtime.lr_schedules."""

from __future__ import annotations

import argparse

import pytest
import torch
from models import AwkwardModel
from torch import nn

import zerotrain


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))


def test_on_device_builds_on_meta_in_the_dtype_and_restores_torch() -> None:
    constructors = (torch.empty, torch.zeros, torch.ones, torch.full)
    with zerotrain.OnDevice(dtype=torch.bfloat16, device="meta"):
        net = _Net()
    assert all(p.is_meta and p.dtype is torch.bfloat16 for p in net.parameters())
    assert net.steps.is_meta and net.steps.dtype is torch.long  # integers keep their dtype
    assert (torch.empty, torch.zeros, torch.ones, torch.full) == constructors
    assert torch.empty(2).device.type == "cpu" and torch.empty(2).dtype is torch.float32

    with zerotrain.utils.OnDevice(dtype=torch.float64, device="cpu"):
        on_cpu = _Net()
    assert all(p.device.type == "cpu" and p.dtype is torch.float64 for p in on_cpu.parameters())

    with pytest.raises(RuntimeError, match="inside"), zerotrain.OnDevice(torch.half, "meta"):
        raise RuntimeError("inside")
    assert (torch.empty, torch.zeros, torch.ones, torch.full) == constructors
    assert torch.empty(2).device.type == "cpu"

    with zerotrain.OnDevice(dtype=torch.bfloat16, enabled=False):
        assert not _Net().linear.weight.is_meta
    with pytest.raises(ValueError, match="floating-point"):
        zerotrain.OnDevice(dtype=torch.int8)


def test_zero_config_classes_users_construct() -> None:
    from zerotrain.runtime.zero.config import (
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
        OffloadDeviceEnum,
        ZeroStageEnum,
        get_zero_config,
    )

    config = DeepSpeedZeroConfig(
        stage=3,
        offload_param={"device": "cpu"},
        offload_optimizer=DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu),
        prefetch_bucket_size=1000,  # DeepSpeed's field name
        stage3_param_persistence_threshold=10,  # and its alias
    )
    assert config.stage == ZeroStageEnum.weights
    assert isinstance(config.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert config.offload_param.device == OffloadDeviceEnum.cpu
    assert config.offload_optimizer.device == "cpu"
    assert (config.prefetch_bucket_size, config.param_persistence_threshold) == (1000, 10)
    assert get_zero_config({"zero_optimization": {"stage": 2}}).stage == 2
    assert get_zero_config({"zero_optimization": True}).stage == ZeroStageEnum.optimizer_states
    assert get_zero_config({}).stage == ZeroStageEnum.disabled
    with pytest.raises(ValueError, match="stage"):
        DeepSpeedZeroConfig(stage=4)
    with pytest.raises(ValueError, match="device"):
        DeepSpeedZeroOffloadParamConfig(device="gpu")


def test_lr_schedule_flags_become_a_scheduler_section_that_trains() -> None:
    from zerotrain.runtime import lr_schedules as lrs

    parser = lrs.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--lr_schedule", lrs.WARMUP_LR, "--warmup_max_lr", "0.01", "--warmup_num_steps", "3"]
    )
    section, error = lrs.get_config_from_args(args)
    assert error is None
    assert section == {
        "type": "WarmupLR",
        "params": {
            lrs.WARMUP_MIN_LR: 0.0,
            lrs.WARMUP_MAX_LR: 0.01,
            lrs.WARMUP_NUM_STEPS: 3,
            lrs.WARMUP_TYPE: lrs.WARMUP_LOG_RATE,
        },
    }
    assert lrs.get_lr_from_config(section) == (0.01, "")
    assert lrs.get_config_from_args(parser.parse_args([]))[0] is None
    one_cycle = parser.parse_args(["--lr_schedule", lrs.ONE_CYCLE, "--cycle_max_lr", "0.2"])
    params = lrs.get_config_from_args(one_cycle)[0]["params"]
    assert (params[lrs.CYCLE_MIN_LR], params[lrs.CYCLE_MAX_LR]) == (0.01, 0.2)
    assert lrs.VALID_LR_SCHEDULES == [
        lrs.LR_RANGE_TEST,
        lrs.ONE_CYCLE,
        lrs.WARMUP_LR,
        lrs.WARMUP_DECAY_LR,
        lrs.WARMUP_COSINE_LR,
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": section,
    }
    engine, optimizer, _, scheduler = zerotrain.initialize(model=AwkwardModel(), config=config)
    torch_optimizer = lrs.get_torch_optimizer(optimizer)
    assert torch_optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == 0.0
    assert lrs.update_lr(torch_optimizer.param_groups, [0.5] * 2)[0] == 0.5
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        lrs.get_torch_optimizer(object())
