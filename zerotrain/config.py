"""The typed schema of DeepSpeed's ``ds_config.json``, as far as zerotrain implements it.

``load_config`` turns a dict, a ``.json``/``.yaml``/``.yml`` path or a ``ZeroTrainConfig``
into a validated config with its batch fields resolved for the data-parallel world size. The
field docstrings are the documentation; ``python -m zerotrain.config`` renders docs/config.md.

# [Note: how a config is checked]
``load_config`` runs three passes, so that one run reports every mistake with its key path:
1. ``_normalise`` walks the raw mapping: a key that is neither a field nor one of the DeepSpeed
   keys accepted without a field (config_accepted.py, [Note: lenient where nothing is asked,
   strict where something is]) is a typo, answered with a did-you-mean; an accepted key whose
   value asks for a behaviour zerotrain lacks is refused naming it; an ``"auto"`` placeholder
   (HuggingFace's Trainer fills these in) is refused. Accepted keys and ``_comments`` are
   dropped from what pass 2 sees.
2. pydantic checks types and ranges; ``_config_error`` rewrites each error as one
   ``key.path: must be ..., got ...`` line of a ``ConfigError``.
3. ``ZeroTrainConfig.resolve_batch`` derives the batch triple with DeepSpeed's arithmetic.
Constructing the models directly skips pass 1 and raises pydantic's ValidationError.
"""

import dataclasses
import difflib
import enum
import inspect
import json
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict

from zerotrain import config_accepted
from zerotrain.config_accepted import Accepted, is_comment

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "CSVMonitorConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadStateTypeEnum",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroOptimizationConfig",
    "ZeroTrainConfig",
    "check_config",
    "config_reference_markdown",
    "load_config",
    "read_config_file",
]


class ConfigError(ValueError):
    """A config zerotrain cannot use. The message names every offending key path and the fix,
    one problem per line."""


def _fail(message: str) -> PydanticCustomError:
    """A validation error whose message ``_config_error`` prints as is after the key path."""
    # The message travels in the context so that braces in user values are not format fields.
    return PydanticCustomError("zerotrain", "{message}", {"message": message})


def _reject_bool(value: Any) -> Any:
    # pydantic's lax mode reads true/false as 1/0; in a number field that is always a slip.
    if isinstance(value, bool):
        raise _fail(f"must be a number, got {json.dumps(value)}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_or_per_group_list(value: Any) -> Any:
    if _is_number(value) or (isinstance(value, list) and value and all(map(_is_number, value))):
        return value
    raise _fail(f"must be a number or a list of numbers (one per param group), got {_show(value)}")


def _two_items(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return value
    raise _fail(f"must be a list of two numbers, got {_show(value)}")


_Int = Annotated[int, BeforeValidator(_reject_bool)]
_PositiveInt = Annotated[int, BeforeValidator(_reject_bool), Field(gt=0)]
_NonNegativeInt = Annotated[int, BeforeValidator(_reject_bool), Field(ge=0)]
_NonNegativeFloat = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0)]
_PositiveFloat = Annotated[float, BeforeValidator(_reject_bool), Field(gt=0)]
_Beta = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0, lt=1)]
_Betas = Annotated[tuple[_Beta, _Beta], BeforeValidator(_two_items)]
_LrValue = Annotated[float | list[float], BeforeValidator(_float_or_per_group_list)]


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable, and the
    attribute docstrings are the field descriptions (and the generated docs)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # DeepSpeed keys of this section accepted without a field (config_accepted.py).
    _ACCEPTED: ClassVar[dict[str, Accepted]] = {}
    # DeepSpeed's older key names, still accepted: old name -> current name.
    _RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_old_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls._RENAMED.keys() & data.keys():
            return data
        data = dict(data)
        for old, new in cls._RENAMED.items():
            if old in data:
                if new in data:
                    raise _fail(f"`{old}` is DeepSpeed's old name for `{new}`; set only `{new}`")
                data[new] = data.pop(old)
        return data


# --- optimizer and scheduler parameters -------------------------------------------------


@dataclass(frozen=True)
class _Params:
    """The `params` keys DeepSpeed accepts for one optimizer or scheduler `type`. The validated
    dict holds only the keys the user wrote; the engine passes it on as keyword arguments."""

    doc: str
    keys: dict[str, Any]  # key -> annotation
    required: tuple[str, ...] = ()

    @cached_property
    def adapter(self) -> TypeAdapter[Any]:
        fields = {k: Required[v] if k in self.required else v for k, v in self.keys.items()}
        spec = TypedDict("Params", fields, total=False)  # type: ignore[operator]
        spec.__pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[attr-defined]
        return TypeAdapter(spec)


_ADAM_KEYS = {
    "lr": _NonNegativeFloat,
    "betas": _Betas,
    "eps": _NonNegativeFloat,
    "weight_decay": _NonNegativeFloat,
    "amsgrad": bool,
    "torch_adam": bool,
    "fused": bool,
    "adam_w_mode": bool,
    "bias_correction": bool,
}
_WARMUP_KEYS = {
    "warmup_min_lr": _LrValue,
    "warmup_max_lr": _LrValue,
    "warmup_num_steps": _PositiveInt,
    "warmup_type": Literal["log", "linear"],
    "last_batch_iteration": _Int,
}


