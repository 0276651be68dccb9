"""A pipeline cut from an ordinary model at named modules, rather than written as a sequence
of layers.

[Note: splitting a model by module names]
``split_model(model, example_inputs, split_points)`` traces ``model`` into one graph with torch's
pipeline front end (``torch.distributed.pipelining.pipeline``, on ``torch.export``) and cuts it
before each named module (``SplitPoint.BEGINNING``): stage i runs the graph from its split point
to the next, whatever the forward does in between (sums of embeddings, skips inside a stage,
reshapes). The stages become the layers of a ``PipelineModule``, one per stage, so everything
else (schedules, ZeRO, tensor parallelism, checkpoints) is the PipelineModule's; a parameter is
named ``<stage>.<its name in the model>``. The stages use the model's own parameter and buffer
objects (the tracer's copies are replaced by them), so initial values are the model's.
Limits, each an error or stated here: the model must trace as one graph (no data-dependent
control flow; transformers' GPT-2 does not, a model written for torch.export does); the graph is
specialised to the example's shapes (every micro-batch must have them) and device; one tensor
flows from a stage to the next. A parameter several stages use (an output projection tied to
the input embedding) is one tied parameter, as a TiedLayerSpec's: named
``tied_modules.<owner>.<attr>`` after its first use, its copies' gradients summed over the
stages' ranks (see [Note: tied layers across stages] in pipe/module.py); the stages keep their
own names for it too, as the model does. Every rank traces the whole model and keeps its own
stages; the caller's reference to ``model`` keeps the others alive until dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerotrain.config import ConfigError
from zerotrain.pipe.module import PipelineModule


def split_model(
    model: nn.Module,
    example_inputs: tuple,
    split_points: Sequence[str],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    stages_per_rank: int = 1,
    **options: Any,
) -> PipelineModule:
    """``model`` cut before each module named in ``split_points`` (in forward order) into
    ``len(split_points) + 1`` stages, ``stages_per_rank`` of them per pipeline rank, as a
    ``PipelineModule`` (``options`` go to it: the stage placement, the activation
    checkpoint interval, ...). ``example_inputs``: one micro-batch's inputs, as ``model`` takes
    them (see [Note: splitting a model by module names])."""
    total = len(split_points) + 1
    if total % stages_per_rank:
        raise ConfigError(
            f"split_model: {total} stages ({len(split_points)} split points) do not divide "
            f"into {stages_per_rank} stages per rank"
        )
    stages = cut_model(model, example_inputs, split_points)
    pipe = PipelineModule(
        stages,
        num_stages=total // stages_per_rank,
        loss_fn=loss_fn,
        partition_method="uniform",
        stages_per_rank=stages_per_rank,
        **options,
    )
    for name, (param, used_by) in shared_parameters(stages).items():
        pipe.tie_parameter(name, param, used_by)
    return pipe


def cut_model(
    model: nn.Module, example_inputs: tuple, split_points: Sequence[str]
) -> list[nn.Module]:
    """``model`` traced with ``example_inputs`` and cut before each module of ``split_points``:
    one graph module per stage, holding ``model``'s own parameters and buffers (ConfigError
    where it cannot be: see [Note: splitting a model by module names])."""
    # torch.distributed.pipelining: imported by the models that are split (see pipe/engine.py)
    from zerotrain.comm.pipeline import stage_inputs, trace_stages

    names = dict(model.named_modules())
    unknown = [p for p in split_points if p not in names or not p]
    if unknown or not split_points:
        raise ConfigError(
            f"split_model: split points {unknown or list(split_points)} are not modules of "
            f"{type(model).__name__}; name the modules each stage starts at, such as "
            f"{[n for n, _ in model.named_children()][:3]}"
        )
    total = len(split_points) + 1
    try:
        stages = trace_stages(model, tuple(example_inputs), split_points)
    except Exception as error:
        raise ConfigError(
            f"split_model: {type(model).__name__} could not be traced as one graph "
            f"({type(error).__name__}: {str(error).splitlines()[0]}); write it as a "
            "PipelineModule of layers (LayerSpec) instead"
        ) from error
    if len(stages) != total:
        raise ConfigError(
            f"split_model: the trace has {len(stages)} stages, not {total}: some split "
            f"points of {list(split_points)} are not called in the forward, or not in this order"
        )
    for index, stage in enumerate(stages[1:], start=1):
        inputs = stage_inputs(stage)
        if len(inputs) != 1:
            raise ConfigError(
                f"split_model: stage {index} (from {split_points[index - 1]!r}) takes "
                f"{len(inputs)} tensors {inputs} from the stage before; a PipelineModule passes "
                "one: move the split point where one tensor flows"
            )
    _use_model_tensors(stages, model)
    return stages


def _use_model_tensors(stages: list[nn.Module], model: nn.Module) -> None:
    """Point every stage's parameters and buffers at ``model``'s own objects (the tracer
    copies some: those it saw under two names)."""
    for stage in stages:
        for name, tensor in [
            *stage.named_parameters(remove_duplicate=False),
            *stage.named_buffers(remove_duplicate=False),
        ]:
            owner_name, _, attribute = name.rpartition(".")
            owner = stage.get_submodule(owner_name)
            if isinstance(tensor, nn.Parameter):
                original = model.get_parameter(name)
                if original is not tensor:
                    owner.register_parameter(attribute, original)
            else:
                original = model.get_buffer(name)
                if original is not tensor:
                    kept = attribute not in owner._non_persistent_buffers_set
                    owner.register_buffer(attribute, original, persistent=kept)


def shared_parameters(stages: list[nn.Module]) -> dict[str, tuple[nn.Parameter, set[int]]]:
    """Parameters several stages use (an output projection tied to the input embedding), by
    their name in the first stage that uses them, with the stages using them."""
    first: dict[int, str] = {}
    found: dict[str, tuple[nn.Parameter, set[int]]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            name = first.setdefault(id(param), name)
            found.setdefault(name, (param, set()))[1].add(index)
    return {name: used for name, used in found.items() if len(used[1]) > 1}
