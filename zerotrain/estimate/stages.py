"""One training job, every ZeRO stage: the bytes per device of model states (the formula of
:func:`zerotrain.zero.memory.model_state_bytes`), stage 3's gathered parameters, the step's fp32
gradients and the activations, and the peak they add up to; with optimizer offload, the host
memory and NVMe bytes per rank from the functions the preflight of ``initialize`` calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zerotrain.config import ZERO_DEFAULTS, ConfigError
from zerotrain.estimate.activations import (
    ActivationAssumptions,
    ActivationBytes,
    TransformerShape,
    activation_bytes,
)
from zerotrain.optim.state_bytes import OPTIMIZER_STATE_BYTES
from zerotrain.precision import DTYPES, PrecisionPolicy
from zerotrain.zero.memory import ModelStateBytes, model_state_bytes
from zerotrain.zero.nvme import disk_bytes_needed, staging_host_bytes
from zerotrain.zero.offload import HostBytes, check_host_memory, host_bytes
from zerotrain.zero.policy import ZeroPolicy

__all__ = [
    "OFFLOAD_DEVICES",
    "StageEstimate",
    "TrainingJob",
    "estimate",
    "host_memory_shortfall",
    "largest_bucket",
    "stage3_gathered_numel",
]

OFFLOAD_DEVICES = ("cpu", "nvme")
"""``offload_optimizer.device`` values the estimate models."""


def stage3_gathered_numel(
    *, params: float, root_and_largest_block: float, max_live_numel: float
) -> float:
    """Most elements stage 3 holds gathered at once out of ``params`` (trainable and frozen),
    persistent units included (see [Note: model states]): prefetch and reuse stay within
    ``max_live_numel``; the root unit and the unit in use are gathered whatever the bound."""
    return max(min(float(max_live_numel), float(params)), float(root_and_largest_block))


@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """The inputs of an estimate: model, hardware, precision, optimizer and batch."""

    trainable_params: int
    """Ψ: parameters with gradients and optimizer state."""
    frozen_params: int = 0
    """Parameters with requires_grad=False: no gradient, no state; partitioned at stage 3
    (but for those in persistent units), whole on every rank below."""
    nodes: int = 1
    gpus_per_node: int = 1
    dtype: str = "bf16"
    """``fp32``, ``bf16`` or ``fp16`` (training dtype of parameters, gradients, activations)."""
    optimizer: str = "adam"
    """A key of :data:`OPTIMIZER_STATE_BYTES`."""
    offload: str | None = None
    """None, ``cpu`` or ``nvme``: ``offload_optimizer.device``, with ``ratio`` 1 (the whole
    optimizer partition off the device)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    largest_layer: int = 0
    """DeepSpeed's largest layer, shown for comparison with its estimator."""
    root_and_largest_block: int = 0
    """Stage 3's always-gathered elements (:attr:`ParameterCount.root_and_largest_block`)."""
    persistent_numel: int = 0
    """Stage 3's trainable elements in units below the persistence threshold (kept whole)."""
    persistent_frozen: int = 0
    """Stage 3's frozen elements in those units (:attr:`ParameterCount.persistent_frozen`)."""
    max_live_numel: int
    """``stage3_max_live_parameters`` (zerotrain.config.ZERO_DEFAULTS has the default)."""
    reduce_bucket_size: int = ZERO_DEFAULTS.reduce_bucket_size
    """Elements per bucket at stages 1-2: with offload, the largest bucket sizes the ring."""
    largest_unit: int = 0
    """Stage 3's largest gather unit (:attr:`ParameterCount.largest_unit`), its largest
    bucket; 0: unknown, taken as ``min(reduce_bucket_size, Ψ)``."""
    buffer_count: int = ZERO_DEFAULTS.offload_optimizer.buffer_count
    """``offload_optimizer.buffer_count``: ring buffers (and NVMe staging sets)."""
    sub_group_size: int = ZERO_DEFAULTS.sub_group_size
    """``zero_optimization.sub_group_size``: elements stepped at once with NVMe offload."""
    shape: TransformerShape | None = None
    """Activations are estimated only with a shape."""
    attention: Literal["eager", "flash"] = "eager"
    """:attr:`ActivationAssumptions.attention`."""
    dropout: bool = True
    """:attr:`ActivationAssumptions.dropout`."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"--optimizer: one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {self.optimizer!r}"
            )
        if self.offload not in (None, *OFFLOAD_DEVICES):
            raise ValueError(f"--offload: cpu or nvme, got {self.offload!r}")
        if self.offload == "nvme" and self.optimizer == "lamb":
            raise ValueError(
                "--offload nvme steps the optimizer sub-group by sub-group, and lamb needs whole "
                "parameters (its trust ratio); use --offload cpu, or adam, adamw or sgd"
            )
        if min(self.reduce_bucket_size, self.buffer_count, self.sub_group_size) < 1:
            raise ValueError(
                "--reduce-bucket-size, --buffer-count and --sub-group-size must be at least 1"
            )
        if self.offload and 0 in self.stages:
            raise ValueError(
                "--offload needs ZeRO stage 1, 2 or 3 (offload moves the partitioned optimizer "
                "states); pass --stage 1, 2 or 3, or leave --stage out"
            )
        if self.trainable_params <= 0:
            raise ValueError(
                "--params / --model: the model has no trainable parameters "
                f"({self.trainable_params}); ZeRO partitions only trainable ones"
            )
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("--nodes and --gpus-per-node must be at least 1")

    @property
    def world_size(self) -> int:
        """N: data-parallel ranks, one per device."""
        return self.nodes * self.gpus_per_node

    @property
    def precision(self) -> PrecisionPolicy:
        """The dtypes zerotrain would train in."""
        return PrecisionPolicy(DTYPES[self.dtype])

    @property
    def precision_bytes(self) -> int:
        """Bytes per element of parameters, gradients and activations."""
        return DTYPES[self.dtype].itemsize

    @property
    def assumptions(self) -> ActivationAssumptions:
        """What the activation estimate assumes (norm statistics as on CUDA)."""
        return ActivationAssumptions(
            element_bytes=self.precision_bytes, attention=self.attention, dropout=self.dropout
        )


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """Bytes per device at one ZeRO stage."""

    stage: int
    states: ModelStateBytes
    frozen: float
    """Frozen parameters (whole on every rank; at stage 3 partitioned, but for those in
    persistent units)."""
    gathered: float
    """Stage 3: gathered parameters beyond this rank's shards, during forward and backward."""
    activations: ActivationBytes | None
    host: HostBytes | None = None
    """With offload: the host memory one rank allocates, as the preflight counts it."""
    disk: int = 0
    """With NVMe offload: bytes of one rank's working file."""

    @property
    def model_states(self) -> float:
        """Model states on the device: trainable and frozen parameters, gradients, optimizer."""
        return self.states.total + self.frozen

    def peak(self, checkpointing: bool) -> float:
        """Model states plus the larger of the two transient phases: forward/backward
        (gathered parameters and activations) and the optimizer step (fp32 gradients)."""
        activations = 0.0
        if self.activations is not None:
            act = self.activations
            activations = act.checkpointed_peak if checkpointing else act.without_checkpointing
        return self.model_states + max(self.gathered + activations, self.states.step_grads)


