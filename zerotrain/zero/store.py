"""Where this rank's fp32 master shard and its optimizer state live, and the step over them.

The shard group and checkpoints only talk to the :class:`ShardStore` interface (the
placement strategy), so that a later store can keep the shard in CPU memory or on NVMe and
step it there, without anything else changing. Checkpoints read and write the state piecewise
through it (:meth:`ShardStore.state_tensor`), never through the torch optimizer's dict.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from zerotrain.optim.adam import keeps_step_on_device
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.low_precision import LowPrecisionSteps, copy_into

OptimizerOver = Callable[..., torch.optim.Optimizer]
"""``optimizer_over(masters, probe=False)`` builds the torch optimizer over the master tensors:
per bucket, in bucket order, the tensors its optimizer part is stepped as (one, or a store's
sub-groups); ``probe``: over stand-ins, to learn what it keeps (no per-parameter layout)."""


class ParamShards:
    """The model's copies (training dtype) of the parts a store steps, one per bucket, which
    a store writes bucket by bucket: it fills ``open(i)`` with bucket i's new values, then calls
    ``close(i)``, with no other bucket open in between. Here they are resident tensors; stage
    3's shards on NVMe stage each bucket in a host buffer and write it to disk at ``close``
    (zerotrain/zero/param_home.py)."""

    def __init__(self, tensors: list[torch.Tensor], exact: bool = True):
        self.tensors = tensors
        # whether the copies keep what the store writes: not when a quantized all-gather
        # (comm_compression.parameters) writes its dequantized values back into them
        self.exact = exact

    def __len__(self) -> int:
        return len(self.tensors)

    def open(self, index: int) -> torch.Tensor:
        return self.tensors[index]

    def close(self, index: int) -> None:
        """Bucket ``index``'s values are complete."""

    def fill(self, index: int, values: torch.Tensor) -> None:
        """Bucket ``index`` takes ``values`` (cast to its dtype)."""
        self.open(index).copy_(values)
        self.close(index)

    @property
    def resident(self) -> bool:
        """Whether :attr:`tensors` are the copies themselves (a master may alias them)."""
        return True


