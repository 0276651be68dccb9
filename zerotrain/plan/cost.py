"""The planner's cost model: per candidate config, the peak memory per rank, the model-state
bytes and the time of an optimizer step, from the model's shape, the estimator
(zerotrain/estimate/) and the machine's measured rates (zerotrain/plan/probe.py).

[Note: the planner's cost model]
Memory per rank: the estimator's model states at the candidate's stage (ZeRO's formula, which
real runs measure exactly) and stage 3's gathered parameters, plus the larger of two transient
phases (:func:`_transient_bytes`), from the activations the model probe counted ([Note: the
model probe]; Korthikanti et al.'s formula where the model cannot be built here):
- the end of the forward: every block's saved activations and the loss's first gradients
  over the logits (:func:`_loss_gradient_bytes`), or with checkpointing the kept block inputs
  and the larger of those gradients and one block's worth, recomputed in the backward;
- at stages 2-3, the backward's reduction: the buckets in flight (the one filling and the one
  before it on the wire: the whole partitioned gradient at stage 2 with DeepSpeed's 5e8-element
  buckets, two gather units at stage 3) beside a block's activations (and the kept inputs).
Plus what communication compression's codecs keep between steps (error feedback, factors,
top-k's counts) and what a training process holds besides (``Corrections.memory_overhead``:
the allocator's arenas, thread stacks, the communicator's buffers). On a CPU-only machine the
device is host memory, so what optimizer offload moves off the device stays in it, less what
is allocated and never touched (:func:`_host_touched`); the model as built is not counted:
``initialize`` adopts or frees its tensors, and building peaks below training (see [Note:
what a trial measures]). Over the fixed configs of bench/plan.py these come within 5% of trials
(bench/README.md).

Step time: compute, the collectives, the optimizer step, each priced on the machine:
- compute: the model probe's forward and backward per micro-batch, the median of its runs as
  a trial reports its median step (with checkpointing, its recomputing backward), times
  ``Corrections.compute_scale``, plus the engine's own work
  (``engine_seconds_per_parameter``: once a step at stages 0-1, whose buckets are worked at
  the accumulation boundary; every micro-batch at 2-3, which reduce in every backward; on a
  GPU ``DEVICE_ENGINE_BYTES`` per parameter at the probed device copy rate instead). Where
  the model cannot be built here: 2 FLOPs per parameter and token forward at the probed
  matmul rate times ``FLOP_EFFICIENCY``, and causal attention's 2·L·s·h per token at the
  probed attention rate, three times for forward and backward, four with checkpointing;
- collectives (:func:`_comm_seconds`): the gradient reduction (at the accumulation boundary at
  stages 0-1, in every backward at 2-3) and the parameters' all-gathers (after the step at
  stages 1-2, in every forward and backward at 3), each on the probed link of its kind, not
  overlapped with compute (gloo on CPU ranks shares their cores); with ``comm_compression``,
  the codecs' own compute and the bytes they send instead ([Note: compression in the plan] in
  zerotrain/plan/compression_cost.py);
- the optimizer step: the config's optimizer over the rank's partition, at the probed
  fused-AdamW rate times its measured ratio to it ([Note: the optimizer's cost] in
  zerotrain/plan/optimizer_cost.py): on a GPU the device's rate, the CPU's for the share
  offload puts on the host; with Muon's matrices to and from the ranks that orthogonalise them; NVMe
  offload adds its working file's reads and writes (master and state, each way) at the probed
  disk rates, shared by the node's ranks, which step at once; on a GPU, offload's copies of
  gradients to the host and parameters back, where they outlast the backward and forward they
  run beside (:func:`_host_copy_seconds`).

Tensor parallelism at degree t: a rank's share of the model ([Note: a tensor-parallel rank's
share] in zerotrain/plan/tensor_share.py) stands for the model in every term above (its
parameters, its measured compute and activations), ZeRO and its collectives run over the
world / t data-parallel ranks, and the share's all-reduces of activations are added to the
collectives (``tensor_parallel_seconds`` in zerotrain/plan/exchanges.py).

Sequence parallelism (Ulysses) at degree sp: every parameter on every rank, ZeRO sharding
them over the data- and sequence-parallel ranks together (``Candidate.shards``), the batch
split over the world / sp data-parallel ranks; compute and activations are a rank's share of
the step as the model probe ran it with Ulysses applied over a group of one rank ([Note: a
sequence-parallel rank's share] in zerotrain/plan/sequence_share.py); the all-to-alls, the
loss's all-reduces and the position check are added to the collectives
(``sequence_parallel_seconds`` there).

Expert parallelism at the degree e the model's MoE layers ask for ([Note: an expert-parallel
rank's share] in zerotrain/plan/expert_share.py): the model counted and probed is a rank's
(its own experts, run on the tokens it routes); ZeRO keeps two shard groups, as the engine
does: the dense parameters over the data-parallel ranks, the experts over the 1/e of them that
hold the same experts (their model states, collectives and optimizer partition each priced
over its own ranks: :func:`_shard_groups`); the tokens' exchanges are added to the collectives
(``expert_parallel_seconds`` there).

A pipeline of p stages ([Note: a pipeline stage's share] in zerotrain/plan/pipeline_share.py):
each stage's parameters stand for the model in the memory terms, with the activations of the
micro-batches 1F1B keeps in flight on it (p on the first stage, one fewer on each next, and
for each the output it sent, until its gradient returns); the peak and the model states are
the largest stage's. The step is 1F1B's over the stages' measured shares: every stage once
(fill and drain), then the slowest stage for each further micro-batch, the engine's own work
inside each backward (a pipeline's engine divides every gradient as it takes it, at any stage);
each micro-batch's activation and gradient crossing a cut, one hop of the probed all-gather
link; the largest stage's data-parallel collectives and optimizer step; and the gradient
all-reduce of the parameters two stages hold (a tied embedding).

``zerotrain plan --verify`` measures the top candidates and moves the two corrections toward
what it measured (``refine`` in zerotrain/plan/planner.py), kept with the machine's probe for
the next run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import torch

from zerotrain.comm.communicator import ring_sent
from zerotrain.config import ConfigError, ZeroTrainConfig, check_config
from zerotrain.config.schema import TiledComputeConfig
from zerotrain.estimate import TrainingJob, TransformerShape, estimate
from zerotrain.estimate.model import ParameterCount
from zerotrain.estimate.preflight import config_job
from zerotrain.estimate.stages import StageEstimate, host_share, largest_bucket
from zerotrain.optim.registry import find_optimizer
from zerotrain.plan.candidates import Candidate, section
from zerotrain.plan.compression_cost import CompressionProfile, compressed_seconds
from zerotrain.plan.exchanges import (
    expert_parallel_seconds,
    sequence_parallel_seconds,
    tensor_parallel_seconds,
)
from zerotrain.plan.expert_share import ExpertShare
from zerotrain.plan.model_probe import ModelProfile
from zerotrain.plan.optimizer_cost import ADAMW, OptimizerCost
from zerotrain.plan.pipeline_share import PipelineShare
from zerotrain.plan.probe import Machine
from zerotrain.plan.sequence_share import SequenceShare
from zerotrain.plan.tensor_share import TensorShare
from zerotrain.zero.compression_options import compression_policies
from zerotrain.zero.memory import ModelStateBytes
from zerotrain.zero.nvme import sub_group_numel
from zerotrain.zero.offload import HostBytes
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.whole_matrices import ROUND_NUMEL

__all__ = [
    "Corrections",
    "ModelFacts",
    "Prediction",
    "predict",
    "typed_config",
    "unpriced",
]


FLOP_EFFICIENCY = 0.6
"""Without a model profile: the share of the probed square-matmul rate a model's forward and
backward reach (0.54-0.74 for the GPTs of examples/gpt on this CPU)."""


@dataclass(frozen=True)
class Corrections:
    """The cost model's constants that measurements refine (see [Note: the planner's cost
    model])."""

    compute_scale: float = 1.0
    """Measured compute over predicted (the model probe's, or the FLOP count's)."""
    memory_overhead: float = 7e6
    """What a training process holds besides model states and activations: the allocator's
    arenas, thread stacks, the communicator's buffers (3-6 MB for the demo GPT on this CPU,
    14-21 MB for the 30M GPT and the Llama of bench/plan.py; a trial counts no library pages:
    [Note: what a trial measures] in zerotrain/plan_trial.py)."""
    engine_seconds_per_parameter: float = 5e-9
    """The engine's own work per parameter and pass over the buckets (copies, hooks): once a
    step at stages 0-1, every micro-batch at 2-3."""
    verified: int = 0
    """Trials they were refined from."""


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model needs of the model: its parameters (``count``) and shape."""

    count: ParameterCount
    seq_len: int
    dtype: str
    attention: str = "flash"
    """``flash`` (fused SDPA kernels: no s x s matrix kept) or ``eager``."""
    dropout: bool = False
    profile: ModelProfile | None = None
    """Measured compute and activations, where the model could be built here."""
    shares: dict[int, TensorShare] = field(default_factory=dict)
    """Tensor-parallel degree (> 1) -> rank 0's share of the model, for each that splits it."""
    pipelines: dict[int, PipelineShare] = field(default_factory=dict)
    """Pipeline degree (> 1) -> the model cut into that many stages, where it was cut and
    profiled here."""
    sequences: dict[int, SequenceShare] = field(default_factory=dict)
    """Sequence-parallel degree (> 1) -> a rank's share of a step, for each at which Ulysses
    can share the model's attention."""
    optimizer: OptimizerCost = ADAMW
    """The optimizer the planned configs train with (their ``optimizer`` section)."""
    experts: ExpertShare | None = None
    """The model's zerotrain.moe experts, where it has MoE layers."""
    compression: CompressionProfile | None = None
    """The base config's communication compression, where it has some ([Note: compression in
    the plan] in zerotrain/plan/compression_cost.py)."""

    def shape(self, micro_batch: int, tp: int = 1) -> TransformerShape | None:
        """The shape Korthikanti's formula takes; at tensor-parallel degree ``tp`` a rank's
        heads and MLP width (its attention and MLP tensors split; the rest counted whole, which
        over-counts the few that are split too)."""
        config = self.count.config
        if not {"hidden_size", "layers", "heads"} <= set(config):
            return None
        hidden = config["hidden_size"]
        return TransformerShape(
            batch_size=micro_batch,
            seq_len=self.seq_len,
            hidden_size=hidden,
            layers=config["layers"],
            heads=max(1, config["heads"] // tp),
            vocab_size=config.get("vocab_size"),
            intermediate_size=config.get("intermediate_size", 4 * hidden) // tp,
            mlp=self.count.mlp or "gelu",
        )

    def share(self, tp: int, sp: int = 1) -> tuple[ParameterCount, ModelProfile | None]:
        """A rank's parameters and measured profile at tensor-parallel degree ``tp`` (or at
        sequence-parallel degree ``sp``, which holds every parameter)."""
        if sp > 1:
            return self.count, self.sequences[sp].profile
        if tp == 1:
            return self.count, self.profile
        share = self.shares[tp]
        return share.count, share.profile

    def tokens(self, sp: int = 1) -> int:
        """Tokens of each sample a rank holds at sequence-parallel degree ``sp``."""
        return self.sequences[sp].tokens if sp > 1 else self.seq_len

    def attention_flops_per_token(self) -> float:
        """Causal attention's forward FLOPs per token: 2·L·s·h (the two products, halved)."""
        config = self.count.config
        return 2 * config.get("layers", 0) * self.seq_len * config.get("hidden_size", 0)


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted cost; the step is the sum of the four ``*_s`` parts."""

    peak_memory_bytes: int
    model_state_bytes: int
    step_time_s: float
    compute_s: float
    engine_s: float
    comm_s: float
    optimizer_s: float
    host_memory_bytes: int = 0
    """On a GPU, the host memory a rank's offload holds (host masters, state and gradients, the
    pinned buffers, stage 3's parameter shards): the preflight's count, which the node's host
    must have besides its devices; 0 without offload, and on a CPU-only machine, where it is
    in the peak."""
    disk_bytes: int = 0
    """With NVMe offload, a rank's working files under ``nvme_path``."""

    @property
    def bound(self) -> str:
        """What the step's time is mostly: ``compute``, ``link`` or ``optimizer``."""
        parts = {"compute": self.compute_s, "link": self.comm_s, "optimizer": self.optimizer_s}
        return max(parts, key=lambda k: parts[k])

    def as_dict(self) -> dict:
        return asdict(self)


def _job(
    candidate: Candidate,
    facts: ModelFacts,
    cfg: ZeroTrainConfig,
    count: ParameterCount,
    machine: Machine,
) -> TrainingJob:
    """The estimator's job for ``candidate``: a rank's share of the model (``count``: its
    tensor-parallel share, or its pipeline stage's) over the data-parallel ranks, trained as
    its config ``cfg`` says (precision, optimizer, offload and their sizes), as ``initialize``'s
    memory preflight reads a config (zerotrain/estimate/preflight.py)."""
    optimizer = facts.optimizer
    job = config_job(
        count,
        cfg,
        optimizer=(optimizer.kind, optimizer.state_bytes_of(count)),
        data_parallel=candidate.shards,
        device=torch.device("cpu" if machine.device == "cpu" else "cuda"),  # device: its name
        shape=facts.shape(candidate.micro_batch, candidate.tp),
        attention=facts.attention,
        dropout=facts.dropout,
    )
    if job is None:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device: {optimizer.name} needs whole "
            "parameters, which NVMe offload steps in sub-groups; offload to cpu instead"
        )
    return job


