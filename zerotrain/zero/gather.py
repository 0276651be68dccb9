"""How the model's parameters are made whole for use: three residencies, one way to wait.

[Note: waiting for parameters]
Where a parameter bucket's full values come from an all-gather still in flight, the bucket is
in :class:`BucketGathers`, and whoever needs its values waits there, for that bucket only:
* :class:`Replicated` (stage 0): every rank steps every element; nothing is ever gathered.
* :class:`GatheredAfterStep` (stages 1-2): after the step each rank all-gathers every bucket
  from the shards the ranks updated. With ``overlap_param_gather`` each module waits, in a
  forward pre-hook, for the buckets holding its own parameters (DeAR, arXiv:2302.12445), so the
  later buckets' gathers go on during the earlier layers; otherwise the step waits for all.
* :class:`GatheredForUse` (stage 3): the units' life cycle below. Persistent units are
  refreshed after the step like stages 1-2's buckets, and each waits at its next use.

[Note: a step deferred to the next use]
A store that steps on the host (zerotrain/zero/offload.py) may leave buckets to be stepped
later, where the forward waits per bucket anyway (stage 3; stages 1-2 with
``overlap_param_gather``): the bucket's step then runs when its parameters are next gathered or
waited for, in the order the forward needs them, so on CUDA the host steps a later layer's
bucket while the device runs the earlier layers' forward. :class:`BucketGathers` holds the
deferred calls; every path that reads parameters (a gather, a wait, ``wait()`` before a
backward, a step or a checkpoint) runs them first, and they run in the same order on every rank.


[Note: the life of a stage-3 unit]
Between uses a unit's parameters are empty placeholders and only this rank's shard
(``bucket.param_shard``) exists. Before the unit's module runs forward its buckets are
all-gathered into fresh full buffers and every parameter's ``.data`` is pointed into them; after
the forward they are released again (``.data`` back to the placeholder). Autograd saved the
parameter *objects*, not their storage, so a hook on the module's outputs re-gathers the unit
just before its backward runs; once every gradient of a bucket has been handed to the reducer
the unit is released. The root unit stays gathered from the start of the forward to the end of
the backward. Units smaller than the persistence threshold are never released: their shard is a
view of a full buffer that the optimizer step refreshes, as in stages 1-2.

Prefetch: the order in which units are gathered is recorded on the first step (forward and
backward separately). Later, gathering the unit at position k also issues the gathers of the
next units in that order, up to ``prefetch_numel`` elements, as long as the live gathered total
stays within ``max_live_numel``. Every rank records the same order when every rank runs the
same modules, which stage 3 requires (as FSDP does): gathers are collectives.

Reuse: from the recorded order, each forward use of a unit knows its reuse distance, the
elements gathered between the end of that forward and the unit's next use (DeepSpeed's
``stage3_max_reuse_distance``). A unit whose reuse distance is within ``max_reuse_numel`` is
kept gathered, if the live total allows, instead of being released and gathered again: the last
blocks of the forward are the first of the backward. With DeepSpeed's defaults a small model is
gathered once per step; lower the bounds to trade that traffic for memory.

Recomputation: activation checkpointing (zerotrain.checkpointing, or torch.utils.checkpoint
directly) runs a region's forward again inside the backward, and with it the hooks of the units
the region calls. Such a forward gathers its unit for immediate use and nothing else: it neither
records nor advances the order, nor releases the unit afterwards (the hook on the first
forward's outputs and the reducer do that, as without checkpointing).

[Note: stage 3 under torch.compile]
``model.compile()`` compiles ``Module._call_impl``, forward hooks included, so dynamo would trace
the gatherer's forward hooks. It turns their ``param.data = ...`` into ``aten.set_`` on graph
inputs, which AOTAutograd replays as real in-place ops: the version counter of a parameter that
an earlier compiled region saved for backward moves, and backward fails with "modified by an
inplace operation". (It would also cut the collectives and the bookkeeping into small graphs,
recompiled per parameter shape.) The hooks therefore run eagerly (``torch.compiler.disable``,
as FSDP2 does with its own): dynamo breaks the graph at each hook and compiles the module code
between them, which only ever sees gathered parameters. Eager ``.data`` assignment keeps the
version counter, a gather writes a fresh buffer (never one that parameters saved for backward
view), and AOTAutograd saves the parameter objects, so backward finds them re-gathered as
without compile. The multi-grad and reducer hooks run in the autograd engine, outside dynamo;
compiled autograd, which would trace them, is not supported.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerotrain.comm import Communicator, PendingOp
from zerotrain.config import ZERO_DEFAULTS
from zerotrain.zero.init import ZeroParamStatus, gather_param, is_init_partitioned, mark_partitioned
from zerotrain.zero.layout import FlatBucket, NamedParams, OptimizerPartition, point_params_at
from zerotrain.zero.param_home import ParamOffload, ShardHome, shard_home
from zerotrain.zero.store import ParamShards
from zerotrain.zero.units import assign_units, find_unit_modules


@dataclass(frozen=True)
class Stage3Options:
    """Stage-3 knobs, in elements (DeepSpeed's ``stage3_*`` keys)."""

    prefetch_numel: int = ZERO_DEFAULTS.stage3_prefetch_bucket_size
    max_live_numel: int = ZERO_DEFAULTS.stage3_max_live_parameters
    max_reuse_numel: int = ZERO_DEFAULTS.stage3_max_reuse_distance
    persistence_threshold: int = ZERO_DEFAULTS.stage3_param_persistence_threshold  # per unit here
    offload_param: ParamOffload | None = None  # where the shards live between uses


class BucketGathers:
    """Parameter all-gathers in flight, by bucket (see [Note: waiting for parameters])."""

    def __init__(self, comm: Communicator, home: ShardHome | None = None):
        self.comm = comm
        self.home = home or ShardHome()  # stage 3: where the shards are lent from
        self._ops: dict[int, PendingOp] = {}  # id(bucket) -> its all-gather
        # id(bucket) -> what must run before its shard is read: a deferred optimizer step (and,
        # stages 1-2, the gather itself); see [Note: a step deferred to the next use]
        self._before: dict[int, Callable[[], None]] = {}

    def defer(self, bucket: FlatBucket, before: Callable[[], None]) -> None:
        """Run ``before`` when ``bucket`` is next gathered or waited for (or at :meth:`flush`)."""
        self._before[id(bucket)] = before

    def _run_before(self, bucket: FlatBucket) -> None:
        before = self._before.pop(id(bucket), None)
        if before is not None:
            before()

    def flush(self) -> None:
        """Run every deferred call, in the order they were deferred (the same on every rank)."""
        while self._before:
            self._before.pop(next(iter(self._before)))()

    @property
    def deferred(self) -> int:
        return len(self._before)

    def issue(self, bucket: FlatBucket, shard: torch.Tensor | None = None) -> None:
        """Start gathering ``bucket.flat_param`` from every rank's ``shard`` (stage 3: the one
        the shard home lends, see [Note: lending a shard] in param_home.py)."""
        self._run_before(bucket)  # a deferred step writes the shard
        earlier = self._ops.pop(id(bucket), None)
        if earlier is not None:  # never two gathers into one buffer at once
            earlier.wait()
        flat_param = bucket.require_flat_param()
        if shard is None:
            shard = self.home.lend(bucket)
            if self.home.on_host:
                shard = _to_device(shard, flat_param)
            self.home.give_back(bucket)
        self._ops[id(bucket)] = self.comm.all_gather(flat_param, shard, async_op=True)

    def read_ahead(self, buckets: list[FlatBucket]) -> None:
        """Stage 3: ``buckets`` are gathered soon (beyond the prefetch): start their reads."""
        for bucket in buckets:
            self.home.read_ahead(bucket)

    def wait(self, buckets) -> None:
        """Complete the gathers of ``buckets`` that are in flight (or deferred)."""
        for bucket in buckets:
            self._run_before(bucket)
            op = self._ops.pop(id(bucket), None)
            if op is not None:
                op.wait()

    def waiting(self, bucket: FlatBucket) -> bool:
        return id(bucket) in self._ops

    def __len__(self) -> int:
        return len(self._ops)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued (prefetch), not yet waited on
    GATHERED = "gathered"


_DS_STATUS = {
    UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: ZeroParamStatus.AVAILABLE,
}


@dataclass
class GatherUnit:
    """One module subtree's trainable parameters, as one or more buckets (one per group)."""

    index: int
    module: nn.Module
    buckets: list[FlatBucket]
    is_root: bool
    persistent: bool
    state: UnitState = UnitState.SHARDED
    buckets_left: int = 0  # buckets whose gradients have not all arrived this backward

    @property
    def numel(self) -> int:
        return sum(b.numel_padded for b in self.buckets)

    def set_status(self, state: UnitState) -> None:
        """The unit's state, mirrored on its parameters' DeepSpeed ``ds_status``."""
        self.state = state
        status = _DS_STATUS[state]
        for bucket in self.buckets:
            for slot in bucket.slots:
                # pyrefly: ignore[missing-attribute] (a DeepSpeed attribute torch does not declare)
                slot.param.ds_status = status


class ParameterGatherer:
    """Runs the stage-3 unit life cycle through module hooks (see the note above)."""

    def __init__(
        self,
        units: list[GatherUnit],
        comm: Communicator,
        gathers: BucketGathers,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int = 0,
    ):
        self.units = units
        self.comm = comm
        self.in_flight = gathers
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self._keep_after_forward: list[bool] = []  # per recorded forward position
        self._kept: list[GatherUnit] = []  # gathered for a later reuse, not in use now
        self.live_numel = 0
        self.max_live_numel_seen = 0  # high-water mark of gathered elements
        self.prefetched = 0  # gathers issued ahead of use
        self.gathers = 0  # all gathers issued (per unit)
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._order: dict[str, list[int]] = {"forward": [], "backward": []}
        self._recorded = False
        self._cursor = {"forward": 0, "backward": 0}
        for unit in units:
            unit.buckets_left = len(unit.buckets)
            for bucket in unit.buckets:
                for slot in bucket.slots:
                    mark_partitioned(
                        slot.param, slot.shape, comm.world_size, _DS_STATUS[unit.state]
                    )
            if unit.persistent:  # its full buffer exists already, and its shard views it
                for bucket in unit.buckets:
                    point_params_at(bucket)
                unit.set_status(UnitState.GATHERED)
                self.live_numel += unit.numel
            else:
                self._point_at_placeholders(unit)
            # Eager even in a compiled model: [Note: stage 3 under torch.compile]. Wrapped here,
            # not at import: torch.compiler.disable imports dynamo (seconds), which torch.optim's
            # constructors do anyway but `import zerotrain` should not.
            eager = torch.compiler.disable
            if unit.is_root:
                unit.module.register_forward_pre_hook(eager(self._root_pre_forward))
                unit.module.register_forward_hook(eager(self._root_post_forward))
            else:
                unit.module.register_forward_pre_hook(
                    eager(lambda m, args, u=unit: self._pre_forward(u))
                )
                unit.module.register_forward_hook(
                    eager(lambda m, args, out, u=unit: self._post_forward(u, out))
                )
        self._unit_of_bucket = {id(b): u for u in units for b in u.buckets}

    # -- gather / release ----------------------------------------------------------------------
    def _issue(self, unit: GatherUnit) -> None:
        if unit.state is not UnitState.SHARDED:
            return
        for bucket in unit.buckets:
            bucket.flat_param = torch.empty(
                bucket.numel_padded, dtype=bucket.dtype, device=bucket.device
            )
            self.in_flight.issue(bucket)
        unit.set_status(UnitState.GATHERING)
        self.gathers += 1
        self.live_numel += unit.numel
        self.max_live_numel_seen = max(self.max_live_numel_seen, self.live_numel)

    def _wait(self, unit: GatherUnit) -> None:
        if unit.state is not UnitState.GATHERING:
            return
        self.in_flight.wait(unit.buckets)
        for bucket in unit.buckets:
            point_params_at(bucket)
        unit.set_status(UnitState.GATHERED)

    def _gather_now(self, unit: GatherUnit) -> None:
        self._issue(unit)
        self._wait(unit)

    def release(self, unit: GatherUnit) -> None:
        """Drop the unit's full parameters (no-op for persistent units)."""
        if unit in self._kept:
            self._kept.remove(unit)
        if unit.persistent or unit.state is UnitState.SHARDED:
            return
        self._wait(unit)  # never free a buffer a collective is still writing
        self._point_at_placeholders(unit)
        for bucket in unit.buckets:
            bucket.flat_param = None
        unit.set_status(UnitState.SHARDED)
        self.live_numel -= unit.numel

    def _point_at_placeholders(self, unit: GatherUnit) -> None:
        for bucket in unit.buckets:
            key = (bucket.dtype, bucket.device)
            if key not in self._placeholders:
                self._placeholders[key] = torch.empty(0, dtype=bucket.dtype, device=bucket.device)
            for slot in bucket.slots:
                slot.param.data = self._placeholders[key]

    # -- prefetch ------------------------------------------------------------------------------
    def _make_room(self, unit: GatherUnit) -> None:
        """Release units kept for reuse until gathering ``unit`` fits the live bound; the
        earliest kept is reused last (backward runs in reverse), so it goes first."""
        if unit in self._kept:
            self._kept.remove(unit)
        if unit.state is not UnitState.SHARDED:
            return
        while self._kept and self.live_numel + unit.numel > self.max_live_numel:
            self.release(self._kept.pop(0))

    def _use(self, unit: GatherUnit, phase: str) -> None:
        """Gather ``unit`` for immediate use in ``phase`` and prefetch what follows it."""
        self._make_room(unit)
        self._issue(unit)  # before any prefetch: the live bound counts the unit in use first
        order = self._order[phase]
        if not self._recorded:
            order.append(unit.index)
        else:
            cursor = self._cursor[phase]
            if cursor < len(order) and order[cursor] == unit.index:
                self._cursor[phase] = cursor + 1
                self._prefetch(order[cursor + 1 :])
            else:  # the order changed (e.g. control flow): stop prefetching this step
                self._cursor[phase] = len(order)
        self._wait(unit)

    def _prefetch(self, upcoming: list[int]) -> None:
        budget = self.prefetch_numel
        for index in upcoming:
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED:
                continue
            if unit.numel > budget or self.live_numel + unit.numel > self.max_live_numel:
                self.in_flight.read_ahead(unit.buckets)  # the next to gather: start its reads
                return
            self._issue(unit)
            self.prefetched += 1
            budget -= unit.numel

    def _reused_soon(self, position: int) -> bool:
        """Whether the unit used at recorded forward ``position`` should stay gathered."""
        if not self._recorded or not 0 <= position < len(self._keep_after_forward):
            return False
        return self._keep_after_forward[position] and self.live_numel <= self.max_live_numel

    def _plan_reuse(self) -> None:
        """After the recording step: which forward uses are followed soon by another use."""
        uses = self._order["forward"] + self._order["backward"]
        numel = [self.units[u].numel for u in uses]
        keep = []
        for position, unit in enumerate(self._order["forward"]):
            following = uses[position + 1 :]
            if unit not in following:
                keep.append(False)
                continue
            distance = sum(numel[position + 1 : position + 1 + following.index(unit)])
            keep.append(distance <= self.max_reuse_numel)
        self._keep_after_forward = keep

    # -- hooks ---------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if _recomputing():  # the root is gathered until the end of the backward
            return
        self._cursor = {"forward": 0, "backward": 0}  # a new forward (training or eval)
        self._use(self.units[-1], "forward")

    def _root_post_forward(self, module, args, output) -> None:
        if _recomputing():
            return
        if not torch.is_grad_enabled():  # no backward will follow
            self.release(self.units[-1])

    def _pre_forward(self, unit: GatherUnit) -> None:
        if _recomputing():  # see "Recomputation" in the note above
            self._make_room(unit)
            self._gather_now(unit)
            return
        self._use(unit, "forward")

    def _post_forward(self, unit: GatherUnit, output) -> None:
        if _recomputing():
            return
        if not torch.is_grad_enabled():  # no backward will follow
            self.release(unit)
            return
        if self._reused_soon(self._cursor["forward"] - 1):
            self._kept.append(unit)
        else:
            self.release(unit)
        tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, u=unit: self._use(u, "backward"), mode="any"
            )

    # -- driven by the reducer and the optimizer ------------------------------------------------
    def bucket_grads_taken(self, bucket: FlatBucket) -> None:
        """All of ``bucket``'s gradients are with the reducer: release its unit once complete."""
        unit = self._unit_of_bucket[id(bucket)]
        unit.buckets_left -= 1
        if unit.buckets_left == 0 and not unit.is_root:
            self.release(unit)

    def finish_backward(self) -> None:
        """End of a micro-step's backward: release every unit, reset per-step state."""
        for unit in self.units:
            self.release(unit)
            unit.buckets_left = len(unit.buckets)
        if not self._recorded:
            self._recorded = True
            self._plan_reuse()

    def refresh_persistent(self) -> None:
        """After an optimizer step: start bringing persistent units' full buffers up to date
        (each unit's next use waits for its own; see [Note: waiting for parameters]), and drop
        any other unit still gathered (a backward this engine did not run, e.g. another
        engine's loss through this model, gathers without releasing): its values predate the
        step, so its next use must gather again."""
        for unit in self.units:
            if not unit.persistent:
                self.release(unit)
            unit.buckets_left = len(unit.buckets)
        for unit in self.units:
            if unit.persistent:
                for bucket in unit.buckets:
                    self.in_flight.issue(bucket)
                unit.set_status(UnitState.GATHERING)

    def wait_all(self) -> None:
        """Complete every gather in flight (prefetched units, persistent refreshes)."""
        for unit in self.units:
            self._wait(unit)

    def gather(self, unit: GatherUnit) -> None:
        """Gather ``unit`` now, outside the hooks (pair with :meth:`release`)."""
        self._gather_now(unit)

    def unit_of(self, bucket: FlatBucket) -> GatherUnit:
        return self._unit_of_bucket[id(bucket)]


