"""The shard group: ZeRO's unit of partitioning, in the spirit of FSDP2's ``FSDPParamGroup``.

A group is a set of flat buckets (zerotrain/zero/layout.py) partitioned over the ranks of one
communicator (passed in, never an implicit world group), with one strategy of each kind chosen
once from the ZeRO policy (see [Note: the stage is read once] in policy.py):
* which part of each bucket this rank's optimizer steps (``partition``),
* how gradients are reduced (``reduction``, zerotrain/zero/reduce.py),
* how parameters are made whole for use (``residency``, zerotrain/zero/gather.py),
* where the fp32 masters and optimizer state live and are stepped (``store``, store.py);
and the step extensions the optimizer and the compression need (``extensions``, extension.py).
Its lifecycle is explicit (:class:`GroupState`) and checked when ``ZEROTRAIN_DEBUG=1``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.compression import GradientCompression, ParameterCompression
from zerotrain.compression.auto import AutoOptions
from zerotrain.optim.catch_up import Arrivals, CatchUp, catches_up
from zerotrain.optim.onebit import ExactSteps
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.compression_tuner import CompressionTuner
from zerotrain.zero.extension import (
    CatchUpExtension,
    LocalStepsExtension,
    Resume,
    StepExtension,
)
from zerotrain.zero.gather import GatherForUseOptions, ParamResidency, Runs
from zerotrain.zero.init import ParamOwner, take_ownership
from zerotrain.zero.layout import (
    FlatBucket,
    NamedParams,
    OptimizerPartition,
    ParamSlot,
    build_buckets,
)
from zerotrain.zero.offload import OffloadOptions
from zerotrain.zero.outer_step import OuterStep, SiteOptions
from zerotrain.zero.policy import ZeroPolicy, choose_strategies
from zerotrain.zero.reduce import GradientReduction
from zerotrain.zero.store import ShardStore
from zerotrain.zero.whole_matrices import ShardedMatrices


def debug_checks() -> bool:
    """``ZEROTRAIN_DEBUG=1``: check lifecycle transitions (read at each check, so a test can
    turn it on in a running process)."""
    return os.environ.get("ZEROTRAIN_DEBUG", "") not in ("", "0")


class GroupState(enum.Enum):
    """Where a group is in a training step."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


_ALLOWED = {
    GroupState.IDLE: {GroupState.FORWARD, GroupState.BACKWARD, GroupState.STEP, GroupState.IDLE},
    GroupState.FORWARD: {GroupState.IDLE},
    GroupState.BACKWARD: {GroupState.IDLE},
    GroupState.STEP: {GroupState.IDLE},
}


@dataclass
class ShardSegments:
    """Which original parameters each master tensor holds, and where.

    Optimizers whose update needs per-parameter norms (Lamb's trust ratio) use it to compute
    them on flat shards: ``ranges[i]`` lists the ``(start, end, param_index)`` runs of the i-th
    master tensor, in order (elements in no run are padding), and ``allreduce`` sums a
    per-parameter vector across ranks. Memory per parameter, not per element. Optimizers
    whose update needs whole matrices (Muon) get them through ``matrices(group_index,
    tensors)``: the layout of optimizer group ``group_index``'s master tensors
    (:class:`ShardedMatrices`).
    """

    ranges: list[list[tuple[int, int, int]]]
    num_segments: int
    allreduce: Callable[[torch.Tensor], None]
    matrices: Callable[[int, list[torch.Tensor]], ShardedMatrices]


OptimizerFactory = Callable[[list[dict], ShardSegments | None], torch.optim.Optimizer]
"""Builds the optimizer over parameter groups of master tensors; ``segments`` None: a probe over
stand-ins (zerotrain/zero/offload.py), which needs no per-parameter layout."""


@dataclass(frozen=True)
class MasterPiece:
    """A run of one parameter's elements inside one of this rank's master tensors:
    ``master[master_start : master_start + numel]`` holds elements
    ``[param_start, param_start + numel)`` of the flattened parameter ``name``."""

    name: str
    master: int  # index into the store's master tensors (= bucket index)
    master_start: int
    param_start: int
    numel: int