COMPRESSING_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam")
"""Optimizers that compress their own exchange of gradients (zerotrain/optim/onebit.py)."""


def unpriced(cfg: ZeroTrainConfig, facts: ModelFacts, device: str = "cpu") -> list[str]:
    """What ``cfg`` (a plan's base config) and the model of ``facts`` turn on that the cost
    model leaves out on ``device`` (``Machine.device``), each with its key and how it is
    priced instead (docs/plan.md, "Keeping your own keys")."""
    out = []
    compression = cfg.comm_compression
    if facts.compression is None and compression_policies(cfg):
        out.append("comm_compression: the collectives are priced at full width")
    if compression.hierarchical_partition:
        out.append("comm_compression.hierarchical_partition: priced without hpZ's partition")
    spec = find_optimizer(cfg.optimizer.type) if cfg.optimizer is not None else None
    if spec is not None and spec.name in COMPRESSING_OPTIMIZERS:
        out.append(f"{spec.name}'s compressed exchange: priced as the uncompressed collectives")
    if facts.experts is not None and (cfg.moe.token_dedup or cfg.moe.overlap_chunks > 1):
        out.append(
            "moe.token_dedup, moe.overlap_chunks: the experts' exchanges are priced whole, "
            "after compute"
        )
    checkpointing = cfg.activation_checkpointing
    # on a CPU device the kept inputs are in host memory already: nothing moves
    if checkpointing is not None and checkpointing.cpu_checkpointing and device != "cpu":
        out.append(
            "activation_checkpointing.cpu_checkpointing: the kept inputs are priced on the device"
        )
    if cfg.lora_fa.enabled:
        out.append("lora_fa: every parameter is priced as trained (no adapters)")
    if cfg.torch_autocast.enabled:
        out.append("torch_autocast: compute and activations are priced in the parameters' dtype")
    return out


