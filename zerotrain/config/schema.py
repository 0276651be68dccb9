"""The typed schema of DeepSpeed's ``ds_config.json``, as far as zerotrain implements it: one
pydantic model per section, ``ZeroTrainConfig`` at the top. The field docstrings are the
documentation (docs.py renders them into docs/config.md)."""

import importlib
import re
from typing import Annotated, Any, Literal, get_args

import torch
from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from zerotrain.config import deepspeed_keys
from zerotrain.config.batch import BatchSizes, resolve_batch_sizes
from zerotrain.config.compression import (
    CommCompressionConfig,
    check_compression,
    check_local_steps,
    from_zero_plus_plus,
)
from zerotrain.config.errors import ConfigError, fail
from zerotrain.config.params import OptimizerConfig, SchedulerConfig
from zerotrain.config.section import (
    Int,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    canonical_choice,
)
from zerotrain.config.sites import SitesConfig
from zerotrain.config.zero import (
    ZERO_DEFAULTS,
    AioConfig,
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OffloadStateTypeEnum,
    ZeroOptimizationConfig,
)
from zerotrain.precision import DTYPES, PrecisionPolicy, training_dtype

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CommCompressionConfig",
    "CommsLoggerConfig",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadStateTypeEnum",
    "TensorBoardConfig",
    "WandbConfig",
    "ZERO_DEFAULTS",
    "ZeroOptimizationConfig",
    "ZeroTrainConfig",
]


class FP16Config(Section):
    """`fp16`: float16 mixed precision with loss scaling (fp32 master weights)."""

    _ACCEPTED = deepspeed_keys.FP16

    enabled: bool = False
    """Run forward and backward in float16, keep fp32 master weights, scale the loss."""
    auto_cast: bool = False
    """Cast the floating-point tensors among the arguments of `engine(...)` to float16 before
    the model's forward (integer tensors, such as token ids, are left alone)."""
    loss_scale: NonNegativeFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: NonNegativeInt = 16
    """Dynamic loss scaling starts at a scale of 2**initial_scale_power."""
    loss_scale_window: PositiveInt = 1000
    """The dynamic scale doubles after this many consecutive steps without overflow."""
    hysteresis: PositiveInt = 2
    """The dynamic scale halves on the hysteresis-th overflow since its last refill (DeepSpeed's
    delayed shift); every overflowing step is skipped."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow, so only consecutive overflows
    count towards halving."""
    min_loss_scale: NonNegativeFloat = 1.0
    """Lower bound of the dynamic loss scale (0: none)."""


class BF16Config(Section):
    """`bf16` (DeepSpeed also reads the old name `bfloat16`): bfloat16 mixed precision; no loss
    scaling is needed."""

    _ACCEPTED = deepspeed_keys.BF16

    enabled: bool = False
    """Run forward and backward in bfloat16 and keep fp32 master weights."""
    auto_cast: bool = False
    """Cast the floating-point tensors among the arguments of `engine(...)` to bfloat16 before
    the model's forward (integer tensors, such as token ids, are left alone), as
    `fp16.auto_cast` does for float16. (A zerotrain key.)"""
    bf16_master_weights_and_grads: bool = False
    """Keep the optimizer's master weights, and the gradients it reads, in bfloat16 instead of
    fp32: the masters are then the bf16 parameters themselves (no copy), 4-6 bytes less per
    parameter. The update is computed in fp32 and rounded back (to nearest, or
    `stochastic_rounding`). Updates smaller than half a bf16 step of a weight are lost when
    rounding to nearest (docs/precision-and-optimizers.md has the measured drift)."""
    bf16_optimizer_states: bool = False
    """Keep the optimizer's per-element state (Adam's two moments, Muon's momentum) in
    bfloat16: half its bytes; the update is computed in fp32."""
    stochastic_rounding: bool = False
    """With `bf16_master_weights_and_grads`: round each updated master to bfloat16
    stochastically (up with the probability of the remainder) instead of to nearest, so small
    updates accumulate in expectation instead of being lost. (A zerotrain key: DeepSpeed has
    no such option.)"""

    @field_validator("bf16_master_weights_and_grads", "bf16_optimizer_states")
    @classmethod
    def _needs_bf16(cls, value: bool, info: ValidationInfo) -> bool:
        if value and not info.data.get("enabled"):
            raise fail("applies to bf16 training; set bf16.enabled true or remove it")
        return value

    @field_validator("stochastic_rounding")
    @classmethod
    def _rounds_masters(cls, value: bool, info: ValidationInfo) -> bool:
        if value and not info.data.get("bf16_master_weights_and_grads"):
            raise fail(
                "rounds bf16 master weights; set bf16.bf16_master_weights_and_grads true or "
                "remove it"
            )
        return value


