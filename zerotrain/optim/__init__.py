"""Optimizers and LR schedulers built from DeepSpeed ``optimizer`` / ``scheduler`` config sections.

Adam, AdamW and SGD are torch's own optimizers (fused kernels where the tensors allow: torch's
fused Adam runs on CPU at the speed of DeepSpeed's C++ CPU-Adam), except Adam without bias
correction, which is :class:`FusedAdam` (DeepSpeed's, also ``zerotrain.ops.adam``); Lamb is
:class:`Lamb`, which also computes per-parameter trust ratios on ZeRO shards. The schedulers are DeepSpeed's, as
``torch.optim.lr_scheduler.LRScheduler`` subclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from zerotrain.optim.adam import DeepSpeedCPUAdam, FusedAdam
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.schedulers import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "DeepSpeedCPUAdam",
    "FusedAdam",
    "Lamb",
    "NoOptimizer",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]

# Keys each optimizer type accepts in ``optimizer.params``: DeepSpeed's constructor arguments for
# that type (FusedAdam plus the engine's adam_w_mode/torch_adam, torch's SGD, FusedLamb) and the
# torch kernel switches ``fused``/``foreach``.
_ADAM_KEYS = frozenset(
    {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "bias_correction",
        "adam_w_mode",
        "torch_adam",
        "fused",
        "foreach",
        "set_grad_none",
    }
)
_ACCEPTED_KEYS: dict[str, frozenset[str]] = {
    "Adam": _ADAM_KEYS,
    "AdamW": _ADAM_KEYS,
    "SGD": frozenset(
        {"lr", "momentum", "dampening", "weight_decay", "nesterov", "fused", "foreach"}
    ),
    "Lamb": frozenset(
        {
            "lr",
            "betas",
            "eps",
            "eps_inside_sqrt",
            "weight_decay",
            "bias_correction",
            "max_coeff",
            "min_coeff",
            "amsgrad",
        }
    ),
}

# Where torch has fused optimizer kernels that this library targets.
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def build_optimizer(
    type: str,
    params: Mapping[str, Any],
    param_groups: list[dict[str, Any]],
    *,
    norm_allreduce: Callable[[Tensor], None] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer named by a DeepSpeed ``optimizer`` config section.

    DeepSpeed semantics (``engine._configure_basic_optimizer``):

    - "Adam" with ``adam_w_mode`` true (DeepSpeed's default) decays weights decoupled, i.e. is
      torch ``AdamW``; with ``adam_w_mode`` false it is L2-regularised torch ``Adam``. "AdamW" is
      always decoupled, whatever ``adam_w_mode`` says.
    - Defaults are DeepSpeed's FusedAdam ones: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
      weight_decay 0. With ``torch_adam`` true DeepSpeed calls torch's class directly, so a
      decoupled Adam then defaults to torch AdamW's weight_decay 0.01.
    - "SGD" is torch ``SGD`` with torch's defaults; "Lamb" is :class:`Lamb` (DeepSpeed FusedLamb).
    - ``max_grad_norm`` is rejected as in DeepSpeed: gradient clipping is the engine's job.

    Kernel choice: unless ``fused``/``foreach``/``torch_adam`` say otherwise, Adam, AdamW and SGD
    use torch's fused kernel when every tensor is a floating-point tensor on CPU or CUDA, and
    otherwise leave torch to choose (foreach where it supports the tensors). ``fused: true``
    forces the fused kernel, ``fused: false`` forbids it; ``torch_adam: true`` keeps torch's own
    default choice, as in DeepSpeed.

    Args:
        type: ``optimizer.type``, one of "Adam", "AdamW", "SGD", "Lamb".
        params: ``optimizer.params``; only keys of that optimizer are accepted.
        param_groups: torch-style groups, ``[{"params": [tensors...], **overrides}]``; for Lamb
            a group may carry ``segment_ranges`` and ``num_segments`` (see :class:`Lamb`).
        norm_allreduce: for Lamb on shards, sums a 1-D tensor in place across ranks; ignored
            by the other optimizers. (The engine gives a Lamb its layout and this callback
            afterwards, through ``Lamb.set_segments``.)

    Raises:
        ValueError: unknown type, unknown or unsupported parameter, naming the config key.
    """
    accepted = _ACCEPTED_KEYS.get(type)
    if accepted is None:
        raise ValueError(
            f"optimizer.type: unknown optimizer {type!r}; expected one of {sorted(_ACCEPTED_KEYS)}"
        )
    options = dict(params)
    if "max_grad_norm" in options:
        raise ValueError(
            "optimizer.params.max_grad_norm: not supported as an optimizer parameter; "
            "use the top-level 'gradient_clipping' instead"
        )
    for key in options:
        if key not in accepted:
            raise ValueError(
                f"optimizer.params.{key}: not a parameter of {type}; expected some of {sorted(accepted)}"
            )
    if "betas" in options:
        options["betas"] = tuple(options["betas"])

    # Shallow copies: torch fills defaults into the group dicts it is given.
    param_groups = [{**group, "params": _group_tensors(group)} for group in param_groups]
    if type == "Lamb":
        return Lamb(param_groups, **options, norm_allreduce=norm_allreduce)
    tensors = [t for group in param_groups for t in group["params"]]
    if type == "SGD":
        fused, foreach = _kernel_choice(options, tensors, default_auto=True)
        return torch.optim.SGD(param_groups, **options, fused=fused, foreach=foreach)
    return _build_adam(type, options, param_groups, tensors)


