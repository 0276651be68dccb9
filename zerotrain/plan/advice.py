"""``initialize``'s advice: one rank-0 warning, before the first step computes anything, when
the config is predicted not to fit or to be far slower than what ``zerotrain plan`` would
choose on this machine.

[Note: initialize's advice]
The sequence length is known only from the first batch, so the advice is a forward pre-hook
that runs in the model's first forward, before the model computes anything, and removes
itself. It runs on rank 0 alone and calls no collective (no rank waits for it), uses no random
numbers and changes nothing, so training is the same with or without it. It prices the
config with the planner's cost model (zerotrain/plan/cost.py), its compute by the model's
FLOPs (a model probe would run the user's model), on this machine's cached probe and
corrections: no probe runs inside a training job, so without a cache (``zerotrain plan``
makes one) ``initialize`` says so once at INFO, counts nothing and adds no hook. Against the plan for the same
global batch over the same ranks, with the config's other keys kept, it warns:
- when the config's predicted peak per rank is above what a rank may use (the plan's margin),
  naming the plan's choice, or the plan's refusal when nothing fits;
- when its predicted step is :data:`SLOWER` times the choice's or more.
It advises on data parallelism with ZeRO 0-3 and optimizer offload (not on a config with
tensor, pipeline, sequence or expert parallelism, and it weighs none of them), Adam's or
AdamW's state, and a model whose transformer shape the estimator recognises; for anything
else it stays silent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from zerotrain.config import ZeroTrainConfig
from zerotrain.fmt import quantity
from zerotrain.plan.candidates import Candidate, training_dtype, without_choices
from zerotrain.plan.cost import ModelFacts, predict
from zerotrain.plan.planner import (
    PlanError,
    load_corrections,
    make_plan,
    model_facts,
    rank_budget,
    with_optimizer,
)
from zerotrain.plan.probe import Machine, cached_machine, with_current_memory

__all__ = ["SLOWER", "Advice", "advise_on_first_forward", "prepare_advice"]

SLOWER = 2.0
_ADAM = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"}
logger = logging.getLogger("zerotrain")


@dataclass(frozen=True)
class Advice:
    """What the advice needs, gathered in ``initialize`` before the model is wrapped (stage 3
    then partitions its parameters); :meth:`check` runs once the sequence length is known."""

    facts: ModelFacts
    config: ZeroTrainConfig
    raw: dict
    machine: Machine
    """This machine's cached probe (its memory is read again in :meth:`check`)."""
    world: int
    """Data-parallel ranks."""
    ranks_per_node: int

    def check(self, seq_len: int) -> str | None:
        """The warning for a first batch of ``seq_len`` tokens a sample (None: nothing to say)."""
        cfg = self.config
        offload = cfg.zero_optimization.offload_optimizer
        nvme_path = _nvme_path(cfg)
        machine = with_current_memory(self.machine)
        facts = replace(self.facts, seq_len=seq_len)
        corrections = load_corrections(machine)
        batch = cfg.batch_sizes()
        mine = Candidate(
            stage=cfg.zero_optimization.stage,
            offload=None if offload.device == "none" else offload.device,
            activation_checkpointing=cfg.activation_checkpointing is not None,
            micro_batch=batch.train_micro_batch_size_per_gpu,
            accumulation=batch.gradient_accumulation_steps,
            world=self.world,
        )
        predicted = predict(mine, facts, machine, corrections, mine.config(self.raw, nvme_path))
        try:
            plan = make_plan(
                facts,
                machine,
                world=self.world,
                ranks_per_node=self.ranks_per_node,
                global_batch=batch.train_batch_size,
                base=without_choices(self.raw),
                nvme_path=nvme_path,
                corrections=corrections,
            )
        except PlanError as error:
            if predicted.peak_memory_bytes > rank_budget(machine, self.ranks_per_node):
                return f"zerotrain: this config is predicted not to fit, nor is any: {error}"
            return None
        best = plan.best
        if predicted.peak_memory_bytes > plan.budget:
            return (
                f"zerotrain: this config ({mine.label()}) is predicted to need "
                f"{_bytes(predicted.peak_memory_bytes)} per rank at {seq_len} tokens a sample, "
                f"more than the {_bytes(plan.budget)} a rank may use here; "
                f"{best.candidate.label()} is predicted to fit "
                f"({_bytes(best.predicted.peak_memory_bytes)}) and take "
                f"{best.predicted.step_time_s:.3g} s a step (`zerotrain plan` shows the table)"
            )
        ratio = predicted.step_time_s / best.predicted.step_time_s
        if ratio >= SLOWER:
            return (
                f"zerotrain: this config ({mine.label()}) is predicted to take "
                f"{predicted.step_time_s:.3g} s a step at {seq_len} tokens a sample, {ratio:.1f}x "
                f"the {best.predicted.step_time_s:.3g} s of {best.candidate.label()} on this "
                f"machine ({best.predicted.bound}-bound; yours is {predicted.bound}-bound; "
                "`zerotrain plan` shows the table)"
            )
        return None


def _bytes(value: float) -> str:
    return quantity(value, "B")


def prepare_advice(
    model: nn.Module,
    cfg: ZeroTrainConfig,
    raw: dict,
    *,
    optimizer_type: str | None,
    world: int,
    ranks_per_node: int,
    parallel_sizes: dict[str, int],
) -> Advice | None:
    """The advice for this run, or None where it gives none (see [Note:
    initialize's advice])."""
    if any(size > 1 for axis, size in parallel_sizes.items() if axis != "dp"):
        return None
    if (optimizer_type or "").replace("_", "").lower() not in _ADAM:
        return None
    dtype = training_dtype(raw)
    machine = cached_machine(dtype=dtype, world=ranks_per_node, nvme_path=_nvme_path(cfg))
    if machine is None:
        logger.info(
            "zerotrain: no advice on this config: this machine has no probe cached for "
            "%s on %d rank(s) a node (`zerotrain plan` makes one)",
            dtype,
            ranks_per_node,
        )
        return None
    facts = model_facts(model, seq_len=1, dtype=dtype)
    if facts.shape(1) is None:
        return None
    facts = with_optimizer(facts, raw, machine.threads)  # Adam's: nothing timed
    return Advice(facts, cfg, raw, machine, world, ranks_per_node)


def _nvme_path(cfg: ZeroTrainConfig) -> str | None:
    """The working directory of NVMe offload, which keys the machine's probe."""
    offload = cfg.zero_optimization.offload_optimizer
    return str(offload.nvme_path) if offload.device == "nvme" else None


def advise_on_first_forward(module: nn.Module, advice: Advice) -> None:
    """Run ``advice`` in ``module``'s first forward, once (see [Note: initialize's advice])."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        handle.remove()
        seq_len = _sequence_length(args, kwargs)
        if seq_len is None:
            return
        try:
            warning = advice.check(seq_len)
        except Exception as error:  # noqa: BLE001 (advice must never stop a training run)
            logger.info("zerotrain: no advice on this config (%s: %s)", type(error).__name__, error)
            return
        if warning:
            logger.warning(warning)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)


def _sequence_length(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """Tokens a sample: the second dimension of the token ids (``input_ids``, else the first
    integer tensor of two dimensions)."""
    import torch

    ids = kwargs.get("input_ids")
    candidates = [ids] if ids is not None else [*args, *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            return int(value.shape[1])
    return None
