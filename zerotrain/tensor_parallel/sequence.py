"""Sequence parallelism: the parts of a transformer block that tensor parallelism leaves
replicated run on a share of the sequence (Korthikanti et al., arXiv:2205.05198).

[Note: sequence parallelism]
Tensor parallelism splits attention and MLP, but every rank still runs the whole sequence
through the norms, dropouts and residual adds between them, and keeps their activations. With
``tensor_parallel.sequence_parallel`` each rank holds 1/tp of the sequence there instead:
* a block's input is cut to this rank's share of the sequence (dimension 1) before the first
  block of the model (or of the pipeline stage) and gathered whole again after the last one;
* a module whose layers are split (an attention, an MLP) gathers the whole sequence at its
  input (all-gather; backward: reduce-scatter, which also sums what the column-parallel layers'
  backward all-reduced), and its row-parallel layer reduce-scatters its partial sums (instead of
  all-reducing them: backward all-gathers), so the module's output is this rank's share again.
The bytes are those of tensor parallelism (an all-reduce is a reduce-scatter and an
all-gather); the activations between the split modules shrink by tp. A parameter inside the
blocks that is not split (a norm's, a row-parallel layer's bias) now sees only this rank's
tokens: its gradient is summed over the tensor-parallel group before the step, as a tied
layer's copies are summed across pipeline stages (``GroupOptions.summed``).
Blocks are found as the modules holding the split modules (a GPT-2 ``h.3`` holding ``attn`` and
``mlp``), and are expected to be run one after the other on the hidden states (their first
argument, or ``hidden_states=``). Dropout there draws each rank's mask for its own tokens, so
training with dropout differs from one process by the masks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.comm.split import split_of
from zerotrain.config.errors import ConfigError
from zerotrain.tensor_parallel.regions import (
    check_sequence,
    gather_sequence,
    gather_to_region,
    scatter_sequence,
)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def parallelize_sequence(
    model: nn.Module, split_layers: list[str], comm: Communicator
) -> list[nn.Parameter]:
    """Hook ``model``'s blocks and split modules for sequence parallelism over ``comm``
    ([Note: sequence parallelism]); ``split_layers`` are the names of the layers split column-
    or row-wise. Returns the trainable parameters whose gradients must be summed over
    ``comm``."""
    modules = dict(model.named_modules())
    owners = sorted({_parent(name) for name in split_layers}, key=list(modules).index)
    blocks = sorted({_parent(name) for name in owners}, key=list(modules).index)
    for owner in owners:
        block = _parent(owner)
        if not block or isinstance(modules[block], _CONTAINERS):
            raise ConfigError(
                "tensor_parallel.sequence_parallel: the split layers of "
                f"{owner or type(model).__name__!r} are not inside a module of a transformer "
                "block (such as blocks.0.attn holding blocks.0.attn.qkv); sequence parallelism "
                "needs blocks that hold the attention and MLP modules"
            )
    for owner in owners:
        modules[owner].register_forward_pre_hook(
            _on_hidden_states(gather_to_region, comm, owner), with_kwargs=True
        )
    if not blocks:
        return []
    first, last = modules[blocks[0]], modules[blocks[-1]]
    first.register_forward_pre_hook(
        _on_hidden_states(scatter_sequence, comm, blocks[0]), with_kwargs=True
    )
    last.register_forward_hook(lambda _m, _a, out: _gather_output(out, comm))
    summed = []
    for name in blocks:
        summed += [p for p in modules[name].parameters() if p.requires_grad and split_of(p) is None]
    return summed


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _on_hidden_states(region, comm: Communicator, where: str):
    """A forward pre-hook passing a module's hidden states (its first argument, or
    ``hidden_states=``) through ``region``."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        positional = bool(args) and torch.is_tensor(args[0])
        hidden = args[0] if positional else kwargs.get("hidden_states")
        if not torch.is_tensor(hidden):
            raise TypeError(
                f"sequence parallelism: {where!r} was called without hidden states (a tensor "
                "as its first argument, or hidden_states=)"
            )
        if region is scatter_sequence:  # where the sequence is cut: it must divide
            check_sequence(hidden, comm, where)
        hidden = region(hidden, comm)
        if positional:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


def _gather_output(out: Any, comm: Communicator) -> Any:
    """The last block's output (a tensor, or a tuple whose first item is the hidden states)
    with the whole sequence."""
    if torch.is_tensor(out):
        return gather_sequence(out, comm)
    if isinstance(out, tuple) and out and torch.is_tensor(out[0]):
        return (gather_sequence(out[0], comm), *out[1:])
    raise TypeError(
        f"sequence parallelism: the last block returned {type(out).__name__}; a tensor or a "
        "tuple starting with the hidden states was expected"
    )
