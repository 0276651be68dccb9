"""Mixture-of-Experts with DeepSpeed-MoE's API (``deepspeed.moe``): the layer (layer.py), its
gating (gating.py), the all-to-all dispatch over the expert-parallel group (dispatch.py) and the
optimizer-group helpers (utils.py). See docs/moe.md."""

from zerotrain.moe import layer, utils
from zerotrain.moe.layer import MoE

__all__ = ["MoE", "layer", "utils"]