class ShardGroup:
    """Flat buckets over one communicator, with their partition, reduction, residency and
    store (see the module docstring). Built by :func:`build_shard_group`."""

    def __init__(
        self,
        buckets: list[FlatBucket],
        comm: Communicator,
        partition: OptimizerPartition,
        residency: ParamResidency,
        reduction: GradientReduction,
        store: ShardStore,
        model_parallel: ModelParallel | None = None,
        summed: list[tuple[int, Communicator]] | None = None,
        extensions: list[StepExtension] | None = None,
    ):
        self.buckets = buckets
        self.comm = comm
        self.partition = partition
        self.residency = residency
        self.reduction = reduction
        self.store = store
        self.model_parallel = model_parallel
        self.summed = summed or []  # (bucket index, group), in the parameters' name order
        # by name, in the order chosen (see [Note: step extensions] in extension.py)
        self.extensions = {e.name: e for e in extensions or []}
        reduction.extensions = list(self.extensions.values())
        self.num_params = sum(b.numel for b in buckets)
        self.state = GroupState.IDLE
        self._deferred: dict[int, Callable[[], None]] = {}  # bucket -> its deferred step

    def _enter(self, state: GroupState) -> None:
        if state not in _ALLOWED[self.state] and debug_checks():
            raise RuntimeError(f"shard group: {self.state.value} -> {state.value} is not allowed")
        self.state = state

    # -- the step's phases ---------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.state is GroupState.IDLE:  # a forward inside backward recomputes: no change
            self._enter(GroupState.FORWARD)

    def end_forward(self) -> None:
        if self.state is GroupState.FORWARD:
            self._enter(GroupState.IDLE)

    def begin_backward(self, at_boundary: bool, grad_factor: float) -> None:
        self.residency.wait()  # whatever the forward did not need: finish it now
        self._enter(GroupState.BACKWARD)
        if at_boundary:
            self.store.forget_taken()
        self.reduction.begin_backward(at_boundary, grad_factor)

    def finish_backward(self, at_boundary: bool) -> None:
        self.reduction.finish_backward(at_boundary)
        self._enter(GroupState.IDLE)

    def abort_backward(self) -> None:
        self.reduction.abort_backward()
        self._enter(GroupState.IDLE)

    def begin_step(self) -> None:
        self.residency.wait()  # a step without a forward since the last one
        self._enter(GroupState.STEP)
        reduced = self.reduction.reduced_grads()
        for index, group in self.summed:  # a tied layer's copies take the sum of their gradients
            group.all_reduce(reduced[index])
        self.store.attach_grads(reduced)
        for extension in self.extensions.values():
            extension.grads_attached(self._arrivals)

    def _arrivals(self, index: int) -> Arrivals | None:
        """Where in this rank's part of bucket ``index`` gradients arrived this step, and the
        steps each carries (for an Adam catching up). None for a bucket whose copies on other
        model-parallel ranks add their gradients to its own (a tied layer, a sequence-parallel
        norm): each copy's codec chooses other elements, so the sum has no one count, and
        catching up per copy would step the copies apart. Such a bucket steps as it comes."""
        if any(index == summed for summed, _ in self.summed):
            return None
        arrived = self.reduction.codec.catch_up(index)
        if arrived is None:
            return None
        positions, counts = arrived
        start, end = self.partition.range(self.buckets[index])
        mine = (positions >= start) & (positions < end)
        return positions[mine] - start, counts[mine]

    def step_store(self) -> None:
        """The store's step over the reduced gradients (attached by :meth:`begin_step`):
        deferred bucket by bucket to each one's next use where the residency allows it."""
        parts = self.residency.param_targets()
        now = any(extension.wants_masters_now() for extension in self.extensions.values())
        if self.residency.defers_use and not now:
            self._deferred = self.store.step_deferred(parts)
        else:
            self.store.step(parts)

    def end_step(self, applied: bool, rescaled: float = 1.0) -> None:
        """After the store stepped (and wrote the parameter parts, or will: ``applied``) or
        skipped: publish, drop the gradients. ``rescaled``: the loss scale's change for the
        next step."""
        if applied:
            changed = [extension.step_applied() for extension in self.extensions.values()]
            if any(changed):  # an outer step moved the masters: the parameters follow
                self.store.write_params(self.residency.param_targets())
            self.residency.publish(self._deferred)
            self._deferred = {}
        self.store.release_grads()
        self.reduction.zero_grads()
        if applied:  # a compression's warm-up counts the optimizer steps taken
            self.reduction.codec.end_step()
        else:
            self.reduction.codec.skip_step()
        if rescaled != 1.0:
            self.reduction.codec.rescale(rescaled)
        self._enter(GroupState.IDLE)
        for extension in self.extensions.values():
            extension.step_ended(applied)

    def masters_set(self) -> None:
        """The masters were set from outside a step, alike on every rank (a load, a
        broadcast)."""
        for extension in self.extensions.values():
            extension.masters_set()

    def shares_overflow(self) -> bool:
        """Whether this step's ranks hold different gradients (an extension's), so that a
        non-finite norm on one must reach the others."""
        return any(extension.shares_overflow() for extension in self.extensions.values())

    def publish(self) -> None:
        """After the masters changed outside a step (a checkpoint load): update the model's
        parameters on every rank (collective)."""
        self.store.write_params(self.residency.param_targets())
        self.residency.publish()

    # -- views of the state --------------------------------------------------------------------
    def shared_master(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s master as every rank holds it alike, which is what is saved: an
        extension's where one keeps it (0/1 Adam's local steps: the last synchronization's)."""
        for extension in self.extensions.values():
            shared = extension.shared_master(index)
            if shared is not None:
                return shared
        return self.store.state_tensor(index, "master")

    def progress(self) -> list[str]:
        """What the step extensions add to the throughput line."""
        texts = (extension.progress() for extension in self.extensions.values())
        return [text for text in texts if text]

    def extension_tensors(self, kind: str) -> list[torch.Tensor]:
        """What the step extensions of ``kind`` (``StepExtension.memory_kind``) keep, for
        memory accounting."""
        extensions = [e for e in self.extensions.values() if e.memory_kind == kind]
        return [t for extension in extensions for t in extension.tensors()]

    # -- this rank's state besides the masters and the optimizer's -----------------------------
    def state_dict(self) -> dict:
        """The gradient codec's state (error feedback, factors) and each step extension's, by
        name: what a checkpoint keeps per rank (exact resume)."""
        return {
            "codec": self.reduction.codec.state_dict(),
            "extensions": {name: e.state_dict() for name, e in self.extensions.items()},
        }

    def load_state_dict(self, state: dict | None, resume: Resume) -> list[str]:
        """Continue from ``state`` (:meth:`state_dict`'s; None: not saved): the extensions
        first, in their order (``auto``'s tuner may choose the codec), then the codec, which
        continues only on the same bucket layout (the same world size) with the optimizer's
        state. Returns warnings for what started afresh and lost kept state."""
        state = state or {}
        saved = dict(state.get("extensions") or {})
        warnings = [
            extension.load_state_dict(saved.pop(name, None), resume=resume)
            for name, extension in self.extensions.items()
        ]
        warnings += [
            EXTENSIONS[name].orphaned(value, resume)
            for name, value in saved.items()
            if name in EXTENSIONS  # a later version's: nothing here could take it
        ]
        kept = resume.optimizer_loaded and resume.same_world
        problem = self.reduction.codec.load_state_dict(
            state.get("codec") if kept else None, steps=resume.steps
        )
        if problem is not None and resume.optimizer_loaded:
            if not resume.same_world:
                problem = (
                    f"the checkpoint was saved at world size {resume.saved_world_size}, this "
                    f"run has {resume.world_size}"
                )
            warnings.append(
                "comm_compression's kept state (error feedback, low-rank factors) starts "
                f"afresh: {problem}"
            )
        return [w for w in warnings if w is not None]

    def grad_sum_of_squares(self) -> torch.Tensor:
        """The squared global gradient norm (0-d fp32), over every rank's shard and, with model
        parallelism, every model-parallel rank's parameters: a bucket of parameters held whole
        by r ranks counts 1/r on each (exact for powers of two), so the sum counts it once."""
        mp = self.model_parallel
        weights = None
        if mp is not None and mp.comm.world_size > 1:
            weights = [1.0 / mp.replicas(b.slots[0].param) for b in self.buckets]
        sum_sq = self.store.grad_sum_of_squares(weights).to(self.partition.comm.device)
        self.partition.sum_over_ranks(sum_sq)
        if mp is not None and weights is not None:
            mp.comm.all_reduce(sum_sq)
        return sum_sq

    def locate(self, param: nn.Parameter):
        """``(bucket index, slot)`` of a parameter this group trains, or None."""
        for index, bucket in enumerate(self.buckets):
            for slot in bucket.slots:
                if slot.param is param:
                    return index, slot
        return None

    def trained_names(self) -> dict[int, str]:
        """``id(param) -> name`` of every parameter the group trains (tied ones under one
        name)."""
        return {id(s.param): s.name for b in self.buckets for s in b.slots}

    def master_pieces(self, *, own_shard_only: bool) -> list[MasterPiece]:
        """Where each parameter's elements sit in this rank's master tensors.

        ``own_shard_only``: only this rank's 1/N shard of each bucket, whatever the partition
        (what its checkpoint file holds: with replicated optimizer states every rank holds
        everything, and each writes its 1/N). Otherwise all the elements the masters hold.
        """
        pieces = []
        for index, bucket in enumerate(self.buckets):
            opt_start, _ = self.partition.range(bucket)
            start, end = bucket.shard_range() if own_shard_only else self.partition.range(bucket)
            for slot in bucket.slots:
                lo, hi = slot.overlap(start, end)
                if lo < hi:
                    pieces.append(
                        MasterPiece(slot.name, index, lo - opt_start, lo - slot.offset, hi - lo)
                    )
        return pieces

    # -- one parameter's state, read and set by hand (deepspeed.utils.safe_get_* / safe_set_*) --
    def local_piece(self, index: int, slot: ParamSlot) -> tuple[slice, slice]:
        """Where this rank's part of bucket ``index`` holds ``slot``'s parameter: positions in
        the part, and the same elements' positions in the flattened parameter (both empty where
        the part holds none of it)."""
        start, end = self.partition.range(self.buckets[index])
        lo, hi = slot.overlap(start, end)
        hi = max(lo, hi)
        return slice(lo - start, hi - start), slice(lo - slot.offset, hi - slot.offset)

    def part_of(self, index: int, kind: str) -> torch.Tensor:
        """This rank's part of bucket ``index``'s ``kind``: ``"grad"`` (reduced so far, loss
        scale included), ``"master"`` or an element state key (see ShardStore.state_tensor)."""
        if kind != "grad":
            return self.store.state_tensor(index, kind)
        if not self.reduction.holds_reduced:
            raise RuntimeError(
                f"the gradients of {self.buckets[index].slots[0].name!r}'s bucket are reduced "
                "only between the backward of an accumulation boundary (every backward at "
                "stages 2-3) and step(); read or set them there"
            )
        return self.reduction.reduced_grads()[index]

    def local_value(self, index: int, slot: ParamSlot, kind: str) -> torch.Tensor:
        """This rank's elements of ``slot``'s flattened parameter in :meth:`part_of` (a 1-D
        fp32 copy; empty where this rank's part holds none)."""
        part, _ = self.local_piece(index, slot)
        return self.part_of(index, kind)[part].float().clone()

    def set_local_value(self, index: int, slot: ParamSlot, kind: str, values: torch.Tensor) -> None:
        """Set this rank's elements of ``slot``'s parameter in :meth:`part_of` to ``values``
        (1-D, :meth:`local_value`'s length). A master takes effect at the next step, which
        trains from it and writes it into the model's parameters."""
        part, _ = self.local_piece(index, slot)
        if kind == "grad":
            with torch.no_grad():
                self.part_of(index, kind)[part].copy_(values)
            # a store that took the reduced gradients (a norm, a host copy) takes them again
            self.store.forget_taken()
        else:
            self.store.write_state_piece(index, kind, part.start, values)

    def set_param(self, index: int, slot: ParamSlot, value: torch.Tensor) -> None:
        """``slot``'s parameter takes the whole ``value`` (fp32), as its master and in the
        model's copy, as if it had been trained to it; every rank calls it with the same value
        (collective where stage 3 gathers the unit)."""
        bucket = self.buckets[index]
        gathered_here = self.residency.begin_access([bucket])
        try:
            # the master first: should the model's copy then fail, the next step writes the
            # master (the new value) over it, never the old master over a new copy
            part, piece = self.local_piece(index, slot)
            self.store.write_state_piece(index, "master", part.start, value.reshape(-1)[piece])
            with torch.no_grad():
                bucket.view(bucket.require_flat_param(), slot).copy_(value.view(slot.shape))
            self.residency.take_values(bucket)  # stage 3: the shard kept between uses
            self.masters_set()
        finally:
            self.residency.end_access(gathered_here)

    def full_master_params(self) -> dict[int, torch.Tensor]:
        """``id(param) -> full fp32 master value``, gathered from every rank's part."""
        out: dict[int, torch.Tensor] = {}
        for index, bucket in enumerate(self.buckets):
            full = self.partition.full(bucket, self.store.state_tensor(index, "master"))
            for slot in bucket.slots:
                out[id(slot.param)] = bucket.view(full, slot)
        return out


@dataclass(frozen=True)
class ModelParallel:
    """The model-parallel group (tensor and pipeline parallelism) whose ranks hold different
    parameters, or different pieces of one: ``replicas(param)`` is how many of its ranks hold
    ``param`` whole, with identical gradients (1 for a tensor-parallel piece or a pipeline
    stage's own layer). The global gradient norm sums over ``comm`` and counts every parameter
    once (see :meth:`ShardGroup.grad_sum_of_squares`)."""

    comm: Communicator
    replicas: Callable[[nn.Parameter], int]


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """What a shard group is built from, besides the model (the ``zero_optimization`` section,
    the precision, and the communicator of the ranks it is partitioned over)."""

    policy: ZeroPolicy
    comm: Communicator
    precision: PrecisionPolicy
    bucket_numel: int = 500_000_000  # reduce_bucket_size
    gather_for_use: GatherForUseOptions = field(default_factory=GatherForUseOptions)
    overlap_param_gather: bool = False
    comm_dtype: torch.dtype | None = None  # communication_data_type (None: the training dtype)
    offload: OffloadOptions | None = None  # offload_optimizer (None: masters on the device)
    model_parallel: ModelParallel | None = None  # None: every parameter whole on every rank
    # id(param) -> a group over which its reduced gradient is also summed: the copies of a
    # tied layer on other pipeline stages (zerotrain/pipe/module.py)
    summed: dict[int, Communicator] = field(default_factory=dict)
    # id(param) -> the stages of a pipeline rank whose backward gives it gradients, when it
    # runs several (interleaved 1F1B, ZBV): buckets do not mix stages, so each backward
    # reduces its own stage's buckets only (see GradientReduction.restrict)
    chunks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # id(param) -> the dtype its gradient is reduced in, where not the others' (torch_autocast's
    # lower-precision-safe modules): such parameters have buckets of their own
    comm_dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    # the ranks a gradient is averaged over (None: comm's); more for expert parameters, whose
    # gradients on one rank already sum the tokens of its whole expert-parallel group
    average_over: int | None = None
    # how gradients travel (comm_compression.gradients; None: uncompressed)
    compression: GradientCompression | None = None
    # how gathered parameters travel (comm_compression.parameters; None: uncompressed)
    param_compression: ParameterCompression | None = None
    # comm_compression.auto: the policies a tuner chooses among as the group trains (None:
    # ``compression`` and ``param_compression`` throughout)
    auto: AutoOptions | None = None
    # the sites' outer steps (None: one site; see [Note: outer steps over shards])
    sites: SiteOptions | None = None


def build_shard_group(
    model: nn.Module,
    groups: list[tuple[dict, NamedParams]],
    make_optimizer: OptimizerFactory,
    options: GroupOptions,
    *,
    owner: ParamOwner,
    frozen: NamedParams,
    loss_scale: Callable[[], float] = lambda: 1.0,
) -> ShardGroup:
    """Lay out ``groups``' parameters in buckets, choose the strategies for the policy and
    build the group's state; ``make_optimizer`` builds the torch optimizer over the masters.
    ``frozen``: the frozen parameters the group holds (stage 3 partitions them too). ``owner``
    is recorded on each parameter (zerotrain.zero.init.take_ownership). ``loss_scale``: the
    scale in this step's gradients (fp16's)."""
    comm, precision = options.comm, options.precision
    strategies = choose_strategies(options.policy, comm, options.offload)
    residency = strategies.residency(
        model,
        comm,
        strategies.partition,
        gather_for_use=options.gather_for_use,
        overlap_param_gather=options.overlap_param_gather,
        param_compression=options.param_compression,
    )
    runs, split = residency.layout_runs([named for _, named in groups])
    if (
        options.model_parallel is not None
        or options.summed
        or options.chunks
        or options.comm_dtypes
    ):
        # a bucket's parameters have one replica count, one set of stages and one dtype on the
        # wire; a summed one has a bucket of its own, laid out alike on every rank it is summed
        # over
        mp = options.model_parallel

        def kind(param: nn.Parameter) -> tuple[int, tuple[int, ...], str]:
            replicas = mp.replicas(param) if mp is not None else 1
            wire = options.comm_dtypes.get(id(param))
            return replicas, options.chunks.get(id(param), ()), str(wire or "")

        runs = _split_runs(runs, kind, options.summed)
    index_of = {id(p): i for i, (_, p) in enumerate(n for _, g in groups for n in g)}
    buckets = build_buckets(
        runs,
        index_of=index_of,
        bucket_numel=options.bucket_numel if split else None,
        world_size=comm.world_size,
        rank=comm.rank,
        full_value=residency.full_value,
        shard_only=residency.shards_params,
    )
    residency.take_frozen(frozen, precision.param_dtype)
    for bucket in buckets + residency.frozen_buckets:
        for slot in bucket.slots:
            take_ownership(slot.param, owner)
    for bucket in buckets:
        bucket.dtype = precision.param_dtype  # the values stay fp32 until init_bucket
        bucket.comm_dtype = options.comm_dtypes.get(id(bucket.slots[0].param))
    residency.adopt(buckets)
    masters_fp32 = [residency.init_bucket(bucket) for bucket in buckets]
    residency.start()
    reduce_comm = residency.reduce_comm
    partition = strategies.partition
    order = []  # master index per optimizer group, in the optimizer's order
    members = []
    for group_index in range(len(groups)):
        members.append([i for i, b in enumerate(buckets) if b.group_index == group_index])
        order += members[-1]
    ranges = [buckets[i].slot_ranges(*partition.range(buckets[i])) for i in order]

    bucket_of: dict[int, int] = {}  # id of each optimizer tensor -> its bucket

    def matrices(group_index: int, tensors: list[torch.Tensor]) -> ShardedMatrices:
        group_members = members[group_index]
        positions = {id(t): group_members.index(bucket_of[id(t)]) for t in tensors}
        group_buckets = [buckets[i] for i in group_members]
        return ShardedMatrices(positions, group_buckets, partition.sharded, partition.comm)

    segments = ShardSegments(ranges, len(index_of), partition.sum_over_ranks, matrices)

    def optimizer_over(
        masters: list[list[torch.Tensor]], probe: bool = False
    ) -> torch.optim.Optimizer:
        bucket_of.clear()
        bucket_of.update((id(t), i) for i, tensors in enumerate(masters) for t in tensors)
        inner_groups = [
            {**hyper, "params": [t for i in indices for t in masters[i]]}
            for (hyper, _), indices in zip(groups, members, strict=True)
        ]
        return make_optimizer(inner_groups, None if probe else segments)

    store = strategies.placement.build_store(
        masters_fp32, residency.param_targets(), precision, optimizer_over
    )
    compression = _one_bit(options, store.optimizer, residency.shards_params)
    catch_up, compression = _catch_up(options, store, compression)
    reduction = strategies.reduction(
        buckets,
        reduce_comm,
        options.comm_dtype,
        on_bucket_grads_taken=residency.bucket_grads_taken,
        on_settled=residency.finish_backward,
        on_bucket_reduced=store.take_reduced,
        average_over=options.average_over,
        compression=compression,
        embeddings={id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)},
        accum_dtype=precision.grad_accum_dtype,
    )
    summed = [
        (index, group)
        for _, index, group in sorted(
            (b.slots[0].name, i, options.summed[id(b.slots[0].param)])
            for i, b in enumerate(buckets)
            if id(b.slots[0].param) in options.summed
        )
    ]
    extensions = _step_extensions(
        options, store, partition, reduction, residency, summed, catch_up, loss_scale
    )
    shard_group = ShardGroup(
        buckets,
        comm,
        partition,
        residency,
        reduction,
        store,
        options.model_parallel,
        summed,
        extensions,
    )
    return shard_group


