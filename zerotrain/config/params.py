"""The sections of the form ``{"type": ..., "params": {...}}``: `optimizer` and `scheduler`.
Each implemented ``type`` lists the ``params`` keys DeepSpeed accepts for it, with their types.
The optimizer types and their keys are zerotrain.optim.registry's (the registry also builds
them); this module adds the type of each key."""

import difflib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator
from typing_extensions import Required, TypedDict

from zerotrain.config import deepspeed_keys
from zerotrain.config.errors import fail
from zerotrain.config.section import (
    Betas,
    Int,
    LrValue,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Section,
)
from zerotrain.optim.registry import DEEPSPEED_ONLY_OPTIMIZERS, OPTIMIZERS
from zerotrain.optim.schedulers import SCHEDULERS

__all__ = ["OptimizerConfig", "Params", "SchedulerConfig", "TypedParamsSection"]


@dataclass(frozen=True)
class Params:
    """The `params` keys DeepSpeed accepts for one optimizer or scheduler `type`. The validated
    dict holds only the keys the user wrote; the engine passes it on as keyword arguments."""

    doc: str
    keys: dict[str, Any]  # key -> annotation
    required: tuple[str, ...] = ()

    @cached_property
    def adapter(self) -> TypeAdapter[Any]:
        # a TypedDict built at run time: Required[...] wraps annotations held as values
        # pyrefly: ignore[invalid-annotation]
        fields = {k: Required[v] if k in self.required else v for k, v in self.keys.items()}
        spec = TypedDict("Params", fields, total=False)  # type: ignore[operator]
        spec.__pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)  # type: ignore[attr-defined]
        return TypeAdapter(spec)


class TypedParamsSection(Section):
    """A section of the form ``{"type": ..., "params": {...}}`` (optimizer, scheduler)."""

    _KIND: ClassVar[str] = ""
    _PARAMS: ClassVar[dict[str, Params]] = {}  # the implemented types
    _DEEPSPEED_ONLY_TYPES: ClassVar[frozenset[str]] = frozenset()  # lower case

    @field_validator("type", mode="before", check_fields=False)
    @classmethod
    def _normalise_type(cls, value: Any) -> Any:
        if not isinstance(value, str):  # the Literal check reports it
            return value
        lowered = {choice.lower(): choice for choice in cls._PARAMS}
        if value.lower() in lowered:
            return lowered[value.lower()]
        allowed = ", ".join(cls._PARAMS)
        if value.lower() in cls._DEEPSPEED_ONLY_TYPES:
            raise fail(
                f"'{value}' is a DeepSpeed {cls._KIND} that zerotrain does not implement "
                f"yet; use one of {allowed}"
            )
        match = difflib.get_close_matches(value.lower(), list(lowered), n=1)
        hint = f"; did you mean '{lowered[match[0]]}'?" if match else ";"
        raise fail(f"unknown {cls._KIND} '{value}'{hint} zerotrain supports {allowed}")

    @field_validator("params", check_fields=False)
    @classmethod
    def _validate_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:  # the invalid type is reported on its own
            return params
        return cls._PARAMS[info.data["type"]].adapter.validate_python(params)


