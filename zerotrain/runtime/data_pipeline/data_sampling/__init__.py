"""``deepspeed.runtime.data_pipeline.data_sampling``."""

from zerotrain.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr

__all__ = ["variable_batch_size_and_lr"]
