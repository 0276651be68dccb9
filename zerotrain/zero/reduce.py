"""Gradient reduction across data-parallel ranks, bucket by bucket: three strategies.

[Note: reduction order]
Every rank must issue the same collectives in the same order. Buckets are therefore launched
strictly in bucket order: a bucket whose gradients are complete waits until every earlier
bucket has been launched. A bucket with a parameter that got no gradient this backward (unused
in the forward, on this rank or all) is launched by :meth:`GradientReduction.finish_backward`
with zeros for that parameter, so no rank waits for a gradient that will never come.

[Note: the three reductions]
* :class:`AllReduceAtBoundary` (nothing sharded, stage 0): gradients accumulate in full
  buffers that every ``param.grad`` views; in the backward of the accumulation boundary each
  bucket is all-reduced as soon as its gradients are complete.
* :class:`ReduceScatterAtBoundary` (optimizer states sharded, stage 1): as above, but each
  bucket is reduce-scattered in place, so only this rank's shard of the buffer holds the
  average.
* :class:`ReduceScatterInBackward` (gradients sharded, stages 2-3): during every backward, each
  gradient is written, already multiplied by 1/N, into its bucket's transient buffer as it
  arrives (``param.grad`` is freed at once, so no rank keeps full gradients after backward);
  once a bucket's gradients are all there it is reduce-scattered into this rank's persistent
  ``grad_shard``.
Reductions are asynchronous: backward goes on computing earlier layers' gradients while a
bucket is on the wire (wait-free backpropagation); ``finish_backward`` waits for them. The
collective itself, the backend's or a compressed one, is the codec's
(``comm_compression``; [Note: gradient codecs] in zerotrain/compression/codec.py).

[Note: fp32 gradient accumulation]
``data_types.grad_accum_dtype: fp32`` under bf16 or fp16 (``accum_dtype``; bf16 below, fp16
alike: tests/test_grad_accum_dtype.py checks both bit for bit) keeps the persistent gradient
buffers in fp32, as DeepSpeed 0.19 does (its BF16_Optimizer at stage 1, ``gradient_accumulation_
dtype`` of its ZeRO 2-3 optimizers); gradients are still produced and sent in bf16 (or
``communication_data_type``):
* stages 0-1: each micro-step's bf16 ``param.grad`` is added, upcast, into the fp32 ``flat_grad``
  by its hook and dropped (``param.grad`` views no buffer: it is None between backwards); at the
  boundary the fp32 sum is rounded once to the wire's dtype, reduced, and stored back in fp32.
* stages 2-3: each micro-step is reduce-scattered in bf16 as before and the reduced shard is
  added, upcast, into the fp32 ``grad_shard``.
So a step's gradient is rounded to bf16 once per reduction instead of once per micro-step's
addition. The store takes the fp32 buffers as the masters' gradients with no copy. DeepSpeed
refuses this at stage 0 (an "unsupported mix" of dtypes), and so does the config.

A pipeline rank running several stages (interleaved 1F1B, ZBV) gives each backward the
gradients of one stage's parameters only: :meth:`GradientReduction.restrict` limits what the
reductions in backward (stages 2-3) launch to that stage's buckets, so the others do not travel
as zeros. A boundary reduction (stages 0-1) still reduces every bucket: it sends what the whole
accumulation gathered.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import ClassVar

import torch

from zerotrain.comm import Communicator
from zerotrain.compression import BucketShape, GradientCompression, make_codec
from zerotrain.compression.codec import Chain, Pending
from zerotrain.zero.extension import StepExtension
from zerotrain.zero.layout import FlatBucket, ParamSlot, point_grads_at


def _nothing(*_args) -> None:
    pass


class GradientReduction(ABC):
    """Averages gradients over the ranks of ``comm``, bucket by bucket during backward: hooks,
    arrival, launch order and the backward's lifecycle; subclasses say where gradients are
    kept and which collective reduces them (see [Note: the three reductions])."""

    every_backward: ClassVar[bool]
    """Whether every backward reduces (gradients are sharded), or only the boundary's."""
    collective: ClassVar[str] = "reduce_scatter"
    """The codec's collective it calls: ``all_reduce`` or ``reduce_scatter``."""

    def __init__(
        self,
        buckets: list[FlatBucket],
        comm: Communicator,
        comm_dtype: torch.dtype | None = None,
        on_bucket_grads_taken: Callable[[FlatBucket], None] = _nothing,
        on_settled: Callable[[], None] = _nothing,
        on_bucket_reduced: Callable[[int, torch.Tensor], None] = _nothing,
        average_over: int | None = None,
        compression: GradientCompression | None = None,
        embeddings: Collection[int] = (),
        accum_dtype: torch.dtype | None = None,
    ):
        self.buckets = buckets
        self.comm = comm
        # the persistent buffers' dtype (None: the training dtype; see [Note: fp32 gradient
        # accumulation])
        self.accum_dtype = accum_dtype
        # how each bucket travels: the backend's collectives, or compressed ones; the
        # ``embeddings`` (ids of embedding tables) are whole under the low-rank methods
        shapes = [
            BucketShape(
                b.numel_padded,
                [(s.offset, tuple(s.shape)) for s in b.slots],
                frozenset(s.offset for s in b.slots if id(s.param) in embeddings),
            )
            for b in buckets
        ]
        self.shapes = shapes
        self.codec = make_codec(compression, comm, shapes)
        # communication_data_type: the dtype gradients are summed in (None: the training dtype)
        self.comm_dtype = comm_dtype
        self._on_bucket_grads_taken = on_bucket_grads_taken  # all of a bucket's grads are in
        self._on_settled = on_settled  # a backward's reductions are all done
        # A bucket's gradient is final for the step: its reduction at the boundary completed.
        self._on_bucket_reduced = on_bucket_reduced
        self._at_boundary = False
        # the ranks whose gradients are averaged: ``comm``'s, or more where each rank's
        # gradients already sum those of others (an expert's, over its expert-parallel group)
        self._inv_world = 1.0 / (average_over or comm.world_size)
        self._arrived: list[set[int]] = [set() for _ in buckets]
        self.launches = [0] * len(buckets)  # reductions launched per bucket (auto counts them)
        self._pending: list[Pending] = []
        self._pending_buckets: list[int] = []  # the bucket of each pending op
        self._all = list(range(len(buckets)))
        self._scope = self._all  # the buckets a reduction in backward launches (see restrict)
        self._order = self._all  # this backward's launch order
        self._place = {b: i for i, b in enumerate(self._order)}  # bucket -> its place in it
        self._next_launch = 0  # the place of the next bucket to launch
        # A backward was reduced in this accumulation (stage 1: flat_grad's shard holds an
        # average).
        self._shard_holds_grads = False
        # Parameters whose .grad holds gradients another engine's backward wrote, not reduced
        # yet: this engine's next backward reduces them with its own; step() refuses them.
        self._stray: set[int] = set()
        self._reducing = self.every_backward  # else only in the boundary's backward
        self._in_backward = False  # between begin_backward and finish_backward
        # Called with the parameter's name when a gradient arrives while no backward is open:
        # it raises, opens one (begin_backward), or accepts the gradient as a plain .grad
        # (see backward.py).
        self.on_stray_grad: Callable[[str], None] = _refuse_stray_grad
        self._grad_factor = 1.0  # on this backward's gradients (see begin_backward)
        # the group's step extensions (extension.py), which may keep a bucket's gradient on
        # this rank or rewrite it as it is sent (stage 0's reduction honours them)
        self.extensions: list[StepExtension] = []
        for bucket in buckets:
            self._allocate(bucket)
        self._hooks: dict[int, Callable[[torch.Tensor], None]] = {}  # id(param) -> its hook
        for bucket_index, bucket in enumerate(buckets):
            for slot in bucket.slots:
                hook = self._make_hook(bucket_index, slot)
                self._hooks[id(slot.param)] = hook
                slot.param.register_post_accumulate_grad_hook(hook)

    def wire_dtype(self, bucket: FlatBucket) -> torch.dtype:
        """The dtype ``bucket``'s gradients are summed over the ranks in: its own (torch_autocast's
        lower-precision-safe modules), else communication_data_type's, else the training dtype."""
        return bucket.comm_dtype or self.comm_dtype or bucket.dtype

    # -- what a strategy decides -----------------------------------------------------------------
    @abstractmethod
    def _allocate(self, bucket: FlatBucket) -> None:
        """Create the bucket's persistent gradient buffer."""

    @abstractmethod
    def _take_grad(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        """A parameter's gradient of this backward is complete: take it into the bucket."""

    @abstractmethod
    def _launch(self, index: int) -> None:
        """Start bucket ``index``'s reduction (asynchronous, appended to ``_pending``)."""

    @abstractmethod
    def reduced_grads(self) -> list[torch.Tensor]:
        """Per bucket, the averaged gradient of the part the optimizer steps on this rank."""

    @abstractmethod
    def grad_buffers(self) -> list[torch.Tensor]:
        """The persistent gradient buffers (for memory accounting)."""

    @abstractmethod
    def _reset_grads(self) -> None:
        """Empty the gradient buffers for a new accumulation."""

    def _on_hook(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        if self._reducing:
            self._on_grad_ready(bucket_index, slot, param)

    def _prepare_backward(self, at_boundary: bool) -> None:  # noqa: B027 (a hook: optional)
        """Before a backward, after the factor is set."""

    def _end_backward_grads(self) -> None:  # noqa: B027 (a hook: optional)
        """After a backward, before its reductions are launched."""

    def _drop_transients(self) -> None:  # noqa: B027 (a hook: optional)
        """Forget buffers that only live within one backward."""

    # -- the common path ---------------------------------------------------------------------------
    def _make_hook(self, bucket_index: int, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:
                self.on_stray_grad(slot.name)  # raises, opens a backward, or leaves .grad be
                if not self._in_backward:
                    self._stray.add(slot.index)  # in .grad, not reduced yet
                    return
            self._on_hook(bucket_index, slot, param)

        return hook

    def take_assigned_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Take the gradients a backward assigned to ``params``' ``.grad`` (no hook of
        autograd's accumulation saw them) as their hooks would have."""
        for param in params:
            if param.grad is not None:
                self._hooks[id(param)](param)

    def restrict(self, buckets: list[int] | None) -> None:
        """Let the following backwards' reductions launch only ``buckets`` (ascending; None: all):
        their gradients are the only ones those backwards produce (see the module's docstring)."""
        self._scope = self._all if buckets is None else buckets

    def _on_grad_ready(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        place = self._place.get(bucket_index)
        if place is None:
            raise RuntimeError(
                f"gradient of '{slot.name}' arrived in a backward restricted to other buckets "
                "(a pipeline stage's backward reached a parameter of another of its stages)"
            )
        if place < self._next_launch:
            raise RuntimeError(
                f"gradient of '{slot.name}' arrived after its bucket was reduced: a parameter got "
                "gradients from two backward passes in one micro-step. Call engine.backward "
                "once per micro-batch (sum the losses first)."
            )
        self._take_grad(bucket_index, slot, param)
        arrived = self._arrived[bucket_index]
        arrived.add(slot.index)
        bucket = self.buckets[bucket_index]
        if len(arrived) == len(bucket.slots):
            self._on_bucket_grads_taken(bucket)
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self._order):
            index = self._order[self._next_launch]
            complete = len(self._arrived[index]) == len(self.buckets[index].slots)
            if not (complete or force):
                return
            self._launch(index)
            self.launches[index] += 1
            self._pending_buckets.append(index)
            self._next_launch += 1

    def begin_backward(self, at_boundary: bool, grad_factor: float = 1.0) -> None:
        """Called before each micro-step's backward.

        ``grad_factor`` multiplies every gradient this backward produces, whichever path it
        took to the parameter (``loss.backward()`` divides by the accumulation steps here)."""
        self._in_backward = True
        self._at_boundary = at_boundary
        self._reducing = self.every_backward or at_boundary
        order = self._scope if self.every_backward else self._all
        if order is not self._order:
            self._order, self._place = order, {b: i for i, b in enumerate(order)}
        self._grad_factor = grad_factor
        self._prepare_backward(at_boundary)

    def finish_backward(self, at_boundary: bool) -> None:
        """Called after each micro-step's backward: launches what is left, waits for all."""
        self._in_backward = False
        self._end_backward_grads()
        self._grad_factor = 1.0
        if not (self.every_backward or at_boundary):
            return
        self._launch_ready(force=True)  # also all buckets if no hook saw this backward
        self._settle()
        self._stray.clear()  # reduced with this backward's
        self._shard_holds_grads = True

    def abort_backward(self) -> None:
        """Forget a backward that raised part-way (a caught out-of-memory error, a bad batch):
        the accumulation's gradients are dropped and the next backward starts clean.
        Reductions already launched are waited for, so every rank stays in step."""
        self._in_backward = False
        self._at_boundary = False
        self._grad_factor = 1.0
        self._settle()
        self.codec.abort_backward()
        self._drop_transients()
        for arrived in self._arrived:
            arrived.clear()
        self.zero_grads()

    def _settle(self) -> None:
        """Wait for every reduction in flight and return to the state between backwards."""
        grads = self.reduced_grads() if self._at_boundary and self._pending else []
        for op, index in zip(self._pending, self._pending_buckets, strict=True):
            op.wait()
            if grads:  # views of the persistent buffers: final once the op completed
                self._on_bucket_reduced(index, grads[index])
        self._pending.clear()
        self._pending_buckets.clear()
        self._next_launch = 0
        self._reducing = self.every_backward
        self._on_settled()

    @property
    def unreduced_grads(self) -> list[str]:
        """Names of parameters holding gradients another engine's backward wrote since this
        engine's last reduction and still in ``.grad`` (step() would not average them)."""
        if not self._stray:  # every step asks: skip the walk over the parameters
            return []
        return [
            s.name
            for b in self.buckets
            for s in b.slots
            if s.index in self._stray and s.param.grad is not None
        ]

    @property
    def holds_reduced(self) -> bool:
        """Whether :meth:`reduced_grads` hold this accumulation's gradients: from the end of a
        reduced backward (every one at stages 2-3, the boundary's at 0-1) until the step."""
        return self._shard_holds_grads

    def zero_grads(self) -> None:
        """Start a new accumulation."""
        self._shard_holds_grads = False
        self._stray.clear()
        self._reset_grads()


class _InPlaceReduction(GradientReduction):
    """Gradients accumulate in a full flat buffer per bucket that every ``param.grad`` views,
    and only the boundary's backward reduces it, in place."""

    every_backward = False

    def __init__(self, *args, **kwargs):
        self._carry: list[torch.Tensor] = []  # stage 1: see _carry_reduced_shards
        super().__init__(*args, **kwargs)

    @abstractmethod
    def _owned(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        """The part of a bucket-sized tensor that holds the average after the reduction."""

    @abstractmethod
    def _reduce(self, index: int, wire: torch.Tensor) -> Pending:
        """The asynchronous reduction of bucket ``index``'s ``wire`` (the flat gradient, scaled
        by 1/N)."""

    def _allocate(self, bucket: FlatBucket) -> None:
        bucket.flat_grad = torch.zeros(
            bucket.numel_padded, dtype=self.accum_dtype or bucket.dtype, device=bucket.device
        )
        if not self._widened(bucket):
            point_grads_at(bucket)  # after the params: a grad must match their dtype

    def _widened(self, bucket: FlatBucket) -> bool:
        """Whether ``flat_grad`` is wider than the parameters, so no ``param.grad`` views it
        (see [Note: fp32 gradient accumulation])."""
        return self.accum_dtype not in (None, bucket.dtype)

    def _settle_grad(self, bucket: FlatBucket, slot: ParamSlot) -> None:
        """A ``param.grad`` no hook took into the buffer: the view again, or (widened) added
        into the buffer and dropped."""
        if not self._widened(bucket):
            _repair_grad_view(bucket, slot)
        elif slot.param.grad is not None:  # written while no backward was open
            bucket.view(bucket.require_flat_grad(), slot).add_(slot.param.grad)
            slot.param.grad = None

    def _on_hook(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        bucket = self.buckets[bucket_index]
        if self._grad_factor != 1.0 or self._widened(bucket):
            _fold_into_view(bucket, slot, self._grad_factor, keep_view=not self._widened(bucket))
        super()._on_hook(bucket_index, slot, param)

    def _take_grad(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        self._settle_grad(self.buckets[bucket_index], slot)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        for slot in bucket.slots:  # parameters without a gradient this backward
            if slot.index not in self._arrived[index]:
                self._settle_grad(bucket, slot)
        wire = bucket.require_flat_grad()
        if any(e.keeps_gradient(index, wire) for e in self.extensions):  # this rank's step's
            self._pending.append(Chain([], self._arrived[index].clear))
            return
        if self.wire_dtype(bucket) != wire.dtype:
            # summed in that dtype (an fp32 accumulation: rounded once), stored back after
            wire = wire.to(self.wire_dtype(bucket))
        for extension in self.extensions:
            extension.sending(index, wire)
        wire.mul_(self._inv_world)
        op = self._reduce(index, wire)
        self._pending.append(op.then(lambda: self._store_reduced(index, wire)))

    def _store_reduced(self, index: int, wire: torch.Tensor) -> None:
        """The reduced bucket into ``flat_grad`` (a copy only when it travelled in another
        dtype)."""
        bucket = self.buckets[index]
        flat_grad = bucket.require_flat_grad()
        if wire is not flat_grad:
            self._owned(bucket, flat_grad).copy_(self._owned(bucket, wire))
        if self._carry:
            bucket.shard(flat_grad).add_(self._carry[index])
        self._arrived[index].clear()

    def _prepare_backward(self, at_boundary: bool) -> None:  # noqa: B027 (a hook: optional)
        """Stages 0-1 let autograd write fresh gradients under a factor (or into no buffer:
        widened) and fold them, scaled, into the accumulating buffer."""
        for bucket in self.buckets:
            if self._grad_factor != 1.0 or self._widened(bucket):
                for slot in bucket.slots:
                    self._settle_grad(bucket, slot)  # a .grad written meanwhile: keep it
                    slot.param.grad = None

    def _end_backward_grads(self) -> None:  # noqa: B027 (a hook: optional)
        if self._grad_factor != 1.0:
            for bucket in self.buckets:  # parameters this backward gave no gradient
                if self._widened(bucket):  # none views the buffer
                    continue
                for slot in bucket.slots:
                    if slot.param.grad is None:
                        slot.param.grad = bucket.view(bucket.require_flat_grad(), slot)

    def _settle(self) -> None:
        super()._settle()
        self._carry = []

    def reduced_grads(self) -> list[torch.Tensor]:
        return [self._owned(b, b.require_flat_grad()) for b in self.buckets]

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.require_flat_grad() for b in self.buckets]

    def _reset_grads(self) -> None:
        for bucket in self.buckets:
            bucket.require_flat_grad().zero_()
            if self._widened(bucket):  # what a backward that raised left in .grad goes too
                for slot in bucket.slots:
                    slot.param.grad = None
            else:
                point_grads_at(bucket)  # also where a backward that raised left them None


class AllReduceAtBoundary(_InPlaceReduction):
    """Stage 0: every rank ends with the whole averaged gradient."""

    collective = "all_reduce"

    def _owned(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def _reduce(self, index: int, wire: torch.Tensor) -> Pending:
        return self.codec.all_reduce(index, wire)


class ReduceScatterAtBoundary(_InPlaceReduction):
    """Stage 1: each rank ends with the average in its own shard of the full buffer."""

    def _owned(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        return bucket.shard(flat)

    def _reduce(self, index: int, wire: torch.Tensor) -> Pending:
        shard = self.buckets[index].shard(wire)  # in place: the input's own slice
        return self.codec.reduce_scatter(index, shard, wire)

    def _prepare_backward(self, at_boundary: bool) -> None:  # noqa: B027 (a hook: optional)
        if at_boundary and self._shard_holds_grads:
            self._carry_reduced_shards()
        super()._prepare_backward(at_boundary)

    def _carry_reduced_shards(self) -> None:
        """A second reduced backward in one accumulation (two losses, two engines): the first
        reduction left the average in this rank's shard of ``flat_grad`` and unreduced values
        elsewhere, which a second in-place reduce-scatter would sum again. Keep the average
        (for parameters whose ``.grad`` the user did not drop, as ``zero_grad`` does in torch),
        restart the buffer from zero, and add the average back after the reduction
        (``_store_reduced``)."""
        stray = self.unreduced_grads
        if stray:
            raise RuntimeError(
                f"gradients of {stray[:3]} from another engine's backward arrived after this "
                "accumulation was reduced; at ZeRO stage 1 they cannot join it: drop them with "
                "zero_grad() first (or step before the other engine's backward)"
            )
        self._carry = []
        for bucket in self.buckets:
            kept = bucket.shard(bucket.require_flat_grad()).clone()
            start, end = bucket.shard_range()
            widened = self._widened(bucket)  # no .grad a user could drop
            for slot in bucket.slots:
                if slot.param.grad is None and not widened:  # dropped by the user: its average
                    lo, hi = slot.overlap(start, end)  # goes too
                    if lo < hi:
                        kept[lo - start : hi - start].zero_()
            self._carry.append(kept)
            bucket.require_flat_grad().zero_()
            if not widened:
                point_grads_at(bucket)


class ReduceScatterInBackward(GradientReduction):
    """Stages 2-3: every backward reduce-scatters into this rank's persistent ``grad_shard``."""

    every_backward = True

    def __init__(self, *args, **kwargs):
        self._comm_buffers: list[torch.Tensor | None] = []
        # buckets whose grad_shard holds this accumulation's gradients (the others are stale:
        # overwritten by their first reduction)
        self._written: set[int] = set()
        super().__init__(*args, **kwargs)
        self._comm_buffers = [None] * len(self.buckets)

    def _allocate(self, bucket: FlatBucket) -> None:
        # in the dtype the reduction produces, or the wider one it accumulates in
        dtype = self.accum_dtype or self.comm_dtype or bucket.dtype
        bucket.grad_shard = torch.zeros(bucket.shard_numel, dtype=dtype, device=bucket.device)

    def _comm_buffer(self, bucket_index: int) -> torch.Tensor:
        # Uninitialised: every gradient is written into it once, and _launch zeroes the rest
        # (padding, parameters without a gradient); a zeros() would write the bucket twice.
        buffer = self._comm_buffers[bucket_index]
        if buffer is None:
            bucket = self.buckets[bucket_index]
            dtype = self.wire_dtype(bucket)
            buffer = torch.empty(bucket.numel_padded, dtype=dtype, device=bucket.device)
            self._comm_buffers[bucket_index] = buffer
        return buffer

    def _take_grad(self, bucket_index: int, slot: ParamSlot, param: torch.Tensor) -> None:
        buffer = self._comm_buffer(bucket_index)
        # The average's 1/N on the way in: one pass over the gradient, not a copy and a
        # scaling pass over the bucket (the same rounding: one multiply per element).
        torch.mul(
            _hooked_grad(param, slot).reshape(-1),
            self._inv_world if self._grad_factor == 1.0 else self._inv_world * self._grad_factor,
            out=buffer[slot.offset : slot.offset + slot.numel],
        )
        param.grad = None

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        buffer = self._comm_buffer(index)  # the gradients that arrived, already scaled
        for slot in bucket.slots:
            if slot.index not in self._arrived[index]:
                buffer[slot.offset : slot.offset + slot.numel].zero_()
        buffer[bucket.numel :].zero_()
        shard = bucket.require_grad_shard()
        first = index not in self._written  # its first reduction of this accumulation: write
        self._written.add(index)
        if first and shard.dtype == buffer.dtype:
            op = self.codec.reduce_scatter(index, shard, buffer)
            self._pending.append(op.then(lambda: self._free_buffer(index)))
        else:  # added (or, widened, copied) into the shard: see [Note: fp32 gradient accumulation]
            reduced = torch.empty(shard.numel(), dtype=buffer.dtype, device=shard.device)
            op = self.codec.reduce_scatter(index, reduced, buffer)
            self._pending.append(op.then(lambda: self._free_buffer(index, reduced, first)))

    def _free_buffer(
        self, index: int, reduced: torch.Tensor | None = None, first: bool = False
    ) -> None:
        if reduced is not None:
            shard = self.buckets[index].require_grad_shard()
            if first:
                shard.copy_(reduced)
            else:
                shard.add_(reduced)
        self._comm_buffers[index] = None
        self._arrived[index].clear()

    def _drop_transients(self) -> None:  # noqa: B027 (a hook: optional)
        self._comm_buffers = [None] * len(self.buckets)

    def reduced_grads(self) -> list[torch.Tensor]:
        return [b.require_grad_shard() for b in self.buckets]

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.require_grad_shard() for b in self.buckets]

    def _reset_grads(self) -> None:
        self._written.clear()
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.grad = None


def _repair_grad_view(bucket: FlatBucket, slot: ParamSlot) -> None:
    """Make ``param.grad`` the view into the flat buffer again (stages 0-1). If user code
    replaced it (e.g. ``module.zero_grad(set_to_none=True)``), autograd accumulated into a fresh
    tensor; fold that into the buffer. No gradient at all: the parameter contributes zeros."""
    grad = slot.param.grad
    view = bucket.view(bucket.require_flat_grad(), slot)
    if grad is None or grad.data_ptr() != view.data_ptr():
        if grad is not None:
            view.copy_(grad)
        else:
            view.zero_()
        slot.param.grad = view


def _fold_into_view(bucket: FlatBucket, slot: ParamSlot, factor: float, keep_view: bool) -> None:
    """Add ``factor`` times this backward's fresh gradient into the accumulating buffer, and
    make ``param.grad`` the buffer's view again, or None where the buffer is wider (stages 0-1,
    with a gradient factor or fp32 accumulation)."""
    view = bucket.view(bucket.require_flat_grad(), slot)
    view.add_(_hooked_grad(slot.param, slot), alpha=factor)  # upcast exactly, one rounding
    slot.param.grad = view if keep_view else None


def _hooked_grad(param: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """``param.grad`` in its post-accumulate-grad hook, where autograd has just written it."""
    grad = param.grad
    if grad is None:  # another hook on the parameter, run first, took it
        raise RuntimeError(
            f"gradient of '{slot.name}' is None in this engine's gradient hook: another hook "
            "on the parameter set its .grad to None first"
        )
    return grad


def _refuse_stray_grad(name: str) -> None:
    raise RuntimeError(f"gradient of '{name}' arrived while no backward was open")
