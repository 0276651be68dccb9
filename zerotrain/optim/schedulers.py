"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

[Note: iteration counting]
DeepSpeed's schedulers count ``last_batch_iteration``: -1 after construction, 0 after the first
``step()``. torch's ``LRScheduler`` counts ``last_epoch`` and already steps once inside its
constructor, so ``last_epoch`` is 0 after construction. The two are one counter shifted by one:
``last_batch_iteration == last_epoch - 1``. Every schedule here is written as a pure function of
``last_batch_iteration`` (``_lrs_at``), so the values match DeepSpeed's step for step, while
``state_dict``/``load_state_dict``/``get_last_lr`` are torch's. ``last_batch_iteration`` is also
exposed as a property and written into ``state_dict`` so that DeepSpeed-style checkpoints (which
hold only ``{"last_batch_iteration": n}``) load as well.

The engine steps a scheduler once per optimizer step, after ``optimizer.step()``, as DeepSpeed
does. That means the very first optimizer step runs at the construction-time LR: ``warmup_min_lr``
for the warmup schedules, 0 for ``WarmupCosineLR`` and ``cycle_min_lr`` for ``OneCycle``, exactly
as in DeepSpeed.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "SCHEDULERS",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "repoint_scheduler",
]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"

# DeepSpeed's OneCycle replaces the second Adam beta by this constant whenever it cycles
# momentum (lr_schedules.py, OneCycle._initialize_momentum). Kept for parity: a user switching
# from DeepSpeed must get the same betas.
_ONECYCLE_BETA2 = 0.99


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """Broadcast a scalar to every param group, or check a per-group list (DeepSpeed's rule)."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name}: expected one value per param group ({num_groups}), got {len(value)}"
            )
        return list(value)
    return [value] * num_groups


def _check_warmup(owner: str, warmup_num_steps: Any, warmup_type: str) -> str:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(
            f"{owner}: warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
        )
    if warmup_num_steps <= 0:  # DeepSpeed 0.19.6 and later refuse it too, in these words
        raise ValueError(
            f"{owner}: warmup_num_steps must be a positive integer, got {warmup_num_steps}; "
            "for the shortest warmup give 1 (as in DeepSpeed, a warmup lasts at least 2 "
            "steps and the first step runs at warmup_min_lr)"
        )
    if warmup_type not in (WARMUP_LOG, WARMUP_LINEAR):
        # DeepSpeed logs a warning and falls back to "log"; an error here would reject configs
        # that DeepSpeed accepts.
        warnings.warn(
            f"{owner}: unknown warmup_type {warmup_type!r}, using 'log' as DeepSpeed does "
            f"(choose 'log' or 'linear')",
            UserWarning,
            stacklevel=3,
        )
        return WARMUP_LOG
    return warmup_type


def _warn_if_shorter_than_warmup(owner: str, total_num_steps: int, warmup_num_steps: int) -> None:
    # DeepSpeed logs this and runs on; the schedule is still well defined.
    if total_num_steps < warmup_num_steps:
        warnings.warn(
            f"{owner}: total_num_steps {total_num_steps} is less than warmup_num_steps "
            f"{warmup_num_steps}",
            UserWarning,
            stacklevel=3,
        )


def _warmup_fraction(
    iteration: int, warmup_num_steps: int, warmup_type: str, inverse_log_warmup: float
) -> float:
    """Progress through warmup in [0, 1): log(it + 1) / log(W) or it / W."""
    if warmup_type == WARMUP_LOG:
        return inverse_log_warmup * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _IterationScheduler(LRScheduler):
    """Base: a schedule defined per DeepSpeed ``last_batch_iteration`` (see the module note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if last_batch_iteration != -1:
            # Resuming: torch requires "initial_lr" in every group; these schedules never read it.
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first ``step()``, then 0, 1, ..."""
        return self.last_epoch - 1

    @last_batch_iteration.setter
    def last_batch_iteration(self, value: int) -> None:
        self.last_epoch = value + 1

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rate of each param group at the current ``last_batch_iteration``."""
        return self._lrs_at(self.last_batch_iteration)

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration, or jump to ``last_batch_iteration`` (DeepSpeed's signature)."""
        if last_batch_iteration is not None:
            # torch's step() adds one to last_epoch; land on last_batch_iteration after it.
            self.last_epoch = last_batch_iteration
        super().step()

    def state_dict(self) -> dict[str, Any]:
        """torch's scheduler state plus DeepSpeed's ``last_batch_iteration`` key."""
        state = super().state_dict()
        state["last_batch_iteration"] = self.last_batch_iteration
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or a DeepSpeed one (only the iteration)."""
        state = dict(state_dict)
        iteration = state.pop("last_batch_iteration", None)
        if "last_epoch" not in state:
            if iteration is None:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the state has neither 'last_epoch' "
                    "nor 'last_batch_iteration'; pass a dict from state_dict()"
                )
            self.last_batch_iteration = int(iteration)
            return
        super().load_state_dict(state)


class WarmupLR(_IterationScheduler):
    """DeepSpeed ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    At iteration ``it`` (DeepSpeed's ``last_batch_iteration``):
    ``lr = min_lr + (max_lr - min_lr) * gamma`` with
    ``gamma = log(it + 1) / log(W)`` ("log") or ``it / W`` ("linear") while ``it < W`` and 1
    afterwards, where ``W = max(2, warmup_num_steps)``. Before the first step ``lr = min_lr``.

    Args:
        optimizer: the wrapped optimizer.
        warmup_min_lr: start LR, a float or one value per param group. Default 0.
        warmup_max_lr: end LR, a float or one per group. Default: each group's current ``lr``.
        warmup_num_steps: warmup length in optimizer steps. Default 1000.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: the iteration to resume from; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.warmup_type = _check_warmup(owner, warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, f"{owner}.warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, f"{owner}.warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(
                iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warmup
            )
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed ``WarmupDecayLR``: :class:`WarmupLR`, then linear decay to 0 at the end.

    After warmup (``it >= W``): ``gamma = max(0, (T - it) / max(1, T - W))`` with
    ``T = total_num_steps``.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: total training steps (required).
        warmup_min_lr: start LR, a float or one value per param group. Default 0.
        warmup_max_lr: peak LR, a float or one per group. Default 0.001 (DeepSpeed's).
        warmup_num_steps: warmup length in optimizer steps. Default 1000.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: the iteration to resume from; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        _warn_if_shorter_than_warmup("WarmupDecayLR", total_num_steps, self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_IterationScheduler):
    """DeepSpeed ``WarmupCosineLR``: an LR *ratio* applied to each group's LR at construction.

    ``lr = base_lr * ratio``. Before the first step ``ratio = 0``. During warmup (``it < W``)
    ``ratio = warmup_min_ratio + f * (1 - warmup_min_ratio)`` with ``f`` the log or linear warmup
    fraction. Afterwards ``p = min(1, (it - W + 1) / max(1, T - W))`` and
    ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``.

    Args:
        optimizer: the wrapped optimizer; its groups' current ``lr`` are the base LRs.
        total_num_steps: total training steps (required).
        warmup_min_ratio: ratio at the start of warmup. Default 0.
        warmup_num_steps: warmup length in optimizer steps. Default 1000.
        cos_min_ratio: ratio at the end of the cosine. Default 0.0001.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: the iteration to resume from; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.warmup_type = _check_warmup(type(self).__name__, warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warmup = 1.0 / math.log(self.warmup_num_steps)
        _warn_if_shorter_than_warmup("WarmupCosineLR", total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier applied to the base LRs at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(
                iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warmup
            )
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_step = iteration - self.warmup_num_steps + 1
        decay_total = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, decay_step / decay_total)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.lr_ratio(iteration)
        return [base * ratio for base in self.org_lrs]


class OneCycle(_IterationScheduler):
    """DeepSpeed ``OneCycle`` (1cycle, Smith, arXiv:1803.09820): one LR cycle, then decay.

    With ``b = it + 1``, ``S = first + second`` step sizes and ``x = 1 + b/S - floor(1 + b/S)``,
    the cycle scale is ``x / r`` while ``x <= r = first / S`` and ``(x - 1) / (r - 1)`` after; a
    stair count ``c > 0`` in a half floors it to ``c`` levels. While ``it < S``:
    ``lr = min_lr + (max_lr - min_lr) * scale`` and ``beta1 = max_mom - (max_mom - min_mom) *
    scale``. After the cycle, with ``k = it - S + 1``: ``lr = min_lr / (1 + decay_lr_rate * k /
    decay_step_size)`` and ``beta1 = max_mom * (1 + decay_mom_rate * k / decay_step_size)``
    (DeepSpeed's formula: momentum grows), or constant ``min_lr`` / ``max_mom`` when the rate or
    ``decay_step_size`` is 0.

    Momentum is cycled only for optimizers with ``betas`` (Adam, AdamW, Lamb), as in DeepSpeed,
    which also sets beta2 to 0.99 while it does so. For other optimizers (SGD) it is disabled with
    a warning: DeepSpeed does not cycle SGD's ``momentum``, and neither do we, for parity.

    Args:
        optimizer: the wrapped optimizer.
        cycle_min_lr: LR at the start and end of the cycle (required); float or one per group.
        cycle_max_lr: LR at the peak of the cycle (required); float or one per group.
        decay_lr_rate: post-cycle LR decay rate. Default 0.
        cycle_first_step_size: steps in the increasing half. Default 2000.
        cycle_second_step_size: steps in the decreasing half. Default: the first's.
        cycle_first_stair_count: stairs in the first half; 0 is continuous. Default 0.
        cycle_second_stair_count: stairs in the second half. Default: the first's.
        decay_step_size: post-cycle decay interval; 0 disables decay. Default 0.
        cycle_momentum: cycle beta1 inversely to the LR. Default True.
        cycle_min_mom: lowest beta1 (at the LR peak). Default 0.8.
        cycle_max_mom: highest beta1. Default 0.9.
        decay_mom_rate: post-cycle momentum decay rate. Default 0.
        last_batch_iteration: the iteration to resume from; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"OneCycle: cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"OneCycle: cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay_interval = math.isclose(decay_step_size, 0)

        self.min_lrs = _per_group(optimizer, cycle_min_lr, "OneCycle.cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "OneCycle.cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_interval or math.isclose(decay_lr_rate, 0)

        if cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(optimizer).__name__} has no "
                "'betas' (DeepSpeed cycles Adam-style beta1 only); set cycle_momentum to false "
                "to silence this",
                UserWarning,
                stacklevel=2,
            )
            cycle_momentum = False
        self.cycle_momentum = cycle_momentum
        self.min_moms = _per_group(optimizer, cycle_min_mom, "OneCycle.cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "OneCycle.cycle_max_mom")
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay_interval or math.isclose(decay_mom_rate, 0)
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer position in the cycle, not from the float scale: at a
            # half-cycle boundary the float can sit 1 ulp under a stair and floor one too low.
            # Same rule as DeepSpeed 0.19.
            position = batch % self.total_size
            if position <= self.first_step_size:
                level = position * stairs / self.first_step_size
            else:
                level = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(level) / stairs
        return scale

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval(iteration)
        return [lo / factor for lo in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """beta1 of each param group at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval(iteration)
        return [hi * factor for hi in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration (or jump to ``batch_iteration``); sets LR and, if cycled, betas."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            momenta = self.momenta_at(self.last_batch_iteration)
            for group, beta1 in zip(self.optimizer.param_groups, momenta, strict=True):
                group["betas"] = (beta1, _ONECYCLE_BETA2)


SCHEDULERS: dict[str, type[_IterationScheduler]] = {
    # DeepSpeed's names; the config validates `scheduler.type` against these keys
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}


def build_scheduler(
    type: str, params: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> LRScheduler:
    """Build the scheduler named by a DeepSpeed ``scheduler`` config section.

    Args:
        type: ``scheduler.type``: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" or "OneCycle".
        params: ``scheduler.params``, with DeepSpeed's parameter names; absent keys take
            DeepSpeed's defaults.
        optimizer: the optimizer whose param groups are scheduled.

    Raises:
        ValueError: an unknown type, an unknown parameter, or a missing required one, naming the
            config key.
    """
    cls = SCHEDULERS.get(type)
    if cls is None:
        raise ValueError(
            f"scheduler.type: unknown scheduler {type!r}; expected one of {sorted(SCHEDULERS)}"
        )
    signature = inspect.signature(cls.__init__)
    accepted = {
        name: p for name, p in signature.parameters.items() if name not in ("self", "optimizer")
    }
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"scheduler.params.{key}: not a parameter of {type}; "
                f"expected some of {sorted(accepted)}"
            )
    for name, p in accepted.items():
        if p.default is inspect.Parameter.empty and name not in params:
            raise ValueError(f"scheduler.params.{name}: required by {type}")
    return cls(optimizer, **params)


def repoint_scheduler(scheduler: LRScheduler, optimizer: torch.optim.Optimizer) -> None:
    """``scheduler`` over ``optimizer``, whose steps it must see: torch's LRScheduler patches
    its optimizer's ``step`` at construction to mark each call (``_opt_called``) and warns at
    its first step when the optimizer it holds has no marked step, which a scheduler repointed
    after construction does not have (torch's protocol in torch/optim/lr_scheduler.py, stable
    since torch 1.1)."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    # the unbound function and a weak reference, as torch's own patch: the wrapper, stored on
    # the optimizer, must not hold the optimizer (a bound method would, a reference cycle)
    func = step.__func__
    owner = weakref.ref(optimizer)

    @functools.wraps(func)
    def marked_step(*args, **kwargs):
        target = owner()
        target._opt_called = True  # pyrefly: ignore[missing-attribute]
        return func(target, *args, **kwargs)

    marked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked_step  # type: ignore[method-assign]