def typed_config(config: dict, facts: ModelFacts) -> ZeroTrainConfig:
    """A candidate's ds_config, checked and typed as ``initialize`` reads it (HF's "auto"
    values left out); ValueError where its optimizer is not the one ``facts`` price
    (:func:`zerotrain.plan.planner.with_optimizer` reads it)."""
    for key in ("bf16", "fp16"):  # HF's "auto" precision: the dtype the facts were made in
        if section(config, key).get("enabled") == "auto":
            config = {**config, key: {**config[key], "enabled": facts.dtype == key}}
    cfg = check_config(config, unfilled=True)
    named = cfg.optimizer.type if cfg.optimizer is not None else None
    spec = find_optimizer(named) if named else None
    if spec is not None and spec.name != facts.optimizer.name:
        raise ValueError(
            f"the config's optimizer is {spec.name}, the model facts price "
            f"{facts.optimizer.name}: read it with zerotrain.plan.planner.with_optimizer"
        )
    return cfg


def predict(
    candidate: Candidate,
    facts: ModelFacts,
    machine: Machine,
    corrections: Corrections,
    config: dict,
) -> Prediction:
    """``candidate``'s cost on ``machine`` (see [Note: the planner's cost model]), trained as
    its ds_config ``config`` says (:func:`typed_config`)."""
    cfg = typed_config(config, facts)
    if candidate.pp > 1:
        return _predict_pipeline(candidate, facts, machine, corrections, cfg)
    count, profile = facts.share(candidate.tp, candidate.sp)
    job = _job(candidate, facts, cfg, count, machine)
    (row,) = estimate(job)
    if facts.experts is not None:
        row = _with_expert_group(row, job, candidate, facts.experts)
    psi = count.trainable
    element = 2 if facts.dtype in ("bf16", "fp16") else 4
    checkpointing = candidate.activation_checkpointing
    measured = profile.micro_batches.get(candidate.micro_batch) if profile else None
    if measured is not None and profile is not None:
        kept = measured.checkpointed_saved_bytes if checkpointing else measured.saved_bytes
        # a checkpointed backward recomputes one block at a time: at least the largest one's
        layer = max(measured.saved_bytes / max(1, profile.layers), measured.largest_block_bytes)
        per_micro = (
            measured.checkpointed_forward_backward_s
            if checkpointing
            else measured.forward_backward_s
        )
        compute = candidate.accumulation * per_micro
    else:
        act = row.activations
        kept = (act.checkpointed_kept if checkpointing else act.without_checkpointing) if act else 0
        layer = act.per_layer if act else 0
        # per token a rank holds, attention over the whole sequence (with 1/sp of the heads)
        tokens = candidate.micro_batch * candidate.accumulation * facts.tokens(candidate.sp)
        passes = (4 if checkpointing else 3) * tokens
        compute = passes * (
            2 * psi / (machine.matmul_flops * FLOP_EFFICIENCY)
            + facts.attention_flops_per_token() / candidate.tp / machine.attention_flops
        )
    transient = _transient_bytes(
        candidate,
        job,
        kept,
        layer,
        element,
        machine.device == "cpu",
        _loss_gradient_bytes(candidate, facts, cfg.tiled_compute, element),
    )
    memory = row.peak_with(transient)
    compute *= corrections.compute_scale
    engine = _engine_seconds(candidate, psi, corrections, machine)
    memory += corrections.memory_overhead
    if machine.device == "cpu":  # the device is host memory: what offload moves stays in it
        memory += _host_touched(row.host, job, candidate, facts) if row.host is not None else 0
    host = _host_beside_device(row, machine)
    groups = _shard_groups(candidate, psi, facts)
    comm, codec_state = _comm_seconds(candidate, groups, element, machine, facts.compression)
    memory += codec_state
    tokens = facts.tokens(candidate.sp)
    if facts.experts is not None:
        comm += expert_parallel_seconds(candidate, facts.experts, tokens, element, machine)
    if candidate.tp > 1:
        share = facts.shares[candidate.tp]
        comm += tensor_parallel_seconds(candidate, share, tokens, element, machine)
    if candidate.sp > 1:
        share = facts.sequences[candidate.sp]
        comm += sequence_parallel_seconds(candidate, share, element, machine)
    optimizer = _optimizer_seconds(candidate, job, count, facts, machine)
    optimizer += _host_copy_seconds(
        candidate, job, facts, compute / candidate.accumulation, machine
    )
    return Prediction(
        peak_memory_bytes=int(memory),
        model_state_bytes=int(row.model_states),
        step_time_s=compute + engine + comm + optimizer,
        compute_s=compute,
        engine_s=engine,
        comm_s=comm,
        optimizer_s=optimizer,
        host_memory_bytes=host,
        disk_bytes=row.disk,
    )


