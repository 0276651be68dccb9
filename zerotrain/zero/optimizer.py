"""The ZeRO optimizer: one code path for stages 0-3, driven by a :class:`ZeroPolicy`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.comm import Communicator, PendingOp
from zerotrain.optim import NoOptimizer
from zerotrain.precision import LossScaler, PrecisionPolicy
from zerotrain.zero.gather import GatherUnit, ParameterGatherer, UnitState
from zerotrain.zero.init import gather_param, is_init_partitioned, take_ownership
from zerotrain.zero.memory import model_state_bytes, optimizer_state_bytes_per_element
from zerotrain.zero.partition import (
    FlatBucket,
    NamedParams,
    ZeroPolicy,
    build_buckets,
    point_grads_at,
    point_params_at,
)
from zerotrain.zero.reducer import GradientReducer
from zerotrain.zero.shard_store import DeviceShardStore, ShardStore
from zerotrain.zero.units import assign_units, find_unit_modules


@dataclass(frozen=True)
class Stage3Options:
    """Stage-3 knobs, in elements (DeepSpeed's ``stage3_*`` keys)."""

    prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live_numel: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_numel: int = 1_000_000_000  # stage3_max_reuse_distance
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold (per unit here)


@dataclass
class ShardSegments:
    """Which original parameters each master tensor holds, and where.

    Optimizers whose update needs per-parameter norms (Lamb's trust ratio) use it to compute
    them on flat shards: ``ranges[i]`` lists the ``(start, end, param_index)`` runs of the i-th
    master tensor, in order (elements in no run are padding), and ``allreduce`` sums a
    per-parameter vector across ranks. Memory per parameter, not per element.
    """

    ranges: list[list[tuple[int, int, int]]]
    num_segments: int
    allreduce: Callable[[torch.Tensor], None]


OptimizerFactory = Callable[[list[dict], ShardSegments], torch.optim.Optimizer]


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


class ZeroOptimizer:
    """Partitions model states per the policy and steps them.

    Holds the flat buckets (the model's parameters are views into them), reduces gradients,
    unscales fp16 gradients, clips by the global norm across all shards, steps the master
    shards through a :class:`ShardStore`, and refreshes every rank's parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: list[tuple[dict, NamedParams]],
        make_optimizer: OptimizerFactory,
        *,
        policy: ZeroPolicy,
        precision: PrecisionPolicy,
        comm: Communicator,
        loss_scaler: LossScaler,
        gradient_clipping: float = 0.0,
        bucket_numel: int = 500_000_000,
        stage3: Stage3Options | None = None,
        overlap_param_gather: bool = False,
        comm_dtype: torch.dtype | None = None,
    ):
        self.policy = policy
        self.precision = precision
        self.comm = comm
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.overflow = False  # the last step was skipped for a non-finite gradient
        index_of = {id(p): i for i, (_, p) in enumerate(n for _, g in groups for n in g)}
        if policy.shard_parameters:
            stage3 = stage3 or Stage3Options()
            unit_modules = find_unit_modules(model)
            unit_of = assign_units(model, unit_modules)
            # backward meets the blocks in reverse; the root unit (embeddings) finishes last
            order = [*reversed(range(len(unit_modules))), len(unit_modules)]
            runs = [
                (g, u, [(n, p) for n, p in named if unit_of[id(p)] == u])
                for u in order
                for g, (_, named) in enumerate(groups)
            ]
            runs = [run for run in runs if run[2]]
            bucket_numel = None  # one bucket per (unit, group): a unit gathers as a whole
        else:
            runs = [(g, 0, named) for g, (_, named) in enumerate(groups)]
        shard_only = policy.shard_parameters

        def full_value(param: nn.Parameter) -> torch.Tensor:
            if is_init_partitioned(param):  # built under zero.Init: gather one at a time
                return gather_param(param, comm)
            if shard_only:  # no flat buffer to broadcast: every rank takes rank 0's values
                comm.broadcast(param.data, src=0)
            return param.detach()

        self.buckets: list[FlatBucket] = build_buckets(
            runs,
            index_of=index_of,
            bucket_numel=bucket_numel,
            world_size=comm.world_size,
            rank=comm.rank,
            full_value=full_value,
            shard_only=shard_only,
        )
        self.num_params = sum(b.numel for b in self.buckets)
        for bucket in self.buckets:
            for slot in bucket.slots:
                take_ownership(slot.param, self)
        if not shard_only:  # every rank starts from rank 0's weights, as in DeepSpeed
            for bucket in self.buckets:
                comm.broadcast(bucket.flat_param, src=0)

        persistent_units = set()
        if policy.shard_parameters:
            unit_numel: dict[int, int] = {}
            for bucket in self.buckets:
                unit_numel[bucket.unit] = unit_numel.get(bucket.unit, 0) + bucket.numel
            threshold = stage3.persistence_threshold
            persistent_units = {u for u, numel in unit_numel.items() if numel < threshold}

        masters = []
        dtype = precision.param_dtype
        for bucket in self.buckets:
            bucket.dtype = dtype
            if shard_only:
                master_fp32 = bucket.param_shard
                bucket.param_shard = master_fp32.to(dtype)
                if bucket.unit in persistent_units:  # kept whole; its shard views the buffer
                    bucket.flat_param = torch.empty(
                        bucket.numel_padded, dtype=dtype, device=bucket.device
                    )
                    comm.all_gather(bucket.flat_param, bucket.param_shard)
                    bucket.param_shard = bucket.shard(bucket.flat_param)
            else:
                flat_fp32 = bucket.flat_param
                bucket.flat_param = flat_fp32.to(dtype)
                master_fp32 = self._optimizer_part(bucket, flat_fp32)
                point_params_at(bucket)  # stage 3: the gatherer points them
            # fp32 training: the master is the model's own copy of this rank's part
            masters.append(
                master_fp32.clone() if precision.has_master_copy else self._param_part(bucket)
            )
            if policy.shard_gradients:  # in the dtype the reduction produces
                bucket.grad_shard = torch.zeros(
                    bucket.shard_numel, dtype=comm_dtype or dtype, device=bucket.device
                )
            else:
                bucket.flat_grad = torch.zeros(
                    bucket.numel_padded, dtype=dtype, device=bucket.device
                )
                point_grads_at(bucket)  # after the params: a grad must match their dtype

        self.gatherer: ParameterGatherer | None = None
        reduce_comm = comm
        if policy.shard_parameters:
            self.gatherer = self._make_gatherer(model, unit_modules, persistent_units, stage3)
            # Gathers and reductions on separate groups: each keeps its own order on all ranks
            # even when backward interleaves them differently (see [Note: reduction order]).
            reduce_comm = comm.new_group()

        inner_groups = []
        ranges = []
        for group_index, (hyper, _) in enumerate(groups):
            members = [i for i, b in enumerate(self.buckets) if b.group_index == group_index]
            inner_groups.append({**hyper, "params": [masters[i] for i in members]})
            ranges += [self._segment_ranges(self.buckets[i]) for i in members]
        segments = ShardSegments(ranges, len(index_of), self._allreduce_sum)
        self.store: ShardStore = DeviceShardStore(
            masters,
            make_optimizer(inner_groups, segments),
            masters_alias_params=not precision.has_master_copy,
        )
        self.reducer = GradientReducer(
            self.buckets, reduce_comm, policy, gatherer=self.gatherer, comm_dtype=comm_dtype
        )
        # stages 1-2 with overlap_param_gather: bucket index -> its all-gather in flight
        self._param_gathers: dict[int, PendingOp] = {}
        self.overlap_param_gather = overlap_param_gather and self.gatherer is None
        if self.overlap_param_gather and policy.shard_optimizer_states:
            self._wait_for_params_before_forward(model)

    def _make_gatherer(
        self, model, unit_modules, persistent_units: set[int], options: Stage3Options
    ) -> ParameterGatherer:
        units = []
        root = len(unit_modules)
        for index in range(root + 1):
            buckets = [b for b in self.buckets if b.unit == index]
            module = model if index == root else unit_modules[index]
            units.append(
                GatherUnit(index, module, buckets, index == root, index in persistent_units)
            )
        return ParameterGatherer(
            units,
            self.comm,
            prefetch_numel=options.prefetch_numel,
            max_live_numel=options.max_live_numel,
            max_reuse_numel=options.max_reuse_numel,
        )

    # -- construction helpers ------------------------------------------------------------------
    def _optimizer_range(self, bucket: FlatBucket) -> tuple[int, int]:
        if self.policy.shard_optimizer_states:
            return bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel
        return 0, bucket.numel_padded

    def _optimizer_part(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        start, end = self._optimizer_range(bucket)
        return flat[start:end]

    def _param_part(self, bucket: FlatBucket) -> torch.Tensor:
        """The model's copy (training dtype) of the part this rank's optimizer steps."""
        if self.policy.shard_parameters:
            return bucket.param_shard
        return self._optimizer_part(bucket, bucket.flat_param)

    def _segment_ranges(self, bucket: FlatBucket) -> list[tuple[int, int, int]]:
        return bucket.slot_ranges(*self._optimizer_range(bucket))

    def _allreduce_sum(self, tensor: torch.Tensor) -> None:
        if self.policy.shard_optimizer_states:
            self.comm.all_reduce(tensor)

    def holds_whole_during_step(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is whole throughout forward and backward: always below stage 3;
        at stage 3 when it is in the root unit or a persistent one."""
        if self.gatherer is None:
            return True
        for bucket in self.buckets:
            if any(slot.param is param for slot in bucket.slots):
                unit = self.gatherer.unit_of(bucket)
                return unit.is_root or unit.persistent
        return True  # not trained by this engine (frozen): replicated

    # -- the user-visible optimizer surface -------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's fp32 master shards."""
        return self.store.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The torch optimizer's state, keyed by this rank's master tensors."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def _layout(self) -> dict:
        return {
            "world_size": self.comm.world_size,
            "stage": self.policy.stage,
            "master_numels": [m.numel() for m in self.store.master_shards()],
        }

    def state_dict(self) -> dict:
        """This rank's part of the optimizer (as DeepSpeed's ZeRO optimizers return theirs): the
        torch optimizer's state, the fp32 masters, the loss scaler. It loads back into an
        optimizer of the same layout; ``engine.save_checkpoint`` saves state that loads at any
        world size and stage."""
        return {
            "layout": self._layout(),
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach().clone() for m in self.store.master_shards()],
            "loss_scaler": self.loss_scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict`'s output (collective: the parameters are refreshed)."""
        saved, ours = state_dict["layout"], self._layout()
        if saved != ours:
            raise ValueError(
                f"optimizer.load_state_dict: saved with world size {saved['world_size']} and "
                f"stage {saved['stage']} ({len(saved['master_numels'])} master tensors), this "
                f"optimizer has world size {ours['world_size']} and stage {ours['stage']} "
                f"({len(ours['master_numels'])}); move state between layouts with "
                "engine.save_checkpoint / load_checkpoint"
            )
        with torch.no_grad():
            for master, value in zip(
                self.store.master_shards(), state_dict["masters"], strict=True
            ):
                master.copy_(value)
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = state_dict["skipped_steps"]
        self.publish_params()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new gradient accumulation (``set_to_none`` is accepted; buffers are reused)."""
        del set_to_none
        self.reducer.zero_grads()

    def backward_prologue(self, at_boundary: bool, grad_factor: float = 1.0) -> None:
        """Prepare the reduction of a micro-step's backward (stages 0-1: only at a boundary);
        ``grad_factor`` multiplies the gradients it produces."""
        if not self.trains:
            raise RuntimeError(NoOptimizer.MESSAGE)  # before any gradient is reduced
        self.wait_param_gathers()  # whatever the forward did not need: finish it now
        self.reducer.begin_backward(at_boundary, grad_factor)

    def backward_epilogue(self, at_boundary: bool) -> None:
        """Reduce what the policy reduces after a micro-step's backward."""
        self.reducer.finish_backward(at_boundary)

    def abort_backward(self) -> None:
        """Drop what a backward that raised part-way left behind (see the reducer's)."""
        self.reducer.abort_backward()

    @property
    def trains(self) -> bool:
        """False for an engine built without an optimizer (forward passes only)."""
        return not isinstance(self.optimizer, NoOptimizer)

    def step(self) -> bool:
        """Unscale, clip and apply the averaged gradients; False if skipped for overflow."""
        unreduced = self.reducer.unreduced_grads
        if unreduced:
            raise RuntimeError(
                f"step(): gradients of {unreduced[:3]} came from another engine's backward (a "
                "loss through both models) after this engine's last backward, and were not "
                "averaged over the ranks; drop them with zero_grad(), or run this engine's "
                "backward after them, before step()"
            )
        self.wait_param_gathers()  # a step without a forward since the last one
        self.store.attach_grads(self.reducer.reduced_grads())
        sum_sq = self.store.grad_sum_of_squares()
        if self.policy.shard_optimizer_states:  # each element is owned by exactly one rank
            self.comm.all_reduce(sum_sq)
        inv_scale = 1.0 / self.loss_scaler.scale
        norm = math.sqrt(sum_sq.item()) * inv_scale
        overflow = self.overflow = not math.isfinite(norm)
        self.loss_scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if not self.loss_scaler.dynamic and self.comm.rank == 0:
                warnings.warn(
                    "zerotrain: non-finite gradient norm; optimizer step skipped", stacklevel=3
                )
        else:
            self.global_grad_norm = norm
            clip = 1.0
            if self.gradient_clipping > 0:
                clip = min(1.0, self.gradient_clipping / (norm + 1e-6))
            self.store.scale_grads(inv_scale * clip)
            self.store.step()
            self.publish_params()
        self.store.release_grads()
        self.reducer.zero_grads()
        return not overflow

    def publish_params(self) -> None:
        """After the masters changed (a step, a checkpoint load): update the model's parameters
        on every rank (collective)."""
        self.store.write_params([self._param_part(b) for b in self.buckets])
        if self.gatherer is not None:
            self.gatherer.refresh_persistent()  # the others gather at their next use
        elif self.policy.shard_optimizer_states:
            # Buckets hold parameters in reverse order: the forward needs the last one first.
            for index in reversed(range(len(self.buckets))):
                bucket = self.buckets[index]
                self._param_gathers[index] = self.comm.all_gather(
                    bucket.flat_param, bucket.shard(bucket.flat_param), async_op=True
                )
            if not self.overlap_param_gather:
                self.wait_param_gathers()

    def wait_param_gathers(self, buckets: tuple[int, ...] | None = None) -> None:
        """Complete the parameter all-gathers still in flight (``overlap_param_gather``): those
        of ``buckets``, or all. Parameters read outside a module's forward after a step are
        current once this returned."""
        for index in list(self._param_gathers) if buckets is None else buckets:
            op = self._param_gathers.pop(index, None)
            if op is not None:
                op.wait()

    def _wait_for_params_before_forward(self, model: nn.Module) -> None:
        """[DeAR, arXiv:2302.12445] Each module waits, in a forward pre-hook, for the buckets that
        hold its own parameters: the later buckets' gathers go on during the earlier layers."""
        bucket_of = {id(s.param): i for i, b in enumerate(self.buckets) for s in b.slots}
        for module in model.modules():
            own = {bucket_of.get(id(p)) for p in module.parameters(recurse=False)} - {None}
            if own:
                buckets = tuple(sorted(own, reverse=True))
                module.register_forward_pre_hook(
                    lambda _module, _args, buckets=buckets: self.wait_param_gathers(buckets)
                )

    # -- full access to parameters outside forward (GatheredParameters) -------------------------
    def begin_access(self, params: list[nn.Parameter]) -> tuple[list[FlatBucket], list]:
        """Make ``params`` whole (collective); returns what :meth:`end_access` needs."""
        self.wait_param_gathers()
        wanted = {id(p) for p in params}
        buckets = [b for b in self.buckets if any(id(s.param) in wanted for s in b.slots)]
        gathered_here = []
        if self.gatherer is not None:
            for unit in {id(u): u for u in map(self.gatherer.unit_of, buckets)}.values():
                if unit.state is UnitState.SHARDED:
                    self.gatherer.gather(unit)
                    gathered_here.append(unit)
        return buckets, gathered_here

    def end_access(self, access, modifier_rank: int | None) -> None:
        """Finish :meth:`begin_access`; with ``modifier_rank``, that rank's (possibly changed)
        values become every rank's parameters, master weights included."""
        buckets, gathered_here = access
        if modifier_rank is not None:
            for bucket in buckets:
                self.comm.broadcast(bucket.flat_param, src=modifier_rank)
                if bucket.param_shard is not None:
                    bucket.param_shard.copy_(bucket.shard(bucket.flat_param))
            if self.precision.has_master_copy:
                masters = self.store.master_shards()
                for bucket in buckets:
                    part = self._optimizer_part(bucket, bucket.flat_param)
                    masters[self.buckets.index(bucket)].copy_(part)
        for unit in gathered_here:
            self.gatherer.release(unit)

    # -- state views ---------------------------------------------------------------------------
    def master_pieces(self, *, own_shard_only: bool) -> list[MasterPiece]:
        """Where each parameter's elements sit in this rank's master tensors.

        ``own_shard_only``: only this rank's 1/N shard of each bucket, whatever the stage (what
        its checkpoint file holds: with unsharded optimizer states every rank holds everything,
        and each writes its 1/N). Otherwise all the elements the master tensors hold.
        """
        pieces = []
        for index, bucket in enumerate(self.buckets):
            opt_start, opt_end = self._optimizer_range(bucket)
            start, end = opt_start, opt_end
            if own_shard_only:
                start, end = (
                    bucket.rank * bucket.shard_numel,
                    (bucket.rank + 1) * bucket.shard_numel,
                )
            for slot in bucket.slots:
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
                if lo < hi:
                    pieces.append(
                        MasterPiece(slot.name, index, lo - opt_start, lo - slot.offset, hi - lo)
                    )
        return pieces

    def full_master_params(self) -> dict[int, torch.Tensor]:
        """``id(param) -> full fp32 master value``, gathered from every rank's shard."""
        out: dict[int, torch.Tensor] = {}
        for bucket, master in zip(self.buckets, self.store.master_shards(), strict=True):
            if self.policy.shard_optimizer_states:
                full = torch.empty(bucket.numel_padded, dtype=master.dtype, device=master.device)
                self.comm.all_gather(full, master)
            else:
                full = master
            for slot in bucket.slots:
                out[id(slot.param)] = bucket.view(full, slot)
        return out

    def full_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """One parameter's full fp32 value of ``kind`` (collective where it is partitioned:
        every rank calls it for the same parameter): ``"master"`` (the fp32 master weight),
        ``"grad"`` (the gradient reduced so far, unscaled: the average after the boundary's
        backward), or an optimizer state key such as ``"exp_avg"`` (None before the optimizer
        created it). None for a parameter this optimizer does not train."""
        found = [(i, s) for i, b in enumerate(self.buckets) for s in b.slots if s.param is param]
        if not found:
            return None
        index, slot = found[0]
        bucket, master = self.buckets[index], self.store.master_shards()[index]
        if kind == "master":
            local = master
        elif kind == "grad":
            local = self.reducer.reduced_grads()[index].float() / self.loss_scaler.scale
        else:
            local = self.optimizer.state.get(master, {}).get(kind)
            if local is None:
                return None
        full = local
        if self.policy.shard_optimizer_states:
            full = torch.empty(bucket.numel_padded, dtype=local.dtype, device=local.device)
            self.comm.all_gather(full, local.contiguous())
        return bucket.view(full, slot).float().clone()

    def memory_breakdown(self) -> dict[str, float]:
        """Bytes of model states this rank holds, measured from the allocated tensors.

        ``parameters``/``gradients``/``optimizer_states`` (fp32 masters that are separate copies
        plus the optimizer's state) and their ``total``; ``formula_total`` is the ZeRO paper's
        figure for the same job (arXiv:1910.02054 §5: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N in mixed
        precision with Adam).
        """
        seen: set[int] = set()

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = nbytes(
            t for b in self.buckets for t in (b.flat_param, b.param_shard) if t is not None
        )
        grads = nbytes(
            b.grad_shard if b.grad_shard is not None else b.flat_grad for b in self.buckets
        )
        state_tensors = [
            t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        optim = nbytes(self.store.master_shards()) + nbytes(state_tensors)
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_states": optim,
            "total": params + grads + optim,
            "formula_total": self.formula_bytes(),
        }

    def formula_bytes(self) -> float:
        """The ZeRO formula for this job: p·Ψ/N_p + g·Ψ/N_g + (m + s)·Ψ/N_o
        (:func:`zerotrain.zero.memory.model_state_bytes`, which ``zerotrain estimate`` prints).

        Stage 3 keeps units below the persistence threshold whole: those count p·Ψ_persistent.
        """
        persistent = 0
        if self.gatherer is not None:
            persistent = sum(u.numel for u in self.gatherer.units if u.persistent)
        return model_state_bytes(
            self.num_params,
            world_size=self.comm.world_size,
            policy=self.policy,
            precision=self.precision,
            optimizer_state_bytes=optimizer_state_bytes_per_element(self.optimizer),
            persistent_numel=persistent,
        ).total
