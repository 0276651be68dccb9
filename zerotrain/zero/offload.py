"""Optimizer offload: fp32 masters and optimizer state in host memory, stepped there.

[Note: the offload hand-off]
ZeRO-Offload (arXiv:2101.06840) keeps the fp32 master weights and the optimizer state of
some buckets ("host buckets") in host memory and runs their optimizer step on the CPU; the
device keeps the 16-bit parameters and gradients. A step's data moves bucket by bucket:
* at the accumulation boundary, as soon as a bucket's gradient reduction has completed, its
  gradient is copied into the bucket's preallocated fp32 host buffer (on CUDA: on a side
  stream, so backward goes on) and its norm is taken on the device, so the global norm is
  known when backward ends (:meth:`OffloadedShardStore.take_reduced`);
* the step unscales and clips the host gradients, steps the masters with the configured torch
  optimizer (fused CPU kernels where torch has them) and sends each updated bucket back through
  a ring of ``buffer_count`` preallocated (pinned) host buffers in the training dtype
  (:meth:`OffloadedShardStore.write_params`): no host allocation inside a step.
Buckets kept on the device (``ratio`` below 1) are stepped there, as without offload. The
numerics are the in-memory path's: the same optimizer over the same fp32 values, the same norm
of each bucket's fp32 gradient, summed in bucket order (bit for bit on a CPU device).

Which buckets go to the host: backward produces gradients in bucket order (buckets hold the
parameters in reverse registration order), and forward needs parameters in the reverse of it.
The first buckets therefore have their gradients earliest and their parameters needed last:
the host takes buckets from the front until it holds ``ratio`` of the elements, so the work
left on the critical path is the device's (:func:`choose_host_buckets`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from zerotrain.accelerator import available_host_memory
from zerotrain.optim.state_bytes import optimizer_state_bytes_per_element
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.host import configure_host_threads, host_tensor
from zerotrain.zero.low_precision import LowPrecisionSteps, gradients_only
from zerotrain.zero.store import (
    InMemoryShardStore,
    OptimizerOver,
    ParamShards,
    Placement,
    ShardStore,
    masters_alias_params,
    needs_whole_parameters,
    sum_of_squares,
    write_device_params,
)
from zerotrain.zero.swap import AioOptions


@dataclass(frozen=True, kw_only=True)
class OffloadOptions:
    """``zero_optimization.offload_optimizer`` (with ``sub_group_size`` and ``aio``), as the
    shard group reads it."""

    device: str = "cpu"  # "cpu" or "nvme"
    ratio: float | str = 1.0  # share of the optimizer state on the host, or "auto"
    pin_memory: bool = True
    buffer_count: int = 4
    nvme_path: str | None = None
    sub_group_size: int = 1_000_000_000
    device_budget: Callable[[], int | None] | None = None  # ratio "auto": free device bytes
    aio: AioOptions = field(default_factory=AioOptions)  # NVMe I/O


def choose_host_buckets(numels: list[int], ratio: float) -> list[bool]:
    """Per bucket (in bucket order), whether its optimizer state lives on the host: buckets
    from the front until the host holds at least ``ratio`` of the elements (see [Note: the
    offload hand-off])."""
    total = sum(numels)
    on_host, held = [], 0
    for numel in numels:
        take = total > 0 and held < ratio * total
        on_host.append(take)
        held += numel if take else 0
    return on_host


def fit_on_device(numels: list[int], bytes_per_element: float, budget: int) -> list[bool]:
    """``ratio: auto``: per bucket, whether it goes to the host, keeping on the device the
    buckets from the back (gradients last in backward, parameters first in forward) while
    their optimizer state fits in ``budget`` bytes."""
    on_host = [True] * len(numels)
    used = 0.0
    for index in reversed(range(len(numels))):
        need = numels[index] * bytes_per_element
        if used + need > budget:
            break
        on_host[index] = False
        used += need
    return on_host


RING_CHUNK = 1 << 24
"""Elements per ring buffer at most (32 MiB in bf16): a bucket larger than this goes through
the ring in pieces, so the ring's size does not grow with ``reduce_bucket_size``."""


def ring_numel(largest: int) -> int:
    """Elements per ring buffer for buckets (or sub-groups) of at most ``largest``."""
    return min(largest, RING_CHUNK)