# DeepSpeed's names of a dtype (its DtypeEnum), as data_types takes them
_DTYPE_NAMES = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("bf16", "bfloat16", "bfloat", "torch.bfloat16"), "bf16"),
}


def _dtype_name(value: Any) -> Any:
    return _DTYPE_NAMES.get(value.lower(), value) if isinstance(value, str) else value


class DataTypesConfig(Section):
    """`data_types`: the dtype gradients accumulate in, as DeepSpeed's section names it."""

    grad_accum_dtype: Annotated[
        Literal[tuple(DTYPES)] | None,  # type: ignore[valid-type]
        BeforeValidator(_dtype_name),
    ] = None
    """The dtype gradients are summed in over the micro-steps of a step and kept in until the
    optimizer steps; null: the training dtype. `fp32` under bf16 is DeepSpeed's usual bf16
    setup, and also serves fp16, at ZeRO stages 1-3 (DeepSpeed refuses it at stage 0, and so
    does zerotrain): each micro-step's bf16 (fp16) gradient is added, upcast, to fp32 buffers (stage 1: before the
    reduction, which rounds the sum to the wire's dtype once; stages 2-3: after each
    micro-step's reduction), which the optimizer then steps from without a copy. Costs 2 more
    bytes per gradient element a rank keeps (stage 1: all of them; stages 2-3: its shard).
    DeepSpeed's names (`float32`, `bfloat16`, `half`...) are accepted."""


DEFAULT_SNAPSHOT_PATH = "/dev/shm/zerotrain"  # a memory file system on Linux


class InMemorySnapshotsConfig(Section):
    """`checkpoint.in_memory_snapshots`: every `every_steps` steps each rank keeps the training
    state in host shared memory that outlives its process, and a copy of it on a rank of another
    node; after a restart (torchrun's elastic agent, `zerotrain run --max-restarts N`),
    `load_checkpoint` resumes from the newest complete snapshot when it is newer than the disk's
    checkpoint, at any new world size. See docs/checkpoints.md. (A zerotrain section.)"""

    enabled: bool = False
    """Take in-memory snapshots (needs a job id: launch with `zerotrain run`, torchrun or
    SLURM)."""
    every_steps: PositiveInt = 10
    """Take a snapshot at every this many optimizer steps. Writing one in the background costs
    host CPU time (its checksums and copies): every step doubled the step time of a 2-core CPU
    run (bench/README.md); every 10 steps costs a tenth of that."""
    keep: PositiveInt = 2
    """Snapshots kept per node: an older one is there when the newest fails its checksum."""
    path: str = DEFAULT_SNAPSHOT_PATH
    """Where the snapshots live (a memory file system: `/dev/shm`); one folder per job below
    it. `ZEROTRAIN_SNAPSHOT_DIR` overrides it (emulated nodes on one host each set their own)."""