def _step_extensions(
    options: GroupOptions,
    store: ShardStore,
    partition: OptimizerPartition,
    reduction: GradientReduction,
    residency: ParamResidency,
    summed: list[tuple[int, Communicator]],
    catch_up: CatchUp | None,
    loss_scale: Callable[[], float],
) -> list[StepExtension]:
    """The group's step extensions, in the order their hooks run (see [Note: step extensions]
    in extension.py), from what the optimizer, the store and the options declare. A new
    extension is chosen here, and named in :data:`EXTENSIONS`."""
    chosen: list[StepExtension] = []
    comm = reduction.comm
    local_steps = getattr(store.optimizer, "local_steps", None)  # 0/1 Adam's (config: stage 0)
    if local_steps is not None:
        _check_local_steps(store.on_device and not partition.sharded)
        masters = store.master_shards()
        assert masters is not None  # on the device
        sums = (options.average_over or comm.world_size) // comm.world_size
        local_steps.bind(masters, {i: g.world_size for i, g in summed}, sums)
        local_steps.loss_scale = loss_scale  # a message's carry, unscaled, takes it too
        chosen.append(LocalStepsExtension(local_steps))
    if catch_up is not None:
        chosen.append(CatchUpExtension(catch_up, len(reduction.buckets)))
    if options.sites is not None:
        masters = store.master_shards()
        if masters is None:  # the config refuses NVMe offload with sites
            raise ValueError("sites: the outer step needs the masters in memory, not on NVMe")
        runs = [_param_runs(bucket, *partition.range(bucket)) for bucket in reduction.buckets]
        chosen.append(OuterStep(options.sites, masters, store.optimizer, runs))
    if options.auto is not None and comm.world_size > 1:
        dtype = options.precision.param_dtype if reduction.buckets else torch.float32
        counts = catch_up is not None
        chosen.append(
            CompressionTuner(reduction, residency, dtype, options.auto, counts_arrivals=counts)
        )
    return chosen


