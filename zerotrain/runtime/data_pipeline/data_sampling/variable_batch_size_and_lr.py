"""``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``."""

from __future__ import annotations

__all__ = ["get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(*args, **kwargs):
    """DeepSpeed's variable-batch-size data loader and learning-rate scaling; raises."""
    raise NotImplementedError(
        "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed: variable batch "
        "sizes with learning-rate scaling (DeepSpeed's data efficiency library) are not "
        "implemented in zerotrain yet; use a fixed train_micro_batch_size_per_gpu"
    )