class CheckpointConfig(Section):
    """`checkpoint`: how `engine.save_checkpoint` and `engine.load_checkpoint` behave. Every
    zerotrain checkpoint loads at any world size and ZeRO stage (see docs/checkpoints.md)."""

    _ACCEPTED = deepspeed_keys.CHECKPOINT

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """What to do when ranks pass different tags to `save_checkpoint`: `Warn` (every rank logs
    a warning on the `zerotrain` logger, `deepspeed.utils.logger`, as DeepSpeed does, and saves
    under rank 0's tag), `Fail` (raise) or `Ignore` (use rank 0's tag silently). Any
    capitalization is accepted, as in DeepSpeed."""
    keep_last: NonNegativeInt = 0
    """Keep only the newest this many complete checkpoints in the save directory; older ones
    are deleted after a newer one is committed. 0 keeps all. (A zerotrain key.)"""
    async_save: bool = False
    """`save_checkpoint` returns once each rank's shards are copied into host memory; a
    background thread writes and commits them (the step after a save does not wait for the
    disk). `save_checkpoint(..., async_save=...)` decides per call. See docs/checkpoints.md.
    (A zerotrain key.)"""
    async_save_pending: Literal["wait", "skip"] = "wait"
    """An asynchronous save while the previous one is still being written: `wait` for it, or
    `skip` this save with a warning. (A zerotrain key.)"""
    in_memory_snapshots: InMemorySnapshotsConfig = Field(default_factory=InMemorySnapshotsConfig)
    """Snapshots in host memory and on a buddy node, for recovery in seconds after a lost rank
    or node (see `checkpoint.in_memory_snapshots.*` and docs/checkpoints.md)."""
    require_resume: bool = False
    """`load_checkpoint` with `tag=None` raises `CheckpointError` on every rank when it finds no
    checkpoint to load (a path that does not exist, an empty folder, only incomplete saves),
    instead of returning `(None, None)`: for jobs that must resume, where a mistyped path would
    otherwise train from scratch. `ZEROTRAIN_REQUIRE_RESUME=1` (`zerotrain run
    --require-resume`) sets it too. (A zerotrain key.)"""
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
        choices = get_args(cls.model_fields["tag_validation"].annotation)
        return canonical_choice(value, list(choices)) or value


class LoRAFAConfig(Section):
    """`lora_fa` (a zerotrain section): `initialize` converts the model's linear layers named
    in `target_modules` to LoRA-FA adapters (`zerotrain.lora.apply_lora_fa`; Zhang et al.,
    arXiv:2308.03303) and freezes everything else, before ZeRO partitions it. The optimizer
    then comes from the `optimizer` section, or from a factory passed to `initialize`: a torch
    optimizer built before would hold the layers replaced here. See docs/integrations.md."""

    enabled: bool = False
    """Convert the model at `initialize`."""
    target_modules: list[str] = Field(default_factory=list)
    """Layers to adapt, by qualified name or its last parts, as peft's `target_modules`
    (e.g. `["q_proj", "v_proj"]`, or `["c_attn", "c_proj", "c_fc"]` for GPT-2)."""
    r: PositiveInt = 8
    """The adapters' rank: B is (out x r), A (r x in) is frozen."""
    alpha: PositiveFloat = 16.0
    """The adapter output is scaled by alpha / r, as in peft."""

    @model_validator(mode="after")
    def _targets_when_enabled(self) -> "LoRAFAConfig":
        if self.enabled and not self.target_modules:
            raise fail(
                "target_modules is empty; name the linear layers to adapt, e.g. "
                '["q_proj", "v_proj"]'
            )
        return self


def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(module), name, None) if module else None
    if not isinstance(found, type):
        raise ImportError(f"{path!r} names no class")
    return found


