"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data efficiency library, which zerotrain
does not have yet; its module paths import, its functions raise naming the feature."""

from zerotrain.runtime.data_pipeline import data_sampling

__all__ = ["data_sampling"]