def _recomputing() -> bool:
    """Whether a module forward runs inside a backward pass: activation checkpointing's
    recomputation. (torch.utils.checkpoint asks autograd the same question.)"""
    return torch._C._current_graph_task_id() != -1


Runs = list[tuple[int, int, NamedParams]]  # (optimizer group, unit, parameters), see layout.py


class ParamResidency:
    """How the model's parameters exist between uses, are made whole for use, and take the
    optimizer's updates (see [Note: waiting for parameters])."""

    shards_params: ClassVar[bool] = False
    """Whether a rank keeps only its shard of the parameters between uses."""

    def __init__(
        self,
        model: nn.Module,
        comm: Communicator,
        partition: OptimizerPartition,
        *,
        stage3: Stage3Options,
        overlap_param_gather: bool,
    ):
        self.model = model
        self.comm = comm
        self.partition = partition
        self.stage3 = stage3
        self.overlap_param_gather = overlap_param_gather
        # where stage 3 keeps the shards between uses (the other stages keep whole parameters)
        self.home = shard_home(stage3.offload_param) if self.shards_params else ShardHome()
        self.in_flight = BucketGathers(comm, self.home)
        self.buckets: list[FlatBucket] = []

    # -- building the layout -----------------------------------------------------------------------
    def layout_runs(self, groups: list[NamedParams]) -> tuple[Runs, bool]:
        """The runs of parameters that may share a bucket, and whether ``reduce_bucket_size``
        splits them (else one bucket per run)."""
        return [(g, 0, named) for g, named in enumerate(groups)], True

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        """A parameter's whole initial value (collective: every rank calls it in order)."""
        if is_init_partitioned(param):  # built under zero.Init: gather one at a time
            return gather_param(param, self.comm)
        return param.detach()

    def adopt(self, buckets: list[FlatBucket]) -> None:
        """Take the built buckets: every rank starts from rank 0's weights, as in DeepSpeed."""
        self.buckets = buckets
        for bucket in buckets:
            self.comm.broadcast(bucket.require_flat_param(), src=0)

    def init_bucket(self, bucket: FlatBucket) -> torch.Tensor:
        """Put the bucket in the training dtype; returns the fp32 values of the optimizer's
        part."""
        flat_fp32 = bucket.require_flat_param()
        bucket.flat_param = flat_fp32.to(bucket.dtype)
        point_params_at(bucket)
        return self.partition.part(bucket, flat_fp32)

    def start(self) -> None:
        """Install the hooks that run the residency during forward."""

    @property
    def reduce_comm(self) -> Communicator:
        """The communicator gradient reductions use."""
        return self.comm

    # -- during training ---------------------------------------------------------------------------
    def param_targets(self) -> ParamShards:
        """The model's copies (training dtype) of the parts this rank's optimizer steps."""
        return ParamShards([self.partition.part(b, b.require_flat_param()) for b in self.buckets])

    def take_values(self, bucket: FlatBucket) -> None:
        """``bucket.flat_param`` was changed in place: the shard kept between uses takes its
        part (stage 3; the other stages keep nothing else)."""

    def publish(self, deferred: dict[int, Callable[[], None]] | None = None) -> None:
        """The optimizer wrote its part of every bucket, or will: ``deferred`` maps a bucket
        index to the call that steps it and writes its part (see [Note: a step deferred to the
        next use]). Make the parameters current, each by its next use at the latest."""
        for index, finish in (deferred or {}).items():
            self.in_flight.defer(self.buckets[index], finish)

    @property
    def defers_use(self) -> bool:
        """Whether each use in forward waits for its own buckets, so that the optimizer may
        step a bucket as late as its first use."""
        return False

    def wait(self, buckets=None) -> None:
        """Finish gathering ``buckets`` (default: all): their values are current after this."""
        if buckets is None:
            self.in_flight.flush()
        self.in_flight.wait(self.buckets if buckets is None else buckets)

    def holds_whole(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is whole throughout forward and backward."""
        return True

    def begin_access(self, buckets: list[FlatBucket]) -> list:
        """Make ``buckets`` whole outside forward (collective); returns what to release."""
        self.wait()
        return []

    def end_access(self, gathered_here: list) -> None:
        """Release what :meth:`begin_access` gathered."""

    def bucket_grads_taken(self, bucket: FlatBucket) -> None:
        """All of ``bucket``'s gradients of this backward are with the reduction."""

    def finish_backward(self) -> None:
        """A backward's reductions are done."""

    @property
    def persistent_numel(self) -> int:
        """Elements kept whole on every rank although parameters are sharded."""
        return 0

    def host_param_tensors(self) -> list[torch.Tensor]:
        """The host memory holding parameter shards (``offload_param``)."""
        return self.home.host_tensors()

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank holds (for memory accounting)."""
        return [t for b in self.buckets for t in (b.flat_param, b.param_shard) if t is not None]


class Replicated(ParamResidency):
    """Stage 0: every rank holds and steps every parameter; nothing to gather."""


class GatheredAfterStep(ParamResidency):
    """Stages 1-2: whole parameters on every rank; each steps its shard and gathers the rest."""

    def start(self) -> None:
        if not self.overlap_param_gather:
            return
        bucket_of = {id(s.param): b for b in self.buckets for s in b.slots}
        for module in self.model.modules():
            own = {id(bucket_of[id(p)]): bucket_of[id(p)] for p in _own_params(module, bucket_of)}
            if own:
                # the later buckets hold the earlier layers (reverse order): wait for those first
                buckets = sorted(own.values(), key=self.buckets.index, reverse=True)
                module.register_forward_pre_hook(_waiter(self.in_flight, buckets))

    @property
    def defers_use(self) -> bool:
        return self.overlap_param_gather

    def publish(self, deferred: dict[int, Callable[[], None]] | None = None) -> None:
        deferred = deferred or {}
        # Buckets hold parameters in reverse order: the forward needs the last one first.
        for index in reversed(range(len(self.buckets))):
            bucket = self.buckets[index]
            if index in deferred:  # step it, then gather it, at its first use
                self.in_flight.defer(bucket, _then_gather(deferred[index], self.in_flight, bucket))
            else:
                self.in_flight.issue(bucket, bucket.shard(bucket.require_flat_param()))
        if not self.overlap_param_gather:
            self.wait()


class GatheredForUse(ParamResidency):
    """Stage 3: each rank keeps its shard; gather units are gathered around their use."""

    shards_params = True

    def __init__(self, model: nn.Module, comm: Communicator, partition, **options):
        super().__init__(model, comm, partition, **options)
        self.unit_modules = find_unit_modules(model)
        self._gatherer: ParameterGatherer | None = None  # made by start()
        self._persistent: set[int] = set()
        # Gathers and reductions on separate groups: each keeps its own order on all ranks
        # even when backward interleaves them differently (see [Note: reduction order]).
        self._reduce_comm: Communicator | None = None

    def layout_runs(self, groups: list[NamedParams]) -> tuple[Runs, bool]:
        """One bucket per (unit, optimizer group): a unit gathers as a whole."""
        unit_of = assign_units(self.model, self.unit_modules)
        # backward meets the blocks in reverse; the root unit (embeddings) finishes last
        order = [*reversed(range(len(self.unit_modules))), len(self.unit_modules)]
        runs = [
            (g, u, [(n, p) for n, p in named if unit_of[id(p)] == u])
            for u in order
            for g, named in enumerate(groups)
        ]
        return [run for run in runs if run[2]], False

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        if not is_init_partitioned(param):  # no flat buffer to broadcast: take rank 0's values
            self.comm.broadcast(param.data, src=0)
        return super().full_value(param)

    def adopt(self, buckets: list[FlatBucket]) -> None:
        self.buckets = buckets
        unit_numel: dict[int, int] = {}
        for bucket in buckets:
            unit_numel[bucket.unit] = unit_numel.get(bucket.unit, 0) + bucket.numel
        threshold = self.stage3.persistence_threshold
        self._persistent = {u for u, numel in unit_numel.items() if numel < threshold}
        self.home.check([b for b in buckets if b.unit not in self._persistent])

    def init_bucket(self, bucket: FlatBucket) -> torch.Tensor:
        master_fp32 = bucket.require_param_shard()
        bucket.param_shard = master_fp32.to(bucket.dtype)
        if bucket.unit in self._persistent:  # kept whole; its shard views the buffer
            bucket.flat_param = torch.empty(
                bucket.numel_padded, dtype=bucket.dtype, device=bucket.device
            )
            self.comm.all_gather(bucket.flat_param, bucket.param_shard)
            bucket.param_shard = bucket.shard(bucket.flat_param)
        else:  # a copy, not a view of the master
            self.home.keep(bucket, bucket.param_shard)
        return master_fp32

    def start(self) -> None:
        units = []
        root = len(self.unit_modules)
        for index in range(root + 1):
            buckets = [b for b in self.buckets if b.unit == index]
            module = self.model if index == root else self.unit_modules[index]
            persistent = index in self._persistent
            units.append(GatherUnit(index, module, buckets, index == root, persistent))
        self._gatherer = ParameterGatherer(
            units,
            self.comm,
            self.in_flight,
            prefetch_numel=self.stage3.prefetch_numel,
            max_live_numel=self.stage3.max_live_numel,
            max_reuse_numel=self.stage3.max_reuse_numel,
        )

    @property
    def gatherer(self) -> ParameterGatherer:
        """The units' life cycle, from :meth:`start` on."""
        if self._gatherer is None:
            raise RuntimeError("stage 3: the parameter gatherer is made by start(), not yet called")
        return self._gatherer

    @property
    def reduce_comm(self) -> Communicator:
        if self._reduce_comm is None:
            self._reduce_comm = self.comm.new_group()
        return self._reduce_comm

    def param_targets(self) -> ParamShards:
        return self.home.targets(self.buckets)

    def take_values(self, bucket: FlatBucket) -> None:
        self.home.targets([bucket]).fill(0, bucket.shard(bucket.require_flat_param()))

    @property
    def defers_use(self) -> bool:
        return True

    def publish(self, deferred: dict[int, Callable[[], None]] | None = None) -> None:
        super().publish(deferred)  # deferred steps run before their bucket's next gather
        self.gatherer.refresh_persistent()  # the others gather at their next use

    def wait(self, buckets=None) -> None:
        self.in_flight.flush()
        self.gatherer.wait_all()

    def holds_whole(self, param: nn.Parameter) -> bool:
        """At stage 3 only the root unit's and persistent units' parameters are."""
        for bucket in self.buckets:
            if any(slot.param is param for slot in bucket.slots):
                unit = self.gatherer.unit_of(bucket)
                return unit.is_root or unit.persistent
        return True  # not trained by this engine (frozen): replicated

    def begin_access(self, buckets: list[FlatBucket]) -> list:
        self.wait()
        gathered_here = []
        for unit in {id(u): u for u in map(self.gatherer.unit_of, buckets)}.values():
            if unit.state is UnitState.SHARDED:
                self.gatherer.gather(unit)
                gathered_here.append(unit)
        return gathered_here

    def end_access(self, gathered_here: list) -> None:
        for unit in gathered_here:
            self.gatherer.release(unit)

    def bucket_grads_taken(self, bucket: FlatBucket) -> None:
        self.gatherer.bucket_grads_taken(bucket)

    def finish_backward(self) -> None:
        self.gatherer.finish_backward()

    @property
    def persistent_numel(self) -> int:
        return sum(u.numel for u in self.gatherer.units if u.persistent)


def _then_gather(
    finish: Callable[[], None], in_flight: BucketGathers, bucket: FlatBucket
) -> Callable[[], None]:
    def finish_then_gather() -> None:
        finish()
        in_flight.issue(bucket, bucket.shard(bucket.require_flat_param()))

    return finish_then_gather


def _to_device(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host shard (``offload_param``) brought to the device for its all-gather; the copy is
    asynchronous from pinned memory and ordered before the gather on the current stream."""
    staged = torch.empty(shard.numel(), dtype=like.dtype, device=like.device)
    staged.copy_(shard, non_blocking=True)
    return staged


def _own_params(module: nn.Module, bucket_of: dict[int, FlatBucket]) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if id(p) in bucket_of]


def _waiter(in_flight: BucketGathers, buckets: list[FlatBucket]) -> Callable:
    def wait_for_own_buckets(_module, _args) -> None:
        in_flight.wait(buckets)

    return wait_for_own_buckets
