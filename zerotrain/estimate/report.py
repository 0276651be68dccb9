"""The estimate for people and programs: the ``zerotrain estimate`` table with its notes, and
the same numbers as JSON."""

from __future__ import annotations

import textwrap

from zerotrain.estimate.activations import (
    ActivationAssumptions,
    TransformerShape,
    activation_bytes,
)
from zerotrain.estimate.stages import (
    StageEstimate,
    TrainingJob,
    host_memory_shortfall,
    largest_bucket,
)
from zerotrain.fmt import count, quantity, scaled
from zerotrain.zero.nvme import SUB_GROUP_ALIGNMENT, sub_group_numel
from zerotrain.zero.offload import RING_CHUNK
from zerotrain.zero.policy import ZeroPolicy

__all__ = ["format_table", "to_json"]


# The fits verdict where activations were not estimated: the peak without them fits, and
# whether the activations fit too is unknown ("yes" would claim more than the table knows).
FITS_WITHOUT_ACTIVATIONS = "yes w/o act"


def _fits(row: StageEstimate, device_memory: int) -> str:
    if row.peak(checkpointing=False) <= device_memory:
        return "yes" if row.activations is not None else FITS_WITHOUT_ACTIVATIONS
    if row.activations is not None and row.peak(checkpointing=True) <= device_memory:
        return "with ckpt"
    return "no"


def _host_fits(job: TrainingJob, row: StageEstimate, host_memory: int) -> str:
    return "no" if host_memory_shortfall(job, row, host_memory) else "yes"


def format_table(
    job: TrainingJob,
    rows: list[StageEstimate],
    device_memory: int | None = None,
    host_memory: int | None = None,
) -> str:
    """The human-readable estimate: inputs, one line per stage (GiB per device; with offload,
    GiB per node off the device), notes. ``host_memory``: a node's available host memory, for
    the preflight's verdict."""
    n = job.world_size
    precision = job.precision
    optimizer_bytes = precision.stored_state_bytes(job.state_bytes)
    master = precision.master_dtype.itemsize if precision.has_master_copy else 0
    masters = f" with {job.master_dtype} masters" if master else ", no master copy"
    state = f" in {job.optimizer_state_dtype}" if job.optimizer_state_dtype != "fp32" else ""
    lines = [
        f"zerotrain estimate: {count(job.trainable_params + job.frozen_params)} parameters "
        f"({count(job.trainable_params)} trainable, {count(job.frozen_params)} frozen), "
        f"{job.dtype}, {job.optimizer} ({master + optimizer_bytes:.3g} bytes of optimizer state"
        f"{state} per parameter{masters}), "
        f"{job.nodes} node(s) x {job.gpus_per_node} device(s) = {n} ranks",
    ]
    if job.largest_layer:
        lines.append(f"largest layer: {count(job.largest_layer)} parameters")
    if job.shape:
        shape, a = job.shape, job.assumptions
        lines.append(
            f"activations: micro-batch {shape.batch_size} x {shape.seq_len} tokens, hidden "
            f"{shape.hidden_size}, {shape.mlp} MLP {shape.mlp_width}, {shape.layers} layers, "
            f"{shape.heads} heads"
            + (f", vocabulary {shape.vocab_size}" if shape.vocab_size else "")
            + f"; {a.element_bytes}-byte activations, {a.attention} attention, "
            + ("with" if a.dropout else "no")
            + f" dropout: {quantity(activation_bytes(shape, a).per_layer, 'B', prefix='Gi')} per layer"
        )
    if job.offload:
        lines.append(
            f"offload_optimizer: {job.offload}, ratio 1, buffer_count {job.buffer_count}"
            + (f", sub_group_size {count(job.sub_group_size)}" if job.offload == "nvme" else "")
            + f"; reduce_bucket_size {count(job.reduce_bucket_size)}"
        )
    lines.append(
        "bytes per device in GiB (2^30 bytes)"
        + (", off the device per node" if job.offload else "")
    )
    lines.append("")
    header = ["stage", "params", "grads", "optim", "states", "gathered", "step"]
    if job.shape:
        header += ["act", "act ckpt", "peak", "peak ckpt"]
    else:
        header += ["peak"]
    if job.offload:
        header.append("CPU/node")
    if job.offload == "nvme":
        header.append("NVMe/node")
    if device_memory is not None:
        header.append(f"fits {scaled(device_memory, 'Gi')}GiB")
    if job.offload and host_memory is not None:
        header.append(f"host fits {scaled(host_memory, 'Gi')}GiB")
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
        if row.host is not None:
            cells.append(scaled(row.host.total * job.gpus_per_node, "Gi"))
        if job.offload == "nvme":
            cells.append(scaled(row.disk * job.gpus_per_node, "Gi"))
        if device_memory is not None:
            cells.append(_fits(row, device_memory))
        if job.offload and host_memory is not None:
            cells.append(_host_fits(job, row, host_memory))
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(r, widths, strict=True)))
    lines.append("")
    lines += [
        textwrap.fill(
            note, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False
        )
        for note in _notes(job, rows, device_memory, host_memory)
    ]
    return "\n".join(lines)


