"""The engine of a ``PipelineModule``: ``train_batch`` / ``eval_batch`` run one step's
micro-batches through the stages with a ``torch.distributed.pipelining`` schedule.

[Note: a pipeline step on ZeRO]
Each stage's engine is an ordinary ZeroTrainEngine over its stage's layers, ZeRO-partitioned over
the data-parallel group of the stage. The schedule (1F1B, GPipe, interleaved 1F1B, ZBV) calls
the engine's forward for each micro-batch and runs each backward through its outputs, which opens
the engine's reducer as ``loss.backward()`` does (see backward.py): every parameter gradient is
divided by the accumulation steps (the micro-batches of a step) as it is taken, so the
schedule's own scaling is off. The stage marks the schedule's last backward as the accumulation
boundary: stages 0-1 then reduce once per step, after the last micro-batch, stage 2
reduce-scatters each micro-batch's gradients into the partitions. Then the optimizer steps
once. With several stages per rank (interleaved, ZBV), the boundary is the last backward of the
stage that finishes last, and each backward reduces (at stage 2) only the buckets of its own
stage: buckets never mix the stages' parameters. ZBV's weight-gradient steps are backwards the
engine opens itself ([Note: the weight-gradient step] in comm/pipeline.py). Stage 3 is refused:
with many micro-batches per step it does not pay (see docs/parallelism.md, "Not yet").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.engine import ZeroTrainEngine
from zerotrain.pipe.module import PipelineModule

if TYPE_CHECKING:
    from zerotrain.comm.pipeline import PipelineAction, PipelineSchedule


class PipelineEngine(ZeroTrainEngine):
    """The engine ``initialize`` returns for a ``PipelineModule``: train with
    :meth:`train_batch`, evaluate with :meth:`eval_batch` (DeepSpeed's pipeline engine API)."""

    def __init__(self, *args: Any, pipe_comm: Communicator, schedule: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pipe_comm = pipe_comm  # the stages: rank i of it runs stage i
        self.num_stages = pipe_comm.world_size
        self.stage_id = pipe_comm.rank
        self._schedule_name = schedule
        self._schedule: PipelineSchedule | None = None  # built at the first batch
        self._running = False  # inside train_batch / eval_batch
        self._data: Iterator | None = None
        self._chunk_scopes: list[list[list[int]]] = []  # per chunk: the buckets it reduces
        self._chunk_params: list[list[nn.Parameter]] = []  # per chunk: its trained parameters
        self._chunks_done = 0  # chunks whose last backward of this step has begun
        # the forwards and backwards this rank ran in the last train_batch / eval_batch, in
        # order, with their times (zerotrain.pipe.timeline replays them)
        self.pipeline_actions: list[PipelineAction] = []

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the pipeline's last stage (ZBV places it on the first rank)."""
        return self.stage_id == self._last_rank()

    def _last_rank(self) -> int:
        module = self.module
        assert isinstance(module, PipelineModule)  # initialize makes this engine for one
        return module.rank_of(module.num_stages * module.stages_per_rank - 1)

    # -- only the schedule drives forward, backward and step ----------------------------------
    def forward(self, *args: Any, **kwargs: Any):
        if not self._running:
            raise RuntimeError(
                "pipeline engine: forward, backward and step are run by the pipeline schedule; "
                "call engine.train_batch(data_iter) or engine.eval_batch(data_iter)"
            )
        return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        raise RuntimeError("pipeline engine: backward is run by engine.train_batch(data_iter)")

    def step(self) -> None:
        raise RuntimeError("pipeline engine: the step is taken by engine.train_batch(data_iter)")

    # -- the pipeline -------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches of
        ``(inputs, labels)`` from ``data_iter`` (default: the engine's dataloader), read on the
        first (inputs) and last (labels) stages. Returns the step's mean loss on every rank."""
        inputs, labels = self._next_batch(data_iter)
        losses: list[torch.Tensor] = []  # the schedule fills it (the last stage)
        self._running = True
        self._chunks_done = 0
        self.pipeline_actions.clear()
        try:
            self._run(self._pipeline().step, inputs, labels, losses)
            if self._fp16_scaled():  # as the loss function returned them: scaled
                unscale = self.gradient_accumulation_steps() / self.optimizer.loss_scale
                losses = [loss.detach().float() * unscale for loss in losses]
            for loss in losses:  # this step's, for its throughput line
                self.metrics.observe_loss(loss.detach())
            steps = self.gradient_accumulation_steps()
            for micro in range(steps):  # count the micro-steps; the last one updates
                self.set_gradient_accumulation_boundary(micro == steps - 1)
                super().step()
        finally:
            self._running = False
            self.set_gradient_accumulation_boundary(None)
        return self._mean_loss(losses)

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, **_: Any):
        """The mean loss over ``gradient_accumulation_steps`` micro-batches of ``data_iter``,
        forward only, on every rank."""
        if return_logits:
            raise NotImplementedError("eval_batch(return_logits=True) is not supported yet")
        inputs, labels = self._next_batch(data_iter)
        losses: list[torch.Tensor] = []
        self._running = True
        self.pipeline_actions.clear()
        try:
            with torch.no_grad():
                self._run(self._pipeline().eval, inputs, labels, losses)
        finally:
            self._running = False
        return self._mean_loss(losses)

    def _pipeline(self) -> PipelineSchedule:
        if self._schedule is None:
            module = self.module
            assert isinstance(module, PipelineModule)  # initialize makes this engine for one
            # torch.distributed.pipelining takes seconds to import (DTensor, dynamo): only a
            # pipeline that runs pays for it, not every import of zerotrain
            from zerotrain.comm.pipeline import StageRun, pipeline_schedule

            if module.loss_fn is None:
                raise ValueError("PipelineModule(loss_fn=...) is required to train it")
            chunks = range(module.stages_per_rank)
            chunks_of = module.chunks_of()
            self._chunk_scopes = [
                self.optimizer.scope(lambda p, c=c: c in chunks_of[id(p)]) for c in chunks
            ]
            trained = [p for p in module.parameters() if p.requires_grad]
            self._chunk_params = [[p for p in trained if c in chunks_of[id(p)]] for c in chunks]
            runs = [
                StageRun(module.stages[c], functools.partial(self, chunk=c), self._chunk_params[c])
                for c in chunks
            ]
            self._schedule = pipeline_schedule(
                runs,
                self.pipe_comm,
                self.device,
                self._schedule_name,
                self.gradient_accumulation_steps(),
                self._loss,
                on_backward=self._before_backward,
                weight_backward=self._weight_backward,
                actions=self.pipeline_actions,
            )
        return self._schedule

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The model's loss of a micro-batch; under fp16 loss scaling, in training, times the
        scale and 1/accumulation: what autograd starts from (see :meth:`_before_backward`)."""
        module = self.module
        assert isinstance(module, PipelineModule) and module.loss_fn is not None
        loss = module.loss_fn(output, target)
        if self._fp16_scaled() and torch.is_grad_enabled():
            return loss.float() * (self.optimizer.loss_scale / self.gradient_accumulation_steps())
        return loss

    def _fp16_scaled(self) -> bool:
        return self.optimizer.loss_scaler.dynamic or self.optimizer.loss_scale != 1.0

    def _before_backward(self, chunk: int, last: bool) -> None:
        """Each backward of the schedule, of this rank's stage ``chunk``: the last one of the
        step ends the accumulation (with several stages per rank, the last of the last one to
        finish), and only the chunk's buckets are reduced in it. Under fp16 the loss already
        carries both factors (:meth:`_loss`), as ``engine.scale(loss)`` puts them (see
        [Note: loss.backward() without engine.backward] in backward.py); on every stage the
        gradients arriving from the next one carry them too."""
        self._chunks_done += last
        chunks = len(self._chunk_params)
        self.set_gradient_accumulation_boundary(self._chunks_done == chunks)
        if chunks > 1:
            self.optimizer.restrict(self._chunk_scopes[chunk])
        if self._fp16_scaled():
            self._backward.user_scaled = True

    def _weight_backward(self, chunk: int, run: Callable[[], None]) -> None:
        """A weight-gradient step of the zero-bubble schedules (see [Note: the weight-gradient
        step] in comm/pipeline.py): a backward of this engine around ``run``, which assigns
        the gradients of the chunk's parameters rather than accumulating them."""
        self._backward.outside_autograd(run, self._chunk_params[chunk])

    def _run(self, run, inputs: list | None, labels: list | None, losses: list) -> None:
        run(
            inputs if self.is_first_stage() else None,
            labels if self.is_last_stage() else None,
            losses,
        )

    def _next_batch(self, data_iter: Iterator | None) -> tuple[list | None, list | None]:
        """This step's micro-batches: their inputs and their labels, each micro-batch with its
        own shapes (see [Note: self-describing stage messages] in comm/stage_messages.py)."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError(
                    "train_batch(): pass a data iterator, or training_data to initialize"
                )
            if self._data is None:
                self._data = _repeating(self.training_dataloader)
            data_iter = self._data
        pairs = [next(data_iter) for _ in range(self.gradient_accumulation_steps())]
        if not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
            raise TypeError(
                "train_batch / eval_batch: each micro-batch must be an (inputs, labels) pair of "
                f"tensors, got {type(pairs[0]).__name__}"
            )
        inputs = [torch.as_tensor(x).to(self.device) for x, _ in pairs]
        labels = [torch.as_tensor(y).to(self.device) for _, y in pairs]
        return inputs, labels

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss, averaged over the data-parallel ranks and
        sent to every stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            loss = torch.stack([t.detach().float() for t in losses]).mean()
            data_parallel = self.optimizer.comm
            data_parallel.all_reduce(loss)
            loss /= data_parallel.world_size
        last = self.pipe_comm.global_rank_of(self._last_rank())
        self.pipe_comm.broadcast(loss, src=last)
        return loss


def _repeating(loader) -> Iterator:
    while True:
        yield from loader