def _did_you_mean(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean '{match[0]}'?" if match else ""


def _canonical_type(value: Any, choices: list[str]) -> str | None:
    """The spelling of ``value`` among ``choices``, ignoring case; None if it is not one."""
    if not isinstance(value, str):
        return None
    return {c.lower(): c for c in choices}.get(value.lower())


class _TypedParamsSection(_Section):
    """A section of the form ``{"type": ..., "params": {...}}`` (optimizer, scheduler)."""

    _KIND: ClassVar[str] = ""
    _PARAMS: ClassVar[dict[str, _Params]] = {}  # the implemented types
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
            raise _fail(
                f"'{value}' is a DeepSpeed {cls._KIND} that zerotrain does not implement "
                f"yet; use one of {allowed}"
            )
        match = difflib.get_close_matches(value.lower(), list(lowered), n=1)
        hint = f"; did you mean '{lowered[match[0]]}'?" if match else ";"
        raise _fail(f"unknown {cls._KIND} '{value}'{hint} zerotrain supports {allowed}")

    @field_validator("params", check_fields=False)
    @classmethod
    def _validate_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:  # the invalid type is reported on its own
            return params
        return cls._PARAMS[info.data["type"]].adapter.validate_python(params)


class OptimizerConfig(_TypedParamsSection):
    """`optimizer`: the optimizer the engine builds when the caller passes none. The `params`
    keys allowed for each `type` are listed in the *optimizer.params* section below."""

    _KIND = "optimizer"
    _PARAMS = {
        "Adam": _Params(
            "DeepSpeed's Adam: `adam_w_mode` (default true) selects decoupled weight decay "
            "(torch.optim.AdamW), false L2 regularisation (torch.optim.Adam); "
            "`bias_correction: false` steps without bias correction, as DeepSpeed's "
            "FusedAdam does (zerotrain.ops.adam.FusedAdam).",
            _ADAM_KEYS,
        ),
        "AdamW": _Params(
            "torch.optim.AdamW: decoupled weight decay whatever `adam_w_mode` says, as in "
            "DeepSpeed; `bias_correction` as for Adam.",
            _ADAM_KEYS,
        ),
        "SGD": _Params(
            "torch.optim.SGD.",
            {
                "lr": _NonNegativeFloat,
                "momentum": _NonNegativeFloat,
                "dampening": _NonNegativeFloat,
                "weight_decay": _NonNegativeFloat,
                "nesterov": bool,
            },
        ),
        "Lamb": _Params(
            "DeepSpeed's FusedLamb (arXiv:1904.00962).",
            {
                "lr": _NonNegativeFloat,
                "betas": _Betas,
                "eps": _NonNegativeFloat,
                "weight_decay": _NonNegativeFloat,
                "max_coeff": _NonNegativeFloat,
                "min_coeff": _NonNegativeFloat,
                "bias_correction": bool,
            },
        ),
    }
    _DEEPSPEED_ONLY_TYPES = frozenset(
        """
        adagrad onebitadam zerooneadam onebitlamb lion muadam muadamw musgd muon
        """.split()
    )
    _ACCEPTED = config_accepted.OPTIMIZER

    type: Literal["Adam", "AdamW", "SGD", "Lamb"]
    """Optimizer name, any capitalisation (`adamw` is read as `AdamW`)."""
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments of the optimizer; only the keys DeepSpeed accepts for `type`."""


class SchedulerConfig(_TypedParamsSection):
    """`scheduler`: a DeepSpeed learning-rate schedule, stepped once per optimizer step. The
    `params` keys allowed for each `type` are listed in the *scheduler.params* section below."""

    _KIND = "scheduler"
    _PARAMS = {
        "WarmupLR": _Params("DeepSpeed's WarmupLR.", _WARMUP_KEYS),
        "WarmupDecayLR": _Params(
            "DeepSpeed's WarmupDecayLR.",
            {**_WARMUP_KEYS, "total_num_steps": _PositiveInt},
            required=("total_num_steps",),
        ),
        "WarmupCosineLR": _Params(
            "DeepSpeed's WarmupCosineLR.",
            {
                "total_num_steps": _PositiveInt,
                "warmup_min_ratio": _NonNegativeFloat,
                "warmup_num_steps": _PositiveInt,
                "cos_min_ratio": _NonNegativeFloat,
                "warmup_type": Literal["log", "linear"],
                "last_batch_iteration": _Int,
            },
            required=("total_num_steps",),
        ),
        "OneCycle": _Params(
            "DeepSpeed's OneCycle (arXiv:1803.09820).",
            {
                "cycle_min_lr": _NonNegativeFloat,
                "cycle_max_lr": _NonNegativeFloat,
                "decay_lr_rate": _NonNegativeFloat,
                "cycle_first_step_size": _PositiveInt,
                "cycle_second_step_size": _PositiveInt | None,
                "cycle_first_stair_count": _NonNegativeInt,
                "cycle_second_stair_count": _NonNegativeInt | None,
                "decay_step_size": _NonNegativeInt,
                "cycle_momentum": bool,
                "cycle_min_mom": _NonNegativeFloat,
                "cycle_max_mom": _NonNegativeFloat,
                "decay_mom_rate": _NonNegativeFloat,
                "last_batch_iteration": _Int,
            },
            required=("cycle_min_lr", "cycle_max_lr"),
        ),
    }
    _DEEPSPEED_ONLY_TYPES = frozenset({"lrrangetest"})

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]
    """Schedule name, any capitalisation (`warmuplr` is read as `WarmupLR`)."""
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments of the schedule (names as in DeepSpeed's `lr_schedules.py`)."""


class FP16Config(_Section):
    """`fp16`: float16 mixed precision with loss scaling (fp32 master weights)."""

    _ACCEPTED = config_accepted.FP16

    enabled: bool = False
    """Run forward and backward in float16, keep fp32 master weights, scale the loss."""
    auto_cast: bool = False
    """Cast the floating-point tensors among the arguments of `engine(...)` to float16 before
    the model's forward (integer tensors, such as token ids, are left alone)."""
    loss_scale: _NonNegativeFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: _NonNegativeInt = 16
    """Dynamic loss scaling starts at a scale of 2**initial_scale_power."""
    loss_scale_window: _PositiveInt = 1000
    """The dynamic scale doubles after this many consecutive steps without overflow."""
    hysteresis: _PositiveInt = 2
    """The dynamic scale halves on the hysteresis-th overflow since its last refill (DeepSpeed's
    delayed shift); every overflowing step is skipped."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow, so only consecutive overflows
    count towards halving."""
    min_loss_scale: _NonNegativeFloat = 1.0
    """Lower bound of the dynamic loss scale (0: none)."""


class BF16Config(_Section):
    """`bf16` (DeepSpeed also reads the old name `bfloat16`): bfloat16 mixed precision; no loss
    scaling is needed."""

    _ACCEPTED = config_accepted.BF16

    enabled: bool = False
    """Run forward and backward in bfloat16 and keep fp32 master weights."""


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded states go (DeepSpeed's enum, also ``engine.offload_states``' device)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The kinds of state ``engine.offload_states(include=...)`` moves (DeepSpeed's enum)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def _offload_device(value: Any) -> Any:
    if value is None:  # DeepSpeed's configs write null for "none" too
        return "none"
    return value.lower() if isinstance(value, str) else value


_OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_offload_device)]
_Fraction = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0, le=1)]


