"""What training costs in memory, before running: model states per ZeRO stage, and activations.

``zerotrain estimate`` (zerotrain/cli.py) prints this module's table. The model-state formula
it uses is :func:`zerotrain.zero.memory.model_state_bytes`, the one ``memory_breakdown()``
reports beside what it measures (see [Note: model states] there).

# [Note: activations]
Korthikanti et al. 2022 (arXiv:2205.05198) §4.1: one transformer layer (micro-batch b, sequence
s, hidden h, a heads, a 4h GeLU MLP, no tensor or sequence parallelism: zerotrain is purely
data-parallel) keeps sbh(34 + 5as/h) bytes for its backward with 16-bit activations, 1-byte
dropout masks and attention that stores its softmax:
  attention: LayerNorm output 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as²b, its dropout
  mask as²b and output 2as²b, output projection input 2sbh, dropout mask sbh (11sbh + 5as²b);
  MLP: input 2sbh, GeLU input 8sbh, second linear's input 8sbh, dropout mask sbh (19sbh);
  the two LayerNorms' inputs: 4sbh.
Here e bytes per activation element (2; 4 in fp32) generalise it, per layer:
  16e·sbh                                 the tensors above, 16 elements per token and channel
  + 2·sbh                                 the two residual dropout masks (dropout > 0)
  + attention: eager   e·as²b (softmax output) + (1 + e)·as²b with dropout (mask, output)
               flash   4·asb, the fp32 log-sum-exp per row and head (fused SDPA kernels keep
                       no s×s matrix; their dropout keeps an RNG seed, no mask)
  + 2 LayerNorms × (mean, rstd) × sb × norm_stats_bytes: 4 on CUDA (fp32 statistics); the
    activation dtype's size on CPU; the paper leaves them out (16/(34h) of a layer at 4 bytes).
e = 2, eager, dropout and no norm statistics give exactly sbh(34 + 5as/h).
Outside the layers: token ids and targets (int64, 16sb), the embedding dropout mask (sbh), the
final LayerNorm's input and statistics, the LM head's input (e·sbh each) and, with a vocabulary
size v, the loss's fp32 log-softmax (4sbv). O(s) terms (position ids) are left out.
Full activation checkpointing (every layer) keeps each layer's input, e·sbh, and recomputes one
layer at a time in the backward: L·e·sbh + outside + one layer's bytes at the peak.
Not counted: activation gradients during the backward, kernel temporaries, a non-4h or gated
MLP (SwiGLU keeps more than GeLU).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from zerotrain.fmt import GiB, count, quantity, scaled
from zerotrain.precision import DTYPES, PrecisionPolicy
from zerotrain.zero.memory import OPTIMIZER_STATE_BYTES, ModelStateBytes, model_state_bytes
from zerotrain.zero.partition import ZeroPolicy
from zerotrain.zero.units import assign_units, find_unit_modules

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "PRECISIONS",
    "ActivationAssumptions",
    "ActivationBytes",
    "ModelStateBytes",
    "ParameterCount",
    "StageEstimate",
    "TrainingJob",
    "TransformerShape",
    "activation_bytes",
    "count_parameters",
    "estimate",
    "figure",
    "format_table",
    "model_state_bytes",
    "plot",
    "to_json",
]

PRECISIONS = DTYPES  # the training dtypes by config name
"""The ``--dtype`` names and the training dtype each stands for."""

_HOST_COLUMN = {"cpu": "CPU/node", "nvme": "NVMe/node"}  # where offload would put its bytes


# -- model states ----------------------------------------------------------------------------
def stage3_gathered_numel(
    *, trainable: float, root_and_largest_block: float, max_live_numel: float
) -> float:
    """Most elements stage 3 holds gathered at once, persistent units included (see
    [Note: model states]): prefetch and reuse stay within ``max_live_numel``; the root unit and
    the unit in use are gathered whatever the bound."""
    return max(min(float(max_live_numel), float(trainable)), float(root_and_largest_block))


# -- activations -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The shape that activation memory depends on (Korthikanti et al.'s b, s, h, L, a, v)."""

    batch_size: int
    """Micro-batch per device (b)."""
    seq_len: int
    """Tokens per sample (s)."""
    hidden_size: int
    """Width of the residual stream (h)."""
    layers: int
    """Transformer layers (L)."""
    heads: int
    """Attention heads (a)."""
    vocab_size: int | None = None
    """Vocabulary (v): adds the loss's fp32 log-softmax, 4·s·b·v bytes; None leaves it out."""


