"""``train_micro_batch_size_per_gpu: "auto"`` outside HuggingFace's Trainer: the planner's
micro-batch, chosen in ``initialize``.

[Note: "auto" micro-batches]
HuggingFace's Trainer fills ``"auto"`` from its own arguments before DeepSpeed sees the config;
a config that reaches ``initialize`` with ``"auto"`` still in ``train_micro_batch_size_per_gpu``
had no Trainer fill it, and the planner does. The global batch is the user's
(``train_batch_size``: the planner never changes what the model learns), the stage, offload and
activation checkpointing are the config's; only the split of a rank's samples into micro-batches
is chosen. Priced by the model's FLOPs (no model runs in ``initialize``), every split of the
same step costs the same compute and fewer micro-batches cost less of the engine's own work,
so the plan's choice is the largest micro-batch predicted to fit (the planner's memory model,
zerotrain/plan/cost.py, on this machine's cached probe where there is one, else on the memory
it has now with the default corrections). The sequence length is the first training sample's
where ``training_data`` is given, else the longest the model takes (its config's
``max_position_embeddings``, ``n_positions`` or ``block_size``): a user who trains shorter
sequences gets a micro-batch that fits with room to spare. Rank 0 chooses and the ranks take
its choice, so they cannot disagree on the batch.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from zerotrain.config import ConfigError
from zerotrain.fmt import quantity
from zerotrain.plan.candidates import (
    Candidate,
    batch_per_rank,
    fixed_keys,
    micro_batches,
    section,
    training_dtype,
)
from zerotrain.plan.cost import predict
from zerotrain.plan.planner import load_corrections, model_facts, rank_budget, with_optimizer
from zerotrain.plan.probe import cached_machine, memory_only_machine

__all__ = ["choose_micro_batch", "sequence_length", "wants_auto_micro_batch"]

KEY = "train_micro_batch_size_per_gpu"
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "block_size", "max_seq_len")


def wants_auto_micro_batch(config: Any) -> bool:
    """Whether ``config`` (a raw mapping) leaves the micro-batch to be chosen."""
    value = config.get(KEY) if isinstance(config, dict) else None
    return isinstance(value, str) and value.strip().lower() == "auto"


def sequence_length(model: nn.Module, training_data: Any) -> int | None:
    """Tokens a sample: the first training sample's, else the longest the model takes."""
    if training_data is not None:
        try:
            sample = training_data[0]
        except (TypeError, IndexError, KeyError):
            sample = None
        if isinstance(sample, dict):
            sample = sample.get("input_ids")
        elif isinstance(sample, (tuple, list)) and sample:
            sample = sample[0]
        shape = getattr(sample, "shape", None)
        if shape is not None and len(shape) == 1:
            return int(shape[0])
    for owner in (getattr(model, "config", None), model):
        for key in _CONTEXT_KEYS:
            value = getattr(owner, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def choose_micro_batch(
    config: dict,
    model: nn.Module,
    *,
    world: int,
    ranks_per_node: int,
    seq_len: int | None,
    pipelined: bool = False,
) -> tuple[dict, str]:
    """``config`` (not changed) with its ``"auto"`` micro-batch and accumulation steps chosen
    (see [Note: "auto" micro-batches]) for ``world`` data-parallel ranks, and the line that
    says so; ConfigError where they cannot be (``pipelined``: the model is a pipeline)."""
    tensor_parallel = section(config, "tensor_parallel").get("autotp_size", 1)
    if pipelined or tensor_parallel != 1 or config.get("sequence_parallel_size", 1) != 1:
        raise ConfigError(
            f'{KEY}: "auto" is chosen for data parallelism only (pipeline, tensor and sequence '
            "parallelism need a number; `zerotrain plan` weighs tensor-parallel degrees); set a "
            "number"
        )
    global_batch = config.get("train_batch_size")
    if not isinstance(global_batch, int) or isinstance(global_batch, bool):
        raise ConfigError(
            f'{KEY}: "auto" chooses how a rank\'s share of the global batch is split, so it '
            "needs train_batch_size (samples per optimizer step over all ranks) as a number"
        )
    try:
        per_rank = batch_per_rank(global_batch, world)
    except ValueError:
        raise ConfigError(
            f"train_batch_size: {global_batch} is not a multiple of the {world} data-parallel "
            "ranks; make it one"
        ) from None
    if seq_len is None:
        raise ConfigError(
            f'{KEY}: "auto" needs the sequence length, which neither training_data nor the '
            f"model's config ({', '.join(_CONTEXT_KEYS)}) gives; set a number, or choose one "
            "with `zerotrain plan`"
        )
    dtype = training_dtype(config)
    facts = model_facts(model, seq_len=seq_len, dtype=dtype)
    if facts.shape(1) is None:
        raise ConfigError(
            f'{KEY}: "auto" is chosen for transformers whose shape the estimator knows '
            "(hidden size, layers, heads); set a number, or choose one with `zerotrain plan`"
        )
    facts = with_optimizer(facts, config, threads=None)  # its state's bytes; no step timed
    fixed = fixed_keys(config)  # the stage, offload and checkpointing the config sets
    offload = fixed.get("offload")
    zero = section(config, "zero_optimization")
    nvme_path = section(zero, "offload_optimizer").get("nvme_path") if offload == "nvme" else None
    machine = cached_machine(dtype=dtype, world=ranks_per_node, nvme_path=nvme_path)
    machine = machine or memory_only_machine(dtype=dtype, world=ranks_per_node)
    corrections = load_corrections(machine)
    budget = rank_budget(machine, ranks_per_node)
    if budget <= 0:
        raise ConfigError(
            f'{KEY}: "auto" cannot be chosen: the memory this machine has is not known here; '
            "set a number"
        )
    accumulation = config.get("gradient_accumulation_steps")
    free = {k: v for k, v in config.items() if k not in (KEY, "gradient_accumulation_steps")}
    try:
        sizes = micro_batches(world=world, global_batch=global_batch, base=free)
    except ValueError as error:  # the autotuning section's limits
        raise ConfigError(str(error)) from None
    if isinstance(accumulation, int) and not isinstance(accumulation, bool):
        sizes = [m for m in sizes if m * accumulation == per_rank]  # the config fixes it
    needs = []
    for micro in sorted(sizes, reverse=True):
        candidate = Candidate(
            stage=fixed.get("stage", 0),
            offload=offload,
            activation_checkpointing=fixed.get("activation_checkpointing", False),
            micro_batch=micro,
            accumulation=per_rank // micro,
            world=world,
        )
        chosen = candidate.config(free, nvme_path)
        peak = predict(candidate, facts, machine, corrections, chosen).peak_memory_bytes
        if peak <= budget:
            resolved = copy.deepcopy(config)
            resolved[KEY] = micro
            resolved["gradient_accumulation_steps"] = per_rank // micro
            return resolved, (
                f'zerotrain: {KEY} "auto" -> {micro} ({per_rank // micro} micro-batches a step '
                f"on each of {world} rank(s)): the largest predicted to fit, {quantity(peak, 'B')} "
                f"of the {quantity(budget, 'B')} a rank may use at {seq_len} tokens a sample"
            )
        needs.append((micro, peak))
    if not needs:
        raise ConfigError(
            f'{KEY}: "auto" has no micro-batch to choose: gradient_accumulation_steps '
            f"{accumulation} does not divide the {per_rank} samples a rank takes"
        )
    micro, peak = needs[-1]
    raise ConfigError(
        f'{KEY}: "auto" finds no micro-batch that fits: even {micro} is predicted to need '
        f"{quantity(peak, 'B')} per rank at {seq_len} tokens a sample, more than the "
        f"{quantity(budget, 'B')} a rank may use; more ranks, a higher ZeRO stage, optimizer "
        "offload or activation checkpointing would help (`zerotrain plan` weighs them)"
    )
