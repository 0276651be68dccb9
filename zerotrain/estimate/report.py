"""The estimate for people and programs: the ``zerotrain estimate`` table with its notes, and
the same numbers as JSON."""

from __future__ import annotations

import textwrap

from zerotrain.estimate.activations import activation_bytes
from zerotrain.estimate.stages import HOST_COLUMN, StageEstimate, TrainingJob
from zerotrain.fmt import count, quantity, scaled
from zerotrain.optim.state_bytes import OPTIMIZER_STATE_BYTES

__all__ = ["format_table", "to_json"]


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
    host = HOST_COLUMN.get(job.offload or "")
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
            f"{HOST_COLUMN[job.offload]}: what DeepSpeed-style offload would move there, per node "
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