def _grads_dtype(job: TrainingJob) -> str:
    if job.precision.grad_accum_dtype is None:
        return "training dtype"
    return f"{job.grad_accum_dtype} (data_types.grad_accum_dtype)"


def _notes(
    job: TrainingJob, rows: list[StageEstimate], device_memory: int | None, host_memory: int | None
) -> list[str]:
    masters = (
        f"{job.master_dtype} masters (a copy: 16-bit training)"
        if job.precision.has_master_copy
        else "no master copy (the parameters are the masters)"
    )
    notes = [
        f"params: trainable and frozen, training dtype; grads: {_grads_dtype(job)}; optim: "
        f"{masters} + optimizer state in {job.optimizer_state_dtype}; states: their sum.",
        "gathered: stage 3, full units live during forward/backward, at most "
        f"max(stage3_max_live_parameters = {count(job.max_live_numel)}, root unit + largest "
        "block) elements; step: the fp32 gradient copy during a 16-bit optimizer step.",
        "peak = states + max(gathered + activations, step)"
        + ("; act ckpt: every layer checkpointed, one recomputed." if job.shape else "."),
        *([_activation_note(job.shape, job.assumptions)] if job.shape else []),
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
            + (
                "'with ckpt': only with activation checkpointing."
                if job.shape
                else f"'{FITS_WITHOUT_ACTIVATIONS}': without activations, which were not "
                "estimated and come on top of the peak."
            )
        )
    if job.offload:
        notes += _offload_notes(job, rows, host_memory)
    return notes


def _activation_note(shape: TransformerShape, a: ActivationAssumptions) -> str:
    """What the activation columns assume: the job's dtype, attention, dropout and MLP, next to
    the paper's case, which the estimate reduces to."""
    mlp = shape.mlp
    attention = {
        "eager": "eager attention (keeps the s x s softmax",
        "flash": "flash attention (fused SDPA: a log-sum-exp per row and head, no s x s matrix",
    }[a.attention] + ("; with its dropout mask)" if a.dropout and a.attention == "eager" else ")")
    return (
        "activations: Korthikanti et al. 2022's bytes per layer (sbh(34 + 5as/h) in the paper's "
        "case: 2-byte activations, eager attention, dropout, a 4h GeLU MLP), here with "
        f"{a.element_bytes}-byte activations, {attention}, "
        + ("1-byte dropout masks" if a.dropout else "no dropout masks")
        + f", a {mlp} MLP of width {shape.mlp_width} ("
        + ("two" if mlp == "gelu" else "gated: four")
        + " tensors of that width kept per token) and "
        + ("fp32" if a.norm_stats_bytes == 4 else f"{a.norm_stats_bytes}-byte")
        + " LayerNorm statistics."
    )