@dataclass(frozen=True, kw_only=True)
class ActivationAssumptions:
    """What the model keeps for its backward beyond Korthikanti et al.'s shape terms."""

    element_bytes: int = 2
    """Bytes per activation element: 2 in bf16/fp16 training, 4 in fp32."""
    attention: Literal["eager", "flash"] = "eager"
    """``eager`` keeps the s×s softmax (the paper's 5as/h term); ``flash`` (fused SDPA kernels)
    keeps an fp32 log-sum-exp per row and head instead."""
    dropout: bool = True
    """Dropout layers with p > 0 keep 1-byte masks (the paper's assumption)."""
    norm_stats_bytes: int = 4
    """Bytes of each LayerNorm mean and rstd per row: 4 on CUDA, the activation dtype's size on
    CPU, 0 to leave them out as the paper does."""


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """Activation bytes per device for one micro-batch (see [Note: activations])."""

    per_layer: float
    """What one layer keeps for its backward."""
    layer_input: float
    """One layer's input, e·sbh: all that a checkpointed layer keeps."""
    outside: float
    """Embeddings, final norm, LM head and loss."""
    layers: int

    @property
    def without_checkpointing(self) -> float:
        """Kept from the end of the forward to the backward."""
        return self.layers * self.per_layer + self.outside

    @property
    def checkpointed_kept(self) -> float:
        """Kept after the forward when every layer is checkpointed."""
        return self.layers * self.layer_input + self.outside

    @property
    def checkpointed_peak(self) -> float:
        """With every layer checkpointed, the peak: one layer recomputed in the backward."""
        return self.checkpointed_kept + self.per_layer


def activation_bytes(
    shape: TransformerShape, assumptions: ActivationAssumptions = ActivationAssumptions()
) -> ActivationBytes:
    """Korthikanti et al.'s per-layer sbh(34 + 5as/h), generalised as [Note: activations] says."""
    b, s, h, a = shape.batch_size, shape.seq_len, shape.hidden_size, shape.heads
    e, drop = assumptions.element_bytes, assumptions.dropout
    sbh, sb = s * b * h, s * b
    if assumptions.attention == "eager":
        attention = a * s * s * b * (e + ((1 + e) if drop else 0))
    elif assumptions.attention == "flash":
        attention = 4 * a * s * b
    else:
        raise ValueError(
            f"ActivationAssumptions.attention: 'eager' or 'flash', got {assumptions.attention!r}"
        )
    norm_stats = 2 * sb * assumptions.norm_stats_bytes  # mean and rstd per row
    per_layer = 16 * e * sbh + (2 * sbh if drop else 0) + attention + 2 * norm_stats
    outside = 16 * sb + (sbh if drop else 0) + 2 * e * sbh + norm_stats
    if shape.vocab_size:
        outside += 4 * sb * shape.vocab_size
    return ActivationBytes(
        per_layer=per_layer, layer_input=e * sbh, outside=outside, layers=shape.layers
    )


# -- a model's parameters --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ParameterCount:
    """A model's parameters as the estimate needs them (tied parameters counted once)."""

    trainable: int
    frozen: int
    largest_layer: int
    """Most parameters held directly by one module (DeepSpeed's ``largest_layer_params``)."""
    root_and_largest_block: int = 0
    """Stage 3: trainable elements of the root unit plus the largest block unit, which are
    gathered together (0: unknown)."""
    persistent: int = 0
    """Stage 3: trainable elements in units below the persistence threshold (kept whole)."""
    config: dict[str, int] = field(default_factory=dict)
    """hidden_size, layers, heads, vocab_size found on the model's HF-like ``.config``."""


# HF-like config attribute names, first match wins (GPT-2 style n_* names included).
_CONFIG_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}