class _OffloadSection(_Section):
    """The keys both offload sections have."""

    device: _OffloadDevice = "none"
    """`none` (or null): on the training device. `cpu` asks for the states in CPU memory: on a run
    whose device is the CPU (gloo) they are there already and nothing moves; with CUDA devices
    `initialize` refuses it until zerotrain implements offload. `nvme` (ZeRO-Infinity) is
    refused."""
    nvme_path: str | None = None
    """Directory on the NVMe device (with `device: nvme`)."""
    pin_memory: bool = True
    """Page-locked CPU buffers for faster copies to and from a GPU."""


class OffloadOptimizerConfig(_OffloadSection):
    """`zero_optimization.offload_optimizer`: where the fp32 master weights and optimizer states
    live and are stepped (DeepSpeed's ZeRO-Offload). The keys other than `device` tune
    DeepSpeed's transfers and have no effect on a CPU device."""

    buffer_count: _NonNegativeInt = 4
    """NVMe buffer pool size."""
    pipeline_read: bool = False
    """Overlap NVMe reads with the step."""
    pipeline_write: bool = False
    """Overlap NVMe writes with the step."""
    fast_init: bool = False
    """Faster optimizer initialization with NVMe."""
    ratio: _Fraction = 1.0
    """Fraction of the optimizer step run on the CPU (stage 3)."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for superchips (stage 3)."""
    cpuadam_cores_perc: _Fraction = 0.8
    """Fraction of CPU cores for the CPU optimizer (with `super_offload`)."""


class OffloadParamConfig(_OffloadSection):
    """`zero_optimization.offload_param`: where stage 3 keeps the parameter shards between uses
    (DeepSpeed's ZeRO-Infinity parameter offload). The keys other than `device` tune DeepSpeed's
    transfers and have no effect on a CPU device."""

    buffer_count: _NonNegativeInt = 5
    """NVMe buffer pool size."""
    buffer_size: _NonNegativeInt = 100_000_000
    """Elements per NVMe buffer."""
    max_in_cpu: _NonNegativeInt = 1_000_000_000
    """Parameter elements kept in CPU memory with NVMe offload."""