def needs_whole_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's update needs whole parameters, so that its step is one
    collective over every bucket (Lamb's trust ratios, Muon's matrices)."""
    return bool(getattr(optimizer, "steps_collectively", False))


class ShardStore(ABC):
    """The optimizer's view of this rank's partition: master tensors, their grads, one step."""

    optimizer: torch.optim.Optimizer  # the torch optimizer that steps the masters
    on_device: ClassVar[bool] = False  # the masters and their state live on the device
    # steps masters or state stored narrower than fp32 (the precision policy's); every store
    # sets its own
    low_precision: LowPrecisionSteps

    def step_optimizer(
        self, masters: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> None:
        """The torch optimizer's step over ``masters`` (those with a gradient; ``indices``:
        their buckets, default their positions), in fp32 over narrow storage (see [Note:
        low-precision masters and states])."""
        self.low_precision.step(self.optimizer, masters, indices=indices)

    def master_shards(self) -> list[torch.Tensor] | None:
        """The master tensors (fp32; bf16 with bf16 masters), one per bucket, in bucket order,
        where they stay in memory for the store's life (a step extension may step them in
        place); None where they do not (swapped from NVMe)."""
        return None

    @abstractmethod
    def master_numels(self) -> list[int]:
        """Elements of each bucket's master (its optimizer part), in bucket order."""

    def take_reduced(self, index: int, grad: torch.Tensor) -> None:  # noqa: B027 (optional)
        """Bucket ``index``'s gradient is final for this step (its reduction at the accumulation
        boundary completed): a store that moves gradients starts here."""

    def forget_taken(self) -> None:  # noqa: B027 (optional)
        """A boundary backward begins: gradients taken before are not final."""

    def held_tensors(self) -> list[torch.Tensor]:
        """The masters and optimizer state tensors in memory (for memory accounting)."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return self._resident_masters() + state

    def _resident_masters(self) -> list[torch.Tensor]:
        return []

    def offloaded_tensors(self) -> list[torch.Tensor]:
        """Those of :meth:`held_tensors` in host memory, off the training device: none here."""
        return []

    def disk_bytes(self) -> int:
        """Bytes of working files (NVMe offload)."""
        return 0

    def offloaded_numel(self) -> int:
        """Elements of master tensors held off the training device."""
        return 0

    def staging_bytes(self) -> int:
        """Bytes of buffers that carry data between host and device."""
        return 0

    @abstractmethod
    def attach_grads(self, reduced_grads: list[torch.Tensor]) -> None:
        """Take the reduced gradient of each bucket's shard (any dtype) as the master's grad."""

    @abstractmethod
    def grad_sum_of_squares(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        """Sum of squared master gradients held here (0-d fp32 tensor); ``weights``: one factor
        per bucket for its share (see ``ModelParallel`` in group.py)."""

    @abstractmethod
    def scale_grads(self, factor: float) -> None:
        """Multiply every master gradient by ``factor`` (unscaling and clipping in one pass)."""

    def step(self, param_shards: ParamShards) -> None:
        """One optimizer step over the masters, then their new values into the model's
        (possibly lower-precision) ``param_shards``: a store may interleave the two."""
        self.step_optimizer(self._resident_masters())
        self.write_params(param_shards)

    def step_deferred(self, param_shards: ParamShards) -> dict[int, Callable[[], None]]:
        """Like :meth:`step`, but the store may leave buckets to step later: returns, per such
        bucket index, the call that steps it and writes its parameter shard, with this step's
        hyperparameters (see [Note: a step deferred to the next use] in in_flight.py)."""
        self.step(param_shards)
        return {}

    @abstractmethod
    def write_params(self, param_shards: ParamShards) -> None:
        """Copy the masters into the model's (possibly lower-precision) shards."""

    @abstractmethod
    def release_grads(self) -> None:
        """Drop the master gradients until the next step."""

    def optimizer_state_dict(self) -> dict:
        """The torch optimizer's ``state_dict()`` (``ZeroOptimizer.state_dict``)."""
        self._settle()
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self._settle()
        self.optimizer.load_state_dict(state_dict)

    # -- state, piecewise (checkpoints) ------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @abstractmethod
    def element_state_keys(self, master: int | None = None) -> list[str]:
        """Optimizer state entries shaped like their master tensor (Adam's ``exp_avg``...):
        sharded with it; the rest (``step``) are per-group scalars. Those of bucket ``master``
        (None: of any bucket; an optimizer may keep other states in other groups, as Muon
        does). Empty before the first step."""

    @abstractmethod
    def state_tensor(self, master: int, key: str) -> torch.Tensor:
        """Bucket ``master``'s ``key``: ``"master"`` (the fp32 weights) or an element state key
        (1-D, the master's length). Change it through :meth:`write_state`: it may be a copy."""

    @abstractmethod
    def write_state(self, master: int, key: str, value: torch.Tensor) -> None:
        """Set bucket ``master``'s ``key`` (see :meth:`state_tensor`) to ``value``."""

    def write_state_piece(self, master: int, key: str, start: int, values: torch.Tensor) -> None:
        """Set elements ``[start, start + values.numel())`` of bucket ``master``'s ``key`` (see
        :meth:`state_tensor`) to ``values`` (1-D), the rest unchanged."""
        whole = self.state_tensor(master, key).clone()
        whole[start : start + values.numel()] = values
        self.write_state(master, key, whole)

    @abstractmethod
    def reset_element_state(self, keys: list[str]) -> None:
        """Replace the optimizer's state by zeroed ``keys`` on every master (to be loaded)."""

    def _settle(self) -> None:  # noqa: B027 (a hook: optional)
        """Finish deferred steps (see :meth:`step_deferred`) before the state is read."""

    def scalar_state(self) -> list[dict]:
        """Per optimizer group, the state entries that are not per element (Adam's ``step``)."""
        self._settle()
        element_keys = set(self.element_state_keys())
        out = []
        for group in self.optimizer.param_groups:
            first = self.optimizer.state.get(group["params"][0], {}) if group["params"] else {}
            out.append({k: v for k, v in first.items() if k not in element_keys})
        return out

    def load_scalar_state(self, hyperparameters: list[dict], scalars: list[dict]) -> None:
        """Per optimizer group: update its hyperparameters and set its scalar state."""
        self._settle()
        for group, hyper, group_scalars in zip(
            self.optimizer.param_groups, hyperparameters, scalars, strict=True
        ):
            # only the settings this optimizer has: a checkpoint of another class of the same
            # state kind (torch's AdamW, FusedAdam) carries its own switches too
            group.update((key, value) for key, value in hyper.items() if key in group)
            on_device = keeps_step_on_device(group)
            for master in group["params"]:
                state = self.optimizer.state[master]
                for key, value in group_scalars.items():
                    if torch.is_tensor(value):
                        value = value.clone().to(master.device if on_device else "cpu")
                    state[key] = value