def _host_beside_device(row: StageEstimate, machine: Machine) -> int:
    """See ``Prediction.host_memory_bytes``."""
    if machine.device == "cpu":
        return 0
    return int((row.host.total if row.host is not None else 0) + row.param_host)


def _engine_seconds(
    candidate: Candidate, psi: int, corrections: Corrections, machine: Machine
) -> float:
    """The engine's own work over a rank's ``psi`` parameters: once a step at stages 0-1 (the
    boundary's buckets), every micro-batch at 2-3 (each backward's reduce-scatter)."""
    passes = 1 if candidate.stage < 2 else candidate.accumulation
    return passes * psi * _engine_seconds_per_parameter(corrections, machine)


DEVICE_ENGINE_BYTES = 28.0
"""On a GPU, the bytes per parameter the engine's own kernels read and write in a pass (the
gradient into its bucket and out as fp32, its norm, clipping's scaling, the parameter from its
master after the step), at the probed device copy rate."""


def _engine_seconds_per_parameter(corrections: Corrections, machine: Machine) -> float:
    if machine.device_copy_bytes_per_s:  # a GPU: device kernels, not the host's loops
        return DEVICE_ENGINE_BYTES / machine.device_copy_bytes_per_s
    return corrections.engine_seconds_per_parameter


def _optimizer_seconds(
    candidate: Candidate,
    job: TrainingJob,
    count: ParameterCount,
    facts: ModelFacts,
    machine: Machine,
) -> float:
    """The optimizer step over a rank's partition of ``job``'s trainable elements (``count``'s
    parameters: the model's, a tensor-parallel share's or a stage's): the config's
    optimizer at the probed fused-AdamW rate (the device's, the CPU's for what offload puts on
    the host), scaled ([Note: the optimizer's cost] in zerotrain/plan/optimizer_cost.py), and
    with NVMe offload its working file (the masters and the state of the offloaded share) read
    and written, the disk shared by the node's ranks."""
    partition = _optimizer_partition(candidate, job, facts)
    hosted = _hosted_elements(candidate, job, facts) if candidate.offload else 0.0
    # a GPU steps what is not offloaded itself; a CPU-only machine's device is its CPU
    device_rate = machine.device_adam_elements_per_s or machine.cpu_adam_rate(partition - hosted)
    seconds = facts.optimizer.step_seconds(
        partition - hosted,
        count=count,
        adam_rate=device_rate,
        matmul_flops=machine.matmul_flops,
        ranks=1 if candidate.stage == 0 else candidate.shards,
    )
    seconds += facts.optimizer.elementwise_seconds(hosted, machine.cpu_adam_rate(hosted))
    if candidate.offload == "nvme" and machine.disk_read_bytes_per_s:
        precision = job.precision
        per_element = precision.master_dtype.itemsize + precision.stored_state_bytes(
            job.state_bytes
        )
        state = _hosted_elements(candidate, job, facts) * per_element
        write = machine.disk_write_bytes_per_s or machine.disk_read_bytes_per_s
        # the node's ranks step at once, sharing its disk (the 2-rank NVMe rows of bench/plan.py
        # were 18-31% under without it: bench/README.md)
        sharing = max(1, min(candidate.world, machine.world))
        seconds += sharing * (state / machine.disk_read_bytes_per_s + state / write)
    if facts.optimizer.kind == "muon":
        seconds += _muon_exchange_seconds(candidate, count, job, machine)
    return seconds


