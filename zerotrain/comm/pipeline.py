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

What stages on different ranks send each other goes through
:class:`~zerotrain.comm.stage_messages.StageMessages`, not torch's receive buffers (shaped once,
from the first batch): every message says its tensors' dtypes and shapes, so each micro-batch
may have its own ([Note: self-describing stage messages] in stage_messages.py); the schedule
still posts, groups and waits every tensor's send and receive itself ([Note: headers apart from
the tensors] there).
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

# the schedules' stage type; the description of a stage's input
from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo

from zerotrain.comm.communicator import Communicator
from zerotrain.comm.stage_messages import MessageKey, StageMessages, restart_advice

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
        # the stage's input as one value, a tuple when the previous stage returned several
        # tensors (DeepSpeed's PipelineModule passes tuples between stages so)
        out = self._run(args[0] if len(args) == 1 else args)
        if isinstance(out, tuple):
            return tuple(_not_a_view(x) for x in out)
        return _not_a_view(out)


class _Alias(torch.autograd.Function):
    """The same memory as a tensor that is not a view: torch's zero-bubble backward detaches
    each stage output in place (``stage_backward_input``), which autograd refuses for a view
    (nn.Linear returns one on 3-D input). No copy; the gradient passes through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads[0]


def _not_a_view(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x._is_view():
        return _Alias.apply(x) if x.requires_grad else x.detach()
    return x


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
    ([Note: the weight-gradient step]), records what it runs, and exchanges its activations and
    gradients with the stages on other ranks as self-describing ``messages`` (counted on their
    communicator as op ``send``; see [Note: self-describing stage messages] in
    stage_messages.py). Tensors between two stages of this rank are handed over directly."""

    def __init__(
        self,
        *args: Any,
        messages: StageMessages,
        on_backward: Callable[[bool], None],
        weight_backward: Callable[[Callable[[], None]], None],
        actions: list[PipelineAction],
        **kwargs: Any,
    ):
        super().__init__(*args, group=messages.comm.group, **kwargs)
        self._messages = messages
        self._on_backward = on_backward
        self._weight_backward = weight_backward
        self._actions = actions
        # torch's checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) hold every micro-batch to the first
        # one's shapes, which may differ by design here; the messages check themselves
        self._runtime_validate = False
        self._inputs: dict[int, list[torch.Tensor]] = {}  # micro-batch -> its input
        self._output_grads: dict[int, tuple[torch.Tensor | None, ...]] = {}
        # micro-batch -> the gradients of its output: from another rank, or from this rank's
        # next stage (ZBV's V)
        self._grads: dict[int, tuple[torch.Tensor | None, ...]] = {}

    # -- what the schedule runs ----------------------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, start)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        if not self.has_backward:  # evaluation: the schedule's backwards do nothing
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if not self.is_last:
            grads = self._grads.pop(bwd_chunk_id)
            outputs, _ = self.fwd_cache[bwd_chunk_id]
            self._output_grads[bwd_chunk_id] = self._grads_for(outputs, grads, bwd_chunk_id)
        start = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._record("B", bwd_chunk_id, start)
        return out

    def _grads_for(
        self, outputs: tuple, grads: tuple[torch.Tensor | None, ...], micro_batch: int
    ) -> tuple[torch.Tensor | None, ...]:
        """``grads`` for this stage's ``outputs``: zeros where the next stage's autograd gave
        none for an output that needs one (as torch's stages send), checked against them."""
        where = f"stage {self.stage_index + 1}'s gradients for micro-batch {micro_batch}"
        if len(grads) != len(outputs):
            raise RuntimeError(
                f"pipeline: {where} are {len(grads)} tensors for the {len(outputs)} outputs of "
                f"stage {self.stage_index}"
            )
        out: list[torch.Tensor | None] = []
        for index, (output, grad) in enumerate(zip(outputs, grads, strict=True)):
            if grad is None:
                out.append(torch.zeros_like(output) if output.requires_grad else None)
                continue
            if grad.shape != output.shape:
                raise RuntimeError(
                    f"pipeline: {where} have shape {tuple(grad.shape)} for output {index} of "
                    f"stage {self.stage_index}, of shape {tuple(output.shape)}"
                )
            out.append(grad)
        return tuple(out)

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

    def _record(self, kind: str, micro_batch: int, start: float) -> None:
        end = time.perf_counter()
        self._actions.append(PipelineAction(kind, self.stage_index, micro_batch, start, end))

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._inputs.clear()
        self._output_grads.clear()
        self._grads.clear()

    # -- the stage's inputs and output gradients: from the messages, not torch's buffers -------
    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        grad = self.has_backward and torch.is_grad_enabled()
        return tuple(
            x.requires_grad_(x.requires_grad and grad) for x in self._inputs.pop(fwd_chunk_id)
        )

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        return self._output_grads.pop(bwd_chunk_id)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any):
        meta = super()._prepare_forward_infra(*args, **kwargs)
        self._drop_buffers(self.args_recv_info)  # allocated for the first batch's shapes
        return meta

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any):
        meta = super()._prepare_backward_infra(*args, **kwargs)
        self._drop_buffers(self.grad_recv_info)
        return meta

    @staticmethod
    def _drop_buffers(recv_infos: dict) -> None:
        for infos in recv_infos.values():
            for info in infos:
                # a root argument holds no buffer: torch >= 2.12 marks it, older torch gives it
                # a class of its own (a placeholder, not a _RecvInfo)
                if isinstance(info, _RecvInfo) and not getattr(info, "is_root_arg", False):
                    info.buffer = None

    # torch's V schedules hand tensors between a rank's two middle stages directly
    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        outputs = prev_stage_outputs
        if not isinstance(outputs, tuple | list):
            outputs = (outputs,)
        self._inputs[mb_index] = [x.detach().requires_grad_(x.requires_grad) for x in outputs]

    # (in evaluation too, where there are no gradients: torch 2.13 raises there)
    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            self._grads[mb_index] = tuple(next_stage_bwd_outputs)

    # -- the schedule's sends and receives: the tensors' operations, which it posts, groups and
    # waits as its own; their header goes ahead ([Note: headers apart from the tensors]) --------
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_first or self._is_same_rank(self.stage_index - 1):
            return []
        peer = self.stage_index_to_group_rank[self.stage_index - 1]
        key = MessageKey("activations", self.stage_index, fwd_chunk_id)
        received, ops = self._messages.recv_ops(peer, key)
        inputs = [x for x in received if x is not None]
        if len(inputs) != len(received):  # get_fwd_send_ops sends none
            raise RuntimeError(f"pipeline: {key.describe()} came with a None")
        self._inputs[fwd_chunk_id] = inputs
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last or self._is_same_rank(self.stage_index + 1):
            return []
        peer = self.stage_index_to_group_rank[self.stage_index + 1]
        key = MessageKey("gradients", self.stage_index, bwd_chunk_id)
        grads, ops = self._messages.recv_ops(peer, key)
        self._grads[bwd_chunk_id] = tuple(grads)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.is_last:
            outputs, _ = self.fwd_cache[fwd_chunk_id]
            key = MessageKey("activations", self.stage_index + 1, fwd_chunk_id)
            if any(x is None for x in outputs):
                raise TypeError(
                    f"pipeline: stage {self.stage_index} returned None in {key.describe()}; "
                    "stages pass tensors, or tuples of tensors, to each other"
                )
            peer = self.stage_index_to_group_rank[self.stage_index + 1]
            return self._messages.send_ops(peer, key, outputs)
        return []

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_first:
            grads = self.bwd_cache.pop(bwd_chunk_id)
            peer = self.stage_index_to_group_rank[self.stage_index - 1]
            key = MessageKey("gradients", self.stage_index - 1, bwd_chunk_id)
            return self._messages.send_ops(peer, key, grads)
        return []