class InMemoryShardStore(ShardStore):
    """A store whose masters are tensors in memory (the device's or the host's), one per
    bucket, that the torch optimizer keys its state by."""

    _masters: list[torch.Tensor]

    def master_shards(self) -> list[torch.Tensor]:
        self._settle()
        return self._masters

    def master_numels(self) -> list[int]:
        return [m.numel() for m in self._masters]

    def _resident_masters(self) -> list[torch.Tensor]:
        return self._masters

    def element_state_keys(self, master: int | None = None) -> list[str]:
        self._settle()
        keys: set[str] = set()
        for tensor in self._masters if master is None else [self._masters[master]]:
            state = self.optimizer.state.get(tensor, {})
            keys.update(
                k for k, v in state.items() if torch.is_tensor(v) and v.shape == tensor.shape
            )
        return sorted(keys)

    def state_tensor(self, master: int, key: str) -> torch.Tensor:
        self._settle()
        tensor = self._masters[master]
        return tensor if key == "master" else self.optimizer.state[tensor][key]

    def write_state(self, master: int, key: str, value: torch.Tensor) -> None:
        copy_into(self.state_tensor(master, key), value)

    def write_state_piece(self, master: int, key: str, start: int, values: torch.Tensor) -> None:
        with torch.no_grad():  # in place: no copy of the whole bucket for one parameter
            self.state_tensor(master, key)[start : start + values.numel()].copy_(values)

    def reset_element_state(self, keys: list[str]) -> None:
        self._settle()
        dtype = self.low_precision.precision.state_dtype
        zero_element_state(self.optimizer, self._masters, keys, dtype)


def write_device_params(
    masters: Sequence[torch.Tensor | None], targets: ParamShards, *, alias: bool
) -> None:
    """The new values of the buckets the device steps (``masters``, None for the others) into
    the model's shards; nothing to do where the masters are those shards (``alias``)."""
    if alias:
        return
    for index, master in enumerate(masters):
        if master is not None:
            targets.fill(index, master)


