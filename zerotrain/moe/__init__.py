"""``deepspeed.moe``: importable, so that scripts which import it but train dense models run;
an MoE layer raises when built, as zerotrain has no expert parallelism yet."""

from zerotrain.moe import layer, utils

__all__ = ["layer", "utils"]
