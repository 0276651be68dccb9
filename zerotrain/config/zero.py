"""The ``zero_optimization`` section of the config: the ZeRO stage, buckets, stage-3 gathering,
and where optimizer states and parameters are offloaded (``offload_optimizer``,
``offload_param``, with the ``aio`` settings of their NVMe files)."""

import enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from zerotrain.config import deepspeed_keys
from zerotrain.config.errors import fail, show
from zerotrain.config.section import Fraction, Int, NonNegativeInt, PositiveInt, Section

__all__ = [
    "ZERO_DEFAULTS",
    "DEFAULT_LEAF_MODULE_CLASSES",
    "AioConfig",
    "LeafModuleConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadStateTypeEnum",
    "ZeroOptimizationConfig",
]


def _check_nvme_path(key: str, path: str) -> None:
    # what can be told without writing: the directory's creation and a write are checked where
    # the working files are made (zero/host.py, prepare_directory)
    resolved = Path(path).expanduser().resolve()
    if resolved.exists() and not resolved.is_dir():
        raise fail(f"{key}: {path} is a file; give a directory for the working files")
    pseudo = resolved.parts[1:2] in (("proc",), ("sys",), ("dev",))
    if pseudo and resolved.parts[1:3] != ("dev", "shm"):  # /dev/shm is a tmpfs: files work
        raise fail(
            f"{key}: {path} is on a kernel pseudo-filesystem (/{resolved.parts[1]}); give a "
            "directory on a local disk"
        )


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


_OffloadDevice = Annotated[
    Literal[tuple(device.value for device in OffloadDeviceEnum)],  # type: ignore[valid-type]
    BeforeValidator(_offload_device),
]


class _OffloadSection(Section):
    """The keys both offload sections have."""

    device: _OffloadDevice = "none"
    """`none` (or null): on the training device. `cpu`: in host memory. `nvme`: in per-rank
    working files under `nvme_path` (ZeRO-Infinity), with host memory for the sub-groups in
    flight only. See docs/offload.md."""
    nvme_path: str | None = None
    """Directory for the working files (with `device: nvme`); each rank writes its own file
    there and removes it at exit. They are not checkpoints."""
    pin_memory: bool = True
    """Page-locked host buffers for faster copies to and from a GPU (no effect on a CPU device;
    falls back to pageable memory with a warning when the host refuses)."""


