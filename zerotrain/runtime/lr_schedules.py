"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (zerotrain.optim.schedulers)."""

from __future__ import annotations

import argparse

import torch

from zerotrain.optim.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

# DeepSpeed's names of the schedules and of their `params` keys (and command-line flags)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""DeepSpeed's schedule names (Accelerate recognises DeepSpeed schedulers by them)."""

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# the command-line flags of add_tuning_arguments: (key, type, default), DeepSpeed's defaults;
# the keys each schedule's overrides read
_RANGE_TEST_FLAGS = [
    (LR_RANGE_TEST_MIN_LR, float, 0.001),
    (LR_RANGE_TEST_STEP_RATE, float, 1.0),
    (LR_RANGE_TEST_STEP_SIZE, int, 1000),
    (LR_RANGE_TEST_STAIRCASE, bool, False),
]
_ONE_CYCLE_FLAGS = [
    (CYCLE_FIRST_STEP_SIZE, int, 1000),
    (CYCLE_FIRST_STAIR_COUNT, int, -1),
    (CYCLE_SECOND_STEP_SIZE, int, -1),
    (CYCLE_SECOND_STAIR_COUNT, int, -1),
    (DECAY_STEP_SIZE, int, 1000),
    (CYCLE_MIN_LR, float, 0.01),
    (CYCLE_MAX_LR, float, 0.1),
    (DECAY_LR_RATE, float, 0.0),
    (CYCLE_MIN_MOM, float, 0.8),
    (CYCLE_MAX_MOM, float, 0.9),
    (DECAY_MOM_RATE, float, 0.0),
]
_WARMUP_FLAGS = [
    (WARMUP_MIN_LR, float, 0.0),
    (WARMUP_MAX_LR, float, 0.001),
    (WARMUP_NUM_STEPS, int, 1000),
    (WARMUP_TYPE, str, WARMUP_LOG_RATE),
]
_COSINE_FLAGS = [(WARMUP_MIN_RATIO, float, 0.01), (COS_MIN_RATIO, float, 0.01)]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's learning-rate schedule flags (``--lr_schedule``, ``--warmup_max_lr``,
    ...) to ``parser``, with DeepSpeed's defaults; returns it."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    group.add_argument("--cycle_momentum", default=False, action="store_true")
    for key, kind, default in _RANGE_TEST_FLAGS + _ONE_CYCLE_FLAGS + _WARMUP_FLAGS + _COSINE_FLAGS:
        group.add_argument(f"--{key}", type=kind, default=default)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The schedule flags of this process's command line, and the other arguments."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _override(args, params: dict, flags) -> None:
    for key, _, _ in flags:
        if getattr(args, key, None) is not None:
            params[key] = getattr(args, key)


def override_lr_range_test_params(args, params: dict) -> None:
    """``params`` takes the LR range test's flags that ``args`` sets."""
    _override(args, params, _RANGE_TEST_FLAGS)


def override_1cycle_params(args, params: dict) -> None:
    """``params`` takes the OneCycle flags that ``args`` sets."""
    _override(args, params, _ONE_CYCLE_FLAGS)


def override_warmupLR_params(args, params: dict) -> None:  # noqa: N802 (DeepSpeed's name)
    """``params`` takes the warmup flags that ``args`` sets."""
    _override(args, params, _WARMUP_FLAGS)


def override_params(args, params: dict) -> None:
    """``params`` takes every schedule flag that ``args`` sets."""
    _override(args, params, _RANGE_TEST_FLAGS + _ONE_CYCLE_FLAGS + _WARMUP_FLAGS)


def get_config_from_args(args) -> tuple[dict | None, str | None]:
    """The ``scheduler`` config section that ``args`` (from :func:`add_tuning_arguments`)
    asks for, or None and why not."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    flags = {LR_RANGE_TEST: _RANGE_TEST_FLAGS, ONE_CYCLE: _ONE_CYCLE_FLAGS}
    params: dict = {}
    _override(args, params, flags.get(schedule, _WARMUP_FLAGS))
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict) -> tuple[float | None, str]:
    """The learning rate a ``scheduler`` section peaks at (the range test's start), or None
    and why not."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(schedule)
    return params[key or WARMUP_MAX_LR], ""


def update_lr(param_groups: list[dict], lrs: list[float]) -> list:
    """Set each group's ``lr`` (a tensor where the group holds one); returns the new values."""
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            lr = torch.tensor([lr], device=group["lr"].device)
        group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """``optimizer`` if it is a torch optimizer, else the one it wraps (``.optimizer``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


class LRRangeTest:
    """DeepSpeed's learning-rate range test, which zerotrain does not implement yet."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "LRRangeTest: zerotrain does not implement DeepSpeed's learning-rate range test "
            "yet; use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle"
        )


__all__ = [
    "COS_MIN_RATIO",
    "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_FIRST_STEP_SIZE",
    "CYCLE_MAX_LR",
    "CYCLE_MAX_MOM",
    "CYCLE_MIN_LR",
    "CYCLE_MIN_MOM",
    "CYCLE_SECOND_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE",
    "DECAY_LR_RATE",
    "DECAY_MOM_RATE",
    "DECAY_STEP_SIZE",
    "EDGE_VALUE",
    "LR_RANGE_TEST",
    "LR_RANGE_TEST_MIN_LR",
    "LR_RANGE_TEST_STAIRCASE",
    "LR_RANGE_TEST_STEP_RATE",
    "LR_RANGE_TEST_STEP_SIZE",
    "LR_SCHEDULE",
    "MID_VALUE",
    "ONE_CYCLE",
    "TOTAL_NUM_STEPS",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "WARMUP_MAX_LR",
    "WARMUP_MIN_LR",
    "WARMUP_MIN_RATIO",
    "WARMUP_NUM_STEPS",
    "WARMUP_TYPE",
    "add_tuning_arguments",
    "get_config_from_args",
    "get_lr_from_config",
    "get_torch_optimizer",
    "override_1cycle_params",
    "override_lr_range_test_params",
    "override_params",
    "override_warmupLR_params",
    "parse_arguments",
    "update_lr",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