def count_parameters(model: nn.Module, *, persistence_threshold: int) -> ParameterCount:
    """Count ``model``'s parameters (on any device, ``meta`` included) and, for stage 3, its
    gather units as zerotrain would form them (zerotrain/zero/units.py)."""
    params = {id(p): p for p in model.parameters()}.values()  # tied: once
    trainable = [p for p in params if p.requires_grad]
    largest_layer = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    blocks = find_unit_modules(model)
    unit_of = assign_units(model, blocks)
    unit_numel = [0] * (len(blocks) + 1)  # the root unit last
    for param in trainable:
        unit_numel[unit_of[id(param)]] += param.numel()
    config = {}
    model_config = getattr(model, "config", None)
    for key, names in _CONFIG_NAMES.items():
        value = next((getattr(model_config, n) for n in names if hasattr(model_config, n)), None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            config[key] = value
    return ParameterCount(
        trainable=sum(p.numel() for p in trainable),
        frozen=sum(p.numel() for p in params if not p.requires_grad),
        largest_layer=largest_layer,
        root_and_largest_block=unit_numel[-1] + max(unit_numel[:-1], default=0),
        persistent=sum(n for n in unit_numel if 0 < n < persistence_threshold),
        config=config,
    )


# -- one job, every stage --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """The inputs of an estimate: model, hardware, precision, optimizer and batch."""

    trainable_params: int
    """Ψ: parameters with gradients and optimizer state."""
    frozen_params: int = 0
    """Parameters with requires_grad=False: whole on every rank, no gradient, no state."""
    nodes: int = 1
    gpus_per_node: int = 1
    dtype: str = "bf16"
    """``fp32``, ``bf16`` or ``fp16`` (training dtype of parameters, gradients, activations)."""
    optimizer: str = "adam"
    """A key of :data:`OPTIMIZER_STATE_BYTES`."""
    offload: str | None = None
    """None, ``cpu`` or ``nvme``: estimate what offload would move (zerotrain cannot run it)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    largest_layer: int = 0
    """DeepSpeed's largest layer, shown for comparison with its estimator."""
    root_and_largest_block: int = 0
    """Stage 3's always-gathered elements (:attr:`ParameterCount.root_and_largest_block`)."""
    persistent_numel: int = 0
    """Stage 3's elements in units below the persistence threshold (kept whole)."""
    max_live_numel: int
    """``stage3_max_live_parameters`` (zerotrain.zero.optimizer.Stage3Options has the default)."""
    shape: TransformerShape | None = None
    """Activations are estimated only with a shape."""
    attention: Literal["eager", "flash"] = "eager"
    """:attr:`ActivationAssumptions.attention`."""
    dropout: bool = True
    """:attr:`ActivationAssumptions.dropout`."""

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise ValueError(f"--dtype: one of {', '.join(PRECISIONS)}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"--optimizer: one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {self.optimizer!r}"
            )
        if self.offload not in (None, *_HOST_COLUMN):
            raise ValueError(f"--offload: cpu or nvme, got {self.offload!r}")
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
        return PrecisionPolicy(PRECISIONS[self.dtype])

    @property
    def precision_bytes(self) -> int:
        """Bytes per element of parameters, gradients and activations."""
        return PRECISIONS[self.dtype].itemsize

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
    """Frozen parameters (whole on every rank)."""
    gathered: float
    """Stage 3: gathered parameters beyond this rank's shards, during forward and backward."""
    activations: ActivationBytes | None

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
            offload=job.offload is not None,
        )
        gathered = 0.0
        if policy.shard_parameters:
            live = stage3_gathered_numel(
                trainable=job.trainable_params,
                root_and_largest_block=max(job.root_and_largest_block, job.largest_layer),
                max_live_numel=job.max_live_numel,
            )
            gathered = p * max(0.0, live - job.persistent_numel)
        rows.append(
            StageEstimate(
                stage=stage,
                states=states,
                frozen=p * job.frozen_params,
                gathered=gathered,
                activations=act,
            )
        )
    return rows


# -- output ----------------------------------------------------------------------------------
def _fits(row: StageEstimate, device_memory: int, with_activations: bool) -> str:
    if row.peak(checkpointing=False) <= device_memory:
        return "yes"
    if with_activations and row.peak(checkpointing=True) <= device_memory:
        return "with ckpt"
    return "no"