def _param_runs(bucket: FlatBucket, start: int, end: int) -> list[tuple[int, int, int]]:
    """The parameters in ``bucket``'s flat positions ``[start, end)``: ``(lo, hi, id(param))``
    each, positions relative to ``start``."""
    param_of = {slot.index: id(slot.param) for slot in bucket.slots}
    return [(lo, hi, param_of[index]) for lo, hi, index in bucket.slot_ranges(start, end)]


# every step extension by name: what a checkpoint's saved state is matched against
EXTENSIONS: dict[str, type[StepExtension]] = {
    e.name: e for e in (LocalStepsExtension, CatchUpExtension, CompressionTuner, OuterStep)
}

# 1-bit Adam's signs: one fp32 scale per this many (1.6% more bytes than signs alone)
ONEBIT_BLOCK = 2048


def _one_bit(
    options: GroupOptions, optimizer: torch.optim.Optimizer, shards_params: bool
) -> GradientCompression | None:
    """The gradient compression under a 1-bit optimizer (OneBitAdam, ZeroOneAdam, from the
    config or built by the script): exact on its exact steps, then the configured method or
    its own signs (see [Note: 1-bit optimizers under ZeRO]); else the configured one."""
    compression = options.compression
    exact = getattr(optimizer, "exact", None)
    if not isinstance(exact, ExactSteps):
        return compression
    why = ""
    if shards_params:
        why = (
            "compresses whole gradients, which stage 3 never forms; set "
            "zero_optimization.stage to 0-2"
        )
    elif compression is not None and compression.warmup_steps:
        why = "chooses its exact steps itself; set comm_compression.gradients.warmup_steps to 0"
    elif options.auto is not None:
        why = "compresses the gradients itself; set comm_compression.auto to false"
    if why:
        raise ValueError(f"{type(optimizer).__name__} {why}")
    if compression is None:
        compression = GradientCompression(method="onebit", min_numel=0, block_size=ONEBIT_BLOCK)
    return replace(compression, warmup_steps=exact.warmup, exact_steps=exact.steps)