def _ratio(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return float(value)
    raise fail(f'must be a number between 0 and 1, or "auto"; got {show(value)}')


class OffloadOptimizerConfig(_OffloadSection):
    """`zero_optimization.offload_optimizer` (stages 1-3): where the fp32 master weights and
    optimizer states live and are stepped (DeepSpeed's ZeRO-Offload)."""

    buffer_count: PositiveInt = 4
    """Host buffers in the ring that carries updated parameters back to the device, and (with
    `device: nvme`) sub-groups of optimizer state in host memory at once (at least 3: one read
    ahead, one stepped, one written back)."""
    pipeline_read: bool = False
    """Accepted for DeepSpeed compatibility, without effect: zerotrain always reads the next NVMe
    sub-group while stepping the current one."""
    pipeline_write: bool = False
    """Accepted for DeepSpeed compatibility, without effect: zerotrain always writes a stepped
    NVMe sub-group back while stepping the next one."""
    fast_init: bool = False
    """Accepted for DeepSpeed compatibility, without effect: the NVMe files are written once, at
    `initialize`, with large sequential writes."""
    ratio: Annotated[float | Literal["auto"], BeforeValidator(_ratio)] = 1.0
    """Share of the optimizer state (in elements, bucket by bucket) kept and stepped on the
    host; the rest stays on the device. `auto` keeps on the device whatever fits in its free
    memory. The host takes the buckets whose gradients arrive first in backward and whose
    parameters are needed last in forward."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for superchips (stage 3); true is refused."""
    cpuadam_cores_perc: Fraction = 0.8
    """Fraction of CPU cores for the CPU optimizer (with `super_offload`)."""


class OffloadParamConfig(_OffloadSection):
    """`zero_optimization.offload_param`: where stage 3 keeps the parameter shards between uses
    (DeepSpeed's ZeRO-Infinity parameter offload): `cpu` keeps them in host memory, `nvme` in a
    working file under `nvme_path`, read through `buffer_count` host buffers; each shard goes to
    the device ahead of its all-gather, in the prefetch order of stage 3. Read at stage 3 only,
    as DeepSpeed does."""

    buffer_count: NonNegativeInt = 5
    """Host buffers that NVMe shards are read and written through."""
    buffer_size: NonNegativeInt = 100_000_000
    """Elements per NVMe buffer: at least the largest gather unit's shard."""
    max_in_cpu: NonNegativeInt = 1_000_000_000
    """Accepted for DeepSpeed compatibility, without effect (the NVMe buffers bound what is in
    host memory)."""


class AioConfig(Section):
    """`aio`: how the NVMe working files of `offload_optimizer.device: nvme` are read and
    written (by a thread pool with direct I/O where the filesystem allows it)."""

    _RENAMED = {"thread_count": "intra_op_parallelism"}  # DeepSpeed's older name

    block_size: PositiveInt = 1_048_576
    """Bytes per read or write call: a multiple of 4096 (direct I/O's alignment)."""
    queue_depth: PositiveInt = 8
    """Read or write calls in flight per file."""
    intra_op_parallelism: PositiveInt = 1
    """I/O threads per rank (DeepSpeed's older name `thread_count` is accepted)."""
    single_submit: bool = False
    """Accepted for DeepSpeed compatibility, without effect (calls are always submitted one by
    one)."""
    overlap_events: bool = True
    """Accepted for DeepSpeed compatibility, without effect (I/O always overlaps the step)."""
    use_gds: bool = False
    """GPUDirect Storage; true is refused (zerotrain reads into host memory)."""

    @field_validator("block_size")
    @classmethod
    def _aligned(cls, value: int) -> int:
        if value % 4096:
            raise fail(f"must be a multiple of 4096 (direct I/O's alignment), got {value}")
        return value

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise fail("GPUDirect Storage is not supported; set it to false")
        return value


DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default ZeRO-3 leaves: HF's Mixture-of-Experts blocks, whose experts each rank
would otherwise gather in the order its own tokens route (collectives that do not match)."""


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value  # DeepSpeed takes one name as a string


NameList = Annotated[list[str], BeforeValidator(_listed)]


class LeafModuleConfig(Section):
    """`leaf_module`: the modules that stage 3 gathers as one unit for their whole forward and
    backward (ZeRO-3 leaves, as `deepspeed.utils.set_z3_leaf_modules` marks them), marked by
    `initialize` at stage 3 before it chooses the gather units. A module matching any of the
    three lists is a leaf; a customised list that matches nothing is warned about."""

    classes: NameList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Module classes by name, plain (`MixtralSparseMoeBlock`) or with their module
    (`transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock`). The default is
    DeepSpeed's: the Mixture-of-Experts blocks of HF's Mixtral, Qwen2-MoE and Qwen3-MoE."""
    names: NameList = Field(default_factory=list)
    """Modules by their `named_modules()` name (`model.layers.0.mlp`)."""
    name_suffixes: NameList = Field(default_factory=list)
    """Modules whose `named_modules()` name ends with one of these (`mlp.experts`)."""


class ZeroOptimizationConfig(Section):
    """`zero_optimization`: what ZeRO (arXiv:1910.02054) partitions across data-parallel ranks.
    Bucket sizes count elements, not bytes."""

    _ACCEPTED = deepspeed_keys.ZERO_OPTIMIZATION
    _RENAMED = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        # DeepSpeed's field names; the stage3_ spellings are its aliases
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: Int = 0
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
    sub_group_size: NonNegativeInt = 1_000_000_000
    """With `offload_optimizer.device: nvme`: elements of optimizer state read, stepped and
    written back as one unit (host memory holds `buffer_count` of them at most), rounded down
    to a multiple of 1024 (at least 1024, so 0 is 1024: DeepSpeed's 0 is one parameter per
    unit) so that results are bit-identical to one step over the whole bucket. No effect
    otherwise: the host and the device step each bucket's shard in one call."""
    cpu_offload_use_pin_memory: bool | None = None
    """DeepSpeed's old key: `pin_memory` of the sections that `cpu_offload` and
    `cpu_offload_param` turn on."""
    reduce_bucket_size: PositiveInt = 500_000_000
    """Elements per bucket (stages 0-2): gradients are reduced (or reduce-scattered), and
    updated parameters all-gathered, one bucket per collective."""
    allgather_bucket_size: PositiveInt = 500_000_000
    """Accepted for DeepSpeed compatibility, without effect: zerotrain all-gathers updated
    parameters in the buckets of `reduce_bucket_size` (one buffer serves both)."""
    overlap_comm: bool = False
    """Accepted for DeepSpeed compatibility, without effect: zerotrain always reduces each
    gradient bucket as soon as it is complete, while backward goes on (same numerics)."""
    overlap_param_gather: bool = False
    """Stages 1-2: all-gather the updated parameters during the next forward instead of at the
    end of `step()`, bucket by bucket, each module waiting only for the buckets that hold its
    own parameters (DeAR, arXiv:2302.12445); same numerics. With optimizer offload to `cpu`, the
    host buckets' steps are deferred to their next use too (docs/offload.md). A zerotrain key.
    Code that reads a parameter in the forward of a module that does not own it, before the
    owner ran, must leave it false; code that reads parameters between `step()` and the next
    forward calls `engine.optimizer.wait_param_gathers()` first."""
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
    stage3_prefetch_bucket_size: NonNegativeInt = 50_000_000
    """Stage 3: at most this many parameter elements are gathered ahead of use, in the order
    recorded on the first step."""
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    """Stage 3: a gather unit (a block, or the root's own parameters) with fewer elements stays
    whole on every rank instead of being gathered for each use (DeepSpeed counts per
    parameter; zerotrain per unit). Such a unit is gathered again as the next forward starts:
    to read it before (an EMA), call `engine.optimizer.wait_param_gathers()`."""
    stage3_max_live_parameters: NonNegativeInt = 1_000_000_000
    """Stage 3: prefetching stops where it would hold more gathered parameter elements than
    this; a unit needed now is always gathered."""
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    """Stage 3: a unit whose next use comes within this many gathered elements (per the order
    recorded on the first step) stays gathered after its forward instead of being released and
    gathered again for its backward (bounded by `stage3_max_live_parameters`)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: let `engine.save_16bit_model` gather the full 16-bit weights and write them;
    when false it saves nothing and returns False, as in DeepSpeed (DeepSpeed's old name
    `stage3_gather_fp16_weights_on_model_save` is accepted)."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: the modules gathered as one unit; see the leaf_module section."""
    zero_quantized_weights: bool = False
    """DeepSpeed's ZeRO++ qwZ. At stage 3 true is `comm_compression.parameters.method: int8`
    (block-quantized parameter gathers, fp32 masters exact). DeepSpeed reads it at stage 3
    only; below, zerotrain too ignores it, with a warning."""
    zero_quantized_gradients: bool = False
    """DeepSpeed's ZeRO++ qgZ. At stage 3 true is `comm_compression.gradients.method: int4`
    (block-quantized all-to-all reduce-scatter). Below stage 3 ignored, with a warning, as
    DeepSpeed ignores it."""
    zero_hpz_partition_size: PositiveInt = 1
    """DeepSpeed's ZeRO++ hpZ. At stage 3 a size above 1 is `comm_compression:
    {hierarchical_partition: true, hierarchical_partition_size: <size>}`: a secondary
    partition of the parameters among each group of that many consecutive ranks (ideally the
    ranks of a node). Below stage 3 ignored, with a warning, as DeepSpeed ignores it."""

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
                    raise fail(
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
            raise fail(f"must be between 0 and 3, got {stage}")
        return stage

    @model_validator(mode="after")
    def _offload_is_coherent(self) -> "ZeroOptimizationConfig":
        optimizer = self.offload_optimizer
        if optimizer.device != "none" and self.stage == 0:
            raise fail(
                f'offload_optimizer.device: "{optimizer.device}" offloads the partitioned '
                "optimizer states of stages 1-3; at stage 0 nothing is partitioned: set stage to "
                '1, 2 or 3, or the device to "none"'
            )
        if optimizer.super_offload:
            raise fail(
                "offload_optimizer.super_offload: true asks for DeepSpeed's SuperOffload for "
                "superchips, which zerotrain does not have; set it to false"
            )
        for name in ("offload_optimizer", "offload_param"):
            section = getattr(self, name)
            if section.device == "nvme" and not section.nvme_path:
                raise fail(f'{name}.device: "nvme" needs {name}.nvme_path (a directory)')
            if section.device == "nvme":
                _check_nvme_path(f"{name}.nvme_path", section.nvme_path)
        return self

    @model_validator(mode="after")
    def _param_gather_overlap_needs_stage_1_or_2(self) -> "ZeroOptimizationConfig":
        if self.overlap_param_gather and self.stage not in (1, 2):
            raise fail(
                f"overlap_param_gather applies to stages 1-2 (they all-gather parameters after "
                f"the step); at stage {self.stage} set it to false"
                + (
                    " (stage 3 already gathers ahead of use: stage3_prefetch_bucket_size)"
                    if self.stage == 3
                    else ""
                )
            )
        return self


ZERO_DEFAULTS = ZeroOptimizationConfig()
"""`zero_optimization` with every key at its default: code outside the config reads DeepSpeed's
defaults here (the stage-3 knobs of zerotrain.zero.gather.GatherForUseOptions, `zerotrain
estimate`), so that the schema above is the one place they are written."""
