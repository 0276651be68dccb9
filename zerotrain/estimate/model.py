"""A model's parameters as the estimate needs them: trainable, frozen, the largest layer,
stage 3's gather units and the kind of MLP (for its activations), counted on any device
(``meta`` included: a 70B model costs nothing)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from zerotrain.optim.muon import uses_muon
from zerotrain.zero.init import full_shape
from zerotrain.zero.units import assign_units, find_unit_modules

__all__ = ["ParameterCount", "count_parameters", "mlp_kind"]


@dataclass(frozen=True, kw_only=True)
class ParameterCount:
    """A model's parameters as the estimate needs them (tied parameters counted once)."""

    trainable: int
    frozen: int
    largest_layer: int
    """Most parameters held directly by one module (DeepSpeed's ``largest_layer_params``)."""
    root_and_largest_block: int = 0
    """Stage 3: elements (trainable and frozen) of the root unit plus the largest block unit,
    which are gathered together (0: unknown)."""
    persistent: int = 0
    """Stage 3: trainable elements in units below the persistence threshold (kept whole)."""
    persistent_frozen: int = 0
    """Stage 3: frozen elements in those units (the others' are partitioned)."""
    largest_unit: int = 0
    """Stage 3: trainable elements of the largest gather unit, root included: its largest
    bucket (one per unit), which sizes offload's transfer ring (0: unknown)."""
    config: dict[str, int] = field(default_factory=dict)
    """hidden_size, layers, heads, vocab_size, intermediate_size found on the model's HF-like
    ``.config``."""
    mlp: Literal["gelu", "swiglu"] | None = None
    """The MLP of the first block, from its matrices (:func:`mlp_kind`); None: not found."""
    muon_matrices: int = 0
    """Trainable elements the Muon optimizer would step (its split: zerotrain.optim.muon's
    ``uses_muon``); the others take its AdamW half."""
    muon_iteration_flops: float = 0.0
    """FLOPs of one Newton-Schulz iteration over each of those matrices, every one whole: for
    m x n with m <= n, the Gram matrix (2·m²·n), its square (2·m³) and the product back
    (2·m²·n), as zerotrain.optim.muon's ``newton_schulz`` computes them."""

    def muon_state_bytes(self) -> float:
        """Muon's fp32 bytes of state per trainable element: 4 (momentum) for its matrices, 8
        (AdamW's moments) for the rest."""
        muon, rest = self.muon_matrices, self.trainable - self.muon_matrices
        return (4 * muon + 8 * rest) / max(1, self.trainable)


# HF-like config attribute names, first match wins (GPT-2 style n_* names included).
_CONFIG_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
}


def mlp_kind(block: nn.Module, hidden: int, width: int) -> Literal["gelu", "swiglu"] | None:
    """What MLP ``block`` holds, from its matrices of ``hidden`` x ``width``: ``swiglu`` where
    one orientation has twice as many as the other (gate and up, then down; a fused gate-up
    counts twice), ``gelu`` where both have as many (in, then out; GPT-2's Conv1D stores them
    transposed, which the ratio does not see); None where there are none or the shapes cannot
    tell (an MLP as wide as the residual stream)."""
    if hidden in (width, 2 * width):
        return None
    one_way = other_way = 0
    for param in block.parameters():
        for rows, matrices in ((width, 1), (2 * width, 2)):
            if tuple(full_shape(param)) == (rows, hidden):
                one_way += matrices
            elif tuple(full_shape(param)) == (hidden, rows):
                other_way += matrices
    fewer, more = sorted((one_way, other_way))
    if fewer and more == 2 * fewer:
        return "swiglu"
    if fewer and more == fewer:
        return "gelu"
    return None


def _numel(param: nn.Parameter) -> int:
    """Elements of the whole parameter, also of a ``zero.Init`` chunk (its ``ds_numel``)."""
    return full_shape(param).numel()


def count_parameters(model: nn.Module, *, persistence_threshold: int) -> ParameterCount:
    """Count ``model``'s parameters (on any device, ``meta`` included; a model built under
    ``zero.Init`` by their whole sizes) and, for stage 3, its gather units as zerotrain would
    form them (zerotrain/zero/units.py)."""
    params = {id(p): p for p in model.parameters()}.values()  # tied: once
    trainable = [p for p in params if p.requires_grad]
    largest_layer = max(
        (sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    blocks = find_unit_modules(model)
    unit_of = assign_units(model, blocks)
    unit_numel = [0] * (len(blocks) + 1)  # trainable elements per unit, the root unit last
    unit_frozen = [0] * (len(blocks) + 1)  # floating-point frozen ones (partitioned too)
    for param in params:
        if param.requires_grad or param.is_floating_point():
            held = unit_numel if param.requires_grad else unit_frozen
            held[unit_of[id(param)]] += _numel(param)
    unit_total = [t + f for t, f in zip(unit_numel, unit_frozen, strict=True)]
    persistent = [0 < n < persistence_threshold for n in unit_total]
    config = {}
    model_config = getattr(model, "config", None)
    for key, names in _CONFIG_NAMES.items():
        value = next((getattr(model_config, n) for n in names if hasattr(model_config, n)), None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            config[key] = value
    mlp = None
    if "hidden_size" in config:
        hidden = config["hidden_size"]
        mlp = mlp_kind(
            blocks[0] if blocks else model, hidden, config.get("intermediate_size", 4 * hidden)
        )
    muon_shapes = [
        tuple(full_shape(p))
        for name, p in model.named_parameters()  # tied: once, by its first name
        if p.requires_grad and uses_muon(name, full_shape(p), p)
    ]
    return ParameterCount(
        trainable=sum(_numel(p) for p in trainable),
        frozen=sum(_numel(p) for p in params if not p.requires_grad),
        largest_layer=largest_layer,
        root_and_largest_block=unit_total[-1] + max(unit_total[:-1], default=0),
        persistent=sum(n for n, kept in zip(unit_numel, persistent, strict=True) if kept),
        persistent_frozen=sum(n for n, kept in zip(unit_frozen, persistent, strict=True) if kept),
        largest_unit=max(unit_numel),
        config=config,
        mlp=mlp,
        muon_matrices=sum(math.prod(shape) for shape in muon_shapes),
        muon_iteration_flops=sum(
            4 * min(shape) ** 2 * max(shape) + 2 * min(shape) ** 3 for shape in muon_shapes
        ),
    )
