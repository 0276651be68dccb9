"""Pipeline schedules: ``torch.distributed.pipelining`` run over a stage group (the pipeline
axis of the mesh). The stage's module is a zerotrain engine; the stage tells it which backward
is a step's last, where it reduces its gradients (see [Note: a pipeline step on ZeRO] in
zerotrain/pipe/engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from zerotrain.comm.communicator import Communicator

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class _BoundaryMarkingStage(PipelineStage):
    def __init__(self, *args: Any, on_backward: Callable[[bool], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_backward = on_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        self._on_backward(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def pipeline_schedule(
    module: nn.Module,
    stages: Communicator,
    device: torch.device,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[..., torch.Tensor],
    on_backward: Callable[[bool], None],
):
    """A ``schedule`` ("1f1b" or "gpipe") of ``micro_batches`` over the stage group ``stages``
    (this rank runs stage ``stages.rank`` with ``module``); ``on_backward(last)`` is called
    before each backward. Gradients are not scaled by the schedule (the caller divides)."""
    stage = _BoundaryMarkingStage(
        module, stages.rank, stages.world_size, device, group=stages.group, on_backward=on_backward
    )
    return SCHEDULES[schedule](
        stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False
    )