def _offload_notes(
    job: TrainingJob, rows: list[StageEstimate], host_memory: int | None
) -> list[str]:
    """What offload puts off the device, as zerotrain allocates it, and the preflight's
    verdict."""
    s = job.precision.stored_state_bytes(job.state_bytes)
    p = job.precision_bytes
    stage3 = 3 in job.stages
    bucket = f"largest bucket: min(reduce_bucket_size, Ψ) = {count(largest_bucket(job, ZeroPolicy.for_stage(1)))}"
    if stage3:
        bucket += "; stage 3 has one bucket per gather unit: " + (
            f"the largest unit, {count(job.largest_unit)}"
            if job.largest_unit
            else "taken as the same (--model counts the units)"
        )
    bucket += (
        "; sharded over the N ranks. An upper bound unless one parameter alone is larger "
        "(buckets close between parameters)."
    )
    if job.offload == "cpu":
        notes = [
            f"CPU/node: the host memory offload_optimizer.device: cpu allocates, {job.gpus_per_node} "
            "ranks per node x what the preflight of initialize counts per rank "
            "(zerotrain.zero.offload.host_bytes): per element of the rank's optimizer "
            f"partition ⌈Ψ/N⌉ an fp32 master (4), the optimizer state ({s}) and an fp32 "
            f"gradient (4), plus a ring of buffer_count = {job.buffer_count} buffers of the "
            f"largest bucket's shard, at most {count(RING_CHUNK)} elements, in {job.dtype} ({p} "
            "bytes) that carries parameters back.",
            bucket,
        ]
    else:
        notes = [
            f"CPU/node: the host memory offload_optimizer.device: nvme allocates, "
            f"{job.gpus_per_node} ranks per node x what the preflight of initialize counts per "
            "rank (zerotrain.zero.nvme.staging_host_bytes): buffer_count = "
            f"{job.buffer_count} staging sets of the largest sub-group (fp32 master, optimizer "
            f"state and fp32 gradient: {4 + s + 4} bytes per element) and a ring of as many "
            f"sub-groups (at most {count(RING_CHUNK)} elements each) in {job.dtype}; a sub-group is sub_group_size rounded down to a "
            f"multiple of {SUB_GROUP_ALIGNMENT} ({count(sub_group_numel(job.sub_group_size))}), "
            "or the largest bucket's shard where that is smaller.",
            bucket,
            "NVMe/node: the working files under nvme_path, an fp32 master and the optimizer "
            f"state per element of the rank's partition, (4 + {s})·⌈Ψ/N⌉ per rank "
            "(zerotrain.zero.nvme.disk_bytes_needed, which the disk preflight checks), before "
            "the padding of its slots to the I/O block.",
        ]
    notes.append(
        "the whole optimizer partition is offloaded (ratio 1): the device keeps the "
        f"{job.dtype} parameters and gradients, and the step runs off it (optim and step 0)."
        + (
            " Stage 3's offload_param (its parameter shards in host memory, p·Ψ/N more per "
            "rank) is not estimated."
            if stage3
            else ""
        )
    )
    per_rank = {}
    for row in rows:
        h = row.host
        if h is None:
            continue
        key = (
            ("staging sets: " if job.offload == "nvme" else "")
            + f"fp32 masters {_gib(h.masters)}, optimizer state {_gib(h.optimizer_state)}, "
            f"fp32 gradients {_gib(h.gradients)}, transfer ring {_gib(h.staging)}"
        )
        per_rank.setdefault(key, []).append(str(row.stage))
    for key, stages in per_rank.items():
        notes.append(f"host memory per rank, stage {', '.join(stages)}: {key}.")
    if host_memory is not None:
        notes.append(
            f"host fits: what the preflight of initialize says on a node with "
            f"{quantity(host_memory, 'B', prefix='Gi')} of available memory "
            "(zerotrain.estimate.verdict; initialize reads MemAvailable, every memory cgroup "
            "up to the root and RLIMIT_AS)."
        )
        refusals: dict[str, list[str]] = {}
        for row in rows:
            refusal = host_memory_shortfall(job, row, host_memory)
            if refusal:
                refusals.setdefault(refusal, []).append(str(row.stage))
        for refusal, stages in refusals.items():
            notes.append(f"stage {', '.join(stages)}: {refusal}")
    return notes


def _gib(nbytes: float) -> str:
    return quantity(nbytes, "B", prefix="Gi")


def to_json(
    job: TrainingJob,
    rows: list[StageEstimate],
    device_memory: int | None = None,
    host_memory: int | None = None,
) -> dict:
    """The estimate as plain data, in bytes per device (with offload: per rank and per node
    off the device)."""
    out_rows = []
    for row in rows:
        record: dict[str, object] = {
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
        if row.host is not None:
            record["host_per_rank"] = {**vars(row.host), "total": row.host.total}
            record["cpu_per_node"] = row.host.total * job.gpus_per_node
        if job.offload == "nvme":
            record["disk_per_rank"] = row.disk
            record["nvme_per_node"] = row.disk * job.gpus_per_node
        if device_memory is not None:
            record["fits"] = _fits(row, device_memory)
        if job.offload and host_memory is not None:
            refusal = host_memory_shortfall(job, row, host_memory)
            record["host_fits"] = "no" if refusal else "yes"
            if refusal:
                record["host_preflight"] = refusal
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
        "host_memory": host_memory,
        "unit": "bytes per device",
        "rows": out_rows,
    }
    return out
