"""What DeepSpeed's engine answers about its configuration, under DeepSpeed's method names.

Scripts and frameworks ask the engine rather than the config: ``engine.fp16_enabled()``,
``engine.zero_optimization_partition_weights()``, ``engine.optimizer_name()``... These are the
read-only questions, mixed into :class:`zerotrain.engine.ZeroTrainEngine`; every answer comes
from the validated config (``engine.zerotrain_config``) or the ZeRO policy, never from a second
copy of a setting.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.checkpoint.protocol import ModelLayout
from zerotrain.config import OffloadOptimizerConfig, OffloadParamConfig, ZeroTrainConfig
from zerotrain.precision import DTYPES
from zerotrain.zero import ZeroOptimizer


class DeepSpeedQueries:
    """DeepSpeed's engine getters (batch sizes, precision, ZeRO stage and offload, names)."""

    zerotrain_config: ZeroTrainConfig
    optimizer: ZeroOptimizer
    layout: ModelLayout
    _client_optimizer_name: str | None

    # -- batch ---------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.zerotrain_config.batch_sizes().train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """The configured micro-batch; across sites with ``sites.work_split``, this site's
        share for the next step (what a loop that makes its own batches takes)."""
        configured = self.zerotrain_config.batch_sizes().train_micro_batch_size_per_gpu
        return self.layout.micro_batch(configured)

    def gradient_accumulation_steps(self) -> int:
        return self.zerotrain_config.batch_sizes().gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``
        (DeepSpeed returns the three getter methods themselves; the values are what is meant)."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def managed_gradient_accumulation(self) -> bool:
        """Always true: ``step()`` counts micro-steps (DeepSpeed's unmanaged mode is refused)."""
        return True

    # -- ZeRO ----------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.optimizer.policy.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.optimizer.policy.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.optimizer.every_backward  # reduced into shards every backward

    def zero_optimization_partition_weights(self) -> bool:
        return self.optimizer.shards_params

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The `offload_optimizer` section when it asks for offload, else None."""
        section = self.zerotrain_config.zero_optimization.offload_optimizer
        return section if section.device != "none" else None

    def zero_offload_param(self) -> OffloadParamConfig | None:
        """The `offload_param` section when it asks for offload, else None."""
        section = self.zerotrain_config.zero_optimization.offload_param
        return section if section.device != "none" else None

    def zero_cpu_offload(self) -> bool:
        return self.zerotrain_config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.zerotrain_config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    # -- precision -----------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.zerotrain_config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.zerotrain_config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return self.zerotrain_config.fp16.enabled and self.zerotrain_config.fp16.auto_cast

    def auto_cast_dtype(self) -> torch.dtype | None:
        """The dtype ``engine(...)`` casts floating-point arguments to (``fp16.auto_cast``,
        ``bf16.auto_cast``), or None."""
        config = self.zerotrain_config
        if self.fp16_auto_cast():
            return torch.float16
        if config.bf16.enabled and config.bf16.auto_cast:
            return torch.bfloat16
        return None

    def dynamic_loss_scale(self) -> bool:
        return self.optimizer.loss_scaler.dynamic

    def torch_autocast_enabled(self) -> bool:
        return self.zerotrain_config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward is autocast to (the torch_autocast section), or None."""
        return self.optimizer.precision.autocast_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (`communication_data_type`, else the training
        dtype)."""
        name = self.zerotrain_config.communication_data_type
        return DTYPES[name] if name else self.optimizer.precision.param_dtype

    def gradient_clipping(self) -> float:
        return self.zerotrain_config.gradient_clipping

    # -- names and reporting -------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """The class name of an optimizer given to ``initialize``, else the config's type in
        lower case ("adamw"), as DeepSpeed reports it."""
        if self._client_optimizer_name is not None:
            return self._client_optimizer_name
        section = self.zerotrain_config.optimizer
        return section.type.lower() if section is not None else None

    def optimizer_params(self) -> dict[str, Any] | None:
        section = self.zerotrain_config.optimizer
        return dict(section.params) if section is not None else None

    def scheduler_name(self) -> str | None:
        section = self.zerotrain_config.scheduler
        return section.type if section is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        section = self.zerotrain_config.scheduler
        return dict(section.params) if section is not None else None

    def steps_per_print(self) -> int | None:
        return self.zerotrain_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.zerotrain_config.wall_clock_breakdown

    def get_mom(self) -> list:
        """Per group: ``betas`` (Adam-like) or ``momentum`` (SGD), as DeepSpeed reports them."""
        return [
            group["betas"] if "betas" in group else group.get("momentum")
            for group in self.optimizer.param_groups
        ]
