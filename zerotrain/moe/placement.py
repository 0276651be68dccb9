"""Where a model's experts run: the expert-parallel degree its MoE layers ask for, checked
against the config, and the layers placed over the mesh's expert-parallel axis (the parallel
layout, zerotrain/parallel, calls both)."""

from __future__ import annotations

from torch import nn

from zerotrain.comm import Communicator, Mesh
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.moe.layer import MoE


def expert_parallel_degree(model: nn.Module, cfg: ZeroTrainConfig, pipelined: bool) -> int:
    """The expert-parallel degree of ``model``'s MoE layers (1 without any): one for all.
    ``pipelined``: the model is a PipelineModule, whose stages decide together."""
    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, MoE)})
    if pipelined and any(Communicator().all_gather_object(bool(sizes))):
        # decided together: a stage builds only its own layers, and every rank must raise
        raise ConfigError(
            "MoE layers in a PipelineModule are not supported yet; train the MoE model without "
            "pipeline parallelism (expert and data parallelism, any ZeRO stage)"
        )
    if sizes and cfg.tensor_parallel.autotp_size > 1:
        raise ConfigError(
            "tensor_parallel.autotp_size: MoE layers with tensor parallelism are not supported "
            "yet; set autotp_size to 1 (expert parallelism spreads the experts instead)"
        )
    if sizes and cfg.lora_fa.enabled:
        raise ConfigError(
            "lora_fa: LoRA-FA adapters with MoE layers are not supported yet; disable lora_fa"
        )
    if len(sizes) > 1:
        raise ConfigError(
            f"MoE: layers with ep_size {sizes}; zerotrain places every MoE layer's experts over "
            "one expert-parallel group: give them one ep_size"
        )
    return sizes[0] if sizes else 1


def place_experts(model: nn.Module, cfg: ZeroTrainConfig, mesh: Mesh) -> None:
    """Give every MoE layer the config's dispatch options and, with experts spread over ranks,
    its expert-parallel group (collective the first time the axis is asked for)."""
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.deepspeed_moe.dedup = cfg.moe.token_dedup
            layer.deepspeed_moe.chunks = cfg.moe.overlap_chunks
            if mesh.sizes["ep"] > 1:  # else every expert is local: nothing to exchange
                layer.place(mesh.axis("ep"))
