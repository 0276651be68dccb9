"""What a pipeline's config must satisfy: checked before anything is built."""

from __future__ import annotations

from torch import nn

from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.pipe.module import MULTI_STAGE_PLACEMENT, PipelineModule


def check_pipeline(cfg: ZeroTrainConfig, model: nn.Module) -> None:
    """That the config's ZeRO stage, schedule and batch suit ``model``'s pipeline stages (a
    model that is no multi-stage PipelineModule passes)."""
    if not isinstance(model, PipelineModule) or model.num_stages * model.stages_per_rank == 1:
        return
    stages, schedule = model.num_stages, cfg.pipeline.schedule
    if cfg.zero_optimization.stage == 3:
        raise ConfigError(
            "zero_optimization.stage: 3 with pipeline parallelism is not supported: a stage "
            "runs many micro-batches per step, so its parameters are either kept gathered "
            "through the step (the peak of stage 2, which shards gradients and optimizer "
            "states too) or gathered twice per micro-batch (several times stage 2's traffic); "
            "use stage 2 (or 0, 1)"
        )
    if cfg.torch_autocast.enabled:
        raise ConfigError(
            "torch_autocast.enabled: the pipeline schedules run each stage's forward themselves, "
            "outside the engine's autocast, which zerotrain does not carry into them yet; use "
            "bf16.enabled (or fp16) with pipeline parallelism"
        )
    placement = MULTI_STAGE_PLACEMENT.get(schedule)
    if placement is None and model.stages_per_rank > 1:
        raise ConfigError(
            f"pipeline.schedule: {schedule} runs one stage per rank, and the PipelineModule has "
            f"stages_per_rank={model.stages_per_rank}; use pipeline.schedule interleaved_1f1b "
            "(or zbv, with stage_placement='v')"
        )
    if placement is not None and (model.stages_per_rank == 1 or placement != model.stage_placement):
        per_rank = "stages_per_rank=2 (or more)" if placement == "loop" else "stages_per_rank=2"
        raise ConfigError(
            f"pipeline.schedule: {schedule} runs several stages per rank, placed "
            f"{placement!r}, and the PipelineModule has stages_per_rank="
            f"{model.stages_per_rank}, stage_placement={model.stage_placement!r}; build it "
            f"with {per_rank}, stage_placement={placement!r}"
        )
    looped = placement == "loop"
    micro_batches = cfg.batch_sizes().gradient_accumulation_steps
    if schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(
            f"gradient_accumulation_steps: {micro_batches}, the micro-batches of a pipeline "
            f"step, must be at least the {stages} stages for the 1f1b schedule (more fill the "
            "pipeline better: its idle share is (stages - 1) / (micro-batches + stages - 1)); "
            "raise it, or use pipeline.schedule gpipe"
        )
    rounds = max(1, micro_batches // stages)
    if looped and micro_batches % rounds:
        raise ConfigError(
            f"gradient_accumulation_steps: {micro_batches} micro-batches run in {rounds} rounds "
            f"of the {stages} pipeline ranks under interleaved_1f1b, and must divide into them; "
            f"use a multiple of {stages} or fewer than {2 * stages}"
        )


def check_tied_offload(cfg: ZeroTrainConfig, tied: dict) -> None:
    """Tied layers on several stages (``tied``: this rank's copies) keep their optimizer on the
    device."""
    if tied and cfg.zero_optimization.offload_optimizer.device != "none":
        raise ConfigError(
            "zero_optimization.offload_optimizer: a PipelineModule with tied layers on several "
            "stages cannot offload its optimizer yet; remove offload_optimizer or keep each "
            "tied key's layers on one stage"
        )