class ZeroOptimizationConfig(_Section):
    """`zero_optimization`: what ZeRO (arXiv:1910.02054) partitions across data-parallel ranks.
    Bucket sizes count elements, not bytes."""

    _ACCEPTED = config_accepted.ZERO_OPTIMIZATION
    _RENAMED = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        # DeepSpeed's field names; the stage3_ spellings are its aliases
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: _Int = 0
    """0: plain data parallelism; 1: partition optimizer states; 2: also gradients; 3: also
    parameters. (DeepSpeed's old form `zero_optimization: false` / `true` is read as stage 0
    / 1.)"""
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer offload; see the offload_optimizer section."""
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    """Stage 3 parameter offload; see the offload_param section."""
    cpu_offload: bool | None = None
    """DeepSpeed's old key: true is `offload_optimizer: {device: cpu}`."""
    cpu_offload_param: bool | None = None
    """DeepSpeed's old key: true is `offload_param: {device: cpu}`."""
    cpu_offload_use_pin_memory: bool | None = None
    """DeepSpeed's old key: `pin_memory` of the sections that `cpu_offload` and
    `cpu_offload_param` turn on."""
    reduce_bucket_size: _PositiveInt = 500_000_000
    """Elements per bucket (stages 0-2): gradients are reduced (or reduce-scattered), and
    updated parameters all-gathered, one bucket per collective."""
    allgather_bucket_size: _PositiveInt = 500_000_000
    """Accepted for DeepSpeed compatibility, without effect: zerotrain all-gathers updated
    parameters in the buckets of `reduce_bucket_size` (one buffer serves both)."""
    overlap_comm: bool = False
    """Accepted for DeepSpeed compatibility, without effect: zerotrain always reduces each
    gradient bucket as soon as it is complete, while backward goes on (same numerics)."""
    overlap_param_gather: bool = False
    """Stages 1-2: all-gather the updated parameters during the next forward instead of at the
    end of `step()`, bucket by bucket, each module waiting only for the buckets that hold its
    own parameters (DeAR, arXiv:2302.12445); same numerics. A zerotrain key. Code that reads a
    parameter in the forward of a module that does not own it, before the owner ran, must
    leave it false."""
    contiguous_gradients: bool = True
    """Accepted for DeepSpeed compatibility, without effect: gradients always accumulate in (or
    are copied to) contiguous bucket buffers."""
    reduce_scatter: bool = True
    """Accepted for DeepSpeed compatibility, without effect: stages 1-3 always reduce-scatter
    (stage 0 all-reduces)."""
    allgather_partitions: bool = True
    """Accepted for DeepSpeed compatibility, without effect: updated parameters are always
    all-gathered."""
    round_robin_gradients: bool = False
    """Accepted for DeepSpeed compatibility. DeepSpeed uses it to spread gradient copies to CPU
    under optimizer offload; it has no effect on numerics, and none in zerotrain."""
    stage3_prefetch_bucket_size: _NonNegativeInt = 50_000_000
    """Stage 3: at most this many parameter elements are gathered ahead of use, in the order
    recorded on the first step."""
    stage3_param_persistence_threshold: _NonNegativeInt = 100_000
    """Stage 3: a gather unit (a block, or the root's own parameters) with fewer elements stays
    whole on every rank instead of being gathered for each use (DeepSpeed counts per
    parameter; zerotrain per unit)."""
    stage3_max_live_parameters: _NonNegativeInt = 1_000_000_000
    """Stage 3: prefetching stops where it would hold more gathered parameter elements than
    this; a unit needed now is always gathered."""
    stage3_max_reuse_distance: _NonNegativeInt = 1_000_000_000
    """Stage 3: a unit whose next use comes within this many gathered elements (per the order
    recorded on the first step) stays gathered after its forward instead of being released and
    gathered again for its backward (bounded by `stage3_max_live_parameters`)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: let `engine.save_16bit_model` gather the full 16-bit weights and write them;
    when false it saves nothing and returns False, as in DeepSpeed (DeepSpeed's old name
    `stage3_gather_fp16_weights_on_model_save` is accepted)."""

    @model_validator(mode="before")
    @classmethod
    def _old_offload_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        pin = data.get("cpu_offload_use_pin_memory")
        for old, section in (
            ("cpu_offload", "offload_optimizer"),
            ("cpu_offload_param", "offload_param"),
        ):
            if data.get(old) is True:
                if section in data:
                    raise _fail(
                        f"`{old}` is DeepSpeed's old form of `{section}`; set only `{section}`"
                    )
                data[section] = {
                    "device": "cpu",
                    **({"pin_memory": pin} if pin is not None else {}),
                }
        return data

    @field_validator("stage")
    @classmethod
    def _stage_in_range(cls, stage: int) -> int:
        if not 0 <= stage <= 3:
            raise _fail(f"must be between 0 and 3, got {stage}")
        return stage

    @model_validator(mode="after")
    def _no_nvme(self) -> "ZeroOptimizationConfig":
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name).device == "nvme":
                raise _fail(
                    f'{name}.device: "nvme" asks for NVMe offload (ZeRO-Infinity), which '
                    'zerotrain does not have yet; set it to "none" (or "cpu")'
                )
        return self

    @model_validator(mode="after")
    def _param_gather_overlap_needs_stage_1_or_2(self) -> "ZeroOptimizationConfig":
        if self.overlap_param_gather and self.stage not in (1, 2):
            raise _fail(
                f"overlap_param_gather applies to stages 1-2 (they all-gather parameters after "
                f"the step); at stage {self.stage} set it to false"
                + (
                    " (stage 3 already gathers ahead of use: stage3_prefetch_bucket_size)"
                    if self.stage == 3
                    else ""
                )
            )
        return self


class CheckpointConfig(_Section):
    """`checkpoint`: how `engine.save_checkpoint` and `engine.load_checkpoint` behave. Every
    zerotrain checkpoint loads at any world size and ZeRO stage (see docs/checkpoints.md)."""

    _ACCEPTED = config_accepted.CHECKPOINT

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """What to do when ranks pass different tags to `save_checkpoint`: `Warn` (every rank then
    saves under rank 0's tag), `Fail` (raise) or `Ignore` (use rank 0's tag silently). Any
    capitalization is accepted, as in DeepSpeed."""
    keep_last: _NonNegativeInt = 0
    """Keep only the newest this many complete checkpoints in the save directory; older ones
    are deleted after a newer one is committed. 0 keeps all. (A zerotrain key.)"""
    load_universal: bool = False
    """Accepted for DeepSpeed compatibility and has no effect: zerotrain checkpoints are always
    universal (they reshard to any world size and stage when loaded)."""
    use_node_local_storage: bool = False
    """DeepSpeed: checkpoints load without a filesystem shared by the nodes. On one node every
    rank shares the node's disk, so `initialize` accepts true there; a job on several nodes
    with true is refused (zerotrain's ranks read the shards they need wherever they were
    written: keep `save_dir` on a shared filesystem)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return _canonical_type(value, ["Ignore", "Warn", "Fail"]) or value


class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing`: the policy of `zerotrain.checkpointing.checkpoint` (and of the
    blocks `zerotrain.checkpointing.wrap` checkpoints), with DeepSpeed's keys; which blocks are
    checkpointed is up to the model code. See docs/activation-checkpointing.md."""

    partition_activations: bool = False
    """Has no effect in zerotrain, which is purely data-parallel: DeepSpeed splits each
    checkpointed activation across model-parallel ranks, which hold identical copies of it;
    data-parallel ranks hold the activations of different samples, so there is nothing to split.
    Rank 0 warns once when it is true."""
    cpu_checkpointing: bool = False
    """Keep the inputs of every checkpointed region (what a checkpoint retains) in CPU memory,
    pinned on CUDA, and copy them back for the recomputation (`torch.autograd.graph.save_on_cpu`);
    the numbers do not change. On a CPU device they are in CPU memory already: nothing moves."""
    contiguous_memory_optimization: bool = False
    """Has no effect in zerotrain: DeepSpeed copies partitioned activations into one buffer of
    `number_checkpoints` slots to limit fragmentation, and zerotrain partitions none (see
    `partition_activations`)."""
    number_checkpoints: _PositiveInt | None = None
    """Has no effect in zerotrain: DeepSpeed sizes the buffer of `contiguous_memory_optimization`
    with it."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at the start and end of every checkpointed forward and
    recomputation, as DeepSpeed does (to attribute time, or to debug). On a CPU device, where
    operations run synchronously, it does nothing."""
    profile: bool = False
    """Time every checkpointed forward and recomputation (synchronizing the device at their
    boundaries); the totals are in `zerotrain.checkpointing.recompute_stats()`, which counts
    calls whether or not this is set."""