def _shard_groups(candidate: Candidate, psi: int, facts: ModelFacts) -> list[tuple[int, int]]:
    """Of a rank's ``psi`` trainable elements, each shard group's and the ranks ZeRO shards it
    over: the dense parameters over ``Candidate.shards``, a model's experts over the
    data-parallel ranks holding the same experts (zerotrain/parallel/layout.py makes the two
    groups)."""
    experts = facts.experts
    if experts is None or not experts.trainable:
        return [(psi, candidate.shards)]
    return [
        (psi - experts.trainable, candidate.shards),
        (experts.trainable, experts.shards(candidate.dp)),
    ]


def _with_expert_group(
    row: StageEstimate, job: TrainingJob, candidate: Candidate, experts: ExpertShare
) -> StageEstimate:
    """``row`` with the model states of the two shard groups a model with experts trains
    with: the dense parameters over ``Candidate.shards``, the experts over their own ranks
    (:func:`_shard_groups`)."""
    if not experts.trainable:
        return row
    (dense,) = estimate(
        replace(
            job,
            trainable_params=job.trainable_params - experts.trainable,
            frozen_params=job.frozen_params - experts.frozen,
        )
    )
    (own,) = estimate(
        replace(
            job,
            trainable_params=experts.trainable,
            frozen_params=experts.frozen,
            nodes=1,
            gpus_per_node=experts.shards(candidate.dp),
            persistent_numel=0,
            persistent_frozen=0,
        )
    )
    states = ModelStateBytes(
        **{
            f.name: getattr(dense.states, f.name) + getattr(own.states, f.name)
            for f in fields(ModelStateBytes)
        }
    )
    return replace(row, states=states, frozen=dense.frozen + own.frozen)


