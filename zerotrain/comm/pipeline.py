"""Pipeline schedules: ``torch.distributed.pipelining`` run over a stage group (the pipeline
axis of the mesh). Each of this rank's stages runs a callable (a chunk of the zerotrain
engine's model); the stage tells the engine, before each backward, which chunk it is and
whether it is that chunk's last of the step, so the engine knows where to reduce its gradients
(see [Note: a pipeline step on ZeRO] in zerotrain/pipe/engine.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.stage import _PipelineStageBase  # the schedules' type

from zerotrain.comm.communicator import Communicator

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
LOOPED_SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B}  # several stages per rank


class _Chunk(nn.Module):
    """What the schedule runs for one stage: a callable, wrapped as the module it expects (its
    parameters are the engine's, reduced by the engine, so the stage sees none)."""

    def __init__(self, run: Callable[..., Any]):
        super().__init__()
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


class PipelineAction(NamedTuple):
    """A forward ("F") or backward ("B") of one micro-batch on one stage, as a rank ran it."""

    kind: str
    stage: int
    micro_batch: int
    start: float  # time.perf_counter()
    end: float


class _Stage(PipelineStage):
    """A stage that tells the engine about each backward, records what it runs, and counts
    what it sends to the neighbouring stages on ``comm`` (op ``send``: the schedule issues the
    point-to-point operations itself)."""

    def __init__(
        self,
        *args: Any,
        comm: Communicator,
        on_backward: Callable[[bool], None],
        actions: list[PipelineAction],
        **kwargs: Any,
    ):
        super().__init__(*args, group=comm.group, **kwargs)
        self._comm = comm
        self._on_backward = on_backward
        self._actions = actions

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, start)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._record("B", bwd_chunk_id, start)
        return out

    def _record(self, kind: str, micro_batch: int, start: float) -> None:
        end = time.perf_counter()
        self._actions.append(PipelineAction(kind, self.stage_index, micro_batch, start, end))

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        self._on_backward(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if ops:
            self._comm.count("send", nbytes, sent=nbytes, calls=len(ops))
        return ops


def pipeline_schedule(
    chunks: Sequence[Callable[..., Any]],
    stages: Communicator,
    device: torch.device,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[..., torch.Tensor],
    on_backward: Callable[[int, bool], None],
    actions: list[PipelineAction],
):
    """A ``schedule`` of ``micro_batches`` over the stage group ``stages``: this rank, at
    position p of it, runs stages ``p + i * stages.world_size`` with ``chunks[i]`` (one chunk
    but for a looped schedule such as "interleaved_1f1b"). ``on_backward(i, last)`` is called
    before each backward of chunk i; ``actions`` gets what this rank runs, in order. Gradients
    are not scaled by the schedule (the caller divides)."""
    total = stages.world_size * len(chunks)
    built: list[_PipelineStageBase] = [
        _Stage(
            _Chunk(run),
            stages.rank + i * stages.world_size,
            total,
            device,
            comm=stages,
            on_backward=lambda last, i=i: on_backward(i, last),
            actions=actions,
        )
        for i, run in enumerate(chunks)
    ]
    if schedule in LOOPED_SCHEDULES:
        kind = LOOPED_SCHEDULES[schedule]
        return kind(built, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = built
    return SCHEDULES[schedule](
        stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False
    )
