"""``deepspeed.checkpoint.utils``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts, whose types are
    kept) replaced by a detached copy on ``device``: ``torch.save`` then writes each tensor's
    own values, not the whole storage a view shares."""
    device = torch.device(device)
    if torch.is_tensor(item):
        detached = item.detach()
        return detached.clone() if detached.device == device else detached.to(device)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        values = [clone_tensors_for_torch_save(v, device) for v in item]
        return values if isinstance(item, list) else type(item)(values)
    return item
