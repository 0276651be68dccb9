"""The ZeRO optimizer: the torch-optimizer face of one or more shard groups
(zerotrain/zero/group.py).

It owns what is global to a step, whatever the partitioning: fp16 unscaling, the global
gradient norm and clipping, skipping a step on overflow, and the optimizer's state dict; the
shard groups do the rest.

[Note: several shard groups]
Parameters partitioned over different ranks are different shard groups: a Mixture-of-Experts
model's expert parameters are partitioned over the ranks that hold the same experts (the
expert-data-parallel group), its dense parameters over every data-parallel rank. Every
operation here runs on each group in turn, in the same order on every rank; the global norm
sums the groups' squares, and one clip factor, one overflow decision and one loss scale hold for
all. The user sees one torch optimizer: the groups' optimizers as one (:class:`GroupedOptimizer`,
their param groups in order), which an LR scheduler schedules.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from zerotrain.optim import NoOptimizer
from zerotrain.precision import LossScaler
from zerotrain.zero.group import (
    GroupOptions,
    OptimizerFactory,
    ShardGroup,
    build_shard_group,
)
from zerotrain.zero.layout import NamedParams, ParamSlot
from zerotrain.zero.param_access import ParamAccess
from zerotrain.zero.store import ShardStore

__all__ = ["GroupedOptimizer", "ShardGroupSpec", "ZeroOptimizer"]

# what one shard group is built from: its options, its optimizer groups (settings, parameters)
# and the frozen parameters it holds
ShardGroupSpec = tuple[GroupOptions, list[tuple[dict, NamedParams]], NamedParams]


class ZeroOptimizer:
    """Partitions model states per the policy (through :class:`ShardGroup` s) and steps them.

    The model's parameters become views into the groups' flat buckets; gradients are reduced
    by the groups' reductions during backward; :meth:`step` unscales fp16 gradients, clips by
    the global norm across all shards, steps the masters through the groups' stores and
    publishes the updated parameters to every rank (see [Note: several shard groups]).
    """

    def __init__(
        self,
        model: nn.Module,
        specs: list[ShardGroupSpec],
        make_optimizer: OptimizerFactory,
        *,
        loss_scaler: LossScaler,
        gradient_clipping: float = 0.0,
    ):
        options = specs[0][0]
        # the policy is reported (checkpoints, DeepSpeed's queries), never branched on
        self.policy = options.policy
        self.precision = options.precision
        self.comm = options.comm  # the data-parallel group of the dense parameters
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.overflow = False  # the last step was skipped for a non-finite gradient

        def loss_scale() -> float:  # read at each use: dynamic fp16 scaling changes it
            return self.loss_scaler.scale

        # what every parameter's owner offers (safe_get/set, GatheredParameters)
        self.access = ParamAccess(self.comm, loss_scale)
        self.groups: list[ShardGroup] = [
            build_shard_group(
                model,
                groups,
                make_optimizer,
                opts,
                owner=self.access,
                frozen=frozen,
                loss_scale=loss_scale,
            )
            for opts, groups, frozen in specs
        ]
        self.access.groups = self.groups
        self._trained_ids = [set(g.trained_names()) for g in self.groups]
        self.stepping = False
        """True while :meth:`step` steps the optimizers (a direct step is refused otherwise:
        ``returned_optimizer`` in optimizer_plan.py)."""
        self._grouped = (
            GroupedOptimizer([g.store for g in self.groups], self._step_stores)
            if len(self.groups) > 1
            else None
        )

    @property
    def group(self) -> ShardGroup:
        """The first shard group, the dense parameters'. Every group steps the same kind of
        optimizer (the checkpoint manifest names it from this one); what acts on the state
        goes through every group."""
        return self.groups[0]

    @property
    def num_params(self) -> int:
        return sum(g.num_params for g in self.groups)

    @property
    def every_backward(self) -> bool:
        """Whether every backward reduces gradients (stages 2-3), not only the boundary's."""
        return self.groups[0].reduction.every_backward

    @property
    def shards_params(self) -> bool:
        """Whether parameters are partitioned (stage 3)."""
        return self.groups[0].residency.shards_params

    def slots(self) -> list[ParamSlot]:
        """Every trained parameter's slot, group by group, bucket by bucket."""
        return [s for g in self.groups for b in g.buckets for s in b.slots]

    def trained_params(self) -> list[nn.Parameter]:
        """The parameters the groups train, each once."""
        return [s.param for s in self.slots()]

    def on_stray_grad(self, handler: Callable[[str], None]) -> None:
        """Call ``handler(name)`` when a gradient arrives while no backward is open."""
        for group in self.groups:
            group.reduction.on_stray_grad = handler

    def take_assigned_grads(self, params: list[nn.Parameter]) -> None:
        """Take gradients assigned to ``.grad`` (not accumulated through autograd's hooks)."""
        for group, mine in zip(self.groups, self._trained_ids, strict=True):
            group.reduction.take_assigned_grads([p for p in params if id(p) in mine])

    def scope(self, keep: Callable[[nn.Parameter], bool]) -> list[list[int]]:
        """Per group, the buckets whose parameters ``keep``: an argument of :meth:`restrict`."""
        return [
            [i for i, b in enumerate(group.buckets) if keep(b.slots[0].param)]
            for group in self.groups
        ]

    def restrict(self, scope: list[list[int]] | None) -> None:
        """Reduce, in the backwards from now on, only the buckets of ``scope`` (a pipeline
        stage's own, from :meth:`scope`; None: all)."""
        for index, group in enumerate(self.groups):
            group.reduction.restrict(None if scope is None else scope[index])

    def unreduced_grads(self) -> list[str]:
        return [name for g in self.groups for name in g.reduction.unreduced_grads]

    # -- the user-visible optimizer surface -------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's fp32 master shards (several groups': one
        :class:`GroupedOptimizer`)."""
        return self._grouped or self.groups[0].store.optimizer

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
            "stage": self.policy.stage,  # recorded, to name the layout in errors
            "master_numels": [n for g in self.groups for n in g.store.master_numels()],
        }

    def state_dict(self) -> dict:
        """This rank's part of the optimizer (as DeepSpeed's ZeRO optimizers return theirs): the
        torch optimizers' state, the fp32 masters, the loss scaler. It loads back into an
        optimizer of the same layout; ``engine.save_checkpoint`` saves state that loads at any
        world size and stage."""
        return {
            "layout": self._layout(),
            "optimizer": self._optimizer_state_dict(),
            "masters": [  # every group's, in order
                g.shared_master(i).detach().clone()
                for g in self.groups
                for i in range(len(g.buckets))
            ],
            "loss_scaler": self.loss_scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def _optimizer_state_dict(self) -> dict:
        """The torch optimizer's state dict (several groups': ``{"optimizers": [...]}``), each
        store settled first."""
        if self._grouped is not None:
            return self._grouped.state_dict()
        return self.groups[0].store.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict`'s output (collective: the parameters are refreshed)."""
        saved, ours = state_dict["layout"], self._layout()
        if saved != ours:
            raise ValueError(
                f"optimizer.load_state_dict: saved with world size {saved['world_size']} and "
                f"stage {saved['stage']} (master tensors {saved['master_numels']}), this "
                f"optimizer has world size {ours['world_size']} and stage {ours['stage']} "
                f"({ours['master_numels']}); move state between layouts with "
                "engine.save_checkpoint / load_checkpoint"
            )
        masters = iter(state_dict["masters"])
        for group in self.groups:
            for index in range(len(group.buckets)):
                group.store.write_state(index, "master", next(masters))
            group.masters_set()  # the saved masters are the last synchronization's
        if load_optimizer_states:
            if self._grouped is not None:
                self._grouped.load_state_dict(state_dict["optimizer"])
            else:
                self.groups[0].store.load_optimizer_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = state_dict["skipped_steps"]
        self.publish_params()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def progress(self) -> list[str]:
        """What the groups' step extensions add to the throughput line (each text once)."""
        return list(dict.fromkeys(text for group in self.groups for text in group.progress()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new gradient accumulation (``set_to_none`` is accepted; buffers are reused)."""
        del set_to_none
        for group in self.groups:
            group.reduction.zero_grads()

    def begin_forward(self) -> None:
        for group in self.groups:
            group.begin_forward()

    def end_forward(self) -> None:
        for group in self.groups:
            group.end_forward()

    def backward_prologue(self, at_boundary: bool, grad_factor: float = 1.0) -> None:
        """Prepare the reduction of a micro-step's backward (stages 0-1: only at a boundary);
        ``grad_factor`` multiplies the gradients it produces."""
        if not self.trains:
            raise RuntimeError(NoOptimizer.MESSAGE)  # before any gradient is reduced
        for group in self.groups:
            group.begin_backward(at_boundary, grad_factor)

    def backward_epilogue(self, at_boundary: bool) -> None:
        """Reduce what the groups reduce after a micro-step's backward."""
        for group in self.groups:
            group.finish_backward(at_boundary)

    def abort_backward(self) -> None:
        """Drop what a backward that raised part-way left behind (see the reduction's)."""
        for group in self.groups:
            group.abort_backward()

    @property
    def trains(self) -> bool:
        """False for an engine built without an optimizer (forward passes only)."""
        return not isinstance(self.groups[0].store.optimizer, NoOptimizer)

    def step(self) -> bool:
        """Unscale, clip and apply the averaged gradients; False if skipped for overflow."""
        unreduced = self.unreduced_grads()
        if unreduced:
            raise RuntimeError(
                f"step(): gradients of {unreduced[:3]} came from another engine's backward (a "
                "loss through both models) after this engine's last backward, and were not "
                "averaged over the ranks; drop them with zero_grad(), or run this engine's "
                "backward after them, before step()"
            )
        for group in self.groups:
            group.begin_step()
        sum_sq = sum(g.grad_sum_of_squares() for g in self.groups)
        scale = self.loss_scaler.scale
        inv_scale = 1.0 / scale
        norm = math.sqrt(float(sum_sq)) * inv_scale
        overflow = self.overflow = self._any_rank_overflows(not math.isfinite(norm))
        self.loss_scaler.update(overflow)
        rescaled = self.loss_scaler.scale / scale  # error feedback kept scaled follows it
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
            for group in self.groups:
                group.store.scale_grads(inv_scale * clip)
            # through the grouped optimizer where there is one: an LR scheduler counts its steps
            self.stepping = True
            try:
                (self._grouped.step if self._grouped is not None else self._step_stores)()
            finally:
                self.stepping = False
        for group in self.groups:
            group.end_step(applied=not overflow, rescaled=rescaled)
        return not overflow

    def _any_rank_overflows(self, overflow: bool) -> bool:
        """``overflow`` on any rank. Every rank decides the same from averaged gradients; where
        an extension keeps them apart (0/1 Adam's local steps) they share it (one element)."""
        if not any(g.shares_overflow() for g in self.groups):
            return overflow
        flag = torch.tensor([float(overflow)], device=self.groups[0].buckets[0].device)
        self.comm.all_reduce(flag, "max", name="overflow_flag")
        return bool(flag.item())

    def _step_stores(self) -> None:
        for group in self.groups:
            group.step_store()

    def publish_params(self) -> None:
        """After the masters changed (a step, a checkpoint load): update the model's parameters
        on every rank (collective)."""
        for group in self.groups:
            group.publish()

    def wait_param_gathers(self) -> None:
        """Complete the parameter all-gathers still in flight (``overlap_param_gather``, stage
        3's prefetch and refresh). Parameters read outside a module's forward after a step are
        current once this returned."""
        for group in self.groups:
            group.residency.wait()

    # -- state views ---------------------------------------------------------------------------


class GroupedOptimizer(torch.optim.Optimizer):
    """The torch optimizers of several stores as one, for LR schedulers and users: their
    param groups in order (the same dicts: a learning rate set here is theirs), a merged view
    of their states; ``step`` steps the shard groups (see [Note: several shard groups])."""

    def __init__(self, stores: list[ShardStore], step: Callable[[], None]):
        # not torch's __init__: the parameters and their state are the member optimizers'
        self.stores = stores
        self.defaults = stores[0].optimizer.defaults
        self._step = step
        # the registries torch's register_step_pre_hook / _post_hook fill (its __init__, which
        # makes them, is not called); step runs them, without torch's global optimizer hooks,
        # which the member optimizers' own steps run
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [group for store in self.stores for group in store.optimizer.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        """A merged copy, for reading: the states live in the member optimizers."""
        return {k: v for store in self.stores for k, v in store.optimizer.state.items()}

    def step(self, closure=None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the ZeRO optimizer's step takes no closure")
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        self._step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for store in self.stores:
            store.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:  # type: ignore[override]
        return {"optimizers": [store.optimizer_state_dict() for store in self.stores]}

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        for store, state in zip(self.stores, state_dict["optimizers"], strict=True):
            store.load_optimizer_state_dict(state)

    def __repr__(self) -> str:
        names = ", ".join(type(store.optimizer).__name__ for store in self.stores)
        return f"GroupedOptimizer({names})"
