"""Pipeline schedules: ``torch.distributed.pipelining`` run over a stage group (the pipeline
axis of the mesh). Each of this rank's stages runs a callable (a chunk of the zerotrain
engine's model); the stage tells the engine, before each backward, which chunk it is and
whether it is that chunk's last of the step, so the engine knows where to reduce its gradients
(see [Note: a pipeline step on ZeRO] in zerotrain/pipe/engine.py). ``trace_stages`` cuts an
ordinary model into stages with torch's tracer (for zerotrain.pipe.split_model).

[Note: the weight-gradient step]
The zero-bubble schedules (ZBV) split a stage's backward in two: first the gradient of its
input, which the previous stage is waiting for, then, later, where the pipeline would idle, the
gradients of its weights. torch computes the second with ``autograd.grad`` and assigns
``param.grad`` itself, so no hook of autograd's accumulation runs, and the engine's reducer,
which takes gradients there, would never see them. The stage therefore hands that step to the
engine (``weight_backward(chunk, run)``), which opens a backward around ``run`` and takes the
assigned gradients after it. The first stage has no input gradient to send: torch runs its
whole backward in the weight step, through autograd, as any other backward.
"""

from __future__ import annotations

import time
import warnings
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
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.pipelining.stage import _PipelineStageBase  # the schedules' type

from zerotrain.comm.communicator import Communicator

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
# several stages per rank
MULTI_STAGE_SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}


class StageRun(NamedTuple):
    """One of this rank's stages: its index in the pipeline, its forward, and the parameters it
    trains (what a weight-gradient step differentiates)."""

    stage: int
    run: Callable[..., Any]
    params: list[nn.Parameter]


class _Chunk(nn.Module):
    """What the schedule runs for one stage: a callable, wrapped as the module it expects, with
    the stage's parameters (the engine's, which the engine reduces)."""

    def __init__(self, run: Callable[..., Any], params: list[nn.Parameter]):
        super().__init__()
        self._run = run
        self._params = params

    def parameters(self, recurse: bool = True):
        return iter(self._params)

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


class PipelineAction(NamedTuple):
    """What a rank ran for one micro-batch on one stage: its forward ("F"), its backward ("B";
    under ZBV the input gradient alone) or its weight gradients ("W", ZBV)."""

    kind: str
    stage: int
    micro_batch: int
    start: float  # time.perf_counter()
    end: float


class _Stage(PipelineStage):
    """A stage that tells the engine about each backward, hands it the weight-gradient steps
    ([Note: the weight-gradient step]), records what it runs, and counts what it sends to the
    neighbouring stages on ``comm`` (op ``send``: the schedule issues the point-to-point
    operations itself)."""

    def __init__(
        self,
        *args: Any,
        comm: Communicator,
        on_backward: Callable[[bool], None],
        weight_backward: Callable[[Callable[[], None]], None],
        actions: list[PipelineAction],
        **kwargs: Any,
    ):
        super().__init__(*args, group=comm.group, **kwargs)
        self._comm = comm
        self._on_backward = on_backward
        self._weight_backward = weight_backward
        self._actions = actions

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, start)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        if not self.has_backward:  # evaluation: the schedule's backwards do nothing
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        start = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._record("B", bwd_chunk_id, start)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
        if not self.has_backward:  # evaluation: nothing to take, no backward to open
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        start = time.perf_counter()
        if self.is_first:  # a whole backward through autograd, announced as any other
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        else:
            self._on_backward(last_backward)
            self._weight_backward(
                lambda: super(_Stage, self).backward_weight_one_chunk(bwd_chunk_id, last_backward)
            )
        self._record("W", bwd_chunk_id, start)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if backward_type != "weight":  # the weight step announced itself
            self._on_backward(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    # torch's V schedules hand the gradients between a rank's two middle stages directly, in
    # evaluation too, where there are none (torch 2.13 raises there): nothing to hand
    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _record(self, kind: str, micro_batch: int, start: float) -> None:
        end = time.perf_counter()
        self._actions.append(PipelineAction(kind, self.stage_index, micro_batch, start, end))

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if ops:
            self._comm.count("send", nbytes, sent=nbytes, calls=len(ops))
        return ops


def trace_stages(
    model: nn.Module, example_inputs: tuple, split_points: Sequence[str]
) -> list[nn.Module]:
    """``model`` traced with ``example_inputs`` and cut before each module of ``split_points``:
    one graph module per stage (torch's pipeline front end; it raises what ``torch.export``
    raises on a model it cannot capture)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's tracer, about its own pytree use
        traced = pipeline(
            model,
            mb_args=example_inputs,
            split_spec={point: SplitPoint.BEGINNING for point in split_points},
        )
    return [traced.get_stage_module(i) for i in range(traced.num_stages)]


def stage_inputs(stage: nn.Module) -> list[str]:
    """The names of a traced stage's inputs."""
    graph = stage.graph
    assert isinstance(graph, torch.fx.Graph)  # a graph module of trace_stages
    return [node.name for node in graph.nodes if node.op == "placeholder"]


def pipeline_schedule(
    stage_runs: Sequence[StageRun],
    stages: Communicator,
    device: torch.device,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[..., torch.Tensor],
    on_backward: Callable[[int, bool], None],
    weight_backward: Callable[[int, Callable[[], None]], None],
    actions: list[PipelineAction],
):
    """A ``schedule`` of ``micro_batches`` over the stage group ``stages``, this rank running
    ``stage_runs`` (one but for the multi-stage schedules, "interleaved_1f1b" and "zbv") out of
    ``len(stage_runs) x stages.world_size``. ``on_backward(i, last)`` is called before each
    backward of ``stage_runs[i]``, ``weight_backward(i, run)`` runs its weight-gradient steps
    ([Note: the weight-gradient step]); ``actions`` gets what this rank runs, in order.
    Gradients are not scaled by the schedule (the caller divides)."""
    total = stages.world_size * len(stage_runs)
    built: list[_PipelineStageBase] = [
        _Stage(
            _Chunk(stage_run.run, stage_run.params),
            stage_run.stage,
            total,
            device,
            comm=stages,
            on_backward=lambda last, i=i: on_backward(i, last),
            weight_backward=lambda run, i=i: weight_backward(i, run),
            actions=actions,
        )
        for i, stage_run in enumerate(stage_runs)
    ]
    if schedule in MULTI_STAGE_SCHEDULES:
        kind = MULTI_STAGE_SCHEDULES[schedule]
        return kind(built, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = built
    return SCHEDULES[schedule](
        stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False
    )