class Ring:
    """``count`` host buffers of ``numel`` elements, reused in turn to send updated parameters
    to the device; a buffer is reused once the copy out of it has completed (CUDA events). To a
    CPU device the copy is synchronous and goes straight to the target: the buffers, allocated
    for the estimator's count, are never touched, so they take no resident memory."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, *, pin: bool):
        self.buffers = [host_tensor(numel, dtype, pin=pin) for _ in range(count)]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def send(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy host ``source`` (any dtype) to ``target`` (the device shard) through the ring,
        a buffer's worth at a time."""
        size = self.buffers[0].numel()
        for start in range(0, source.numel(), size):
            end = min(source.numel(), start + size)
            self._send_piece(source[start:end], target[start:end])

    def _send_piece(self, source: torch.Tensor, target: torch.Tensor) -> None:
        if not target.is_cuda:  # a synchronous copy needs no staging: the buffers stay untouched
            target.copy_(source)  # the same rounding as through a buffer of target's dtype
            return
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        event = self._events[index]
        if event is not None:
            event.synchronize()  # its previous copy to the device is done: reusable
        staged = self.buffers[index][: source.numel()]
        staged.copy_(source)
        target.copy_(staged, non_blocking=True)  # CUDA-only: asynchronous out of pinned memory
        event = torch.cuda.Event()
        event.record()
        self._events[index] = event

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers)


def quiesce_device() -> None:
    """CUDA-only: wait for the device's queued work before the host writes memory that queued
    copies may still read (offload_param's host shards, read by asynchronous copies)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class BucketNorms:
    """Each bucket's fp32 gradient norm, taken on the device as its reduction completes; summed
    in bucket order, as the in-memory store sums them."""

    def __init__(self, buckets: int):
        self._norms: list[torch.Tensor | None] = [None] * buckets

    def take(self, index: int, grad: torch.Tensor) -> None:
        fp32 = grad if grad.dtype == torch.float32 else grad.float()
        self._norms[index] = torch._foreach_norm([fp32])[0]

    def taken(self, index: int) -> bool:
        return self._norms[index] is not None

    def forget(self) -> None:
        self._norms = [None] * len(self._norms)

    def sum_of_squares(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        return sum_of_squares(self._norms, weights)


@dataclass(eq=False)
class _DeferredStep:
    """One host bucket's share of a deferred step: its gradient, its target, the step's
    hyperparameters."""

    store: OffloadedShardStore
    index: int
    grad: torch.Tensor | None
    targets: ParamShards
    hyper: list[dict]

    def run(self) -> None:
        store = self.store
        if store._deferred.pop(self.index, None) is None:
            return  # ran already (a state access settled it)
        master = store._masters[self.index]
        groups = store.optimizer.param_groups
        now = [{k: g[k] for k in h} for g, h in zip(groups, self.hyper, strict=True)]
        for group, hyper in zip(groups, self.hyper, strict=True):
            group.update(hyper)
        master.grad = self.grad
        try:
            # It may run before this step's gradients are released (stage 3 refreshes its
            # persistent units right after the step): only this master may have one, or the
            # device's buckets would be stepped twice.
            with gradients_only(store._masters, [master]):
                store.step_optimizer([master], [self.index])
        finally:
            master.grad = None
            for group, current in zip(groups, now, strict=True):
                group.update(current)
        assert store._ring is not None
        store._ring.send(master, self.targets.open(self.index))
        self.targets.close(self.index)


class OffloadedShardStore(InMemoryShardStore):
    """The masters of host buckets in host memory, stepped there; the others on the device
    (see [Note: the offload hand-off]). One torch optimizer steps them all."""

    def __init__(
        self,
        masters: list[torch.Tensor],
        on_host: list[bool],
        optimizer: torch.optim.Optimizer,
        *,
        masters_alias_params: bool,
        precision: PrecisionPolicy,
        options: OffloadOptions,
    ):
        self._masters = masters
        self.on_host = on_host
        self.optimizer = optimizer
        self.masters_alias_params = masters_alias_params  # device buckets, masters in their dtype
        self.low_precision = LowPrecisionSteps(precision)
        param_dtype = precision.param_dtype
        pin = options.pin_memory
        # The host buckets' gradients, in the masters' dtype (the "4" of ZeRO-Offload's host
        # bytes; 2 with bf16 masters and gradients).
        self._host_grads = [
            host_tensor(m.numel(), precision.master_dtype, pin=pin) if host else None
            for m, host in zip(masters, on_host, strict=True)
        ]
        host_numels = [m.numel() for m, host in zip(masters, on_host, strict=True) if host]
        self._ring = (
            Ring(options.buffer_count, ring_numel(max(host_numels)), param_dtype, pin=pin)
            if host_numels
            else None
        )
        self._norms = BucketNorms(len(masters))  # taken this step
        self._copied: list[torch.cuda.Event | None] = [None] * len(masters)
        self._side_stream = None  # CUDA-only: the device-to-host gradient copies
        self._deferred: dict[int, _DeferredStep] = {}  # host buckets not stepped yet

    # -- gradients in ---------------------------------------------------------------------------
    def take_reduced(self, index: int, grad: torch.Tensor) -> None:
        """Bucket ``index``'s gradient is final for this step (its reduction at the boundary has
        completed): take its norm and, for a host bucket, start its copy to the host."""
        self._norms.take(index, grad)
        host_grad = self._host_grads[index]
        if host_grad is None:
            return
        if grad.is_cuda:  # CUDA-only: copy on a side stream while backward goes on
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            self._side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side_stream):
                host_grad.copy_(grad, non_blocking=True)
                grad.record_stream(self._side_stream)
                event = torch.cuda.Event()
                event.record()
            self._copied[index] = event
        else:
            host_grad.copy_(grad)

    def attach_grads(self, reduced_grads: list[torch.Tensor]) -> None:
        for index, grad in enumerate(reduced_grads):
            if not self._norms.taken(index):  # no boundary backward handed it over
                self.take_reduced(index, grad)
            master, host_grad = self._masters[index], self._host_grads[index]
            if host_grad is None:
                master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
                continue
            event = self._copied[index]
            if event is not None:
                event.synchronize()
                self._copied[index] = None
            master.grad = host_grad

    def grad_sum_of_squares(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        return self._norms.sum_of_squares(weights)

    def scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        grads = [m.grad for m in self._masters if m.grad is not None]
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], factor)

    # -- a step deferred to each bucket's next use ----------------------------------------------
    def step_deferred(self, param_shards: ParamShards) -> dict[int, Callable[[], None]]:
        """Step the device buckets now and return the host buckets' steps, each to run at its
        bucket's next use (see [Note: a step deferred to the next use] in in_flight.py)."""
        if needs_whole_parameters(self.optimizer):  # one collective step over every bucket
            self.step(param_shards)
            return {}
        self._settle()
        hosted = [i for i, host in enumerate(self.on_host) if host]
        grads = {i: self._masters[i].grad for i in hosted}
        for index in hosted:  # out of the device buckets' step
            self._masters[index].grad = None
        if len(hosted) < len(self._masters):
            self.step_optimizer(self._masters)
            write_device_params(self._device_side(), param_shards, alias=self.masters_alias_params)
        # this step's hyperparameters: a scheduler changes them before the deferred steps run
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        quiesce_device()
        self._deferred = {i: _DeferredStep(self, i, grads[i], param_shards, hyper) for i in hosted}
        return {i: step.run for i, step in self._deferred.items()}

    def _settle(self) -> None:
        for step in list(self._deferred.values()):
            step.run()

    # -- parameters out -------------------------------------------------------------------------
    def write_params(self, param_shards: ParamShards) -> None:
        self._settle()
        quiesce_device()
        write_device_params(self._device_side(), param_shards, alias=self.masters_alias_params)
        # The first buckets' parameters are needed last in forward: send the last ones first.
        for index in reversed(range(len(self._masters))):
            if self.on_host[index]:
                assert self._ring is not None
                self._ring.send(self._masters[index], param_shards.open(index))
                param_shards.close(index)

    def _device_side(self) -> list[torch.Tensor | None]:
        """Per bucket, its master where the device steps it, else None."""
        return [None if host else m for m, host in zip(self._masters, self.on_host, strict=True)]

    def release_grads(self) -> None:
        for master in self._masters:
            master.grad = None
        self._norms.forget()

    def forget_taken(self) -> None:
        self._norms.forget()
        self._copied = [None] * len(self._masters)

    # -- what lives where -----------------------------------------------------------------------
    def offloaded_tensors(self) -> list[torch.Tensor]:
        masters = [m for m, host in zip(self._masters, self.on_host, strict=True) if host]
        state = [
            t
            for m in masters
            for t in self.optimizer.state.get(m, {}).values()
            if torch.is_tensor(t)
        ]
        return masters + state + [g for g in self._host_grads if g is not None]

    def offloaded_numel(self) -> int:
        return sum(m.numel() for m, host in zip(self._masters, self.on_host, strict=True) if host)

    def staging_bytes(self) -> int:
        return self._ring.nbytes() if self._ring is not None else 0