class TorchAutocastConfig(Section):
    """`torch_autocast`: DeepSpeed's torch.autocast mixed precision. The parameters and the
    masters stay in the training dtype (fp32 unless bf16 or fp16 is enabled too); every
    forward through the engine runs under `torch.autocast` to `dtype`, so matrix products run
    in it and the ops autocast keeps wide stay wide; the gradients of the parameters of
    `lower_precision_safe_modules` are reduced over the ranks in `dtype`, the others in the
    training dtype. With `dtype: fp16` the loss is scaled as the fp16 section says (dynamic by
    default), as gradients of fp16 products underflow."""

    enabled: bool = False
    """Run the forward under torch.autocast."""
    dtype: Annotated[Literal["bf16", "fp16"], BeforeValidator(_dtype_name)] = "bf16"
    """The autocast dtype (DeepSpeed's names accepted: `bfloat16`, `torch.float16`...)."""
    lower_precision_safe_modules: list[str] | None = None
    """Module classes, by import path, whose parameters' gradients are reduced in `dtype`
    (only parameters of exactly these classes, not subclasses, as DeepSpeed does); null:
    DeepSpeed's list, `torch.nn.Linear` and `torch.nn.Conv1d/2d/3d`."""

    @field_validator("lower_precision_safe_modules")
    @classmethod
    def _importable(cls, value: list[str] | None) -> list[str] | None:
        for path in value or ():
            try:
                _import_class(path)
            except Exception as error:  # noqa: BLE001 (any import failure: the user's path)
                raise fail(f"{path!r} is not an importable class ({error})") from None
        return value

    def safe_classes(self) -> tuple[type, ...]:
        """The classes of `lower_precision_safe_modules` (or DeepSpeed's default list)."""
        paths = self.lower_precision_safe_modules
        if paths is None:
            paths = [f"torch.nn.{name}" for name in ("Linear", "Conv1d", "Conv2d", "Conv3d")]
        return tuple(_import_class(path) for path in paths)


class TiledComputeConfig(Section):
    """`tiled_compute` (a zerotrain section): run a transformers causal LM's MLPs and its loss
    over tiles of the sequence, so that neither the MLPs' intermediate nor the logits
    (sequence x vocabulary, fp32) ever exist for the whole sequence (ALST's TiledMLP and
    TiledFusedLogitsLoss; `initialize` applies them; `zerotrain.sequence` has both for any
    model). The numbers equal the untiled model's up to float rounding. See
    docs/long-context.md."""

    mlp: bool = False
    """Tile every gated MLP (gate/up/down projections: Llama, Qwen, Mistral); backward
    recomputes each tile."""
    mlp_tile_tokens: PositiveInt | None = None
    """Positions per MLP tile, of every row of the batch; null: the hidden size (ALST's
    choice)."""
    loss: bool = False
    """Compute the loss from `labels` or `shift_labels` over tiles of the logits; the model then
    returns the loss and no logits."""
    loss_tile_tokens: PositiveInt | None = None
    """Tokens per loss tile; null: as many as make 64 MiB of fp32 logits (a tile's logits,
    their softmax and its gradient are live together)."""


class TensorParallelConfig(Section):
    """`tensor_parallel`: split the attention and MLP layers of every block over groups of
    `autotp_size` ranks (Megatron-LM's column-then-row split), composed with ZeRO over the
    data-parallel group of world size / `autotp_size` ranks. See docs/parallelism.md."""

    _ACCEPTED = deepspeed_keys.TENSOR_PARALLEL

    autotp_size: PositiveInt = 1
    """The tensor-parallel degree: ranks that split each layer; it must divide the world size
    and the head counts and widths of the split layers. Tensor-parallel peers are neighbouring
    ranks (on one node when they fit) and see the same micro-batches."""
    tp_plan: dict[str, Any] | None = None
    """Which modules to split and how, by qualified-name pattern: `"colwise"`, `"colwise:N"` (a
    fused projection of N blocks, e.g. q/k/v), `"rowwise"`, or `"divide:attr,..."` (integer
    attributes, a head count, divided by the degree); in a config given as a Python dict, also
    torch's `ColwiseParallel()`, `RowwiseParallel()`, `SequenceParallel()` and
    `PrepareModuleInput()` (a torchtitan plan as it is); `initialize` checks them against the
    model. null: the automatic plan, which knows GPT-2, Llama-shaped and zerotrain's example GPT
    blocks. (A zerotrain key.)"""
    sequence_parallel: bool = False
    """Run the norms, dropouts and residual adds between the split attention and MLP on 1/tp of
    the sequence each (Megatron-LM's sequence parallelism): their activations shrink by tp for
    the same bytes. The sequence (dimension 1 of the blocks' hidden states) must divide by
    `autotp_size`; dropout there masks each rank's own tokens. (A zerotrain key.)"""
    check_inputs: bool = True
    """Before each forward, the ranks of a tensor-parallel group compare their inputs (shapes,
    dtypes, and the sum of integer tensors such as token ids) with one 16-byte gather, and all
    raise naming what each got when they differ (data sharded over the world instead of the
    data-parallel ranks); false skips it (it waits for the device once per forward). (A
    zerotrain key.)"""


