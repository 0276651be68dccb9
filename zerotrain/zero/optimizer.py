"""The ZeRO optimizer: the torch-optimizer face of a shard group (zerotrain/zero/group.py).

It owns what is global to a step, whatever the partitioning: fp16 unscaling, the global
gradient norm and clipping, skipping a step on overflow, and the optimizer's state dict; the
shard group does the rest.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from zerotrain.optim import NoOptimizer
from zerotrain.optim.state_bytes import optimizer_state_bytes_per_element
from zerotrain.precision import LossScaler
from zerotrain.zero.group import (
    GroupOptions,
    MasterPiece,
    OptimizerFactory,
    ShardGroup,
    build_shard_group,
)
from zerotrain.zero.layout import FlatBucket, NamedParams
from zerotrain.zero.memory import (
    ModelStateBytes,
    measured_model_states,
    model_state_bytes,
)
from zerotrain.zero.reduce import GradientReduction
from zerotrain.zero.store import ShardStore

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer:
    """Partitions model states per the policy (through a :class:`ShardGroup`) and steps them.

    The model's parameters become views into the group's flat buckets; gradients are reduced
    by the group's reduction during backward; :meth:`step` unscales fp16 gradients, clips by
    the global norm across all shards, steps the masters through the group's store and
    publishes the updated parameters to every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: list[tuple[dict, NamedParams]],
        make_optimizer: OptimizerFactory,
        options: GroupOptions,
        *,
        loss_scaler: LossScaler,
        gradient_clipping: float = 0.0,
    ):
        # the policy is reported (checkpoints, DeepSpeed's queries), never branched on
        self.policy = options.policy
        self.precision = options.precision
        self.comm = options.comm
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.overflow = False  # the last step was skipped for a non-finite gradient
        self.group: ShardGroup = build_shard_group(
            model, groups, make_optimizer, options, owner=self
        )

    @property
    def store(self) -> ShardStore:
        return self.group.store

    @property
    def reduction(self) -> GradientReduction:
        return self.group.reduction

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.group.buckets

    @property
    def num_params(self) -> int:
        return self.group.num_params

    def holds_whole_during_step(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is whole throughout forward and backward (at stage 3 only the
        root unit's and persistent units'; always below)."""
        return self.group.residency.holds_whole(param)

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
            "stage": self.policy.stage,  # recorded, to name the layout in errors
            "master_numels": self.store.master_numels(),
        }

    def state_dict(self) -> dict:
        """This rank's part of the optimizer (as DeepSpeed's ZeRO optimizers return theirs): the
        torch optimizer's state, the fp32 masters, the loss scaler. It loads back into an
        optimizer of the same layout; ``engine.save_checkpoint`` saves state that loads at any
        world size and stage."""
        return {
            "layout": self._layout(),
            "optimizer": self.store.optimizer_state_dict(),
            "masters": [
                self.store.state_tensor(i, "master").detach().clone()
                for i in range(len(self.buckets))
            ],
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
        for index, value in enumerate(state_dict["masters"]):
            self.store.write_state(index, "master", value)
        if load_optimizer_states:
            self.store.load_optimizer_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = state_dict["skipped_steps"]
        self.publish_params()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new gradient accumulation (``set_to_none`` is accepted; buffers are reused)."""
        del set_to_none
        self.reduction.zero_grads()

    def backward_prologue(self, at_boundary: bool, grad_factor: float = 1.0) -> None:
        """Prepare the reduction of a micro-step's backward (stages 0-1: only at a boundary);
        ``grad_factor`` multiplies the gradients it produces."""
        if not self.trains:
            raise RuntimeError(NoOptimizer.MESSAGE)  # before any gradient is reduced
        self.group.begin_backward(at_boundary, grad_factor)

    def backward_epilogue(self, at_boundary: bool) -> None:
        """Reduce what the group reduces after a micro-step's backward."""
        self.group.finish_backward(at_boundary)

    def abort_backward(self) -> None:
        """Drop what a backward that raised part-way left behind (see the reduction's)."""
        self.group.abort_backward()

    @property
    def trains(self) -> bool:
        """False for an engine built without an optimizer (forward passes only)."""
        return not isinstance(self.optimizer, NoOptimizer)

    def step(self) -> bool:
        """Unscale, clip and apply the averaged gradients; False if skipped for overflow."""
        unreduced = self.reduction.unreduced_grads
        if unreduced:
            raise RuntimeError(
                f"step(): gradients of {unreduced[:3]} came from another engine's backward (a "
                "loss through both models) after this engine's last backward, and were not "
                "averaged over the ranks; drop them with zero_grad(), or run this engine's "
                "backward after them, before step()"
            )
        self.group.begin_step()
        sum_sq = self.group.grad_sum_of_squares()
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
            self.group.step_store()
        self.group.end_step(applied=not overflow)
        return not overflow

    def publish_params(self) -> None:
        """After the masters changed (a step, a checkpoint load): update the model's parameters
        on every rank (collective)."""
        self.group.publish()

    def wait_param_gathers(self) -> None:
        """Complete the parameter all-gathers still in flight (``overlap_param_gather``, stage
        3's prefetch and refresh). Parameters read outside a module's forward after a step are
        current once this returned."""
        self.group.residency.wait()

    # -- full access to parameters outside forward (GatheredParameters) -------------------------
    def begin_access(self, params: list[nn.Parameter]) -> tuple[list[FlatBucket], list]:
        """Make ``params`` whole (collective); returns what :meth:`end_access` needs."""
        wanted = {id(p) for p in params}
        residency = self.group.residency
        buckets = [
            b
            for b in self.buckets + residency.frozen_buckets
            if any(id(s.param) in wanted for s in b.slots)
        ]
        return buckets, residency.begin_access(buckets)

    def end_access(self, access, modifier_rank: int | None) -> None:
        """Finish :meth:`begin_access`; with ``modifier_rank``, that rank's (possibly changed)
        values become every rank's parameters, master weights included. ``modifier_rank`` is a
        rank of the data-parallel group (the world's, without model parallelism)."""
        buckets, gathered_here = access
        if modifier_rank is not None:
            source = self.comm.global_rank_of(modifier_rank)
            for bucket in buckets:
                self.comm.broadcast(bucket.flat_param, src=source)
                self.group.residency.take_values(bucket)
            # the masters too (a no-op where they are the model's own fp32 shards)
            for index, bucket in enumerate(self.buckets):
                if bucket in buckets:
                    part = self.group.partition.part(bucket, bucket.require_flat_param())
                    self.store.write_state(index, "master", part)
        self.group.residency.end_access(gathered_here)

    # -- state views ---------------------------------------------------------------------------
    def master_pieces(self, *, own_shard_only: bool) -> list[MasterPiece]:
        """See :meth:`ShardGroup.master_pieces`."""
        return self.group.master_pieces(own_shard_only=own_shard_only)

    def full_master_params(self) -> dict[int, torch.Tensor]:
        """``id(param) -> full fp32 master value``, gathered from every rank's part."""
        return self.group.full_master_params()

    def full_value(self, param: nn.Parameter, kind: str) -> torch.Tensor | None:
        """One parameter's full fp32 value of ``kind`` (collective where it is partitioned:
        every rank calls it for the same parameter): ``"master"`` (the fp32 master weight),
        ``"grad"`` (the gradient reduced so far, unscaled: the average after the boundary's
        backward), or an optimizer state key such as ``"exp_avg"`` (None before the optimizer
        created it). None for a parameter this optimizer does not train."""
        found = self.group.locate(param)
        if found is None:
            return None
        index, slot = found
        bucket = self.buckets[index]
        if kind == "grad":
            local = self.reduction.reduced_grads()[index].float() / self.loss_scaler.scale
        elif kind == "master" or kind in self.store.element_state_keys():
            local = self.store.state_tensor(index, kind)
        else:
            return None
        return bucket.view(self.group.partition.full(bucket, local), slot).float().clone()

    def memory_breakdown(self) -> dict[str, float]:
        """Bytes of model states this rank holds, measured from the allocated tensors.

        ``parameters``/``gradients``/``optimizer_states`` (fp32 masters that are separate copies
        plus the optimizer's state) and their ``total``; ``formula_total`` is the ZeRO paper's
        figure for the same job (arXiv:1910.02054 §5: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N in mixed
        precision with Adam).
        """
        formula = self._formula()
        return {
            **measured_model_states(self.group),
            "formula_total": formula.total,
            "formula_offloaded": formula.offloaded,
        }

    def formula_bytes(self) -> float:
        """The ZeRO formula for this job: p·Ψ/N_p + g·Ψ/N_g + (m + s)·Ψ/N_o
        (:func:`zerotrain.zero.memory.model_state_bytes`, which ``zerotrain estimate`` prints).

        Stage 3 keeps units below the persistence threshold whole: those count p·Ψ_persistent.
        """
        return self._formula().total

    def _formula(self) -> ModelStateBytes:
        numels = self.store.master_numels()
        return model_state_bytes(
            self.num_params,
            world_size=self.comm.world_size,
            policy=self.policy,
            precision=self.precision,
            optimizer_state_bytes=optimizer_state_bytes_per_element(self.optimizer),
            persistent_numel=self.group.residency.persistent_numel,
            offload=self.store.offloaded_numel() / max(1, sum(numels)),
            offload_params=self.group.residency.home.on_host,
        )