@dataclass(frozen=True)
class HostBytes:
    """Host memory one rank's optimizer offload allocates (see [Note: the offload hand-off])."""

    masters: int
    optimizer_state: int
    gradients: int
    staging: int  # the ring that carries parameters back

    @property
    def total(self) -> int:
        return self.masters + self.optimizer_state + self.gradients + self.staging


def host_bytes(
    numel: int,
    largest: int,
    *,
    state_bytes: float,
    param_itemsize: int,
    buffer_count: int,
    master_itemsize: int = 4,
) -> HostBytes:
    """What :class:`OffloadedShardStore` allocates for ``numel`` offloaded elements in buckets
    of at most ``largest``: masters (fp32; ``master_itemsize`` 2 for bf16 masters),
    ``state_bytes`` of optimizer state as stored and a gradient in the masters' dtype per
    element, and ``buffer_count`` ring buffers of the largest bucket (at most
    :data:`RING_CHUNK` elements) in the training dtype. The memory preflight of ``initialize``
    and ``zerotrain estimate --offload`` count with it (zerotrain/estimate/stages.py)."""
    ring = buffer_count * ring_numel(largest) * param_itemsize
    masters = master_itemsize * numel
    return HostBytes(masters, round(state_bytes * numel), masters, ring)


AUTO_HEADROOM = 0.25
"""``ratio: auto`` leaves this share of the device's memory free for activations and
workspaces."""