class MoEConfig(Section):
    """`moe`: how the model's `zerotrain.moe.MoE` layers exchange tokens over the
    expert-parallel group (the experts, `ep_size` and gating are the layers' arguments). See
    docs/moe.md. (A zerotrain section.)"""

    token_dedup: bool = False
    """Send a token to a rank once, whichever of its top-k experts there take it, and bring
    it back once, summed (HierMoE's token deduplication): fewer all-to-all bytes with top-2
    routing, the same numerics."""
    overlap_chunks: PositiveInt = 1
    """Split each layer's tokens into this many parts and exchange them asynchronously, so
    that one part's all-to-all overlaps another's expert compute, in forward and in backward
    (FSMoE's pipelining); 1: one exchange each way. The same numerics."""


class PipelineConfig(Section):
    """`pipeline`: how a `zerotrain.pipe.PipelineModule` is trained (its stages and partition are
    the module's arguments). See docs/parallelism.md."""

    _ACCEPTED = deepspeed_keys.PIPELINE

    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv"] = "1f1b"
    """The order of the micro-batches' forwards and backwards on each stage: `1f1b` (one
    forward, one backward, once the pipeline is full: at most `stages` micro-batches' activations
    held per stage), `gpipe` (all forwards, then all backwards: every micro-batch's activations
    held), `interleaved_1f1b` (1F1B over several stages per rank, a smaller bubble: build the
    PipelineModule with `stages_per_rank` 2 or more) or `zbv` (zero bubble: two stages per rank
    placed in a V, `stages_per_rank=2, stage_placement="v"`, each backward split into the input
    gradient and, later, the weight gradients, which fill the bubble). All train the same
    model. (A zerotrain key.)"""


class ActivationCheckpointingConfig(Section):
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
    pinned and copied on a side stream on CUDA, and copy them back one region ahead of the
    recomputation, so the device holds at most two regions' inputs in backward; the numbers do
    not change. Applies to `zerotrain.checkpointing` regions and to a transformers model's own
    gradient checkpointing when it is enabled before `initialize`. On a CPU device they are in
    CPU memory already: nothing moves."""
    contiguous_memory_optimization: bool = False
    """Has no effect in zerotrain: DeepSpeed copies partitioned activations into one buffer of
    `number_checkpoints` slots to limit fragmentation, and zerotrain partitions none (see
    `partition_activations`)."""
    number_checkpoints: PositiveInt | None = None
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


class CommsLoggerConfig(Section):
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
                raise fail(f"unknown operation {op!r}; use any of {', '.join(known)}")
            names.append(name)
        return names


class FlopsProfilerConfig(Section):
    """`flops_profiler`: profile one step's forward per module (FLOPs, MACs, parameters,
    latency) and print the module tree, the top modules and the achieved TFLOP/s (rank 0).
    See docs/monitoring.md."""

    enabled: bool = False
    """Profile the step given by `profile_step` and print its profile."""
    recompute_fwd_factor: NonNegativeFloat = 0.0
    """Forwards recomputed in backward per forward (activation checkpointing: 1.0 when every
    block is recomputed): the profile's hardware FLOPs per step are (3 + this) x the forward
    FLOPs. The throughput line always reports model FLOPs (3x)."""
    profile_step: NonNegativeInt = 1
    """Profile the step that starts when `engine.global_steps` equals this, as in DeepSpeed:
    the default 1 profiles the second optimizer step (the first is warm-up). The first
    micro-step's forward of that step is profiled."""
    module_depth: Int = -1
    """Depth of the module tree printed with `detailed`, and of the per-depth top modules; -1
    prints every level."""
    top_modules: PositiveInt = 1
    """How many modules to list per depth, by MACs, by parameters and by latency."""
    detailed: bool = True
    """Print the module tree with each module's profile."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout (rank 0; directories are created)."""
    peak_tflops: PositiveFloat | None = None
    """Peak TFLOP/s of one device, for the utilisation in the profile; null measures it once
    with a short matmul benchmark in the training dtype (reported as measured). A zerotrain
    key."""

    @field_validator("module_depth")
    @classmethod
    def _depth_or_all(cls, depth: int) -> int:
        if depth < -1:
            raise fail(f"must be -1 (every level) or a depth >= 0, got {depth}")
        return depth