class PipelineSchedule:
    """A torch schedule over this rank's stages, run on lists of micro-batches, each with its
    own shapes (torch's ``step`` cuts one batch into equal ones): :meth:`step` trains, :meth:`eval`
    runs the forwards alone. A step that failed midway leaves the stages' messages out of step:
    every later one is refused."""

    def __init__(self, schedule: Any, stages: list[_Stage], messages: StageMessages):
        self._schedule = schedule
        self._stages = stages
        self._messages = messages
        self._failed: str | None = None

    def step(self, inputs: list | None, targets: list | None, losses: list) -> None:
        """One step's forwards and backwards; ``inputs``: each micro-batch's input (the first
        stage), ``targets``: each one's labels (the last stage), ``losses`` gets their losses
        there."""
        self._run(True, inputs, targets, losses)

    def eval(self, inputs: list | None, targets: list | None, losses: list) -> None:
        """:meth:`step`'s forwards alone."""
        self._run(False, inputs, targets, losses)

    def _run(
        self, has_backward: bool, inputs: list | None, targets: list | None, losses: list
    ) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"pipeline: an earlier step failed midway ({self._failed}), which leaves the "
                f"stages' messages out of step; {restart_advice()}"
            )
        schedule = self._schedule
        count = schedule._n_microbatches
        args = [(x,) for x in inputs] if inputs is not None else [()] * count
        saved = schedule._has_backward
        schedule._has_backward = has_backward
        try:
            for stage in self._stages:  # as torch's step() does
                stage.has_backward = has_backward
                stage.clear_runtime_states()
            schedule._step_microbatches(args, [{}] * count, targets, losses, return_outputs=False)
            self._messages.finish()
        except BaseException as error:
            first_line = next(iter(str(error).strip().splitlines()), "")
            self._failed = f"{type(error).__name__}: {first_line[:200]}"
            raise
        finally:
            schedule._has_backward = saved


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
) -> PipelineSchedule:
    """A ``schedule`` of ``micro_batches`` over the stage group ``stages``, this rank running
    ``stage_runs`` (one but for the multi-stage schedules, "interleaved_1f1b" and "zbv") out of
    ``len(stage_runs) x stages.world_size``. ``on_backward(i, last)`` is called before each
    backward of ``stage_runs[i]``, ``weight_backward(i, run)`` runs its weight-gradient steps
    ([Note: the weight-gradient step]); ``actions`` gets what this rank runs, in order.
    Gradients are not scaled by the schedule (the caller divides)."""
    total = stages.world_size * len(stage_runs)
    messages = StageMessages(stages, device)
    built: list[_Stage] = [
        _Stage(
            _Chunk(stage_run.run, stage_run.params),
            stage_run.stage,
            total,
            device,
            messages=messages,
            on_backward=lambda last, i=i: on_backward(i, last),
            weight_backward=lambda run, i=i: weight_backward(i, run),
            actions=actions,
        )
        for i, stage_run in enumerate(stage_runs)
    ]
    options = {"n_microbatches": micro_batches, "loss_fn": loss_fn, "scale_grads": False}
    if schedule in MULTI_STAGE_SCHEDULES:
        stages_of: list[_PipelineStageBase] = list(built)
        torch_schedule = MULTI_STAGE_SCHEDULES[schedule](stages_of, **options)
    else:
        (stage,) = built
        torch_schedule = SCHEDULES[schedule](stage, **options)
    return PipelineSchedule(torch_schedule, built, messages)