def device_budget(device: torch.device) -> int | None:
    """Bytes of optimizer state ``ratio: auto`` may keep on ``device``: its free memory less
    :data:`AUTO_HEADROOM` of its total (a CPU device: the host's available memory, likewise)."""
    if device.type == "cuda":  # CUDA-only
        free, total = torch.cuda.mem_get_info(device)
    else:
        free = available_host_memory()
        if free is None:
            return None
        total = free
    return max(0, int(free - AUTO_HEADROOM * total))


class HostPlacement(Placement):
    """The masters of the host buckets in host memory (see [Note: the offload hand-off])."""

    def __init__(self, options: OffloadOptions):
        self.options = options

    def build_store(
        self,
        masters_fp32: list[torch.Tensor],
        param_parts: ParamShards,
        precision: PrecisionPolicy,
        optimizer_over: OptimizerOver,
    ) -> ShardStore:
        options = self.options
        probe = self._probe(masters_fp32, optimizer_over)
        state_bytes = optimizer_state_bytes_per_element(probe, unknown=8, stand_ins=True)
        stored = precision.stored_state_bytes(state_bytes)
        on_host = self.on_host([m.numel() for m in masters_fp32], stored, precision)
        # the host memory was checked at initialize (zerotrain/estimate/preflight.py)
        alias = masters_alias_params(precision, masters_fp32, param_parts)
        masters = []
        for index, (master, host) in enumerate(zip(masters_fp32, on_host, strict=True)):
            if host:
                masters.append(host_tensor(master.numel(), precision.master_dtype, pin=False))
                masters[-1].copy_(master)
            elif alias:
                masters.append(param_parts.tensors[index])
            else:
                masters.append(master.to(precision.master_dtype, copy=True))
        return OffloadedShardStore(
            masters,
            on_host,
            optimizer_over([[m] for m in masters]),
            masters_alias_params=alias,
            precision=precision,
            options=options,
        )

    def _probe(
        self,
        masters_fp32: list[torch.Tensor],
        optimizer_over: OptimizerOver,
        stand_ins: list[list[torch.Tensor]] | None = None,
    ) -> torch.optim.Optimizer:
        """Set the host step's threads, then probe the optimizer over ``stand_ins`` (default:
        new ones; see probe_optimizer)."""
        if masters_fp32 and masters_fp32[0].is_cuda:  # a CPU device trains on these threads
            configure_host_threads()
        return probe_optimizer(optimizer_over, stand_ins or probe_stand_ins(len(masters_fp32)))

    def on_host(self, numels: list[int], stored_state_bytes: float, precision: PrecisionPolicy):
        """Per bucket, whether it is offloaded (``ratio``, or what does not fit: ``auto``);
        ``stored_state_bytes``: the optimizer's state per element as stored."""
        if self.options.ratio != "auto":
            return choose_host_buckets(numels, float(self.options.ratio))
        budget = self.options.device_budget() if self.options.device_budget else None
        if budget is None:
            return [True] * len(numels)
        per_element = device_bytes_per_element(stored_state_bytes, precision)
        return fit_on_device(numels, per_element, budget)


def device_bytes_per_element(stored_state_bytes: float, precision: PrecisionPolicy) -> float:
    """What one element of the optimizer's partition keeps on the device, which ``ratio:
    "auto"`` weighs against the device's budget: its state as stored, and a master copy and
    its gradient where the masters are a copy (16-bit training with fp32 masters)."""
    copy = 2 * precision.master_dtype.itemsize if precision.has_master_copy else 0
    return stored_state_bytes + copy


def probe_stand_ins(buckets: int) -> list[list[torch.Tensor]]:
    """One one-element stand-in per bucket, for :func:`probe_optimizer`."""
    return [[torch.zeros(1)] for _ in range(buckets)]


def probe_optimizer(
    optimizer_over: OptimizerOver, stand_ins: list[list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """The optimizer over ``stand_ins`` (:func:`probe_stand_ins`), stepped once with zero
    gradients: its state says what it keeps per element, before anything large exists."""
    probe = optimizer_over(stand_ins, probe=True)
    for (tensor,) in stand_ins:
        tensor.grad = torch.zeros(1)
    if not needs_whole_parameters(probe):  # a collective step: not stepped here
        probe.step()
    return probe