class CommsLoggerConfig(_Section):
    """`comms_logger`: record every collective zerotrain issues, per operation and message size;
    `engine.comms_summary()` prints the table (calls, bytes, bytes sent, time, bandwidth)."""

    enabled: bool = False
    """Record calls, bytes and time per operation and message size."""
    verbose: bool = False
    """Also print one line per collective as it completes (rank 0)."""
    prof_all: bool = True
    """Record every operation; false records only those in `prof_ops`."""
    prof_ops: list[str] = Field(default_factory=list)
    """Operations to record when `prof_all` is false: `all_reduce`, `reduce_scatter`,
    `all_gather`, `broadcast` (DeepSpeed's `all_gather_into_tensor`, `reduce_scatter_tensor`
    and `*_base` names are read as these)."""
    debug: bool = False
    """Append the zerotrain function that issued it to each operation's name (`all_gather |
    BucketGathers.issue`), to see which part of the engine communicates."""

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, ops: list[str]) -> list[str]:
        known = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        names = []
        for op in ops:
            name = re.sub(r"(_into_tensor|_tensor|_base)$", "", op)
            if name not in known:
                raise _fail(f"unknown operation {op!r}; use any of {', '.join(known)}")
            names.append(name)
        return names


class FlopsProfilerConfig(_Section):
    """`flops_profiler`: profile one step's forward per module (FLOPs, MACs, parameters,
    latency) and print the module tree, the top modules and the achieved TFLOP/s (rank 0).
    See docs/monitoring.md."""

    enabled: bool = False
    """Profile the step given by `profile_step` and print its profile."""
    recompute_fwd_factor: _NonNegativeFloat = 0.0
    """Forwards recomputed in backward per forward (activation checkpointing: 1.0 when every
    block is recomputed): the profile's hardware FLOPs per step are (3 + this) x the forward
    FLOPs. The throughput line always reports model FLOPs (3x)."""
    profile_step: _NonNegativeInt = 1
    """Profile the step that starts when `engine.global_steps` equals this, as in DeepSpeed:
    the default 1 profiles the second optimizer step (the first is warm-up). The first
    micro-step's forward of that step is profiled."""
    module_depth: _Int = -1
    """Depth of the module tree printed with `detailed`, and of the per-depth top modules; -1
    prints every level."""
    top_modules: _PositiveInt = 1
    """How many modules to list per depth, by MACs, by parameters and by latency."""
    detailed: bool = True
    """Print the module tree with each module's profile."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout (rank 0; directories are created)."""
    peak_tflops: _PositiveFloat | None = None
    """Peak TFLOP/s of one device, for the utilisation in the profile; null measures it once
    with a short matmul benchmark in the training dtype (reported as measured). A zerotrain
    key."""

    @field_validator("module_depth")
    @classmethod
    def _depth_or_all(cls, depth: int) -> int:
        if depth < -1:
            raise _fail(f"must be -1 (every level) or a depth >= 0, got {depth}")
        return depth


class TensorBoardConfig(_Section):
    """`tensorboard`: write the per-step training scalars (see docs/monitoring.md) to a
    TensorBoard event file from rank 0; needs the `tensorboard` package."""

    enabled: bool = False
    """Write the scalars of every optimizer step (`pip install tensorboard`)."""
    output_path: str = ""
    """Directory for the logs; `""` is the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of `output_path` the event file goes to."""


class CSVMonitorConfig(_Section):
    """`csv_monitor`: write the per-step training scalars to CSV files from rank 0, one file
    per scalar with the columns `step` and the scalar's name (DeepSpeed's layout)."""

    enabled: bool = False
    """Write the scalars of every optimizer step."""
    output_path: str = ""
    """Directory for the files; `""` is the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of `output_path` the files go to."""


class WandbConfig(_Section):
    """`wandb`: log the per-step training scalars to Weights & Biases from rank 0; needs the
    `wandb` package."""

    enabled: bool = False
    """Log the scalars of every optimizer step (`pip install wandb`)."""
    group: str | None = None
    """W&B group of the run."""
    team: str | None = None
    """W&B team (entity) of the run."""
    project: str = "deepspeed"
    """W&B project of the run."""


def _zero_optimization_from_bool(value: Any) -> Any:
    # DeepSpeed's oldest form: a bool, read as stage 1 (true) or 0 (false)
    return {"stage": 1 if value else 0} if isinstance(value, bool) else value


def _infinite_is_none(value: Any) -> Any:
    # JSON's Infinity (Python's json reads it) means "never", as null does
    return None if isinstance(value, float) and value == float("inf") else value


