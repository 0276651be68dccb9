"""The ZeRO optimizer: one code path for stages 0-2, driven by a :class:`ZeroPolicy`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.precision import LossScaler, PrecisionPolicy
from zerotrain.zero.partition import (
    FlatBucket,
    ZeroPolicy,
    build_buckets,
    point_grads_at,
    point_params_at,
)
from zerotrain.zero.reducer import GradientReducer
from zerotrain.zero.shard_store import DeviceShardStore, ShardStore

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class ShardSegments:
    """Which original parameter each element of each master tensor belongs to.

    Optimizers whose update needs per-parameter norms (Lamb's trust ratio) use it to compute
    them on flat shards: ``ids[i]`` matches the i-th master tensor (-1 marks padding), and
    ``allreduce`` sums a per-parameter vector across ranks.
    """

    ids: list[torch.Tensor]
    num_segments: int
    allreduce: Callable[[torch.Tensor], None]


OptimizerFactory = Callable[[list[dict], ShardSegments], torch.optim.Optimizer]


class ZeroOptimizer:
    """Partitions model states per the policy and steps them.

    Holds the flat buckets (the model's parameters are views into them), reduces gradients,
    unscales fp16 gradients, clips by the global norm across all shards, steps the master
    shards through a :class:`ShardStore`, and refreshes every rank's parameters.
    """

    def __init__(
        self,
        groups: list[tuple[dict, NamedParams]],
        make_optimizer: OptimizerFactory,
        *,
        policy: ZeroPolicy,
        precision: PrecisionPolicy,
        comm: Communicator,
        bucket_numel: int,
        loss_scaler: LossScaler,
        gradient_clipping: float = 0.0,
    ):
        self.policy = policy
        self.precision = precision
        self.comm = comm
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.buckets: list[FlatBucket] = build_buckets(
            [named for _, named in groups],
            bucket_numel=bucket_numel,
            world_size=comm.world_size,
            rank=comm.rank,
        )
        self.num_params = sum(b.numel for b in self.buckets)
        for bucket in self.buckets:  # every rank starts from rank 0's weights, as in DeepSpeed
            comm.broadcast(bucket.flat_param, src=0)
        masters = [self._make_master(b) for b in self.buckets]
        for bucket in self.buckets:
            bucket.flat_param = bucket.flat_param.to(precision.param_dtype)
            point_params_at(bucket)
            grad_kwargs = {"dtype": precision.param_dtype, "device": bucket.flat_param.device}
            if policy.shard_gradients:
                bucket.grad_shard = torch.zeros(bucket.shard_numel, **grad_kwargs)
            else:
                bucket.flat_grad = torch.zeros(bucket.numel_padded, **grad_kwargs)
                point_grads_at(bucket)

        inner_groups = []
        ids = []
        for group_index, (hyper, _) in enumerate(groups):
            members = [i for i, b in enumerate(self.buckets) if b.group_index == group_index]
            inner_groups.append({**hyper, "params": [masters[i] for i in members]})
            ids += [self._segment_ids(self.buckets[i]) for i in members]
        segments = ShardSegments(ids, sum(len(named) for _, named in groups), self._allreduce_sum)
        self.store: ShardStore = DeviceShardStore(
            masters,
            make_optimizer(inner_groups, segments),
            masters_alias_params=not precision.has_master_copy,
        )
        self.reducer = GradientReducer(self.buckets, comm, policy)

    # -- construction helpers ------------------------------------------------------------------
    def _optimizer_range(self, bucket: FlatBucket) -> tuple[int, int]:
        if self.policy.shard_optimizer_states:
            return bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel
        return 0, bucket.numel_padded

    def _optimizer_part(self, bucket: FlatBucket, flat: torch.Tensor) -> torch.Tensor:
        start, end = self._optimizer_range(bucket)
        return flat[start:end]

    def _make_master(self, bucket: FlatBucket) -> torch.Tensor:
        part = self._optimizer_part(bucket, bucket.flat_param)  # still fp32 here
        return part.clone() if self.precision.has_master_copy else part

    def _segment_ids(self, bucket: FlatBucket) -> torch.Tensor:
        return bucket.slot_ids(*self._optimizer_range(bucket)).to(bucket.flat_param.device)

    def _allreduce_sum(self, tensor: torch.Tensor) -> None:
        if self.policy.shard_optimizer_states:
            self.comm.all_reduce(tensor)

    # -- the user-visible optimizer surface -------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's fp32 master shards."""
        return self.store.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new gradient accumulation (``set_to_none`` is accepted; buffers are reused)."""
        del set_to_none
        self.reducer.zero_grads()

    def backward_epilogue(self, at_boundary: bool) -> None:
        """Reduce what the policy reduces after a micro-step's backward."""
        self.reducer.finish_backward(at_boundary)

    def step(self) -> bool:
        """Unscale, clip and apply the averaged gradients; False if skipped for overflow."""
        self.store.attach_grads(self.reducer.reduced_grads())
        sum_sq = self.store.grad_sum_of_squares()
        if self.policy.shard_optimizer_states:  # each element is owned by exactly one rank
            self.comm.all_reduce(sum_sq)
        inv_scale = 1.0 / self.loss_scaler.scale
        norm = math.sqrt(sum_sq.item()) * inv_scale
        overflow = not math.isfinite(norm)
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
            self.store.write_params([self._optimizer_part(b, b.flat_param) for b in self.buckets])
            if self.policy.shard_optimizer_states:
                self._gather_params()
        self.store.release_grads()
        self.reducer.zero_grads()
        return not overflow

    def _gather_params(self) -> None:
        ops = [
            self.comm.all_gather(b.flat_param, b.shard(b.flat_param), async_op=True)
            for b in self.buckets
        ]
        for op in ops:
            op.wait()

    # -- state views ---------------------------------------------------------------------------
    def full_master_params(self) -> dict[int, torch.Tensor]:
        """``id(param) -> full fp32 master value``, gathered from every rank's shard."""
        out: dict[int, torch.Tensor] = {}
        for bucket, master in zip(self.buckets, self.store.master_shards(), strict=True):
            if not self.precision.has_master_copy:
                full = bucket.flat_param
            elif self.policy.shard_optimizer_states:
                full = torch.empty(bucket.numel_padded, dtype=master.dtype, device=master.device)
                self.comm.all_gather(full, master)
            else:
                full = master
            for slot in bucket.slots:
                out[id(slot.param)] = bucket.view(full, slot)
        return out

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

        params = nbytes(b.flat_param for b in self.buckets)
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
        """The ZeRO formula for this job: Ψ·(p + g/N_g + (m + s)/N_o)."""
        psi, n = self.num_params, self.comm.world_size
        p = g = torch.tensor([], dtype=self.precision.param_dtype).element_size()
        m = 4 if self.precision.has_master_copy else 0
        s = optimizer_state_bytes_per_element(self.optimizer)
        grad_div = n if self.policy.shard_gradients else 1
        optim_div = n if self.policy.shard_optimizer_states else 1
        return psi * (p + g / grad_div + (m + s) / optim_div)


def optimizer_state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """fp32 bytes of state a known optimizer keeps per parameter element (Adam: m and v)."""
    defaults = optimizer.defaults
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        return 12 if defaults.get("amsgrad") else 8
    if name == "Lamb":
        return 8
    if name == "SGD":
        return 4 if defaults.get("momentum", 0) else 0
    # Unknown optimizer: count the state tensors shaped like their parameter, once populated.
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                return sum(
                    t.element_size()
                    for t in state.values()
                    if torch.is_tensor(t) and t.shape == param.shape
                )
    return 0
