"""LAMB with DeepSpeed ``FusedLamb`` semantics that also runs on ZeRO shards.

LAMB (You et al., arXiv:1904.00962, Algorithm 2): Adam moments with bias correction, the
weight decay added to the Adam direction, and the step of each parameter scaled by its trust
ratio ``||w|| / ||update||``, clamped to ``[min_coeff, max_coeff]`` and taken as 1 when either
norm is 0 (DeepSpeed's ``csrc/lamb/fused_lamb_cuda_kernel.cu``).

[Note: trust ratios on shards]
Under ZeRO the optimizer holds flat 1-D tensors, each a slice of many model parameters, and a
model parameter may straddle two ranks. The trust ratio is a property of the *original*
parameter, so a group may carry ``num_segments`` and ``segment_ranges``: for each flat tensor,
the ``(start, end, segment)`` ranges of the original parameters (index ``segment``) it holds, in
order; elements in no range are padding. The elements of one parameter inside one flat tensor are
contiguous, so the layout costs memory per parameter, not per element (an int64 index per element
would cost 8 bytes each, as much as Adam's two moments). A step cuts each chunk of a flat tensor
into runs of one bin each (bin ``segment + 1``; bin 0 is padding), sums ``w**2`` and
``update**2`` per run with ``torch.segment_reduce`` and adds the run sums into their bins, hands
the sums of all segmented groups to ``norm_allreduce`` in one 1-D float64 tensor (one collective
per step), and scales every element by the ratio of its bin, repeated over its run. Padding gets
ratio 0: it never moves.

[Note: two passes and chunks]
The update is needed twice: for its norm, and after the all-reduce to apply it. Keeping it would
cost one extra fp32 copy of the whole shard, so, like DeepSpeed's kernel (part1 / part3), the
update is recomputed in the second pass from the same ``p``, ``exp_avg`` and ``exp_avg_sq``.
Both passes walk a flat tensor in chunks of ``_chunk_numel`` elements, so the temporaries
(including the float64 squares that keep the per-segment sums accurate) stay bounded whatever
the shard size.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["FusedLamb", "Lamb"]

# Keys of a param group that describe how the group's tensors map onto model parameters. They
# are a property of the current sharding, not training state: state_dict() leaves them out and
# load_state_dict() keeps the ones the optimizer was built with.
_LAYOUT_KEYS = ("segment_ranges", "num_segments")

_SUM_DTYPE = torch.float64

# A range of a segmented tensor: elements [start, end) belong to model parameter `segment`.
SegmentRange = tuple[int, int, int]


@dataclass(frozen=True)
class _Runs:
    """A segmented tensor as consecutive runs of one bin each, covering all its elements: bin
    ``segment + 1`` for each of its ranges, bin 0 for the padding between and after them."""

    ends: list[int]  # exclusive end of each run; increasing, the last one is the tensor's numel
    bins: list[int]

    @classmethod
    def of(cls, ranges: Sequence[SegmentRange], numel: int) -> _Runs:
        ends: list[int] = []
        bins: list[int] = []
        position = 0
        for start, end, segment in ranges:
            if start > position:
                ends.append(start)
                bins.append(0)
            ends.append(end)
            bins.append(segment + 1)
            position = end
        if position < numel:
            ends.append(numel)
            bins.append(0)
        return cls(ends, bins)

    def in_chunk(self, chunk: slice, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(lengths, bins)`` of the runs cut to ``chunk``, as int64 tensors on ``device``."""
        lengths, bins = [], []
        position = chunk.start
        for i in range(bisect.bisect_right(self.ends, chunk.start), len(self.ends)):
            end = min(self.ends[i], chunk.stop)
            lengths.append(end - position)
            bins.append(self.bins[i])
            if end == chunk.stop:
                break
            position = end
        return (
            torch.tensor(lengths, dtype=torch.int64, device=device),
            torch.tensor(bins, dtype=torch.int64, device=device),
        )