def format_table(
    job: TrainingJob, rows: list[StageEstimate], device_memory: int | None = None
) -> str:
    """The human-readable estimate: inputs, one line per stage (GiB per device), notes."""
    n = job.world_size
    optimizer_bytes = OPTIMIZER_STATE_BYTES[job.optimizer]
    master = 4 if job.precision.has_master_copy else 0
    lines = [
        f"zerotrain estimate: {count(job.trainable_params + job.frozen_params)} parameters "
        f"({count(job.trainable_params)} trainable, {count(job.frozen_params)} frozen), "
        f"{job.dtype}, {job.optimizer} ({master + optimizer_bytes} bytes of optimizer state per "
        f"parameter{' with fp32 masters' if master else ', no master copy'}), "
        f"{job.nodes} node(s) x {job.gpus_per_node} device(s) = {n} ranks",
    ]
    if job.largest_layer:
        lines.append(f"largest layer: {count(job.largest_layer)} parameters")
    if job.shape:
        shape, a = job.shape, job.assumptions
        lines.append(
            f"activations: micro-batch {shape.batch_size} x {shape.seq_len} tokens, hidden "
            f"{shape.hidden_size}, {shape.layers} layers, {shape.heads} heads"
            + (f", vocabulary {shape.vocab_size}" if shape.vocab_size else "")
            + f"; {a.element_bytes}-byte activations, {a.attention} attention, "
            + ("with" if a.dropout else "no")
            + f" dropout: {quantity(activation_bytes(shape, a).per_layer, 'B', prefix='Gi')} per layer"
        )
    if job.offload:
        lines.append(_offload_warning(job.offload))
    lines.append("bytes per device in GiB (2^30 bytes)")
    lines.append("")
    header = ["stage", "params", "grads", "optim", "states", "gathered", "step"]
    if job.shape:
        header += ["act", "act ckpt", "peak", "peak ckpt"]
    else:
        header += ["peak"]
    host = _HOST_COLUMN.get(job.offload or "")
    if host:
        header.append(host)
    if device_memory is not None:
        header.append(f"fits {scaled(device_memory, 'Gi')}GiB")
    table = [header]
    for row in rows:
        cells = [
            str(row.stage),
            scaled(row.states.parameters + row.frozen, "Gi"),
            scaled(row.states.gradients, "Gi"),
            scaled(row.states.optimizer_states, "Gi"),
            scaled(row.model_states, "Gi"),
            scaled(row.gathered, "Gi"),
            scaled(row.states.step_grads, "Gi"),
        ]
        if row.activations is not None:
            cells += [
                scaled(row.activations.without_checkpointing, "Gi"),
                scaled(row.activations.checkpointed_peak, "Gi"),
                scaled(row.peak(checkpointing=False), "Gi"),
                scaled(row.peak(checkpointing=True), "Gi"),
            ]
        else:
            cells.append(scaled(row.peak(checkpointing=False), "Gi"))
        if host:
            cells.append(scaled(row.states.offloaded * job.gpus_per_node, "Gi"))
        if device_memory is not None:
            cells.append(_fits(row, device_memory, row.activations is not None))
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(r, widths, strict=True)))
    lines.append("")
    lines += [
        textwrap.fill(note, 100, initial_indent="- ", subsequent_indent="  ")
        for note in _notes(job, device_memory)
    ]
    return "\n".join(lines)


def _notes(job: TrainingJob, device_memory: int | None) -> list[str]:
    notes = [
        "params: trainable and frozen, training dtype; grads: training dtype; optim: fp32 "
        "masters (16-bit training) + optimizer state; states: their sum.",
        "gathered: stage 3, full units live during forward/backward, at most "
        f"max(stage3_max_live_parameters = {count(job.max_live_numel)}, root unit + largest "
        "block) elements; step: the fp32 gradient copy during a 16-bit optimizer step.",
        "peak = states + max(gathered + activations, step)"
        + ("; act ckpt: every layer checkpointed, one recomputed." if job.shape else "."),
        *(
            [
                "activations: Korthikanti et al. 2022's sbh(34 + 5as/h) bytes per layer (16-bit, "
                "dropout, eager attention), adapted to the assumptions above; a 4h GeLU MLP "
                "assumed (gated MLPs such as SwiGLU keep more)."
            ]
            if job.shape
            else []
        ),
        "not counted: the gradient bucket being reduce-scattered (stages 2-3), kernel "
        "workspaces, the CUDA context, allocator fragmentation: leave headroom.",
    ]
    if not job.shape:
        notes.append(
            "activations not estimated: give --batch-size, --seq-len, --hidden-size, --layers "
            "and --heads (or --model with an HF-like .config)."
        )
    if device_memory is not None:
        notes.append(
            f"fits: peak <= {quantity(device_memory, 'B', prefix='Gi')} ({device_memory} bytes), "
            "no margin; "
            "'with ckpt': only with activation checkpointing."
        )
    if job.offload:
        moved = "the optimizer states" + (
            " (stage 3: and the parameter shards)" if 3 in job.stages else ""
        )
        notes.append(
            f"{_HOST_COLUMN[job.offload]}: what DeepSpeed-style offload would move there, per node "
            f"(devices per node x per rank): {moved}, i.e. fp32 masters, optimizer state and "
            "an fp32 gradient partition for the host's step"
            + (
                "; NVMe offload also needs CPU staging buffers, not counted."
                if job.offload == "nvme"
                else "."
            )
        )
    return notes


def _offload_warning(target: str) -> str:
    return (
        f"offload={target}: zerotrain cannot run offload yet (its config rejects "
        "zero_optimization.offload_optimizer and offload_param); this only estimates it"
    )