def zero_element_state(
    optimizer: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    keys: list[str],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Replace the state of ``masters`` by zeroed ``keys`` in ``dtype`` (every key on every
    master, padding-only ones too: a checkpoint load then writes the values); an optimizer that
    keeps different states in different groups (Muon) says which keys are a master's."""
    keys_of = getattr(optimizer, "element_state_keys_of", lambda master: keys)
    for master in masters:
        optimizer.state.pop(master, None)
        wanted = [key for key in keys if key in keys_of(master)]
        state = {key: torch.zeros_like(master, dtype=dtype) for key in wanted}
        optimizer.state[master].update(state)


def _foreach_norm_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def sum_of_squares(
    norms: list[torch.Tensor | None], weights: Sequence[float] | None = None
) -> torch.Tensor:
    """The sum of the squared per-bucket ``norms`` (None: a bucket without gradients now), each
    times its ``weights`` entry when given."""
    present = [(i, norm) for i, norm in enumerate(norms) if norm is not None]
    if not present:
        return torch.zeros((), dtype=torch.float32)
    squares = torch.stack([norm for _, norm in present]).float().square()
    if weights is not None:
        squares = squares * torch.tensor([weights[i] for i, _ in present], device=squares.device)
    return squares.sum()


class DeviceShardStore(InMemoryShardStore):
    """Master shards on the training device, stepped by a torch optimizer.

    With ``masters_alias_params`` (fp32 training) the masters are the model's own shards, so
    there is no second copy and :meth:`write_params` has nothing to do.
    """

    on_device = True

    def __init__(
        self,
        masters: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        masters_alias_params: bool,
        precision: PrecisionPolicy,
    ):
        self._masters = masters
        self.masters_alias_params = masters_alias_params
        self.optimizer = optimizer  # built over ``masters``
        self.low_precision = LowPrecisionSteps(precision)

    def attach_grads(self, reduced_grads: list[torch.Tensor]) -> None:
        for master, grad in zip(self._masters, reduced_grads, strict=True):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def _grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self._masters if m.grad is not None]

    def grad_sum_of_squares(self, weights: Sequence[float] | None = None) -> torch.Tensor:
        present = [(i, m.grad) for i, m in enumerate(self._masters) if m.grad is not None]
        norms: list[torch.Tensor | None] = [None] * len(self._masters)
        if present:
            grads = [grad for _, grad in present]
            # bf16 masters take bf16 gradients: their norms are summed in fp32
            wide = all(g.dtype == torch.float32 for g in grads)
            found = torch._foreach_norm(grads) if wide else _foreach_norm_fp32(grads)
            for (i, _), norm in zip(present, found, strict=True):
                norms[i] = norm
        return sum_of_squares(norms, weights)

    def scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            torch._foreach_mul_(self._grads(), factor)

    def write_params(self, param_shards: ParamShards) -> None:
        if self.masters_alias_params:
            return
        targets = param_shards.tensors
        if param_shards.resident and all(
            t.device == m.device for t, m in zip(targets, self._masters, strict=True)
        ):
            torch._foreach_copy_(targets, self._masters)
            return
        write_device_params(self._masters, param_shards, alias=False)  # offload_param

    def release_grads(self) -> None:
        for master in self._masters:
            master.grad = None


class Placement:
    """Where the masters live: the strategy that builds a shard group's store. Here, on the
    training device (zerotrain/zero/offload.py has the host's)."""

    def build_store(
        self,
        masters_fp32: list[torch.Tensor],
        param_parts: ParamShards,
        precision: PrecisionPolicy,
        optimizer_over: OptimizerOver,
    ) -> ShardStore:
        """The store over each bucket's optimizer part: ``masters_fp32`` its fp32 values (they
        may alias ``param_parts``, the model's own copy, where the masters have its dtype)."""
        alias = masters_alias_params(precision, masters_fp32, param_parts)
        masters = [
            param_parts.tensors[index] if alias else master.to(precision.master_dtype, copy=True)
            for index, master in enumerate(masters_fp32)
        ]
        optimizer = optimizer_over([[m] for m in masters])
        return DeviceShardStore(masters, optimizer, masters_alias_params=alias, precision=precision)


def masters_alias_params(
    precision: PrecisionPolicy, masters_fp32: list[torch.Tensor], param_parts: ParamShards
) -> bool:
    """Masters in the parameters' dtype (fp32 training; bf16 masters of bf16 training): the
    master is the model's own copy of this rank's part, unless that copy lives elsewhere (offload_param keeps stage 3's shards in host memory or on NVMe) or does
    not keep exact values (a quantized parameter all-gather overwrites it)."""
    if precision.has_master_copy or not param_parts.resident or not param_parts.exact:
        return False
    return all(m.device == p.device for m, p in zip(masters_fp32, param_parts.tensors, strict=True))
