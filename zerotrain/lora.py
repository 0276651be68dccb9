"""LoRA-FA (Zhang et al., arXiv:2308.03303): low-rank adapters whose down-projection is frozen.

LoRA adds ``scaling * B A x`` to a frozen linear layer ``W x`` and trains A (r x in) and B
(out x r). Backward then needs the layer input x for A's gradient: every adapted layer keeps a
full activation (tokens x in) for backward, as full fine-tuning does. LoRA-FA freezes A at its
random initialization and trains B only. B's gradient needs ``h = A x`` (tokens x r), and the
input gradient needs only the weights (``W``, ``A``, ``B``). So an adapted layer keeps ``h``
for backward instead of ``x``: ``in / r`` times fewer bytes (64x for in 4096, r 64).

:class:`LoRAFA` wraps an ``nn.Linear`` (or transformers' GPT-2 ``Conv1D``, whose weight is
stored transposed) and runs one autograd function (:class:`_LoRAFAFunction`) that saves only
``h``. :func:`apply_lora_fa` converts a model's layers by name, as peft's ``target_modules``
does, and freezes everything but the adapters' B. Dropout on the adapter input is not offered:
its mask would have to be kept, and LoRA-FA's point is not keeping input-sized tensors.

The adapters train under every ZeRO stage: B is an ordinary trainable parameter, partitioned
with the others; the frozen base weight and A are not in the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zerotrain.config import ConfigError
from zerotrain.config.schema import LoRAFAConfig
from zerotrain.zero.init import full_shape


class _LoRAFAFunction(torch.autograd.Function):
    """``base(x) + scaling * (x A^T) B^T``; saves ``h = x A^T`` and the weights, never ``x``."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float, transposed: bool):
        base = x @ weight if transposed else x @ weight.t()  # Conv1D keeps (in, out)
        if bias is not None:
            base = base + bias
        h = x @ a.t()
        ctx.save_for_backward(h, weight, a, b)
        ctx.scaling, ctx.transposed = scaling, transposed
        return base + scaling * (h @ b.t())

    @staticmethod
    def backward(ctx, *grads):
        (grad,) = grads
        h, weight, a, b = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            through_base = grad @ weight.t() if ctx.transposed else grad @ weight
            grad_x = through_base + ctx.scaling * ((grad @ b) @ a)
        if ctx.needs_input_grad[4]:
            flat_grad = grad.reshape(-1, grad.shape[-1])
            grad_b = ctx.scaling * (flat_grad.t() @ h.reshape(-1, h.shape[-1]))
        return grad_x, None, None, None, grad_b, None, None


class LoRAFA(nn.Module):
    """A frozen linear layer plus a LoRA-FA adapter of rank ``r``: A frozen (Kaiming-uniform,
    as peft initializes LoRA's A), B trained from zero, scaled by ``alpha / r``."""

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16.0):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRAFA: r must be >= 1, got {r}")
        self.base = base
        self.transposed = _is_conv1d(base)
        in_features, out_features = _features(base)
        base.requires_grad_(False)
        weight = _weight(base)
        self.lora_A = nn.Parameter(
            torch.empty(r, in_features, dtype=weight.dtype, device=weight.device),
            requires_grad=False,
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(
            torch.zeros(out_features, r, dtype=weight.dtype, device=weight.device)
        )
        self.r, self.scaling = r, alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LoRAFAFunction.apply(
            x,
            self.base.weight,
            self.base.bias,
            self.lora_A,
            self.lora_B,
            self.scaling,
            self.transposed,
        )

    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in (in the base layer's layout)."""
        delta = self.scaling * (self.lora_B @ self.lora_A)
        return _weight(self.base) + (delta.t() if self.transposed else delta)

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}"


def apply_lora_fa(
    model: nn.Module, target_modules: str | Iterable[str], r: int = 8, alpha: float = 16.0
) -> list[str]:
    """Replace the linear layers of ``model`` whose qualified name is, or ends with ``.`` plus,
    one of ``target_modules`` (peft's matching) by :class:`LoRAFA` adapters; freeze every other
    parameter. Returns the names replaced; raises if none matched."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    model.requires_grad_(False)
    replaced = []
    for name, module in list(model.named_modules()):
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
            raise TypeError(
                f"apply_lora_fa: {name} is a {type(module).__name__}; LoRA-FA adapts nn.Linear "
                "and transformers' Conv1D layers"
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRAFA(module, r=r, alpha=alpha))
        replaced.append(name)
    if not replaced:
        raise ValueError(f"apply_lora_fa: no module of the model matches {targets}")
    return replaced


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers): ``x @ weight + bias``, weight (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    in_features, out_features = full_shape(_weight(module))  # an Init chunk is 1-D
    return int(in_features), int(out_features)


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is not a tensor"
    return weight


def convert_to_lora_fa(
    model: nn.Module, section: LoRAFAConfig, optimizer, model_parameters, rank: int
) -> Iterable[Any] | None:
    """The config's ``lora_fa`` section: adapt the model's target layers, freeze the rest.
    Returns the parameters to train: ``model_parameters`` given as the model's trainable (or
    all) parameters, as HF's Trainer passes them, become the adapters."""
    before = [p for p in model.parameters() if p.requires_grad]
    given = None if model_parameters is None else list(model_parameters)
    if given is not None:  # parameters, or groups of them
        given = [
            p for item in given for p in (item["params"] if isinstance(item, dict) else [item])
        ]
    taken_before = isinstance(optimizer, torch.optim.Optimizer) or (
        given is not None
        and {id(p) for p in given}
        not in ({id(p) for p in before}, {id(p) for p in model.parameters()})
    )
    if taken_before:
        argument = (
            "optimizer" if isinstance(optimizer, torch.optim.Optimizer) else "model_parameters"
        )
        raise ConfigError(
            "lora_fa.enabled: initialize adapts the model's layers, but "
            f"initialize({argument}=...) holds parameters chosen before; use the config's "
            "optimizer section (or pass an optimizer factory), or call "
            "zerotrain.lora.apply_lora_fa(model, ...) before building the optimizer and leave "
            "lora_fa out of the config"
        )
    adapted = apply_lora_fa(model, section.target_modules, r=section.r, alpha=section.alpha)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        total = sum(full_shape(p).numel() for p in model.parameters())  # Init chunks too
        print(
            f"zerotrain: lora_fa adapted {len(adapted)} layers (r {section.r}, alpha "
            f"{section.alpha:g}): {sum(p.numel() for p in trainable):,} of {total:,} parameters "
            "train",
            flush=True,
        )
    return None if given is None else trainable