class TensorBoardConfig(Section):
    """`tensorboard`: write the per-step training scalars (see docs/monitoring.md) to a
    TensorBoard event file from rank 0; needs the `tensorboard` package."""

    enabled: bool = False
    """Write the scalars of every optimizer step (`pip install tensorboard`)."""
    output_path: str = ""
    """Directory for the logs; `""` is the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of `output_path` the event file goes to."""


class CSVMonitorConfig(Section):
    """`csv_monitor`: write the per-step training scalars to CSV files from rank 0, one file
    per scalar with the columns `step` and the scalar's name (DeepSpeed's layout)."""

    enabled: bool = False
    """Write the scalars of every optimizer step."""
    output_path: str = ""
    """Directory for the files; `""` is the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of `output_path` the files go to."""


class WandbConfig(Section):
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


def _null_is_empty(value: Any) -> Any:
    # DeepSpeed reads a null section as one with every key at its default
    return {} if value is None else value


def _infinite_is_none(value: Any) -> Any:
    # JSON's Infinity (Python's json reads it) means "never", as null does
    return None if isinstance(value, float) and value == float("inf") else value


class ZeroTrainConfig(Section):
    """Top level of the config, with DeepSpeed's key names. Of the three batch keys give any
    two, or `train_batch_size` or `train_micro_batch_size_per_gpu` alone (then
    `gradient_accumulation_steps` is 1); `load_config` derives the rest from
    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size."""

    _ACCEPTED = deepspeed_keys.TOP_LEVEL
    _RENAMED = {"bfloat16": "bf16"}

    train_batch_size: PositiveInt | None = None
    """Samples per optimizer step, summed over all ranks and accumulation steps."""
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    """Samples per forward/backward pass on one rank."""
    gradient_accumulation_steps: PositiveInt | None = None
    """Forward/backward passes whose gradients are summed before each optimizer step."""
    data_parallel_size: PositiveInt | None = None
    """DeepSpeed: the data-parallel size of a device mesh with model parallelism. When given it
    must equal the world size over `tensor_parallel.autotp_size`, `sequence_parallel_size` and
    the pipeline stages."""
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence parallelism: groups of this many consecutive ranks share each sample,
    every rank holding 1/`sequence_parallel_size` of its tokens, and attention switches to a
    share of the heads by an all-to-all (see docs/long-context.md). The sequence-parallel
    ranks hold the same parameters, so ZeRO shards over them and the data-parallel ranks
    together; the batch keys count data-parallel ranks (the world over this and
    `tensor_parallel.autotp_size`). It must divide the world size and the attention heads."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build; leave out when passing a torch optimizer to the engine."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule to build; leave out for a constant rate or a client schedule."""
    gradient_clipping: NonNegativeFloat = 1.0
    """Clip the global gradient L2 norm (over all ranks' partitions) to this value; 0 turns
    clipping off. The default is DeepSpeed 0.19.8's: clipping at 1.0 unless the config says
    otherwise."""
    data_types: Annotated[DataTypesConfig, BeforeValidator(_null_is_empty)] = Field(
        default_factory=DataTypesConfig
    )
    """The dtype gradients accumulate in; see the data_types section."""
    communication_data_type: Literal[tuple(DTYPES)] | None = None  # type: ignore[valid-type]
    """The dtype gradients are reduced in; null: the training dtype (fp32, fp16 or bf16).
    `fp32` in 16-bit training sums gradients without 16-bit rounding (stages 2-3 then also keep
    the reduced gradient partition in fp32: 2 more bytes per element of this rank's shard)."""
    dataloader_drop_last: bool = False
    """The dataloader `initialize` returns leaves out each epoch's last micro-batch when it is
    smaller than `train_micro_batch_size_per_gpu`."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision; see the fp16 section."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """NVMe I/O of offload; see the aio section."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision; see the bf16 section."""
    zero_optimization: Annotated[
        ZeroOptimizationConfig, BeforeValidator(_zero_optimization_from_bool)
    ] = Field(default_factory=ZeroOptimizationConfig)
    """ZeRO partitioning; see the zero_optimization section."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint saving and loading; see the checkpoint section."""
    lora_fa: LoRAFAConfig = Field(default_factory=LoRAFAConfig)
    """Fine-tune with LoRA-FA adapters, the model converted by `initialize`; see the lora_fa
    section."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism composed with ZeRO; see the tensor_parallel section."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """torch.autocast mixed precision over the training dtype's parameters; see the
    torch_autocast section."""
    tiled_compute: TiledComputeConfig = Field(default_factory=TiledComputeConfig)
    """MLPs and loss over tiles of the sequence; see the tiled_compute section."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism of a `PipelineModule`; see the pipeline section."""
    moe: MoEConfig = Field(default_factory=MoEConfig)
    """Mixture-of-Experts token exchange; see the moe section."""
    comm_compression: CommCompressionConfig = Field(default_factory=CommCompressionConfig)
    """Communication compression for slow networks; see the comm_compression section."""
    sites: SitesConfig | None = None
    """Training across sites joined by slow links (DiLoCo's inner and outer steps); see the
    sites section. null: one site."""
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
    steps_per_print: Annotated[PositiveInt | None, BeforeValidator(_infinite_is_none)] = 10
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
    seed: NonNegativeInt | None = None
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
            raise fail("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        return self

    @model_validator(mode="after")
    def _narrow_optimizer_fits(self) -> "ZeroTrainConfig":
        narrow = self.bf16.bf16_master_weights_and_grads or self.bf16.bf16_optimizer_states
        optimizer = self.optimizer.type if self.optimizer is not None else None
        if narrow and optimizer in ("OneBitAdam", "ZeroOneAdam"):
            raise fail(
                f"bf16: bf16 master weights or optimizer states with {optimizer}, whose "
                "compressed steps keep fp32 state of their own, are not supported yet; use "
                "fp32 masters and states (remove bf16_master_weights_and_grads and "
                "bf16_optimizer_states) or another optimizer"
            )
        return self

    @model_validator(mode="after")
    def _grad_accum_fits(self) -> "ZeroTrainConfig":
        wanted, training = self.data_types.grad_accum_dtype, self.precision_policy().name
        if wanted == "fp32" and self.bf16.bf16_master_weights_and_grads:
            raise fail(
                "data_types.grad_accum_dtype: fp32 gradients, and bf16.bf16_master_weights_and_grads "
                "asks for bf16 gradients; remove one of them"
            )
        if wanted in (None, training):
            return self
        if wanted != "fp32" or training not in ("bf16", "fp16"):
            raise fail(
                f"data_types.grad_accum_dtype: {wanted} under {training} training asks for a "
                "gradient accumulation zerotrain does not have (it accumulates in the training "
                "dtype, or in fp32 under bf16 or fp16); set it to null or remove it"
            )
        if self.zero_optimization.stage == 0:
            raise fail(
                f"data_types.grad_accum_dtype: fp32 under {training} accumulates in the buffers "
                "ZeRO stages 1-3 keep, not at zero_optimization.stage 0 (DeepSpeed refuses this "
                "mix at stage 0 too); set the stage to 1, 2 or 3, or remove grad_accum_dtype"
            )
        return self

    def precision_policy(self) -> PrecisionPolicy:
        """The dtypes of each copy of the model state this config trains with."""
        dtype = training_dtype(self.bf16.enabled, self.fp16.enabled)
        name = self.data_types.grad_accum_dtype
        bf16, autocast = self.bf16, self.torch_autocast
        return PrecisionPolicy.of(
            dtype,
            None if name is None else DTYPES[name],
            master_dtype=torch.bfloat16 if bf16.bf16_master_weights_and_grads else torch.float32,
            state_dtype=torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32,
            stochastic_rounding=bf16.stochastic_rounding,
            autocast_dtype=DTYPES[autocast.dtype] if autocast.enabled else None,
        )

    @model_validator(mode="before")
    @classmethod
    def _zero_plus_plus(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("zero_optimization"), dict):
            return data
        section = from_zero_plus_plus(data["zero_optimization"], data.get("comm_compression", {}))
        return data if section is None else {**data, "comm_compression": section}

    @model_validator(mode="after")
    def _sites_fit(self) -> "ZeroTrainConfig":
        if self.sites is None or self.sites.synchronous:
            return self
        if self.zero_optimization.offload_optimizer.device == "nvme":
            raise fail(
                "sites: the outer step moves the masters in memory, and "
                "zero_optimization.offload_optimizer.device nvme swaps them to disk; offload "
                "to cpu, or leave sites out"
            )
        optimizer = self.optimizer.type if self.optimizer is not None else None
        if optimizer in ("OneBitAdam", "ZeroOneAdam"):
            raise fail(
                f"sites: {optimizer} compresses its own exchange every step, which the sites' "
                "inner steps keep on their fast links; use Adam or AdamW inside the sites"
            )
        return self

    @model_validator(mode="after")
    def _compression_fits_the_stage(self) -> "ZeroTrainConfig":
        check_compression(self.comm_compression, self.zero_optimization.stage, self.optimizer)
        check_local_steps(self)
        return self

    def resolve_batch(self, world_size: int) -> "ZeroTrainConfig":
        """A copy with all three batch fields set for the data-parallel ranks among
        ``world_size`` (world size over the tensor- and sequence-parallel degrees; DeepSpeed's rules,
        batch.py); ``ConfigError`` showing the arithmetic when they cannot agree."""
        tp, sp = self.tensor_parallel.autotp_size, self.sequence_parallel_size
        if tp > 1 and world_size % tp:
            raise ConfigError(
                f"tensor_parallel.autotp_size: {tp} does not divide the {world_size} ranks "
                "(of one pipeline stage); choose a degree that divides them"
            )
        if sp > 1 and world_size % (tp * sp):
            raise ConfigError(
                f"sequence_parallel_size: {sp} does not divide the {world_size // tp} ranks "
                "(of one pipeline stage, over the tensor-parallel degree); choose a size that "
                "divides them"
            )
        sizes = resolve_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size=world_size // (tp * sp) if tp * sp > 1 else world_size,  # batch.py checks
            data_parallel_size=self.data_parallel_size,
        )
        return self.model_copy(update=sizes._asdict())

    def batch_sizes(self) -> BatchSizes:
        """The three batch keys of a resolved config (``load_config`` resolves; see
        :meth:`resolve_batch`)."""
        total = self.train_batch_size
        micro, accum = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if total is None or micro is None or accum is None:
            raise ConfigError(
                "the batch sizes are not resolved: take the config from load_config, or call "
                "config.resolve_batch(world_size)"
            )
        return BatchSizes(total, micro, accum)
