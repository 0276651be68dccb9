"""The config's sections as the options each part takes: the shard groups' (ZeRO stage,
buckets, stage 3, offload, compression) and the loss scaler. Each is read here once;
``initialize`` passes the results on."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.compression import GradientCompression
from zerotrain.config import ZeroTrainConfig
from zerotrain.config.compression import AUTO_DEFAULT_METHOD
from zerotrain.precision import DTYPES, LossScaler, lower_precision_grads
from zerotrain.zero import GroupOptions, ZeroPolicy
from zerotrain.zero.compression_options import (
    auto_compression,
    gradient_compression,
    parameter_compression,
    secondary_partition,
)
from zerotrain.zero.gather import GatherForUseOptions
from zerotrain.zero.offload import OffloadOptions, device_budget
from zerotrain.zero.outer_step import SiteOptions
from zerotrain.zero.param_home import ParamOffload
from zerotrain.zero.swap import AioOptions


def group_options(
    cfg: ZeroTrainConfig,
    model: nn.Module,
    device: torch.device,
    dp: Communicator,
    world: Communicator,
) -> GroupOptions:
    """The shard groups' options from the config, for ``model``, partitioned over the
    data-parallel group ``dp`` of the ranks ``world`` (the parallel layout adds what its other
    axes decide: see ``ParallelLayout.shard_group_specs``)."""
    zero = cfg.zero_optimization
    auto = auto_compression(cfg)
    section = cfg.comm_compression
    asked = section.auto or {section.gradients.method, section.parameters.method} != {"none"}
    if asked and dp.world_size == 1 and world.rank == 0:
        taken = f" (its {world.world_size} ranks split the model)" if world.world_size > 1 else ""
        warnings.warn(
            "zerotrain: comm_compression acts between data-parallel ranks, and this run has "
            f"one replica{taken}: nothing is compressed",
            stacklevel=4,  # initialize's caller (initialize -> _zero_optimizer -> here)
        )
    return GroupOptions(
        policy=ZeroPolicy.for_stage(zero.stage),
        comm=dp,
        precision=cfg.precision_policy(),
        bucket_numel=zero.reduce_bucket_size,
        gather_for_use=GatherForUseOptions(
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_numel=zero.stage3_max_reuse_distance,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            offload_param=_param_offload(cfg) if zero.stage == 3 else None,
            ranks_per_node=secondary_partition(cfg),
        ),
        overlap_param_gather=zero.overlap_param_gather,
        comm_dtype=DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        offload=_offload_options(cfg, device),
        compression=gradient_compression(cfg) if auto is None else None,
        param_compression=parameter_compression(cfg) if auto is None else auto.parameters,
        auto=auto,
        comm_dtypes=_autocast_comm_dtypes(cfg, model),
        sites=_site_options(cfg),
    )


def _site_options(cfg: ZeroTrainConfig) -> SiteOptions | None:
    """The ``sites`` section's outer steps (None: one site, or synchronous training); the
    parallel layout adds the ranks they exchange over."""
    sites = cfg.sites
    if sites is None or sites.synchronous:
        return None
    wire = sites.compression

    def codec(method: str) -> GradientCompression:
        return GradientCompression(
            method=method,
            ratio=wire.ratio,
            block_size=wire.block_size,
            min_numel=0,  # a shard is one run of elements: all of it travels compressed
            catch_up=False,  # the outer SGD takes the change as it comes
        )

    outer = sites.outer_optimizer
    params = None if outer is None else outer.params  # None: the average is taken
    streaming = sites.streaming
    return SiteOptions(
        inner_steps=sites.inner_steps,
        fragments=1 if streaming is None else streaming.fragments,
        overlap_steps=0 if streaming is None else streaming.overlap_steps,
        mixing=0.0 if streaming is None else streaming.mixing,
        lr=None if params is None else params.lr,
        momentum=0.0 if params is None else params.momentum,
        nesterov=params is not None and params.nesterov,
        compression=None if wire.method in ("none", "auto") else codec(wire.method),
        choices=(None, codec(AUTO_DEFAULT_METHOD)) if wire.method == "auto" else (),
    )


def _autocast_comm_dtypes(cfg: ZeroTrainConfig, model: nn.Module) -> dict[int, torch.dtype]:
    """torch_autocast: the parameters whose gradients are reduced in its dtype."""
    section = cfg.torch_autocast
    if not section.enabled:
        return {}
    return lower_precision_grads(model, section.safe_classes(), DTYPES[section.dtype])


def loss_scaler(cfg: ZeroTrainConfig) -> LossScaler:
    """The fp16 section's scaler: for fp16 training, and for torch_autocast to fp16 (whose
    products' gradients underflow as fp16 training's do)."""
    fp16 = cfg.fp16
    autocast = cfg.torch_autocast
    if not fp16.enabled and not (autocast.enabled and autocast.dtype == "fp16"):
        return LossScaler()
    if fp16.loss_scale:  # static
        return LossScaler(scale=fp16.loss_scale)
    return LossScaler(
        scale=2.0**fp16.initial_scale_power,
        dynamic=True,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def _aio_options(cfg: ZeroTrainConfig) -> AioOptions:
    return AioOptions(
        block_size=cfg.aio.block_size,
        queue_depth=cfg.aio.queue_depth,
        thread_count=cfg.aio.intra_op_parallelism,
    )


def _param_offload(cfg: ZeroTrainConfig) -> ParamOffload:
    """The `offload_param` section as stage 3 takes it."""
    section = cfg.zero_optimization.offload_param
    return ParamOffload(
        device=section.device,
        pin_memory=section.pin_memory,
        nvme_path=section.nvme_path,
        buffer_count=section.buffer_count,
        buffer_size=section.buffer_size,
        aio=_aio_options(cfg),
    )


def _offload_options(cfg: ZeroTrainConfig, device: torch.device) -> OffloadOptions | None:
    """The `offload_optimizer` section as the shard group takes it (None: not offloaded)."""
    zero = cfg.zero_optimization
    section = zero.offload_optimizer
    if section.device == "none":
        return None
    return OffloadOptions(
        device=section.device,
        ratio=section.ratio,
        pin_memory=section.pin_memory,
        buffer_count=section.buffer_count,
        nvme_path=section.nvme_path,
        sub_group_size=zero.sub_group_size,
        device_budget=lambda: device_budget(device),
        aio=_aio_options(cfg),
    )
