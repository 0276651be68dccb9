"""How the model's parameters are made whole for use: three residencies, one way to wait.

[Note: waiting for parameters]
Where a parameter bucket's full values come from an all-gather still in flight, the bucket is
in :class:`BucketGathers`, and whoever needs its values waits there, for that bucket only:
* :class:`Replicated` (stage 0): every rank steps every element; nothing is ever gathered.
* :class:`GatheredAfterStep` (stages 1-2): after the step each rank all-gathers every bucket
  from the shards the ranks updated. With ``overlap_param_gather`` each module waits, in a
  forward pre-hook, for the buckets holding its own parameters (DeAR, arXiv:2302.12445), so the
  later buckets' gathers go on during the earlier layers; otherwise the step waits for all.
* :class:`GatheredForUse` (stage 3): the units' life cycle ([Note: the life of a stage-3 unit]
  in zerotrain/zero/unit_cycle.py). Persistent units are refreshed after the step like stages
  1-2's buckets, and each waits at its next use.

The gathers in flight, and optimizer steps deferred to a bucket's next use, are in
zerotrain/zero/in_flight.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.comm.communicator import nothing_inside_nodes
from zerotrain.compression.gather import ParameterCompression, ParameterGather
from zerotrain.config import ZERO_DEFAULTS
from zerotrain.zero.hpz import SecondaryShards
from zerotrain.zero.in_flight import BucketGathers
from zerotrain.zero.init import gather_param, is_init_partitioned, unpartition_param
from zerotrain.zero.layout import (
    FlatBucket,
    NamedParams,
    OptimizerPartition,
    build_buckets,
    point_params_at,
)
from zerotrain.zero.param_home import ParamOffload, ShardHome, shard_home
from zerotrain.zero.store import ParamShards
from zerotrain.zero.unit_cycle import GatherUnit, ParameterGatherer, UnitState
from zerotrain.zero.units import assign_units, find_unit_modules


@dataclass(frozen=True)
class GatherForUseOptions:
    """How :class:`GatheredForUse` gathers (the ``stage3_*`` keys, in elements), where the shards
    live between uses, and hpZ's ranks per node; named for the residency, not the stage (only
    the policy reads stages)."""

    prefetch_numel: int = ZERO_DEFAULTS.stage3_prefetch_bucket_size
    max_live_numel: int = ZERO_DEFAULTS.stage3_max_live_parameters
    max_reuse_numel: int = ZERO_DEFAULTS.stage3_max_reuse_distance
    persistence_threshold: int = ZERO_DEFAULTS.stage3_param_persistence_threshold  # per unit here
    offload_param: ParamOffload | None = None  # where the shards live between uses
    # comm_compression.hierarchical_partition: the ranks per node whose secondary partition
    # serves a step's later gathers (0: off; see [Note: the secondary partition] in hpz.py)
    ranks_per_node: int = 0


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
        gather_for_use: GatherForUseOptions,
        overlap_param_gather: bool,
        param_compression: ParameterCompression | None = None,
    ):
        self.model = model
        self.comm = comm
        self.partition = partition
        self.gather_options = gather_for_use
        self.overlap_param_gather = overlap_param_gather
        # where stage 3 keeps the shards between uses (the other stages keep whole parameters)
        self.home = shard_home(gather_for_use.offload_param) if self.shards_params else ShardHome()
        self.in_flight = BucketGathers(comm, self.home, ParameterGather(comm, param_compression))
        self.buckets: list[FlatBucket] = []
        self.frozen_params: list[nn.Parameter] = []  # floating-point ones (take_frozen)
        self.frozen_buckets: list[FlatBucket] = []  # stage 3: where those are partitioned

    # -- building the layout -----------------------------------------------------------------------
    def layout_runs(self, groups: list[NamedParams]) -> tuple[Runs, bool]:
        """The runs of parameters that may share a bucket, and whether ``reduce_bucket_size``
        splits them (else one bucket per run)."""
        return [(g, 0, named) for g, named in enumerate(groups)], True

    def take_frozen(self, named: NamedParams, dtype: torch.dtype) -> None:
        """The model's frozen parameters (before :meth:`adopt`): whole on every rank here, an
        Init chunk gathered (collective). Stage 3 partitions them."""
        for _, param in named:
            if is_init_partitioned(param):
                unpartition_param(param, self.comm)
        self.frozen_params = [p for _, p in named if p.is_floating_point()]

    def frozen_values(self, keep: bool = True) -> dict[int, torch.Tensor]:
        """``id(param) -> full value`` (a host copy) of the frozen parameters this residency
        partitions, gathered unit by unit (collective; ``keep`` False: gathered, not kept, on
        this rank). Empty where they are whole anyway."""
        return {}

    def load_frozen(self, read: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
        """Set partitioned frozen parameters to ``read(param)`` (None: keep the value); every
        rank reads the same values (collective)."""

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        """A parameter's whole initial value (collective: every rank calls it in order)."""
        if is_init_partitioned(param):  # built under zero.Init: gather one at a time
            return gather_param(param, self.comm)
        return param.detach()

    def adopt(self, buckets: list[FlatBucket]) -> None:
        """Take the built buckets: every rank starts from rank 0's weights, as in DeepSpeed."""
        self.buckets = buckets
        for bucket in buckets:
            self.comm.broadcast(bucket.require_flat_param(), src=self.comm.root)

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

    @property
    def param_gather(self) -> ParameterGather:
        """The all-gather of updated parameters: the backend's, or quantized."""
        return self.in_flight.gather

    # -- during training ---------------------------------------------------------------------------
    def param_targets(self) -> ParamShards:
        """The model's copies (training dtype) of the parts this rank's optimizer steps."""
        parts = [self.partition.part(b, b.require_flat_param()) for b in self.buckets]
        return ParamShards(parts, exact=not self.param_gather.lossy)

    def take_values(self, bucket: FlatBucket) -> None:
        """``bucket.flat_param`` was changed in place: the shard kept between uses takes its
        part (stage 3; the other stages keep nothing else)."""

    def publish(self, deferred: dict[int, Callable[[], None]] | None = None) -> None:
        """The optimizer wrote its part of every bucket, or will: ``deferred`` maps a bucket
        index to the call that steps it and writes its part (see [Note: a step deferred to the
        next use] in in_flight.py). Make the parameters current, each by its next use at the
        latest."""
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
        """Trainable elements kept whole on every rank although parameters are sharded (the
        formula's; frozen ones are counted apart)."""
        return 0

    def secondary_tensors(self) -> list[torch.Tensor]:
        """hpZ's partition inside the node (empty without it)."""
        secondary = self.in_flight.secondary
        return secondary.tensors() if secondary is not None else []

    def host_param_tensors(self) -> list[torch.Tensor]:
        """The host memory holding parameter shards (``offload_param``)."""
        return self.home.host_tensors()

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank holds (for memory accounting)."""
        return _storage(self.buckets)

    def frozen_tensors(self) -> list[torch.Tensor]:
        """The frozen parameters' storage this rank holds (for memory accounting)."""
        return [p.data for p in self.frozen_params]


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
        if self.gather_options.ranks_per_node:
            self.in_flight.secondary = _secondary_shards(comm, self.gather_options.ranks_per_node)
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

    def take_frozen(self, named: NamedParams, dtype: torch.dtype) -> None:
        """Partition the floating-point frozen parameters in frozen buckets, one per unit (see
        [Note: frozen parameters at stage 3] in unit_cycle.py); others (integer ones) stay
        whole."""
        floating = [(n, p) for n, p in named if p.is_floating_point()]
        super().take_frozen([(n, p) for n, p in named if not p.is_floating_point()], dtype)
        runs, _ = self.layout_runs([floating])
        self.frozen_buckets = build_buckets(
            [(_NO_OPTIMIZER_GROUP, unit, run) for _, unit, run in runs],
            index_of={id(p): i for i, (_, p) in enumerate(floating)},
            bucket_numel=None,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            full_value=self.full_value,
            shard_only=True,
        )
        for bucket in self.frozen_buckets:
            bucket.dtype = dtype

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        if not is_init_partitioned(param):  # no flat buffer to broadcast: take rank 0's values
            self.comm.broadcast(param.data, src=self.comm.root)
        return super().full_value(param)

    def adopt(self, buckets: list[FlatBucket]) -> None:
        self.buckets = buckets
        every = buckets + self.frozen_buckets
        unit_numel: dict[int, int] = {}
        for bucket in every:
            unit_numel[bucket.unit] = unit_numel.get(bucket.unit, 0) + bucket.numel
        threshold = self.gather_options.persistence_threshold
        self._persistent = {u for u, numel in unit_numel.items() if numel < threshold}
        self.home.check([b for b in every if b.unit not in self._persistent])
        for bucket in self.frozen_buckets:
            self.init_bucket(bucket)

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
            frozen = [b for b in self.frozen_buckets if b.unit == index]
            units.append(GatherUnit(index, module, buckets, index == root, persistent, frozen))
        self._gatherer = ParameterGatherer(
            units,
            self.comm,
            self.in_flight,
            prefetch_numel=self.gather_options.prefetch_numel,
            max_live_numel=self.gather_options.max_live_numel,
            max_reuse_numel=self.gather_options.max_reuse_numel,
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
        targets = self.home.targets(self.buckets)
        # a persistent unit's shard views its gathered buffer, which a quantized gather writes
        targets.exact = not self.param_gather.lossy
        return targets

    def take_values(self, bucket: FlatBucket) -> None:
        self.home.targets([bucket]).fill(0, bucket.shard(bucket.require_flat_param()))
        self.in_flight.forget_secondary(bucket)

    @property
    def defers_use(self) -> bool:
        return True

    def publish(self, deferred: dict[int, Callable[[], None]] | None = None) -> None:
        super().publish(deferred)  # deferred steps run before their bucket's next gather
        self.in_flight.forget_secondary()  # the shards changed: the next gathers are primary
        self.gatherer.refresh_persistent()  # the others gather at their next use

    def wait(self, buckets=None) -> None:
        self.in_flight.flush()
        self.gatherer.wait_all()

    def holds_whole(self, param: nn.Parameter) -> bool:
        """At stage 3 only the root unit's and persistent units' parameters are."""
        for bucket in self.buckets + self.frozen_buckets:
            if any(slot.param is param for slot in bucket.slots):
                unit = self.gatherer.unit_of(bucket)
                return unit.is_root or unit.persistent
        return True  # in no bucket (an integer frozen one, or another engine's): whole

    def _each_frozen_unit(self):
        """Each unit with frozen buckets, gathered in turn (collective), as its buckets."""
        for unit in self.gatherer.units:
            if unit.frozen:
                gathered_here = self.begin_access(unit.frozen)
                try:
                    yield unit.frozen
                finally:
                    self.end_access(gathered_here)

    def frozen_values(self, keep: bool = True) -> dict[int, torch.Tensor]:
        values = {}
        for buckets in self._each_frozen_unit():
            if keep:
                for slot in (s for b in buckets for s in b.slots):
                    values[id(slot.param)] = slot.param.detach().to("cpu", copy=True)
        return values

    def load_frozen(self, read: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
        for buckets in self._each_frozen_unit():
            for bucket in buckets:
                for slot in bucket.slots:
                    value = read(slot.param)
                    if value is not None:
                        slot.param.data.copy_(value)
                self.take_values(bucket)

    def frozen_tensors(self) -> list[torch.Tensor]:
        return _storage(self.frozen_buckets)

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
        units = self.gatherer.units
        return sum(b.numel_padded for u in units if u.persistent for b in u.buckets)


_NO_OPTIMIZER_GROUP = -1  # a frozen bucket's group_index


def _storage(buckets: list[FlatBucket]) -> list[torch.Tensor]:
    return [t for b in buckets for t in (b.flat_param, b.param_shard) if t is not None]


def _then_gather(
    finish: Callable[[], None], in_flight: BucketGathers, bucket: FlatBucket
) -> Callable[[], None]:
    def finish_then_gather() -> None:
        finish()
        in_flight.issue(bucket, bucket.shard(bucket.require_flat_param()))

    return finish_then_gather


def _own_params(module: nn.Module, bucket_of: dict[int, FlatBucket]) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if id(p) in bucket_of]


def _waiter(in_flight: BucketGathers, buckets: list[FlatBucket]) -> Callable:
    def wait_for_own_buckets(_module, _args) -> None:
        in_flight.wait(buckets)

    return wait_for_own_buckets


def _secondary_shards(comm: Communicator, ranks_per_node: int) -> SecondaryShards | None:
    """hpZ's partition inside each node for the gathers over ``comm`` (collective over the
    default group); None, with a warning, where the node holds one rank of ``comm`` or all of
    them: no gather would then stay off the network."""
    node = comm.within_nodes(ranks_per_node)
    key = "comm_compression.hierarchical_partition"
    instead = (
        "a partition inside the node would keep no gather off the network, so stage 3 runs "
        "without it"
    )
    if nothing_inside_nodes(comm, node, ranks_per_node, key, instead):
        return None
    return SecondaryShards(node)