class ZeroTrainConfig(_Section):
    """Top level of the config, with DeepSpeed's key names. Of the three batch keys give any
    two, or `train_batch_size` or `train_micro_batch_size_per_gpu` alone (then
    `gradient_accumulation_steps` is 1); `load_config` derives the rest from
    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size."""

    _ACCEPTED = config_accepted.TOP_LEVEL
    _RENAMED = {"bfloat16": "bf16"}

    train_batch_size: _PositiveInt | None = None
    """Samples per optimizer step, summed over all ranks and accumulation steps."""
    train_micro_batch_size_per_gpu: _PositiveInt | None = None
    """Samples per forward/backward pass on one rank."""
    gradient_accumulation_steps: _PositiveInt | None = None
    """Forward/backward passes whose gradients are summed before each optimizer step."""
    data_parallel_size: _PositiveInt | None = None
    """DeepSpeed: the data-parallel size of a device mesh with model parallelism. zerotrain is
    data-parallel over every rank, so when given it must equal the world size."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build; leave out when passing a torch optimizer to the engine."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule to build; leave out for a constant rate or a client schedule."""
    gradient_clipping: _NonNegativeFloat = 1.0
    """Clip the global gradient L2 norm (over all ranks' partitions) to this value; 0 turns
    clipping off. The default is DeepSpeed 0.19.8's: clipping at 1.0 unless the config says
    otherwise."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """The dtype gradients are reduced in; null: the training dtype (fp32, fp16 or bf16).
    `fp32` in 16-bit training sums gradients without 16-bit rounding (stages 2-3 then also keep
    the reduced gradient partition in fp32: 2 more bytes per element of this rank's shard)."""
    dataloader_drop_last: bool = False
    """The dataloader `initialize` returns leaves out each epoch's last micro-batch when it is
    smaller than `train_micro_batch_size_per_gpu`."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision; see the fp16 section."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision; see the bf16 section."""
    zero_optimization: Annotated[
        ZeroOptimizationConfig, BeforeValidator(_zero_optimization_from_bool)
    ] = Field(default_factory=ZeroOptimizationConfig)
    """ZeRO partitioning; see the zero_optimization section."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint saving and loading; see the checkpoint section."""
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    """How `zerotrain.checkpointing` recomputes activations; `initialize` applies it when
    present. See the activation_checkpointing section."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Communication logging; see the comms_logger section."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """Per-module FLOPs profile of one step; see the flops_profiler section."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor; see the tensorboard section."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor; see the csv_monitor section."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor; see the wandb section."""
    steps_per_print: Annotated[_PositiveInt | None, BeforeValidator(_infinite_is_none)] = 10
    """Rank 0 prints a throughput line every this many optimizer steps: loss (mean over the
    micro-steps and ranks), lr, samples/s, tokens/s, TFLOP/s per rank, memory, grad norm, loss
    scale (docs/monitoring.md). null or `Infinity` never prints (DeepSpeed's default is null;
    zerotrain prints every 10 steps unless told)."""
    dump_state: bool = False
    """Rank 0 prints the resolved config (every key, defaults included) at `initialize`."""
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    """Level of the `zerotrain` logger (`zerotrain.utils.logger`), any capitalisation; null
    leaves it as it is (INFO unless the script set it)."""
    wall_clock_breakdown: bool = False
    """Add to the throughput line the forward, backward and optimizer-step times per step and
    the communication the training thread waited for."""
    count_model_flops: bool = True
    """Count the forward FLOPs of one micro-batch once (torch's FLOP formulas, on rank 0,
    at the first step that prints or is monitored) for the TFLOP/s of the throughput line and
    the monitors; false leaves TFLOP/s out. A zerotrain key."""
    seed: _NonNegativeInt | None = None
    """Seed for the random generators on every rank; null leaves them alone. (A zerotrain key;
    DeepSpeed has none.)"""
    zero_allow_untested_optimizer: bool = False
    """Accepted for DeepSpeed compatibility and has no effect: zerotrain wraps any torch
    optimizer under ZeRO."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_half_precision(self) -> "ZeroTrainConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise _fail("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        return self

    def resolve_batch(self, world_size: int) -> "ZeroTrainConfig":
        """A copy with all three batch fields set for ``world_size`` data-parallel ranks
        (DeepSpeed's rules); ``ConfigError`` showing the arithmetic when they cannot agree."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size: must be a positive integer, got {world_size!r}")
        if self.data_parallel_size not in (None, world_size):
            raise ConfigError(
                f"data_parallel_size: {self.data_parallel_size} asks for a device mesh with "
                f"model parallelism over the {world_size} ranks, which zerotrain does not have "
                f"yet; set it to {world_size} or remove it"
            )
        total, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        accum = self.gradient_accumulation_steps
        tb, mb, ga, ws = (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "world_size",
        )
        if total is None and micro is None:
            given = f"only {ga} is set" if accum is not None else "no batch size is set"
            raise ConfigError(f"{given}; set {tb} or {mb} (or both)")
        if total is not None and micro is not None and accum is not None:
            if total != micro * accum * world_size:
                raise ConfigError(
                    f"{tb} ({total}) != {mb} ({micro}) * {ga} ({accum}) * {ws} ({world_size}) = "
                    f"{micro * accum * world_size}; fix one of them, or leave one out to derive it"
                )
        elif total is None:  # micro given, accum given or 1
            accum = accum or 1
            total = micro * accum * world_size
        else:  # total given with micro, accum or neither (then accum is 1)
            accum = 1 if micro is None and accum is None else accum
            known, known_name, derived_name = (micro, mb, ga) if micro else (accum, ga, mb)
            divisor = known * world_size
            if total % divisor:
                raise ConfigError(
                    f"{tb} ({total}) is not divisible by {known_name} ({known}) * {ws} "
                    f"({world_size}) = {divisor}, so {derived_name} cannot be derived; make "
                    f"{tb} a multiple of {divisor} or set all three batch keys"
                )
            micro, accum = (micro, total // divisor) if micro else (total // divisor, accum)
        return self.model_copy(
            update={
                "train_batch_size": total,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": accum,
            }
        )


# --- turning raw input into a config -----------------------------------------------------


def _show(value: Any, limit: int | None = None) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _section_of(annotation: Any) -> type[_Section] | None:
    """The section model behind a field annotation (``X`` or ``X | None``), if any."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def _auto_problems(value: Any, path: str) -> list[str]:
    if _is_auto(value):
        return [
            f'{path}: "auto" must be resolved before passing the config to zerotrain '
            "(HuggingFace's Trainer does that for DeepSpeed); set a concrete value"
        ]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_problems(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _auto_problems(v, f"{path}.{i}")]
    return []


def _param_problems(
    section: type[_TypedParamsSection], type_value: Any, params: dict[str, Any], path: str
) -> list[str]:
    canonical = _canonical_type(type_value, list(section._PARAMS))
    problems = _auto_problems(params, path)
    if canonical is None:  # the type itself is reported by pydantic
        return problems
    known = list(section._PARAMS[canonical].keys)
    for key in params:
        if key in known:
            continue
        owners = [name for name, spec in section._PARAMS.items() if key in spec.keys]
        if key == "max_grad_norm":
            fix = "not an optimizer parameter; use the top-level `gradient_clipping` instead"
        elif owners:
            fix = f"not a parameter of {canonical}; only of {', '.join(owners)}"
        else:
            fix = f"unknown key{_did_you_mean(str(key), known)}"
        problems.append(f"{path}.{key}: {fix}")
    return problems


@dataclass
class _Pass1:
    """What pass 1 of [Note: how a config is checked] found."""

    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # accepted; may be expected to act


def _normalise(data: dict[Any, Any], section: type[_Section], found: _Pass1, path: str = ""):
    """Pass 1: ``data`` without comments and accepted DeepSpeed keys, for pydantic; unknown
    keys, refused values and "auto" placeholders go to ``found.problems``."""
    fields = section.model_fields
    kept: dict[Any, Any] = {}
    for raw_key, value in data.items():
        key, key_path = str(raw_key), f"{path}{raw_key}"
        if is_comment(key):
            continue
        name = section._RENAMED.get(key, key)
        if name not in fields:
            accepted = section._ACCEPTED.get(key)
            if accepted is None:
                known = [*fields, *section._RENAMED, *section._ACCEPTED]
                found.problems.append(f"{key_path}: unknown key{_did_you_mean(key, known)}")
            elif accepted.idle is not None and not accepted.idle(value):
                found.problems.append(
                    f"`{key_path}: {_show(value, limit=80)}` asks for {accepted.asks}, which "
                    f"zerotrain does not have yet; set it to {accepted.idle_values} or remove it"
                )
            elif accepted.warn:
                found.notes.append(f"{key_path}: ignored. {accepted.why}")
            continue
        subsection = _section_of(fields[name].annotation)
        if subsection is not None and isinstance(value, dict):
            kept[raw_key] = _normalise(value, subsection, found, f"{key_path}.")
            continue
        if (
            name == "params"
            and issubclass(section, _TypedParamsSection)
            and isinstance(value, dict)
        ):
            found.problems += _param_problems(section, data.get("type"), value, key_path)
        elif _is_auto(value) and _auto_left_by_huggingface(key_path, data):
            default = _show(fields[name].get_default(call_default_factory=True))
            found.notes.append(
                f'{key_path}: "auto", which HuggingFace leaves unfilled here, takes the default '
                f"{default}, as in DeepSpeed"
            )
            continue
        else:
            found.problems += _auto_problems(value, key_path)
        kept[raw_key] = value
    return kept


# Keys that HuggingFace's Trainer never fills, so a public config's "auto" reaches DeepSpeed,
# which reads it as the key's default: the old section name, DeepSpeed's unprefixed stage-3
# names, and the stage-3 keys of a config below stage 3 (filled only at stage 3, used only there).
_AUTO_NEVER_FILLED = {
    "bfloat16.enabled",
    *(
        f"zero_optimization.{key}"
        for key in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
        )
    ),
}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _auto_left_by_huggingface(key_path: str, section_data: dict[Any, Any]) -> bool:
    if key_path in _AUTO_NEVER_FILLED:
        return True
    below_stage_3 = section_data.get("stage", 0) in (0, 1, 2)
    return key_path.startswith("zero_optimization.stage3_") and below_stage_3


_ERROR_MESSAGES = {  # pydantic error type -> our wording; ", got <input>" is appended
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "must be a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "must be true or false"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "must be a mapping"),
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "finite_number": "must be a finite number",
    "literal_error": "must be one of {expected}",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
}


def _config_error(error: ValidationError) -> ConfigError:
    """Pass 2 of [Note: how a config is checked]: one ``path: problem`` line per error."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"])
        if item["type"] == "zerotrain":
            text = item["msg"]
        else:
            ctx = item.get("ctx", {})
            template = _ERROR_MESSAGES.get(item["type"])
            text = template.format(**ctx) if template else item["msg"][0].lower() + item["msg"][1:]
            if item["type"] not in ("missing", "extra_forbidden"):
                text += f", got {_show(item['input'])}"
        lines.append(f"{path}: {text}" if path else text)
    return ConfigError("\n".join(lines))


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` and ``5e8`` as numbers, as JSON and YAML 1.2 do
    (PyYAML's YAML 1.1 rules need a dot and would return the string "5e8")."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed refuses duplicate keys too; json.loads would silently keep the last one.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw mapping of a ``.json``/``.yaml``/``.yml`` config file; ``ConfigError`` if it
    cannot be read or parsed."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"{path}: not a .json, .yaml or .yml file; rename it, or pass the config as a dict"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})") from None
    try:
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise ConfigError(f"{path}: not valid {kind} ({exc}); fix the file syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of config keys, got {type(data).__name__}"
        )
    return data


def load_config(
    config: dict[str, Any] | str | os.PathLike[str] | ZeroTrainConfig | None, *, world_size: int
) -> ZeroTrainConfig:
    """Validate a DeepSpeed-style config and resolve its batch fields for ``world_size``
    data-parallel ranks.

    ``config`` is a dict, a path to a ``.json``/``.yaml``/``.yml`` file, an already typed
    ``ZeroTrainConfig`` (its batch fields are re-resolved, which checks them against this
    ``world_size``), or None (an empty config, which fails for want of a batch size). Raises
    ``ConfigError`` listing every problem, one ``key.path: problem and fix`` per line.
    """
    if isinstance(config, ZeroTrainConfig):
        return config.resolve_batch(world_size)
    if config is None:
        raw: Any = {}
    elif isinstance(config, (str, os.PathLike)):
        raw = read_config_file(Path(config))
    else:
        raw = config
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config: must be a dict, a path or a ZeroTrainConfig, got {type(raw).__name__}"
        )
    return check_config(raw).resolve_batch(world_size)


def check_config(raw: dict[str, Any]) -> ZeroTrainConfig:
    """Passes 1 and 2 of [Note: how a config is checked] on a raw mapping, without resolving the
    batch fields, so that one section can be checked on its own (``{"section": {...}}``).
    Accepted keys the user may expect to act (config_accepted.py) are named in a warning."""
    found = _Pass1()
    data = _normalise(raw, ZeroTrainConfig, found)
    if found.problems:
        raise ConfigError("\n".join(found.problems))
    try:
        config = ZeroTrainConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc) from None
    for note in found.notes:
        warnings.warn(f"zerotrain config: {note}", stacklevel=3)
    return config


# --- the generated reference (docs/config.md) --------------------------------------------


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return "section"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(
    section: type[_Section] = ZeroTrainConfig, path: str = ""
) -> list[tuple[str, type[_Section]]]:
    found = [(path, section)]
    for name, field in section.model_fields.items():
        subsection = _section_of(field.annotation)
        if subsection is not None:
            found += _sections(subsection, f"{path}{name}.")
    return found


def config_reference_markdown() -> str:
    """The Markdown reference of every section and field, generated from the schema."""
    out = [
        "# zerotrain configuration reference",
        "",
        "Generated from `zerotrain/config.py` by `python -m zerotrain.config > docs/config.md`;"
        " do not edit by hand.",
        "",
        "zerotrain reads DeepSpeed's `ds_config.json` keys. Each section lists its fields, "
        "then the DeepSpeed keys it accepts without a field: keys that change nothing in "
        "zerotrain (any value, and the table says why) and keys accepted while they ask for "
        "nothing (a feature switched off); any other value of those is refused, naming the "
        "behaviour it asks for. Unknown keys are errors with a did-you-mean, as are "
        '`"auto"` placeholders (HuggingFace\'s Trainer fills them before DeepSpeed sees them), '
        "except where the Trainer never fills them (`bfloat16.enabled`, the unprefixed "
        "stage-3 names, stage-3 keys below stage 3): those take the default with a warning, "
        "as DeepSpeed reads them. "
        "Keys starting with `_` are comments. Load a config with "
        "`zerotrain.config.load_config(config, world_size=...)`; a `.json`, `.yaml` or "
        "`.yml` path or a dict.",
    ]
    for path, section in _sections():
        out += [
            "",
            f"## `{path.rstrip('.')}`" if path else "## Top level",
            "",
            _cell(inspect.cleandoc(section.__doc__ or "")),
            "",
            "| Key | Type | Default | Description |",
            "| --- | --- | --- | --- |",
        ]
        for name, field in section.model_fields.items():
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                value = field.default_factory()  # type: ignore[call-arg]
                default = "`{}`" if isinstance(value, BaseModel) else f"`{_show(value)}`"
            else:
                default = f"`{_show(field.default)}`"
            out.append(
                f"| `{path}{name}` | `{_cell(_type_name(field.annotation))}` | {default} "
                f"| {_cell(field.description or '')} |"
            )
        renamed = ", ".join(f"`{old}` (read as `{new}`)" for old, new in section._RENAMED.items())
        if renamed:
            out += ["", f"Old DeepSpeed names accepted here: {renamed}."]
        if section._ACCEPTED:
            out += [
                "",
                "DeepSpeed keys of this section accepted without a field of their own:",
                "",
                "| Key | Accepted values | Why |",
                "| --- | --- | --- |",
            ]
            out += [
                f"| `{path}{key}` | {_cell(accepted.idle_values) if accepted.idle else 'any'} "
                f"| {_cell(accepted.why)} |"
                for key, accepted in sorted(section._ACCEPTED.items())
            ]
    for path, section in (("optimizer", OptimizerConfig), ("scheduler", SchedulerConfig)):
        out += ["", f"## `{path}.params`", "", f"Allowed keys for each `{path}.type`."]
        for type_name, spec in section._PARAMS.items():
            out += [
                "",
                f"### {type_name}",
                "",
                spec.doc,
                "",
                "| Key | Type | Required |",
                "| --- | --- | --- |",
            ]
            out += [
                f"| `{key}` | `{_cell(_type_name(annotation))}` "
                f"| {'yes' if key in spec.required else 'no'} |"
                for key, annotation in spec.keys.items()
            ]
        if section._DEEPSPEED_ONLY_TYPES:
            out += [
                "",
                f"DeepSpeed {path} types zerotrain does not implement yet (lower-cased): "
                + ", ".join(f"`{name}`" for name in sorted(section._DEEPSPEED_ONLY_TYPES))
                + ".",
            ]
    return "\n".join(out) + "\n"


def main() -> None:
    """``python -m zerotrain.config``: print the Markdown reference."""
    sys.stdout.write(config_reference_markdown())


if __name__ == "__main__":
    main()