# The type of each `optimizer.params` key, whichever optimizer takes it; which keys each
# optimizer takes is zerotrain.optim.registry's.
_OPTIMIZER_PARAM_TYPES = {
    "lr": NonNegativeFloat,
    "betas": Betas,
    "eps": NonNegativeFloat,
    "weight_decay": NonNegativeFloat,
    "amsgrad": bool,
    "torch_adam": bool,
    "fused": bool,
    "foreach": bool,
    "adam_w_mode": bool,
    "bias_correction": bool,
    "set_grad_none": bool,
    "momentum": NonNegativeFloat,
    "dampening": NonNegativeFloat,
    "nesterov": bool,
    "max_coeff": NonNegativeFloat,
    "min_coeff": NonNegativeFloat,
    "eps_inside_sqrt": bool,
    "freeze_step": NonNegativeInt,
    "var_freeze_step": NonNegativeInt,
    "var_update_scaler": PositiveInt,
    "local_step_scaler": PositiveInt,
    "local_step_clipper": PositiveInt,
    "cuda_aware": bool,
    "comm_backend_name": Literal["nccl", "mpi", "hccl", "compressed"],
    "lr_decay": NonNegativeFloat,
    "initial_accumulator_value": NonNegativeFloat,
    "muon_lr": NonNegativeFloat,
    "adam_lr": NonNegativeFloat,
    "ns_steps": PositiveInt,
    "ns_coefficients": tuple[float, float, float],
    "ns_dtype": Literal["fp32", "bf16"],
    "ns_eps": NonNegativeFloat,
    "adjust_lr_fn": Literal["original", "match_rms_adamw"],
}
_WARMUP_KEYS = {
    "warmup_min_lr": LrValue,
    "warmup_max_lr": LrValue,
    "warmup_num_steps": PositiveInt,
    "warmup_type": Literal["log", "linear"],
    "last_batch_iteration": Int,
}


class OptimizerConfig(TypedParamsSection):
    """`optimizer`: the optimizer the engine builds when the caller passes none. The `params`
    keys allowed for each `type` are listed in the *optimizer.params* section below."""

    _KIND = "optimizer"
    _PARAMS = {
        name: Params(spec.doc, {key: _OPTIMIZER_PARAM_TYPES[key] for key in spec.params})
        for name, spec in OPTIMIZERS.items()
    }
    _DEEPSPEED_ONLY_TYPES = DEEPSPEED_ONLY_OPTIMIZERS
    _ACCEPTED = deepspeed_keys.OPTIMIZER

    type: Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]
    """Optimizer name, any capitalisation (`adamw` is read as `AdamW`)."""
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments of the optimizer; only the keys DeepSpeed accepts for `type`."""


class SchedulerConfig(TypedParamsSection):
    """`scheduler`: a DeepSpeed learning-rate schedule, stepped once per optimizer step. The
    `params` keys allowed for each `type` are listed in the *scheduler.params* section below."""

    _KIND = "scheduler"
    _PARAMS = {
        "WarmupLR": Params("DeepSpeed's WarmupLR.", _WARMUP_KEYS),
        "WarmupDecayLR": Params(
            "DeepSpeed's WarmupDecayLR.",
            {**_WARMUP_KEYS, "total_num_steps": PositiveInt},
            required=("total_num_steps",),
        ),
        "WarmupCosineLR": Params(
            "DeepSpeed's WarmupCosineLR.",
            {
                "total_num_steps": PositiveInt,
                "warmup_min_ratio": NonNegativeFloat,
                "warmup_num_steps": PositiveInt,
                "cos_min_ratio": NonNegativeFloat,
                "warmup_type": Literal["log", "linear"],
                "last_batch_iteration": Int,
            },
            required=("total_num_steps",),
        ),
        "OneCycle": Params(
            "DeepSpeed's OneCycle (arXiv:1803.09820).",
            {
                "cycle_min_lr": NonNegativeFloat,
                "cycle_max_lr": NonNegativeFloat,
                "decay_lr_rate": NonNegativeFloat,
                "cycle_first_step_size": PositiveInt,
                "cycle_second_step_size": PositiveInt | None,
                "cycle_first_stair_count": NonNegativeInt,
                "cycle_second_stair_count": NonNegativeInt | None,
                "decay_step_size": NonNegativeInt,
                "cycle_momentum": bool,
                "cycle_min_mom": NonNegativeFloat,
                "cycle_max_mom": NonNegativeFloat,
                "decay_mom_rate": NonNegativeFloat,
                "last_batch_iteration": Int,
            },
            required=("cycle_min_lr", "cycle_max_lr"),
        ),
    }
    _DEEPSPEED_ONLY_TYPES = frozenset({"lrrangetest"})

    type: Literal[tuple(SCHEDULERS)]  # type: ignore[valid-type]
    """Schedule name, any capitalisation (`warmuplr` is read as `WarmupLR`)."""
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments of the schedule (names as in DeepSpeed's `lr_schedules.py`)."""
