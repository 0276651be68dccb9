"""Mixed precision: which dtype each copy of the model state lives in, and fp16 loss scaling."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""The training dtypes by their config names: the one map of them (`communication_data_type`,
`zerotrain estimate --dtype`, `zerotrain checkpoint consolidate --dtype`)."""


def training_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype a model trains in when the config enables bf16 or fp16 (at most one)."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtype of each copy of the model state: the model's working copy, its gradients, the
    optimizer's masters and its state; and the forward's autocast.

    Gradients are produced and communicated in ``param_dtype`` and accumulate in
    ``grad_accum_dtype`` (None: ``param_dtype``; DeepSpeed's ``data_types.grad_accum_dtype``,
    fp32 under bf16 or fp16 in zerotrain: [Note: fp32 gradient accumulation] in zerotrain/zero/reduce.py).
    The optimizer steps masters in ``master_dtype`` (fp32; bf16 with DeepSpeed's
    ``bf16_master_weights_and_grads``) and keeps its per-element state in ``state_dtype``
    (``bf16_optimizer_states``); where either is narrower than fp32 the update is computed in
    fp32 and rounded back ([Note: low-precision masters and states] in
    zerotrain/zero/low_precision.py), to nearest or, with ``stochastic_rounding``,
    stochastically. Where the masters have the parameters' dtype they *are* the model's
    parameters (no copy: fp32 training, bf16 masters of bf16 training). ``autocast_dtype``:
    the forward runs under ``torch.autocast`` to it (the ``torch_autocast`` section).
    """

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def of(
        cls, param_dtype: torch.dtype, grad_accum_dtype: torch.dtype | None, **dtypes: Any
    ) -> PrecisionPolicy:
        """Training in ``param_dtype``, accumulating gradients in ``grad_accum_dtype`` (None, or
        ``param_dtype`` itself: no dtype of their own); ``dtypes``: the other fields."""
        accum = None if grad_accum_dtype == param_dtype else grad_accum_dtype
        return cls(param_dtype, accum, **dtypes)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the persistent gradient buffers (what accumulates over micro-steps)."""
        return self.grad_accum_dtype or self.param_dtype

    @property
    def has_master_copy(self) -> bool:
        """Whether the masters are a copy of their own (their dtype is not the parameters')."""
        return self.param_dtype != self.master_dtype

    def stored_state_bytes(self, fp32_bytes: float) -> float:
        """Bytes per element of an optimizer state of ``fp32_bytes`` in fp32, as stored."""
        return fp32_bytes * self.state_dtype.itemsize / 4

    @property
    def narrow_optimizer(self) -> bool:
        """Whether the masters or the optimizer's state are stored narrower than fp32 (the
        update is computed in fp32 over them)."""
        return self.master_dtype != torch.float32 or self.state_dtype != torch.float32

    @property
    def name(self) -> str:
        return dtype_name(self.param_dtype)


def autocast(policy: PrecisionPolicy, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's ``torch.autocast`` under ``policy`` (nothing without one)."""
    if policy.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=policy.autocast_dtype)


def lower_precision_grads(
    model: nn.Module, classes: tuple[type, ...], dtype: torch.dtype
) -> dict[int, torch.dtype]:
    """``id(param) -> dtype`` for the parameters of the modules of exactly ``classes`` (not
    subclasses: DeepSpeed's rule), whose gradients are reduced in ``dtype`` under
    torch_autocast."""
    return {
        id(param): dtype
        for module in model.modules()
        if type(module) in classes
        for param in module.parameters(recurse=False)
    }


def dtype_name(dtype: torch.dtype) -> str:
    """A training dtype's config name (``bf16``)."""
    return next(name for name, known in DTYPES.items() if known == dtype)


class LossScaler:
    """Static or dynamic loss scale, with DeepSpeed's dynamic-scaling rules.

    Dynamic: start at ``2**initial_scale_power``; an overflow divides the scale by 2 once
    ``hysteresis`` overflows have been absorbed (never below ``min_loss_scale``); after
    ``loss_scale_window`` clean steps since the last overflow the scale doubles. A scaler with
    ``dynamic=False`` keeps ``scale`` fixed (1.0 for bf16 and fp32 training).
    """

    def __init__(
        self,
        scale: float = 1.0,
        dynamic: bool = False,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
    ):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self._hysteresis_left = hysteresis
        self._iteration = 0
        self._last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow_iteration = self._iteration
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if (self._iteration - self._last_overflow_iteration) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "iteration": self._iteration,
            "last_overflow_iteration": self._last_overflow_iteration,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._iteration = int(state["iteration"])
        self._last_overflow_iteration = int(state["last_overflow_iteration"])
