"""The estimate as a chart: stacked bars per ZeRO stage (needs matplotlib)."""

from __future__ import annotations

from zerotrain.estimate.stages import StageEstimate, TrainingJob, host_memory_shortfall
from zerotrain.fmt import GiB, count, quantity, scaled

__all__ = ["figure", "plot"]


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


def _stage_labels(
    job: TrainingJob, rows: list[StageEstimate], host_memory: int | None
) -> list[str]:
    """One x label per bar: the stage and, with offload, its host memory per node and the
    preflight's verdict (the table's ``CPU/node`` and ``host fits`` columns)."""
    labels = []
    for row in rows:
        label = f"stage {row.stage}"
        if row.host is not None:
            label += f"\nCPU/node {scaled(row.host.total * job.gpus_per_node, 'Gi')} GiB"
            if host_memory is not None:
                refused = host_memory_shortfall(job, row, host_memory)
                label += f"\nhost fits: {'no' if refused else 'yes'}"
        labels.append(label)
    return labels


def figure(
    job: TrainingJob,
    rows: list[StageEstimate],
    device_memory: int | None = None,
    host_memory: int | None = None,
):
    """The table as a matplotlib ``Figure``: stacked bars per stage, GiB per device, a dashed
    line at ``device_memory``; with offload, each stage's host memory per node under its bar,
    and with ``host_memory`` the preflight's verdict. One bar container per segment, one bar per
    stage; the legend sits right of the axes, where it covers no bar.

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
    labels = _stage_labels(job, rows, host_memory)
    fig = Figure(figsize=(9, 4.5), dpi=100)
    axes = fig.subplots()
    bottom = [0.0] * len(rows)
    for (name, values), color in zip(segments.items(), _COLORS, strict=False):
        heights = [v / GiB for v in values]
        hatch = "//" if name.startswith("activations (extra") else None
        axes.bar(labels, heights, bottom=bottom, label=name, color=color, hatch=hatch, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for tick in axes.get_xticklabels():  # a stage the host cannot hold stands out
        if tick.get_text().endswith("host fits: no"):
            tick.set_color("#C44E52")
    if device_memory is not None:
        axes.axhline(
            device_memory / GiB,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"device memory {quantity(device_memory, 'B', prefix='Gi', digits=1)}",
        )
    offload = f", offload_optimizer={job.offload}" if job.offload else ""
    host = (
        f", host {quantity(host_memory, 'B', prefix='Gi', digits=1)}/node"
        if job.offload and host_memory is not None
        else ""
    )
    axes.set_title(
        f"{count(job.trainable_params + job.frozen_params)} parameters, {job.dtype}, "
        f"{job.optimizer}, {job.nodes}x{job.gpus_per_node} devices{offload}{host}",
        fontsize=10,
    )
    axes.set_ylabel("GiB per device")
    # Outside the axes: inside, the legend covers whichever bar is tallest at its corner.
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot(
    job: TrainingJob,
    rows: list[StageEstimate],
    path: str,
    device_memory: int | None = None,
    host_memory: int | None = None,
) -> None:
    """Save :func:`figure` to ``path`` (the format from its suffix, e.g. ``.png``)."""
    figure(job, rows, device_memory, host_memory).savefig(path)