def _catch_up(
    options: GroupOptions, store: ShardStore, compression: GradientCompression | None
) -> tuple[CatchUp | None, GradientCompression | None]:
    """An Adam's catching up on top-k and gTop-k's gradients (see [Note: catching up]), and
    the gradient ``compression`` the reduction takes: counting what each step carries only
    where an Adam catches up."""
    asked = [compression] + [p.gradients for p in (options.auto.policies if options.auto else ())]
    if options.comm.world_size == 1 or not any(c is not None and c.counts_arrivals for c in asked):
        return None, compression
    if not catches_up(store.optimizer):  # its update takes the sparse gradients as they are
        return None, None if compression is None else replace(compression, catch_up=False)
    masters = store.master_shards()
    if masters is None:
        raise ValueError(
            "comm_compression.gradients.catch_up: an Adam catching up on sparse gradients steps "
            "the masters in memory (the device's or the host's), not swapped from NVMe; set "
            "catch_up to false or offload_optimizer.device to cpu"
        )
    return CatchUp(store.optimizer, masters), compression


def _check_local_steps(whole_on_each_rank: bool) -> None:
    """0/1 Adam's local steps where the config cannot see them (an optimizer the script built):
    a replica steps alone only where it is whole on this rank."""
    if not whole_on_each_rank:
        raise ValueError(
            "ZeroOneAdam's local steps (local_step_clipper above 1): a replica steps alone only "
            "at zero_optimization.stage 0, without offload"
        )


def _split_runs(runs: Runs, kind: Callable[[nn.Parameter], tuple], alone: Collection[int]) -> Runs:
    """Each run split by the kind of its parameters, and the parameters whose ids are in
    ``alone`` each in a run of its own (all in their order: the same on every rank)."""
    out = []
    for group_index, unit, named in runs:
        for key in sorted({kind(p) for _, p in named}):
            part = [(n, p) for n, p in named if kind(p) == key]
            rest = [(n, p) for n, p in part if id(p) not in alone]
            if rest:
                out.append((group_index, unit, rest))
            out += [(group_index, unit, [(n, p)]) for n, p in part if id(p) in alone]
    return out