def to_json(job: TrainingJob, rows: list[StageEstimate], device_memory: int | None = None) -> dict:
    """The estimate as plain data, in bytes per device."""
    out_rows = []
    for row in rows:
        record = {
            "stage": row.stage,
            "parameters": row.states.parameters,
            "frozen_parameters": row.frozen,
            "gradients": row.states.gradients,
            "optimizer_states": row.states.optimizer_states,
            "model_states": row.model_states,
            "gathered": row.gathered,
            "step_grads": row.states.step_grads,
            "peak": row.peak(checkpointing=False),
        }
        if row.activations is not None:
            record["activations"] = row.activations.without_checkpointing
            record["activations_checkpointed"] = row.activations.checkpointed_peak
            record["peak_checkpointed"] = row.peak(checkpointing=True)
        if job.offload:
            record[f"{job.offload}_per_node"] = row.states.offloaded * job.gpus_per_node
        if device_memory is not None:
            record["fits"] = _fits(row, device_memory, row.activations is not None)
        out_rows.append(record)
    inputs = {
        key: value for key, value in vars(job).items() if key != "shape" and not key.startswith("_")
    }
    inputs["stages"] = list(job.stages)
    if job.shape is not None:
        inputs["shape"] = vars(job.shape)
    out = {
        "inputs": inputs,
        "world_size": job.world_size,
        "device_memory": device_memory,
        "unit": "bytes per device",
        "rows": out_rows,
    }
    if job.offload:
        out["warning"] = _offload_warning(job.offload)
    return out


_SEGMENTS = ("parameters", "gradients", "optimizer states", "gathered / step buffers")
_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#F2B5B5")


def _plot_segments(job: TrainingJob, rows: list[StageEstimate]) -> dict[str, list[float]]:
    """The stacked bar heights in bytes, bottom to top; each stage's bar ends at its peak
    without checkpointing, and the activations-with-checkpointing segment ends at the peak with
    it."""
    names = list(_SEGMENTS)
    if job.shape:
        names += ["activations (checkpointed)", "activations (extra without checkpointing)"]
    segments: dict[str, list[float]] = {name: [] for name in names}
    for row in rows:
        act = row.activations
        kept = act.checkpointed_peak if act else 0.0
        values = [
            row.states.parameters + row.frozen,
            row.states.gradients,
            row.states.optimizer_states,
            row.peak(checkpointing=True) - row.model_states - kept,
        ]
        if act:
            values += [kept, row.peak(checkpointing=False) - row.peak(checkpointing=True)]
        for name, value in zip(names, values, strict=True):
            segments[name].append(value)
    return segments


def figure(job: TrainingJob, rows: list[StageEstimate], device_memory: int | None = None):
    """The table as a matplotlib ``Figure``: stacked bars per stage, GiB per device, a dashed
    line at ``device_memory``. One bar container per segment, one bar per stage.

    Needs matplotlib (``pip install matplotlib``, or zerotrain's ``plot`` extra); raises
    ImportError naming it otherwise."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display
    except ImportError as error:
        raise ImportError(
            "zerotrain estimate --plot needs matplotlib: pip install matplotlib "
            "(or pip install 'zerotrain[plot]')"
        ) from error
    segments = _plot_segments(job, rows)
    labels = [f"stage {row.stage}" for row in rows]
    fig = Figure(figsize=(7, 4.5), dpi=100)
    axes = fig.subplots()
    bottom = [0.0] * len(rows)
    for (name, values), color in zip(segments.items(), _COLORS, strict=False):
        heights = [v / GiB for v in values]
        hatch = "//" if name.startswith("activations (extra") else None
        axes.bar(labels, heights, bottom=bottom, label=name, color=color, hatch=hatch, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if device_memory is not None:
        axes.axhline(
            device_memory / GiB,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"device memory {quantity(device_memory, 'B', prefix='Gi', digits=1)}",
        )
    offload = f", offload={job.offload} (not runnable yet)" if job.offload else ""
    axes.set_title(
        f"{count(job.trainable_params + job.frozen_params)} parameters, {job.dtype}, "
        f"{job.optimizer}, {job.nodes}x{job.gpus_per_node} devices{offload}",
        fontsize=10,
    )
    axes.set_ylabel("GiB per device")
    axes.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot(
    job: TrainingJob, rows: list[StageEstimate], path: str, device_memory: int | None = None
) -> None:
    """Save :func:`figure` to ``path`` (the format from its suffix, e.g. ``.png``)."""
    figure(job, rows, device_memory).savefig(path)