@dataclass
class _TensorStep:
    """One tensor of a group in one step."""

    param: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    bias_correction1: float
    bias_correction2: float
    runs: _Runs | None  # None: the tensor is one model parameter


@dataclass
class _GroupStep:
    """Per-group work of one step: the tensors and their squared-norm sums."""

    group: dict[str, Any]
    tensors: list[_TensorStep] = field(default_factory=list)
    # Segmented: one (num_segments + 1,) vector each, bin 0 = padding.
    # Plain: one 0-d tensor per entry of `tensors`.
    weight_sq: list[Tensor] = field(default_factory=list)
    update_sq: list[Tensor] = field(default_factory=list)

    @property
    def segmented(self) -> bool:
        return "segment_ranges" in self.group


class Lamb(torch.optim.Optimizer):
    """LAMB (arXiv:1904.00962) with DeepSpeed ``FusedLamb`` semantics and ZeRO-shard support.

    Per element, with ``t`` the tensor's step count::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * w
        w = w - lr * trust_ratio * update

    where ``bc1 = 1 - beta1**t`` and ``bc2 = 1 - beta2**t`` (both 1 without bias correction),
    ``eps`` moves under the square root with ``eps_inside_sqrt``, and ``trust_ratio`` is
    ``clamp(||w|| / ||update||, min_coeff, max_coeff)`` over one model parameter, or 1 when either
    norm is 0.

    Without ``segment_ranges`` every tensor in a group is one model parameter. A group may
    instead describe flat ZeRO shards (see [Note: trust ratios on shards]) with the keys:

    - ``"segment_ranges"``: per tensor in ``params`` (contiguous, all on one device), a sequence
      of ``(start, end, segment)`` int triples, in order and disjoint: elements ``[start, end)``
      of the flattened tensor belong to model parameter ``segment``; elements in no range are
      padding and never change;
    - ``"num_segments"``: the number of model parameters (segments are in ``[0, num_segments)``).

    :meth:`set_segments` adds both keys to the groups of an optimizer already built.

    A segmented group treats a missing gradient as zeros, so every rank runs the same
    collectives.

    Args:
        params: tensors or param groups, as for any torch optimizer.
        lr: learning rate. Default 1e-3.
        bias_correction: bias-correct the moments. Default True.
        betas: moment decay rates. Default (0.9, 0.999).
        eps: denominator term. Default 1e-8.
        eps_inside_sqrt: add ``eps`` under the square root. Default False.
        weight_decay: decay coefficient added to the update. Default 0.
        max_coeff: upper clamp of the trust ratio. Default 10.
        min_coeff: lower clamp of the trust ratio. Default 0.01.
        amsgrad: not supported (as in DeepSpeed); must be False.
        norm_allreduce: sums a 1-D tensor in place across ranks, for segmented groups whose
            model parameters are split across ranks; None in a single process. Called once per
            step with one float64 tensor, identical in length on every rank.
    """

    # Elements per chunk in a step; see [Note: two passes and chunks]. Tests lower it.
    _chunk_numel: int = 1 << 20

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        *,
        norm_allreduce: Callable[[Tensor], None] | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support amsgrad (neither does DeepSpeed's FusedLamb)")
        if not lr >= 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Lamb: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {tuple(betas)}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"Lamb: need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                f"max_coeff={max_coeff}"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        self.norm_allreduce = norm_allreduce
        super().__init__(params, defaults)

    steps_collectively = True
    """On shards its step sums per-parameter norms over the ranks: one step over every
    bucket, which every rank takes (zerotrain/zero/offload.py)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checking its ``segment_ranges``/``num_segments`` against its tensors."""
        super().add_param_group(param_group)
        _check_layout(self.param_groups[-1], len(self.param_groups) - 1)

    def set_segments(
        self,
        segment_ranges: Mapping[Tensor, Sequence[SegmentRange]],
        num_segments: int,
        *,
        norm_allreduce: Callable[[Tensor], None] | None = None,
    ) -> None:
        """Make every group segmented: each of its tensors is a flat shard of model parameters.

        For an optimizer built before the layout of its tensors was known (the ZeRO engine
        calls it on a Lamb however it was built: from the config, or by the user).

        Args:
            segment_ranges: for every tensor of every group, its ``(start, end, segment)``
                ranges, as the group key ``"segment_ranges"`` (see the class docstring).
            num_segments: the number of model parameters.
            norm_allreduce: replaces the optimizer's ``norm_allreduce``.

        Raises:
            ValueError: a tensor without ranges, or ranges that do not fit their tensor.
        """
        for index, group in enumerate(self.param_groups):
            ranges = []
            for i, param in enumerate(group["params"]):
                if param not in segment_ranges:
                    raise ValueError(
                        f"Lamb.set_segments: param_groups[{index}] params[{i}] (shape "
                        f"{tuple(param.shape)}) has no entry in segment_ranges; give every "
                        "tensor of the optimizer its ranges"
                    )
                ranges.append(segment_ranges[param])
            group["segment_ranges"] = ranges
            group["num_segments"] = num_segments
            _check_layout(group, index)
        self.norm_allreduce = norm_allreduce

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state without the groups' layout keys (they depend on sharding)."""
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in _LAYOUT_KEYS:
                group.pop(key, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch optimizer state, keeping this optimizer's own group layouts."""
        layouts = [{k: g[k] for k in _LAYOUT_KEYS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, layout in zip(self.param_groups, layouts, strict=True):
            for key in _LAYOUT_KEYS:
                group.pop(key, None)
            group.update(layout)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one LAMB step; ``closure`` re-evaluates the loss, as for torch optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        plans = [self._accumulate(group) for group in self.param_groups]
        self._reduce_segment_sums([plan for plan in plans if plan.segmented])
        for plan in plans:
            self._apply(plan)
        return loss

    # First pass: moments, then the squared norms of weights and updates.
    def _accumulate(self, group: dict[str, Any]) -> _GroupStep:
        plan = _GroupStep(group)
        beta1, beta2 = group["betas"]
        segmented = plan.segmented
        if segmented:
            num_bins = group["num_segments"] + 1
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            weight_sq = torch.zeros(num_bins, dtype=_SUM_DTYPE, device=device)
            update_sq = torch.zeros(num_bins, dtype=_SUM_DTYPE, device=device)
            plan.weight_sq, plan.update_sq = [weight_sq], [update_sq]

        for index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None and not segmented:
                continue
            if grad is not None:
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                if grad.dtype != param.dtype:
                    grad = grad.to(param.dtype)
            state = self.state[param]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.mul_(beta1)
            exp_avg_sq.mul_(beta2)
            if grad is not None:
                exp_avg.add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.addcmul_(grad, grad, value=1.0 - beta2)
            if group["bias_correction"]:
                bc1, bc2 = 1.0 - beta1 ** state["step"], 1.0 - beta2 ** state["step"]
            else:
                bc1 = bc2 = 1.0
            item = _TensorStep(
                param=param,
                exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq,
                bias_correction1=bc1,
                bias_correction2=bc2,
                runs=_Runs.of(group["segment_ranges"][index], param.numel()) if segmented else None,
            )
            plan.tensors.append(item)

            if segmented:
                assert item.runs is not None
                for chunk, update in self._updates(item, group):
                    lengths, bins = item.runs.in_chunk(chunk, param.device)
                    weight = param.view(-1)[chunk].to(_SUM_DTYPE, copy=True).square_()
                    # pyrefly: ignore[unbound-name] (bound above under the same `segmented`)
                    weight_sq.index_add_(0, bins, _run_sums(weight, lengths))
                    # `update` is scratch: squaring it in place is fine even when it is float64.
                    update = update.to(_SUM_DTYPE).square_()
                    # pyrefly: ignore[unbound-name] (as weight_sq)
                    update_sq.index_add_(0, bins, _run_sums(update, lengths))
            else:
                w_sq = torch.zeros((), dtype=_SUM_DTYPE, device=param.device)
                u_sq = torch.zeros((), dtype=_SUM_DTYPE, device=param.device)
                for chunk, update in self._updates(item, group):
                    w_sq += _flat(param)[chunk].square().sum(dtype=_SUM_DTYPE)
                    u_sq += update.square().sum(dtype=_SUM_DTYPE)
                plan.weight_sq.append(w_sq)
                plan.update_sq.append(u_sq)
        return plan

    def _reduce_segment_sums(self, plans: Sequence[_GroupStep]) -> None:
        """Sum every segmented group's norms across ranks in one collective."""
        if not plans or self.norm_allreduce is None:
            return
        parts = [t for plan in plans for t in (plan.weight_sq[0], plan.update_sq[0])]
        device = parts[0].device
        flat = torch.cat([t.to(device) for t in parts])
        self.norm_allreduce(flat)
        offset = 0
        for part in parts:
            part.copy_(flat[offset : offset + part.numel()])
            offset += part.numel()

    # Second pass: recompute each update and apply it scaled by its trust ratio.
    def _apply(self, plan: _GroupStep) -> None:
        group = plan.group
        lr = float(group["lr"])
        if plan.segmented:
            ratio = _trust_ratio(
                plan.weight_sq[0], plan.update_sq[0], group["min_coeff"], group["max_coeff"]
            )
            ratio[0] = 0.0  # padding bin
            step_scale = ratio.mul_(lr)
            for item in plan.tensors:
                assert item.runs is not None
                flat_param = item.param.view(-1)
                for chunk, update in self._updates(item, group):
                    lengths, bins = item.runs.in_chunk(chunk, update.device)
                    scale = step_scale[bins].to(update.dtype)
                    scale = scale.repeat_interleave(lengths, output_size=update.numel())
                    flat_param[chunk].addcmul_(update, scale, value=-1.0)
            return
        for item, w_sq, u_sq in zip(plan.tensors, plan.weight_sq, plan.update_sq, strict=True):
            ratio = _trust_ratio(w_sq, u_sq, group["min_coeff"], group["max_coeff"])
            scale = ratio.mul_(lr).to(item.param.dtype)
            flat_param = _flat(item.param)
            for chunk, update in self._updates(item, group):
                flat_param[chunk].addcmul_(update, scale, value=-1.0)

    def _updates(self, item: _TensorStep, group: dict[str, Any]) -> Iterator[tuple[slice, Tensor]]:
        """Yield ``(chunk, update[chunk])`` over the flattened tensor (see the module note)."""
        if not item.param.is_contiguous():  # only a plain tensor: one chunk, its own shape
            yield slice(None), _update(item.param, item.exp_avg, item.exp_avg_sq, item, group)
            return
        # The moments are only read here, so reshape (a view unless they are non-contiguous).
        param = item.param.view(-1)
        exp_avg = item.exp_avg.reshape(-1)
        exp_avg_sq = item.exp_avg_sq.reshape(-1)
        numel = param.numel()
        for start in range(0, numel, self._chunk_numel):
            chunk = slice(start, min(start + self._chunk_numel, numel))
            yield chunk, _update(param[chunk], exp_avg[chunk], exp_avg_sq[chunk], item, group)


def _flat(tensor: Tensor) -> Tensor:
    """A 1-D view of a contiguous tensor; the tensor itself when it cannot be viewed flat."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor


def _update(
    param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, item: _TensorStep, group: dict[str, Any]
) -> Tensor:
    """The LAMB direction ``m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` (a new tensor)."""
    denom = exp_avg_sq / item.bias_correction2
    if group["eps_inside_sqrt"]:
        denom.add_(group["eps"]).sqrt_()
    else:
        denom.sqrt_().add_(group["eps"])
    update = (exp_avg / item.bias_correction1).div_(denom)
    if group["weight_decay"] != 0:
        update.add_(param, alpha=group["weight_decay"])
    return update


def _run_sums(values: Tensor, lengths: Tensor) -> Tensor:
    """The sum of each run of ``values`` (1-D), the runs ``lengths`` long and covering it."""
    # unsafe: skip checking that the lengths add up (a device sync); they do by construction.
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)


def _trust_ratio(
    weight_sq: Tensor, update_sq: Tensor, min_coeff: float, max_coeff: float
) -> Tensor:
    """``clamp(||w|| / ||u||, min_coeff, max_coeff)``, or 1 where either norm is 0 (a new tensor)."""
    weight_norm, update_norm = weight_sq.sqrt(), update_sq.sqrt()
    ratio = (weight_norm / update_norm).clamp_(min_coeff, max_coeff)
    defined = (weight_norm > 0) & (update_norm > 0)
    return torch.where(defined, ratio, torch.ones_like(ratio))


def _check_layout(group: dict[str, Any], index: int) -> None:
    """Validate a group's ``segment_ranges``/``num_segments`` (see the Lamb docstring)."""
    where = f"Lamb param_groups[{index}]"
    has_ranges, has_count = "segment_ranges" in group, "num_segments" in group
    if not has_ranges and not has_count:
        return
    if not (has_ranges and has_count):
        raise ValueError(f"{where}: 'segment_ranges' and 'num_segments' must be given together")
    num_segments = group["num_segments"]
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 0:
        raise ValueError(f"{where}: num_segments must be a non-negative int, got {num_segments!r}")
    segment_ranges = list(group["segment_ranges"])
    params = group["params"]
    if len(segment_ranges) != len(params):
        raise ValueError(
            f"{where}: segment_ranges has {len(segment_ranges)} entries for {len(params)} params; "
            "give one per tensor"
        )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"{where}: a segmented group must be on one device, got {sorted(map(str, devices))}"
        )
    for i, param in enumerate(params):
        if not param.is_contiguous():
            raise ValueError(f"{where}: params[{i}] must be contiguous")
    group["segment_ranges"] = [
        _checked_ranges(ranges, param.numel(), num_segments, f"{where}: segment_ranges[{i}]")
        for i, (param, ranges) in enumerate(zip(params, segment_ranges, strict=True))
    ]


def _checked_ranges(
    ranges: Iterable[Any], numel: int, num_segments: int, where: str
) -> tuple[SegmentRange, ...]:
    """``ranges`` as int triples, checked to be in order, disjoint, non-empty, inside a tensor of
    ``numel`` elements and of segments in ``[0, num_segments)``."""
    checked = []
    position = 0
    for entry in ranges:
        try:
            start, end, segment = (operator.index(value) for value in entry)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: each range must be a (start, end, segment) triple of ints, got {entry!r}"
            ) from None
        if not position <= start < end <= numel:
            raise ValueError(
                f"{where}: range {(start, end, segment)} must be non-empty, after the previous "
                f"range (which ends at {position}) and within the tensor's {numel} elements"
            )
        if not 0 <= segment < num_segments:
            raise ValueError(
                f"{where}: range {(start, end, segment)}: segment must lie in [0, {num_segments})"
            )
        checked.append((start, end, segment))
        position = end
    return tuple(checked)


class FusedLamb(Lamb):
    """DeepSpeed's ``deepspeed.ops.lamb.FusedLamb`` signature over :class:`Lamb`.
    ``max_grad_norm`` must stay 0: clip with the engine's ``gradient_clipping`` instead (in
    DeepSpeed it needs gradient norms its engine no longer passes)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if max_grad_norm:
            raise ValueError(
                "FusedLamb(max_grad_norm=...): not supported; clip with the config's "
                "`gradient_clipping`"
            )
        super().__init__(
            params,
            lr,
            bias_correction,
            betas,
            eps,
            eps_inside_sqrt,
            weight_decay,
            max_coeff,
            min_coeff,
            amsgrad,
        )
