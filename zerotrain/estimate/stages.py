"""One training job, every ZeRO stage: the bytes per device of model states (the formula of
:func:`zerotrain.zero.memory.model_state_bytes`), stage 3's gathered parameters, the step's fp32
gradients and the activations, and the peak they add up to; with offload, the host memory and
NVMe bytes per rank from the functions the stores allocate by. The memory preflight of
``initialize`` (zerotrain/estimate/preflight.py) is this estimate of the job it is given, by
:func:`rank_needs`, against the limits each rank has, with the changes
:func:`memory_options` lists."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from zerotrain.config import ZERO_DEFAULTS
from zerotrain.estimate.activations import (
    ActivationAssumptions,
    ActivationBytes,
    TransformerShape,
    activation_bytes,
)
from zerotrain.estimate.model import ParameterCount
from zerotrain.estimate.verdict import Limit, Need, Option, RankMemory, gib, shortfall
from zerotrain.optim.state_bytes import OPTIMIZER_STATE_BYTES
from zerotrain.precision import DTYPES, PrecisionPolicy
from zerotrain.zero.memory import ModelStateBytes, model_state_bytes
from zerotrain.zero.nvme import disk_bytes_needed, staging_host_bytes, sub_group_numel
from zerotrain.zero.offload import HostBytes, host_bytes
from zerotrain.zero.policy import ZeroPolicy

__all__ = [
    "OFFLOAD_DEVICES",
    "StageEstimate",
    "TrainingJob",
    "estimate",
    "host_memory_shortfall",
    "largest_bucket",
    "memory_options",
    "rank_needs",
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


NOT_ON_NVME = ("lamb",)
"""Optimizers NVMe offload refuses: Lamb's trust ratios need whole parameters, and NVMe steps
sub-group by sub-group (Muon's matrices are made whole from its sub-groups' updates:
[Note: Muon on NVMe] in zerotrain/zero/nvme.py)."""


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
    grad_accum_dtype: str | None = None
    """``data_types.grad_accum_dtype``: the dtype gradients accumulate in (None: ``dtype``)."""
    master_dtype: str = "fp32"
    """The optimizer's master weights (``bf16``: ``bf16.bf16_master_weights_and_grads``,
    which are then the bf16 parameters themselves)."""
    optimizer_state_dtype: str = "fp32"
    """The optimizer's per-element state (``bf16``: ``bf16.bf16_optimizer_states``)."""
    optimizer: str = "adam"
    """A key of :data:`OPTIMIZER_STATE_BYTES` (``lamb``: not element-wise, so no NVMe)."""
    optimizer_state_bytes: float | None = None
    """Bytes of optimizer state per element where known exactly (the preflight asks the
    optimizer it will build); None: :data:`OPTIMIZER_STATE_BYTES` of ``optimizer``."""
    offload: str | None = None
    """None, ``cpu`` or ``nvme``: ``offload_optimizer.device``."""
    offload_ratio: float = 1.0
    """With ``offload``: ``offload_optimizer.ratio``, the share of the optimizer partition off
    the device (1: all of it)."""
    offload_param: str | None = None
    """None, ``cpu`` or ``nvme``: ``offload_param.device``, where stage 3 keeps the parameter
    shards (read at stage 3 only)."""
    param_buffer_count: int = ZERO_DEFAULTS.offload_param.buffer_count
    """``offload_param.buffer_count``: the NVMe buffers parameter shards are read into."""
    quantized_gather: bool = False
    """``comm_compression.parameters`` (or ``auto`` offering it): the gathered parameters may
    differ from their shards, so at stages 1-3 the fp32 masters are a copy of their own."""
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
        if self.grad_accum_dtype not in (None, *DTYPES):
            raise ValueError(
                f"--grad-accum-dtype: one of {', '.join(DTYPES)}, got {self.grad_accum_dtype!r}"
            )
        for flag, value in (
            ("--master-dtype", self.master_dtype),
            ("--optimizer-state-dtype", self.optimizer_state_dtype),
        ):
            if value not in ("fp32", "bf16"):
                raise ValueError(f"{flag}: fp32 or bf16, got {value!r}")
            if value == "bf16" and self.dtype != "bf16":
                raise ValueError(f"{flag} bf16: applies to bf16 training; pass --dtype bf16")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"--optimizer: one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {self.optimizer!r}"
            )
        if self.offload not in (None, *OFFLOAD_DEVICES):
            raise ValueError(f"--offload: cpu or nvme, got {self.offload!r}")
        if self.offload == "nvme" and self.optimizer in NOT_ON_NVME:
            raise ValueError(
                f"--offload nvme steps the optimizer sub-group by sub-group, and {self.optimizer} "
                "needs whole parameters (Lamb's trust ratios); use --offload cpu, or adam, "
                "adamw, sgd, lion, adagrad or muon"
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

    @classmethod
    def for_model(cls, count: ParameterCount, **settings: Any) -> TrainingJob:
        """The job of a model counted by :func:`~zerotrain.estimate.count_parameters`: its
        parameter fields from ``count``, the others from ``settings``."""
        return cls(
            trainable_params=count.trainable,
            frozen_params=count.frozen,
            largest_layer=count.largest_layer,
            root_and_largest_block=count.root_and_largest_block,
            persistent_numel=count.persistent,
            persistent_frozen=count.persistent_frozen,
            largest_unit=count.largest_unit,
            **settings,
        )

    @property
    def world_size(self) -> int:
        """N: data-parallel ranks, one per device."""
        return self.nodes * self.gpus_per_node

    @property
    def state_bytes(self) -> float:
        """Bytes of optimizer state per element."""
        if self.optimizer_state_bytes is not None:
            return self.optimizer_state_bytes
        return OPTIMIZER_STATE_BYTES[self.optimizer]

    @property
    def precision(self) -> PrecisionPolicy:
        """The dtypes zerotrain would train in."""
        accum = self.grad_accum_dtype
        return PrecisionPolicy.of(
            DTYPES[self.dtype],
            None if accum is None else DTYPES[accum],
            master_dtype=DTYPES[self.master_dtype],
            state_dtype=DTYPES[self.optimizer_state_dtype],
        )

    def master_copy(self, stage: int) -> bool:
        """Whether the fp32 masters are a copy of their own at ``stage``: in 16-bit training,
        and where quantized gathers hand out parameters that differ from them."""
        return self.precision.has_master_copy or (self.quantized_gather and stage >= 1)

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
    """With optimizer offload: the host memory one rank's store allocates."""
    param_host: int = 0
    """With stage 3's ``offload_param``: the host bytes of the parameter shards (``cpu``) or of
    the buffers they are read into (``nvme``)."""
    disk: int = 0
    """With NVMe offload: bytes of one rank's working files."""

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
        return self.peak_with(activations)

    def peak_with(self, activations: float) -> float:
        """:meth:`peak` with ``activations`` bytes at their peak (measured ones: the planner's
        model probe)."""
        return self.model_states + max(self.gathered + activations, self.states.step_grads)


def estimate(job: TrainingJob) -> list[StageEstimate]:
    """Bytes per device at each of ``job.stages``."""
    precision = job.precision
    p = job.precision_bytes
    act = activation_bytes(job.shape, job.assumptions) if job.shape else None
    rows = []
    for stage in job.stages:
        policy = ZeroPolicy.for_stage(stage)
        params_off = job.offload_param is not None and policy.shard_parameters
        states = model_state_bytes(
            job.trainable_params,
            world_size=job.world_size,
            policy=policy,
            precision=precision,
            optimizer_state_bytes=job.state_bytes,
            persistent_numel=job.persistent_numel,
            offload=host_share(job, policy) if job.offload else 0.0,
            offload_params=params_off,
            master_copy=job.master_copy(stage),
        )
        gathered, frozen = 0.0, float(job.frozen_params)
        if policy.shard_parameters:
            whole = min(job.persistent_frozen, job.frozen_params)
            # offload_param keeps the frozen shards with the trainable ones
            frozen = whole + (0 if params_off else (job.frozen_params - whole) / job.world_size)
            live = stage3_gathered_numel(
                params=job.trainable_params + job.frozen_params,
                root_and_largest_block=max(job.root_and_largest_block, job.largest_layer),
                max_live_numel=job.max_live_numel,
            )
            gathered = p * max(0.0, live - job.persistent_numel - whole)
        host, disk = _offload_bytes(job, policy) if job.offload else (None, 0)
        param_host, param_disk = _param_offload_bytes(job, policy) if params_off else (0, 0)
        rows.append(
            StageEstimate(
                stage=stage,
                states=states,
                frozen=p * frozen,
                gathered=gathered,
                activations=act,
                host=host,
                param_host=param_host,
                disk=disk + param_disk,
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


def host_share(job: TrainingJob, policy: ZeroPolicy) -> float:
    """The share of the optimizer partition that offload puts on the host. The store takes
    buckets from the front until the host holds at least ``offload_ratio`` of the elements
    (zerotrain/zero/offload.py's ``choose_host_buckets``): with one bucket, any ratio above 0
    offloads all of it; with several, at least the ratio (their sizes are not known here), a
    lower bound for the host and so an upper one for the device."""
    ratio = min(1.0, max(0.0, job.offload_ratio))
    if 0 < ratio < 1 and largest_bucket(job, policy) >= job.trainable_params:
        return 1.0
    return ratio


def _offload_bytes(job: TrainingJob, policy: ZeroPolicy) -> tuple[HostBytes, int]:
    """One rank's host memory and working-file bytes with the whole optimizer partition
    offloaded, from the functions the preflight of ``initialize`` calls."""
    n = job.world_size
    partition = -(-job.trainable_params // n)  # stages 1-3: ⌈Ψ/N⌉ (buckets pad to N)
    partition = -int(-partition * host_share(job, policy) // 1)
    largest = -(-largest_bucket(job, policy) // n)
    state_bytes = job.precision.stored_state_bytes(job.state_bytes)
    master = job.precision.master_dtype.itemsize
    if job.offload == "nvme":
        # a staging set holds any sub-group's state: for Muon, its AdamW half's
        staged = OPTIMIZER_STATE_BYTES["adamw"] if job.optimizer == "muon" else job.state_bytes
        host = staging_host_bytes(
            largest,
            sub_group_size=job.sub_group_size,
            state_bytes=job.precision.stored_state_bytes(staged),
            param_itemsize=job.precision_bytes,
            buffer_count=job.buffer_count,
            master_itemsize=master,
        )
        return host, disk_bytes_needed(partition, state_bytes, master)
    host = host_bytes(
        partition,
        largest,
        state_bytes=state_bytes,
        param_itemsize=job.precision_bytes,
        buffer_count=job.buffer_count,
        master_itemsize=master,
    )
    return host, 0


def _param_offload_bytes(job: TrainingJob, policy: ZeroPolicy) -> tuple[int, int]:
    """Stage 3's ``offload_param``: one rank's host bytes and working-file bytes (the shards of
    the units that are not kept whole, frozen ones included; with ``nvme`` the host holds
    ``param_buffer_count`` buffers of the largest unit's shard)."""
    n, p = job.world_size, job.precision_bytes
    shards = job.trainable_params - job.persistent_numel
    shards += job.frozen_params - min(job.persistent_frozen, job.frozen_params)
    shard_bytes = p * -(-shards // n)
    if job.offload_param == "nvme":
        largest = -(-largest_bucket(job, policy) // n)
        return max(1, job.param_buffer_count) * largest * p, shard_bytes
    return shard_bytes, 0


def rank_needs(job: TrainingJob, row: StageEstimate, *, on_host: bool) -> tuple[Need | None, Need]:
    """What one rank of ``job`` needs at ``row``'s stage, as (device, host): model states on the
    device with the step's fp32 gradients or stage 3's gathered parameters at peak (activations
    come on top: the preflight does not know them), and what offload keeps in host memory.
    ``on_host``: the training device is the CPU, whose memory holds it all (device None)."""
    states = row.states
    optimizer = "fp32 masters and optimizer state" if states.optimizer_states else "optimizer"
    if not job.master_copy(row.stage):
        optimizer = "optimizer state"
    device = (
        ("parameters", states.parameters),
        ("frozen parameters", row.frozen),
        ("gradients", states.gradients),
        (optimizer, states.optimizer_states),
    )
    peaks = (
        ("the step's fp32 gradients", states.step_grads),
        ("stage 3's gathered parameters", row.gathered),
    )
    host: list[tuple[str, float]] = []
    if row.host is not None:
        if job.offload == "nvme":
            staging = row.host.masters + row.host.optimizer_state + row.host.gradients
            host.append(("offload_optimizer's NVMe staging sets", staging))
        else:
            host += [
                ("offloaded fp32 masters", row.host.masters),
                ("offloaded optimizer state", row.host.optimizer_state),
                ("offloaded fp32 gradients", row.host.gradients),
            ]
        host.append(("transfer ring", row.host.staging))
    if row.param_host:
        what = "offload_param's NVMe buffers" if job.offload_param == "nvme" else "parameter shards"
        host.append((what, row.param_host))
    if on_host:
        return None, Need((*device, *host), peaks)
    return Need(device, peaks), Need(tuple(host))


def memory_options(job: TrainingJob, stage: int, *, on_host: bool) -> list[Option]:
    """Changes of ``job`` at ``stage`` that lower what a rank needs, each evaluated by
    :func:`rank_needs`: a higher stage, optimizer offload to cpu or nvme (``ratio`` 1),
    ``offload_param`` at stage 3, and their combinations; with offload, a lower ``ratio`` or
    ``buffer_count``, and with nvme a smaller ``sub_group_size``."""
    variants: list[tuple[tuple[str, ...], int, TrainingJob, str]] = []  # ..., family
    devices = [job.offload, "cpu"] + (["nvme"] if job.optimizer not in NOT_ON_NVME else [])
    for new_stage in range(stage, 4):
        for device in dict.fromkeys(devices):
            if device is not None and new_stage == 0:
                continue  # offload moves partitioned state: stage 1 or more
            homes = dict.fromkeys([job.offload_param, "cpu", "nvme"] if new_stage == 3 else [None])
            for home in homes:
                changes, cost = [], new_stage - stage
                if new_stage != stage:
                    changes.append(f"stage {new_stage}")
                if device != job.offload:
                    changes.append(f'offload_optimizer.device "{device}"')
                    cost += 1 if device == "cpu" else 2
                if new_stage == 3 and home != job.offload_param:
                    changes.append(f'offload_param.device "{home}"')
                    cost += 1 if home == "cpu" else 2
                ratio = job.offload_ratio if device == job.offload else 1.0
                if changes:
                    changed = replace(
                        job,
                        stages=(new_stage,),
                        offload=device,
                        offload_ratio=ratio,
                        offload_param=home,
                    )
                    variants.append((tuple(changes), cost, changed, ""))
    if job.offload is not None:
        for ratio in (0.75, 0.5, 0.25, 0.0):  # the device keeps more
            if ratio < job.offload_ratio:
                changed = replace(job, stages=(stage,), offload_ratio=ratio)
                variants.append(((f"offload_optimizer.ratio {ratio}",), 3, changed, "ratio"))
        for count in (2, 1):
            if count < job.buffer_count:
                changed = replace(job, stages=(stage,), buffer_count=count)
                change = f"offload_optimizer.buffer_count {count}"
                variants.append(((change,), 3, changed, "buffer_count"))
    if job.offload == "nvme":
        size = sub_group_numel(job.sub_group_size) // 4
        while size >= 1 << 14:
            changed = replace(job, stages=(stage,), sub_group_size=size)
            variants.append(((f"sub_group_size {size}",), 3, changed, "sub_group_size"))
            size //= 4
    options = []
    for changes, cost, changed, family in variants:
        (row,) = estimate(changed)
        device, host = rank_needs(changed, row, on_host=on_host)
        note = f"{gib(row.disk)} of disk per rank" if row.disk else ""
        total = device.total if device else 0.0
        options.append(Option(changes, cost, total, host.total, note, family))
    return options


def more_ranks(
    job: TrainingJob, stage: int, *, on_host: bool
) -> tuple[tuple[int, int, float, float], ...]:
    """What one rank would need with 2, 4, ... 1024 times the data-parallel ranks, as many per
    node as now (more nodes), at ``stage`` and at stage 3: (stage, ranks, device, host)."""
    out = []
    for new_stage in dict.fromkeys([stage, 3]):
        for factor in (2**k for k in range(1, 11)):
            changed = replace(job, nodes=job.nodes * factor, stages=(new_stage,))
            (row,) = estimate(changed)
            device, host = rank_needs(changed, row, on_host=on_host)
            total = device.total if device else 0.0
            out.append((new_stage, changed.world_size, total, host.total))
    return tuple(out)


def host_memory_shortfall(job: TrainingJob, row: StageEstimate, host_memory: int) -> str | None:
    """What the memory preflight of ``initialize`` says of ``row``'s host bytes on a node of
    ``gpus_per_node`` ranks with ``host_memory`` bytes available (the model states on the
    GPUs, which the estimate does not limit): None when the node holds them, else its
    refusal (:func:`zerotrain.estimate.verdict.shortfall`)."""
    if row.host is None and not row.param_host:
        return None
    _, host = rank_needs(job, row, on_host=False)
    one = RankMemory(
        rank=0,
        device=None,
        host=host,
        host_limits=(Limit(host_memory, "--host-memory", "node"),),
        options=tuple(memory_options(job, row.stage, on_host=False)),
        more_ranks=more_ranks(job, row.stage, on_host=False),
    )
    ranks = [replace(one, rank=rank) for rank in range(job.gpus_per_node)]
    return shortfall(ranks)