def _optimizer_partition(candidate: Candidate, job: TrainingJob, facts: ModelFacts) -> int:
    """A rank's share of ``job``'s trainable elements that its optimizer steps: all of them at
    stage 0, ⌈Ψ/N⌉ of each shard group over the N ranks ZeRO shards it over at stages 1-3
    (:func:`_shard_groups`)."""
    groups = _shard_groups(candidate, job.trainable_params, facts)
    return sum(n if candidate.stage == 0 else -(-n // ranks) for n, ranks in groups)


def _hosted_elements(candidate: Candidate, job: TrainingJob, facts: ModelFacts) -> float:
    """The elements of a rank's optimizer partition that offload puts on the host."""
    policy = ZeroPolicy.for_stage(candidate.stage)
    return _optimizer_partition(candidate, job, facts) * host_share(job, policy)


def _muon_exchange_seconds(
    candidate: Candidate, count: ParameterCount, job: TrainingJob, machine: Machine
) -> float:
    """Muon's matrices on their way to the data-parallel rank that orthogonalises each and back
    ([Note: whole matrices on shards] in zerotrain/zero/whole_matrices.py), on the probed
    all-to-all link, in rounds of ``ROUND_NUMEL`` elements: on shards (stages 1-3) a rank sends
    each owner its pieces of the owner's matrices, about (N-1)/N of its 1/N, and gets the
    results back (two all-to-alls a round); at stage 0 each owner sends the results of its 1/N
    of the matrices to every other rank (one)."""
    n, elements = candidate.shards, count.muon_matrices
    link = machine.links.get("all_to_all")
    if n == 1 or not elements or link is None:
        return 0.0
    nbytes = elements * job.precision.master_dtype.itemsize  # the updates, as the masters
    rounds = -(-elements // ROUND_NUMEL)
    if candidate.stage == 0:
        exchanges, sent = 1, nbytes / n * (n - 1)
    else:
        exchanges, sent = 2, nbytes / n * (n - 1) / n
    return exchanges * rounds * link.seconds("all_to_all", int(sent / rounds), n)


def _host_copy_seconds(
    candidate: Candidate,
    job: TrainingJob,
    facts: ModelFacts,
    micro_batch_s: float,
    machine: Machine,
) -> float:
    """Optimizer offload's copies between the device and host memory, at the probed pinned
    copy rate (CUDA only: a CPU-only machine's device is host memory). At the accumulation
    boundary each host bucket's gradient goes to its fp32 host buffer as the backward reduces
    it, and after the step its parameters come back in the training dtype before the next
    forward uses them ([Note: the offload hand-off] in zerotrain/zero/offload.py): each copy
    runs beside compute (the gradients beside the backward, two thirds of a micro-batch's
    ``micro_batch_s``; the parameters beside the forward, a third), and what outlasts it is
    priced."""
    if candidate.offload is None or machine.device == "cpu" or not machine.copy_bytes_per_s:
        return 0.0
    hosted = _hosted_elements(candidate, job, facts)
    precision, rate = job.precision, machine.copy_bytes_per_s
    gradients = hosted * precision.master_dtype.itemsize / rate
    parameters = hosted * precision.param_dtype.itemsize / rate
    return max(0.0, gradients - 2 * micro_batch_s / 3) + max(0.0, parameters - micro_batch_s / 3)


def _predict_pipeline(
    candidate: Candidate,
    facts: ModelFacts,
    machine: Machine,
    corrections: Corrections,
    cfg: ZeroTrainConfig,
) -> Prediction:
    """A pipeline candidate's cost (:func:`predict` per stage, run under 1F1B: see [Note: the
    planner's cost model]): the largest stage's memory and model states, and the step of the
    schedule over the stages' measured shares."""
    share = facts.pipelines[candidate.pp]
    stages = share.stages[candidate.micro_batch]
    element = 2 if facts.dtype in ("bf16", "fp16") else 4
    micro_batches, p = candidate.accumulation, candidate.pp
    crossing = candidate.micro_batch * facts.seq_len * share.boundary_elements * element
    memory = states = comm = optimizer = host = disk = 0.0
    work = []  # per stage, a micro-batch's forward and backward
    own = []  # per stage, the engine's work in each of them (every gradient divided as taken)
    for index, (count, stage) in enumerate(zip(share.counts, stages, strict=True)):
        job = _job(candidate, facts, cfg, count, machine)
        (row,) = estimate(job)
        # 1F1B: stage k holds the activations of up to p - k micro-batches, and (but the last)
        # the output it sent for each, until its gradient comes back
        sent = crossing if index < p - 1 else 0
        kept = min(p - index, micro_batches) * (stage.saved_bytes + sent)
        layer = stage.saved_bytes / max(1, share.blocks // p)
        cpu = machine.device == "cpu"
        tiles = cfg.tiled_compute
        last = _loss_gradient_bytes(candidate, facts, tiles, element) if index == p - 1 else 0.0
        held = row.peak_with(_transient_bytes(candidate, job, kept, layer, element, cpu, last))
        if cpu and row.host is not None:
            held += _host_touched(row.host, job, candidate, facts)
        host, disk = max(host, _host_beside_device(row, machine)), max(disk, row.disk)
        states = max(states, row.model_states)
        psi = count.trainable
        own.append(psi * _engine_seconds_per_parameter(corrections, machine))
        groups = _shard_groups(candidate, psi, facts)
        priced, codec_state = _comm_seconds(candidate, groups, element, machine, facts.compression)
        memory = max(memory, held + codec_state + corrections.memory_overhead)
        comm = max(comm, priced)
        work.append((stage.forward_s + stage.backward_s) * corrections.compute_scale)
        stepped = _optimizer_seconds(candidate, job, count, facts, machine)
        optimizer = max(
            optimizer, stepped + _host_copy_seconds(candidate, job, facts, work[-1], machine)
        )
    compute = _one_f_one_b(work, micro_batches)
    # the engine's work sits in each stage's backward, on the schedule's path
    engine = _one_f_one_b([w + e for w, e in zip(work, own, strict=True)], micro_batches) - compute
    # each micro-batch's activation and its gradient on the way
    messages = 2 * (micro_batches + p - 2)
    comm += messages * _point_to_point_seconds(crossing, machine)
    if share.shared_elements:  # a parameter several stages hold: its gradient summed over them
        link = machine.links.get("all_reduce")
        if link is not None:
            volume = share.shared_elements * element
            comm += link.seconds("all_reduce", ring_sent("all_reduce", volume, 2), 2)
    return Prediction(
        peak_memory_bytes=int(memory),
        model_state_bytes=int(states),
        step_time_s=compute + engine + comm + optimizer,
        compute_s=compute,
        engine_s=engine,
        comm_s=comm,
        optimizer_s=optimizer,
        host_memory_bytes=int(host),
        disk_bytes=int(disk),
    )


def _one_f_one_b(work: list[float], micro_batches: int) -> float:
    """1F1B's span over stages that each take ``work[k]`` a micro-batch: every stage once (fill
    and drain), then the slowest stage for each further micro-batch."""
    return sum(work) + (micro_batches - 1) * max(work)


def _point_to_point_seconds(nbytes: float, machine: Machine) -> float:
    """A message from one rank to a neighbour: one hop of the probed all-gather's link."""
    link = machine.links.get("all_gather")
    return link.seconds("all_gather", int(nbytes), 2) if link is not None else 0.0


def _transient_bytes(
    candidate: Candidate,
    job: TrainingJob,
    kept: float,
    layer: float,
    element: int,
    host_device: bool,
    loss_gradient: float = 0.0,
) -> float:
    """The larger of a step's two transient phases above the model states (and stage 3's
    gathered parameters): the end of the forward and the backward's first steps, with ``kept``
    activation bytes and the ``loss_gradient`` (:func:`_loss_gradient_bytes`; with
    checkpointing, the block inputs, and then one block's ``layer`` bytes being recomputed); and,
    at stages 2-3, the backward's reduction, with the buckets in flight (the one filling, the
    one before it on the wire) while a block is recomputed. On a CPU (``host_device``) a
    bucket's buffer, left uninitialised, becomes resident page by page as its gradients are
    written, while the recomputation frees the kept inputs block by block: the two meet where
    the buckets in flight are written, all the gradients' bytes with one bucket for the whole
    model (the inputs are gone by then: trials of the demo GPT at stage 2 read 6.5 MB under a
    prediction that held them), a small part of them with stage 3's bucket per block (the
    inputs still there). With one rank the reduction is a copy at the backward's end, when
    the inputs are gone."""
    checkpointing = candidate.activation_checkpointing
    forward = kept + (max(layer, loss_gradient) if checkpointing else loss_gradient)
    if candidate.stage < 2:
        return forward
    policy = ZeroPolicy.for_stage(candidate.stage)
    bucket = largest_bucket(job, policy)
    in_flight = min(2, -(-job.trainable_params // max(1, bucket))) * bucket * element
    if not checkpointing or (host_device and candidate.shards == 1):
        backward = layer + in_flight  # one rank's reduction: a copy at the backward's end
    elif host_device:
        grads = job.trainable_params * element
        written = min(1.0, in_flight / max(1, grads))  # of the backward, when they are full
        backward = layer + kept + written * max(0.0, grads - kept)
    else:
        backward = kept + layer + in_flight
    return max(forward, backward)


def _loss_gradient_bytes(
    candidate: Candidate, facts: ModelFacts, tiles: TiledComputeConfig, element: int
) -> float:
    """The language-model loss's first gradients: over the logits of a micro-batch's tokens (a
    rank's share of them under sequence parallelism), the loss's gradient and the log-softmax's,
    in fp32, live together before the output layer's backward frees them (33 MB for the
    Llama of bench/plan.py at 512 tokens and a vocabulary of 8000; its rows were 16% under
    without them). With ``tiles.loss`` the fused loss (zerotrain/sequence/tiled.py) computes
    the gradients in the forward, a tile at a time: one tile's logits, their softmax and its
    gradient (fp32), beside the gradients it keeps for the backward, of the hidden states and
    of the output layer's weight (``element`` bytes each)."""
    from zerotrain.sequence.hf import loss_tile_tokens

    vocab = facts.count.config.get("vocab_size") or 0
    tokens = candidate.micro_batch * facts.tokens(candidate.sp)
    if not tiles.loss or not vocab:
        return 2 * tokens * vocab * 4
    tile = min(tokens, loss_tile_tokens(vocab, tiles.loss_tile_tokens))
    kept = (tokens + vocab) * facts.count.config.get("hidden_size", 0) * element
    return 3 * tile * vocab * 4 + kept


def _host_touched(
    host: HostBytes, job: TrainingJob, candidate: Candidate, facts: ModelFacts
) -> float:
    """The host bytes of optimizer offload that become resident on a CPU device: not the
    transfer ring (copies to a CPU device skip it), and of NVMe's staging sets only those that
    sub-groups pass through (with fewer sub-groups than sets, the others are never touched)."""
    held = host.total - host.staging
    if candidate.offload != "nvme":
        return held
    partition = _optimizer_partition(candidate, job, facts)
    size = min(
        sub_group_numel(job.sub_group_size),
        -(-largest_bucket(job, ZeroPolicy.for_stage(candidate.stage)) // candidate.shards),
    )
    sets = max(1, job.buffer_count)
    return held * min(sets, -(-partition // max(1, size))) / sets


def _comm_seconds(
    candidate: Candidate,
    groups: list[tuple[int, int]],
    element: int,
    machine: Machine,
    compression: CompressionProfile | None,
) -> tuple[float, int]:
    """The step's collectives of each shard group, (elements, ranks) of ``groups``
    (:func:`_shard_groups`), over the ranks ZeRO shards it over, on the probed links ([Note:
    the three reductions] in zerotrain/zero/reduce.py): stage 0 all-reduces at the
    accumulation boundary; stage 1 reduce-scatters there; stages 2-3 reduce-scatter in every
    backward; stages 1-2 all-gather the updated parameters after the step, stage 3 gathers
    them in every forward and backward. Compressed as ``compression`` measured ([Note:
    compression in the plan]); with the bytes its codecs keep."""
    micro = candidate.accumulation
    collective = "all_reduce" if candidate.stage == 0 else "reduce_scatter"
    reductions = micro if candidate.stage >= 2 else 1
    gathers = 2 * micro if candidate.stage == 3 else 0 if candidate.stage == 0 else 1
    if compression is not None:
        counts = {collective: reductions, "all_gather": gathers}
        seconds, state, _ = compressed_seconds(compression, counts, groups, machine.links)
        return seconds, state
    if not machine.links:
        return 0.0, 0

    def cost(op: str, psi: int, world: int) -> float:
        return machine.links[op].seconds(op, ring_sent(op, psi * element, world), world)

    seconds = 0.0
    for psi, world in groups:
        if world > 1:
            seconds += reductions * cost(collective, psi, world)
            seconds += gathers * cost("all_gather", psi, world) if gathers else 0.0
    return seconds, 0
