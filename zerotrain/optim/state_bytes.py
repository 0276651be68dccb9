"""How many bytes of state an optimizer keeps per parameter element: the one table the
estimator, the memory formula and the offload preflight read."""

from __future__ import annotations

import torch

from zerotrain.optim.adam import ADAM_FAMILY
from zerotrain.optim.lamb import Lamb

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 bytes of optimizer state per parameter element (Adam: exp_avg and exp_avg_sq)."""


def optimizer_state_bytes_per_element(optimizer: torch.optim.Optimizer, unknown: int = 0) -> int:
    """fp32 bytes of state a known optimizer keeps per parameter element (Adam: m and v), from
    the estimator's table, so the two cannot disagree. Another optimizer's is measured from its
    state once it has some, else assumed to be ``unknown``."""
    defaults = optimizer.defaults
    if isinstance(optimizer, ADAM_FAMILY):
        return OPTIMIZER_STATE_BYTES["adam"] + (4 if defaults.get("amsgrad") else 0)  # max v
    if isinstance(optimizer, Lamb):
        return OPTIMIZER_STATE_BYTES["lamb"]
    if isinstance(optimizer, torch.optim.SGD):
        return OPTIMIZER_STATE_BYTES["sgd-momentum" if defaults.get("momentum", 0) else "sgd"]
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
    return unknown