def _build_adam(
    type: str,
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    tensors: list[Tensor],
) -> torch.optim.Optimizer:
    adam_w_mode = bool(options.pop("adam_w_mode", True))
    decoupled = type == "AdamW" or adam_w_mode  # DeepSpeed: "AdamW" forces decoupled decay
    torch_adam = bool(options.pop("torch_adam", False))
    # torch's optimizers always return None gradients after zero_grad(); nothing to choose.
    options.pop("set_grad_none", None)
    bias_correction = options.pop("bias_correction", True)
    fused, foreach = _kernel_choice(options, tensors, default_auto=not torch_adam)
    options.setdefault("lr", 1e-3)
    options.setdefault("betas", (0.9, 0.999))
    options.setdefault("eps", 1e-8)
    if not torch_adam:
        options.setdefault("weight_decay", 0.0)  # FusedAdam's default; torch AdamW's is 0.01
    if not bias_correction:  # torch has no kernel for it: DeepSpeed's FusedAdam update
        if options.pop("amsgrad", False):
            raise ValueError(
                "optimizer.params.amsgrad: not supported together with bias_correction false"
            )
        return FusedAdam(param_groups, **options, bias_correction=False, adam_w_mode=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(param_groups, **options, fused=fused, foreach=foreach)


def _kernel_choice(
    options: dict[str, Any], tensors: list[Tensor], *, default_auto: bool
) -> tuple[bool | None, bool | None]:
    """``(fused, foreach)`` for a torch optimizer; pops both keys from ``options``."""
    fused = options.pop("fused", None)
    foreach = options.pop("foreach", None)
    if fused:
        bad = [t for t in tensors if not _fused_capable(t)]
        if bad:
            raise ValueError(
                "optimizer.params.fused: true needs every parameter to be a floating-point tensor "
                f"on CPU or CUDA; got one of dtype {bad[0].dtype} on {bad[0].device}. "
                "Remove the key to fall back automatically"
            )
    if fused is None and foreach is None and default_auto:
        if tensors and all(_fused_capable(t) for t in tensors):
            return True, None
        return False, None
    return fused, foreach


def _fused_capable(tensor: Tensor) -> bool:
    # Subclasses (DTensor and the like) are left to torch's generic paths, as torch itself does.
    return (
        type(tensor) in (Tensor, torch.nn.Parameter)
        and tensor.device.type in _FUSED_DEVICE_TYPES
        and tensor.is_floating_point()
    )


def _group_tensors(group: Mapping[str, Any]) -> list[Tensor]:
    params = group["params"]
    return [params] if isinstance(params, Tensor) else list(params)


class NoOptimizer(torch.optim.Optimizer):
    """Stands in when ``initialize`` is given no optimizer (no `optimizer` section and no
    ``optimizer=``): an engine for evaluation, as DeepSpeed allows. Stepping raises."""

    MESSAGE = (
        "this engine was initialized without an optimizer (no `optimizer` config section and "
        "no initialize(optimizer=...)): it runs forward passes only; give it an optimizer to "
        "train"
    )

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise RuntimeError(self.MESSAGE)
