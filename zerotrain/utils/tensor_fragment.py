"""DeepSpeed's ``deepspeed.utils.tensor_fragment``: one parameter's partitioned state (its fp32
master, gradient and optimizer states), read and set by hand, whatever the ZeRO stage.

The ``full`` functions take and return the whole parameter and are collectives: every rank
calls them for the same parameters in the same order (with the same value, for a set). The
``local`` functions take and return this rank's elements of the flattened parameter, the run of
it that this rank's optimizer partition steps (1-D; the whole parameter at stage 0, empty where
the rank holds none of it); they are not collectives. DeepSpeed defines the local functions at
ZeRO-3 only; zerotrain at every stage.

Gradients are there between the backward of an accumulation boundary (every backward at stages
2-3) and ``step()``, averaged over the ranks and without the fp16 loss scale; elsewhere reading
or setting one raises. A master set with :func:`safe_set_full_fp32_param` is the model's
parameter from then on (in its dtype), as if training had reached it; one set with
:func:`safe_set_local_fp32_param` takes effect at the next step, which trains from it. For a
parameter no engine trains (a frozen one), getters return None and setters do nothing, as in
DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotrain.zero.init import owner_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _get(param: nn.Parameter, kind: str, local: bool) -> torch.Tensor | None:
    owner = owner_of(param)
    if owner is None:
        return None
    return owner.local_value(param, kind) if local else owner.full_value(param, kind)


def _set(param: nn.Parameter, kind: str, value: torch.Tensor, local: bool) -> None:
    owner = owner_of(param)
    if owner is None:
        return
    if local:
        owner.set_local_value(param, kind, value)
    else:
        owner.set_full_value(param, kind, value)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master weight of ``param`` (collective: every rank calls it); None for a
    parameter no engine trains."""
    return _get(param, "master", local=False)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The full fp32 gradient of ``param`` reduced so far, without the fp16 loss scale: the
    average over ranks between the accumulation boundary's backward and ``step()`` (collective)."""
    return _get(param, "grad", local=False)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``) of
    ``param``; None before the optimizer made it (collective)."""
    return _get(param, optim_state_key, local=False)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master weight of ``param`` to the whole ``value`` (its shape), and the
    model's parameter with it: the next forward and step go on from it (collective)."""
    _set(param, "master", value, local=False)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the reduced gradient of ``param`` (unscaled, as :func:`safe_get_full_grad` returns
    it) to the whole ``value``, between the boundary's backward and ``step()``; the step's
    clipping and update use it (collective)."""
    _set(param, "grad", value, local=False)


def safe_set_full_optimizer_state(
    param: nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` to the whole ``value``
    (collective); a key the optimizer does not hold (yet) raises ValueError."""
    _set(param, optim_state_key, value, local=False)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s fp32 master weight (see the module docstring)."""
    return _get(param, "master", local=True)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s reduced gradient, unscaled."""
    return _get(param, "grad", local=True)


def safe_get_local_optimizer_state(
    param: nn.Parameter, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's elements of ``param``'s optimizer state ``optim_state_key``."""
    return _get(param, optim_state_key, local=True)


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of ``param``'s fp32 master weight; the next step trains from
    them and writes them into the model's parameter."""
    _set(param, "master", value, local=True)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of ``param``'s reduced gradient (unscaled)."""
    _set(param, "grad", value, local=True)


def safe_set_local_optimizer_state(
    param: nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's elements of ``param``'s optimizer state ``optim_state_key``."""
    _set(param, optim_state_key, value, local=True)


def safe_update_full_grad_vectorized(
    param_list: list[nn.Parameter],
    update_func: Callable[[torch.Tensor, nn.Parameter], torch.Tensor],
) -> None:
    """For each parameter that needs a gradient: its full gradient becomes
    ``update_func(full_gradient, param)`` (collective, in the list's order on every rank). A
    parameter no engine trains has its ``.grad`` updated, where it has one."""
    for param in param_list:
        if owner_of(param) is None:
            if param.grad is not None:
                param.grad.copy_(update_func(param.grad, param))
            continue
        old = safe_get_full_grad(param) if param.requires_grad else None
        if old is not None:
            safe_set_full_grad(param, update_func(old, param))