def estimate(job: TrainingJob) -> list[StageEstimate]:
    """Bytes per device at each of ``job.stages``."""
    precision = job.precision
    p = job.precision_bytes
    act = activation_bytes(job.shape, job.assumptions) if job.shape else None
    rows = []
    for stage in job.stages:
        policy = ZeroPolicy.for_stage(stage)
        states = model_state_bytes(
            job.trainable_params,
            world_size=job.world_size,
            policy=policy,
            precision=precision,
            optimizer_state_bytes=OPTIMIZER_STATE_BYTES[job.optimizer],
            persistent_numel=job.persistent_numel,
            offload=1.0 if job.offload else 0.0,
        )
        gathered, frozen = 0.0, float(job.frozen_params)
        if policy.shard_parameters:
            whole = min(job.persistent_frozen, job.frozen_params)
            frozen = whole + (job.frozen_params - whole) / job.world_size
            live = stage3_gathered_numel(
                params=job.trainable_params + job.frozen_params,
                root_and_largest_block=max(job.root_and_largest_block, job.largest_layer),
                max_live_numel=job.max_live_numel,
            )
            gathered = p * max(0.0, live - job.persistent_numel - whole)
        host, disk = _offload_bytes(job, policy) if job.offload else (None, 0)
        rows.append(
            StageEstimate(
                stage=stage,
                states=states,
                frozen=p * frozen,
                gathered=gathered,
                activations=act,
                host=host,
                disk=disk,
            )
        )
    return rows


def largest_bucket(job: TrainingJob, policy: ZeroPolicy) -> int:
    """Elements of the job's largest bucket: at stage 3 one bucket per gather unit (the largest
    unit, when known), else buckets close at ``reduce_bucket_size`` elements. An upper bound,
    unless one parameter alone exceeds it (buckets close between parameters)."""
    if policy.shard_parameters and job.largest_unit:
        return job.largest_unit
    return min(job.reduce_bucket_size, job.trainable_params)


def _offload_bytes(job: TrainingJob, policy: ZeroPolicy) -> tuple[HostBytes, int]:
    """One rank's host memory and working-file bytes with the whole optimizer partition
    offloaded, from the functions the preflight of ``initialize`` calls."""
    n = job.world_size
    partition = -(-job.trainable_params // n)  # stages 1-3: ⌈Ψ/N⌉ (buckets pad to N)
    largest = -(-largest_bucket(job, policy) // n)
    state_bytes = OPTIMIZER_STATE_BYTES[job.optimizer]
    if job.offload == "nvme":
        host = staging_host_bytes(
            largest,
            sub_group_size=job.sub_group_size,
            state_bytes=state_bytes,
            param_itemsize=job.precision_bytes,
            buffer_count=job.buffer_count,
        )
        return host, disk_bytes_needed(partition, state_bytes)
    host = host_bytes(
        partition,
        largest,
        state_bytes=state_bytes,
        param_itemsize=job.precision_bytes,
        buffer_count=job.buffer_count,
    )
    return host, 0


def host_memory_shortfall(job: TrainingJob, row: StageEstimate, host_memory: int) -> str | None:
    """What the preflight of ``initialize`` (:func:`check_host_memory`, ``gpus_per_node`` ranks
    on a node with ``host_memory`` bytes available) says of ``row``'s host bytes: None when the
    node holds them, else its refusal."""
    if row.host is None:
        return None
    try:
        check_host_memory(
            row.host,
            local_ranks=job.gpus_per_node,
            available=host_memory,
            nvme=job.offload == "nvme",
        )
    except ConfigError as error:
        return str(error)
    return None
