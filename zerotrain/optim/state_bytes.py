"""How many bytes of state an optimizer keeps per parameter element: the one table the
estimator, the memory formula and the offload preflight read."""

from __future__ import annotations

import torch

from zerotrain.optim.adam import ADAM_FAMILY
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.lion import Lion
from zerotrain.optim.muon import Muon

OPTIMIZER_STATE_BYTES = {
    "adam": 8,
    "adamw": 8,
    "lamb": 8,
    "sgd-momentum": 4,
    "sgd": 0,
    "lion": 4,
    "adagrad": 4,
    "muon": 4,
}
"""fp32 bytes of optimizer state per parameter element (Adam: exp_avg and exp_avg_sq). Muon's
4 are its matrices' momentum; the parameters its AdamW half steps cost Adam's 8."""


def optimizer_state_bytes_per_element(
    optimizer: torch.optim.Optimizer, unknown: int = 0, stand_ins: bool = False
) -> float:
    """fp32 bytes of state a known optimizer keeps per parameter element (Adam: m and v), from
    the estimator's table, so the two cannot disagree; Muon's is the average over its groups'
    elements (4 for matrices, 8 for AdamW's), or AdamW's 8, the larger, over ``stand_ins``
    (a probe's one-element tensors, which say nothing of the groups' sizes). Another
    optimizer's is measured from its state once it has some, else assumed to be ``unknown``."""
    defaults = optimizer.defaults
    if isinstance(optimizer, Muon) and stand_ins:
        return OPTIMIZER_STATE_BYTES["adamw"]
    if isinstance(optimizer, Muon):
        sizes = [
            (sum(p.numel() for p in group["params"]), bool(group["use_muon"]))
            for group in optimizer.param_groups
        ]
        total = sum(n for n, _ in sizes)
        per_group = [n * OPTIMIZER_STATE_BYTES["muon" if m else "adamw"] for n, m in sizes]
        return sum(per_group) / total if total else OPTIMIZER_STATE_BYTES["muon"]
    if isinstance(optimizer, Lion):
        return OPTIMIZER_STATE_BYTES["lion"]
    if isinstance(optimizer, torch.optim.Adagrad):
        return OPTIMIZER_STATE_BYTES["adagrad"]
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
