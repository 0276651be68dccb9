"""What ``initialize`` builds the optimizer and the LR scheduler from, and which optimizer it
returns.

The optimizer is the client's torch optimizer, the one a client's callable builds, the
config's ``optimizer`` section, or none (forward passes only); whichever it is steps this
rank's fp32 master shards.

[Note: the client's optimizer object]
DeepSpeed steps the client's own optimizer object: its ZeRO optimizers point the client's param
groups at the fp32 partitions and step it (``engine._configure_optimizer``, DeepSpeed 0.19). Client
code holding that object keeps working: an LR scheduler built over it (one that
``accelerator.prepare`` gets beside it and steps itself, outside DeepSpeed), an ``lr`` set in
its param groups, its state dict, identity checks. zerotrain does the same: where
one shard group holds every trained parameter, the client's object is emptied and given this
rank's master shards with its param groups' settings (:func:`adopt`), and is what steps; its
old state keyed the model's parameters, which no optimizer steps any more. Several shard groups
(an MoE model's trained experts: [Note: several shard groups] in zero/optimizer.py) need one
torch optimizer each, built from the client's class and settings; the client's object is then
left as it was, and the optimizer ``initialize`` returns is the one to change.

[Note: the optimizer initialize returns]
DeepSpeed's ``initialize`` returns ``engine.optimizer``: at ZeRO stage 0 without fp16/bf16 the
basic optimizer itself (the client's object, the one its callable built, the config's; None
without any), elsewhere a wrapper around it (FP16_Optimizer or BF16_Optimizer at stage 0,
DeepSpeedZeroOptimizer at stages 1-2, DeepSpeedZeroOptimizer_Stage3 at stage 3). zerotrain returns
the torch optimizer that steps where DeepSpeed returns the basic optimizer (the client's own
object: [Note: the client's optimizer object]), and its :class:`ZeroOptimizer` where DeepSpeed
returns a wrapper; that answers ``isinstance`` for the stage's DeepSpeed class
(zerotrain/runtime/zero/stage_1_and_2.py, stage3.py). ``engine.optimizer`` is the ZeroOptimizer
at every stage: the engine steps through it, as users do through ``engine.step()``. The returned
torch optimizer refuses a ``step()`` of its own outside ``engine.step()``: its masters hold
averaged gradients only there (DeepSpeed's would step the model's unaveraged gradients).
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from zerotrain.config import ZeroTrainConfig
from zerotrain.optim import Lamb, NoOptimizer, build_optimizer, build_scheduler, repoint_scheduler
from zerotrain.optim.muon import Muon, muon_groups
from zerotrain.optim.registry import find_optimizer
from zerotrain.zero import ShardSegments, ZeroOptimizer
from zerotrain.zero.group import OptimizerFactory
from zerotrain.zero.init import full_shape
from zerotrain.zero.layout import NamedParams

__all__ = ["OptimizerPlan", "adopt", "optimizer_plan", "returned_optimizer", "scheduler_for"]


@dataclass
class OptimizerPlan:
    """The parameter groups to partition and how to build the optimizer over their shards."""

    groups: list[tuple[dict, NamedParams]]
    """Each optimizer group's settings and its trained parameters, in the client's order."""
    build: OptimizerFactory
    """A new optimizer over master tensors (also the probes over stand-ins)."""
    client: torch.optim.Optimizer | None = None
    """The client's optimizer object, which the shard group steps where there is one group."""
    _given: tuple[list[dict], dict] | None = None
    """The client's groups and state as given, while it is adopted (see :meth:`give_back`)."""

    def give_back(self) -> None:
        """After a failed ``initialize``: the client's object holds its own groups and state
        again, as it was given, instead of a failed engine's shards."""
        if self.client is not None and self._given is not None:
            groups, state = self._given
            self.client.param_groups[:] = groups
            self.client.state.clear()
            self.client.state.update(state)
            self._given = None

    def factory(self, shard_groups: int) -> OptimizerFactory:
        """The builder for ``shard_groups`` shard groups: with one, its real build adopts the
        client's object ([Note: the client's optimizer object]); probes are built new."""
        pending = [self.client] if self.client is not None and shard_groups == 1 else []
        if not pending:
            return self.build

        def make(groups: list[dict], segments: ShardSegments | None) -> torch.optim.Optimizer:
            if segments is None or not pending:  # a probe over stand-ins (OptimizerFactory)
                return self.build(groups, segments)
            client = pending.pop()
            self._given = (list(client.param_groups), dict(client.state))
            return _on_shards(adopt(client, groups), groups, segments)

        return make


def adopt(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """``optimizer`` (the client's object) over ``groups`` instead of its own, as its
    constructor would have taken them: empty state, each group's settings completed from its
    defaults. Its step hooks, and an LR scheduler built over it, stay. On failure it is as
    it was."""
    saved_groups, saved_state = list(optimizer.param_groups), dict(optimizer.state)
    optimizer.state.clear()
    optimizer.param_groups.clear()  # the same list: whoever holds it sees the new groups
    try:
        for group in groups:
            optimizer.add_param_group(group)
    except BaseException:
        optimizer.param_groups[:] = saved_groups
        optimizer.state.update(saved_state)
        raise
    return optimizer


def returned_optimizer(
    zero_optimizer: ZeroOptimizer, cfg: ZeroTrainConfig
) -> ZeroOptimizer | torch.optim.Optimizer | None:
    """The optimizer ``initialize`` returns, as DeepSpeed chooses it ([Note: the optimizer
    initialize returns])."""
    if cfg.zero_optimization.stage > 0 or cfg.fp16.enabled or cfg.bf16.enabled:
        return zero_optimizer  # where DeepSpeed returns its wrapper
    if not zero_optimizer.trains:
        return None  # DeepSpeed's engine.optimizer without an optimizer at stage 0
    optimizer = zero_optimizer.optimizer
    optimizer.register_step_pre_hook(partial(_refuse_direct_step, weakref.ref(zero_optimizer)))
    return optimizer


def _refuse_direct_step(engine_optimizer: weakref.ref, optimizer, args, kwargs) -> None:
    """The masters hold averaged gradients only inside ``engine.step()``; a ``step()`` called
    on the optimizer itself would change nothing, silently."""
    zero = engine_optimizer()
    if zero is not None and not zero.stepping:
        raise RuntimeError(
            f"zerotrain: {type(optimizer).__name__}.step() was called on the optimizer "
            "initialize returned, outside engine.step(): the engine averages the gradients "
            "across ranks and steps this optimizer in engine.step(); call engine.step() "
            "instead (after engine.backward(loss) or loss.backward())"
        )


def _client_wins(key: str, argument: str, what: str, given: object, rank: int) -> None:
    """A config section and a client object for the same thing: DeepSpeed uses the object."""
    if rank == 0:
        warnings.warn(
            f"zerotrain: the config's `{key}` section ({what}) is ignored: "
            f"initialize({argument}=...) was given "
            f"{type(given).__name__}, which is used instead, as DeepSpeed does",
            stacklevel=4,
        )


def optimizer_plan(
    model: nn.Module, optimizer, model_parameters, cfg: ZeroTrainConfig, rank: int
) -> OptimizerPlan:
    """How ``initialize``'s optimizer arguments and the config's section become the optimizer
    over the shards."""
    names = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    if optimizer is not None and cfg.optimizer is not None:
        _client_wins("optimizer", "optimizer", cfg.optimizer.type, optimizer, rank)

    client = None
    if isinstance(optimizer, torch.optim.Optimizer):
        client = optimizer
        raw_groups = optimizer.param_groups
        opt_cls = type(optimizer)
        # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
        # every group carries its own values anyway.
        accepted = inspect.signature(opt_cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}

        def make(groups, segments: ShardSegments | None):
            return _on_shards(opt_cls(groups, **defaults), groups, segments)

    else:
        raw_groups = _groups_from(model_parameters if model_parameters is not None else model)
        if callable(optimizer):
            user_factory: Callable[..., torch.optim.Optimizer] = optimizer

            def make(groups, segments: ShardSegments | None):
                return _on_shards(user_factory(groups), groups, segments)

        elif cfg.optimizer is not None:
            opt_cfg = cfg.optimizer

            def make(groups, segments: ShardSegments | None):
                optimizer = build_optimizer(opt_cfg.type, opt_cfg.params, groups)
                return _on_shards(optimizer, groups, segments)

        else:  # evaluation only (DeepSpeed allows it); backward and step say so
            raw_groups = _groups_from(model)  # DeepSpeed ignores model_parameters here

            def make(groups, segments):
                return NoOptimizer(groups)

    groups: list[tuple[dict, NamedParams]] = []
    seen: set[int] = set()
    for group in raw_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        named = []
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    "initialize: the optimizer or model_parameters hold a tensor that is not a "
                    "parameter of the model; build them from model.parameters()"
                )
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                named.append((names[id(param)], param))
        groups.append((hyper, named))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"initialize: trainable parameters {missing[:5]} are in no optimizer group; add them "
            "to model_parameters / the optimizer, or set requires_grad=False to freeze them"
        )
    spec = find_optimizer(cfg.optimizer.type) if cfg.optimizer is not None else None
    if client is None and not callable(optimizer) and spec is not None and spec.name == "Muon":
        groups = _split_for_muon(groups, rank)
    return OptimizerPlan(groups, make, client)


def _split_for_muon(
    groups: list[tuple[dict, NamedParams]], rank: int
) -> list[tuple[dict, NamedParams]]:
    """The config's Muon: each group cut into its Muon and AdamW parts, on the parameters'
    real shapes (``ds_shape`` under zero.Init: a placeholder's shape says nothing), said once."""
    split, matrices = muon_groups(groups, full_shape)
    if rank == 0:
        others = sum(len(named) for _, named in groups) - len(matrices)
        shown = ", ".join(matrices[:6]) + (", ..." if len(matrices) > 6 else "")
        logging.getLogger("zerotrain").info(
            f"zerotrain: Muon steps {len(matrices)} matrices ({shown or 'none'}); AdamW steps the "
            f"other {others} parameters (embeddings, heads, norms, biases)"
        )
    return split


def _on_shards(
    optimizer: torch.optim.Optimizer, groups: list[dict], segments: ShardSegments | None
) -> torch.optim.Optimizer:
    """``optimizer``, built over the flat master shards in ``groups``, told which model
    parameters those hold where its update needs per-parameter norms: Lamb's trust ratios,
    whether the Lamb comes from the config or from the user (an instance adopted here, or a
    factory). Per-element optimizers need nothing."""
    if isinstance(optimizer, Lamb) and segments is not None:
        masters = [master for group in groups for master in group["params"]]
        optimizer.set_segments(
            dict(zip(masters, segments.ranges, strict=True)),
            segments.num_segments,
            norm_allreduce=segments.allreduce,
        )
    if isinstance(optimizer, Muon) and segments is not None:
        for index, group in enumerate(optimizer.param_groups):
            if group["use_muon"]:
                optimizer.set_layout(index, segments.matrices(index, group["params"]))
    return optimizer


def _groups_from(parameters) -> list[dict]:
    if isinstance(parameters, nn.Module):
        return [{"params": list(parameters.parameters())}]
    items = list(parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if items and isinstance(items[0], tuple):  # named_parameters()
        return [{"params": [p for _, p in items]}]
    return [{"params": items}]


def scheduler_for(
    lr_scheduler: Any, cfg: ZeroTrainConfig, optimizer: torch.optim.Optimizer, rank: int
) -> Any:
    """The LR scheduler of ``optimizer`` (the torch optimizer that steps the shards): the
    client's scheduler, one its callable builds, the config's section's, or None."""
    if lr_scheduler is not None:
        if cfg.scheduler is not None:
            _client_wins("scheduler", "lr_scheduler", cfg.scheduler.type, lr_scheduler, rank)
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            # Built over the client's optimizer: the one that steps is that very object where
            # it was adopted, else one built like it (same groups, same order)
            repoint_scheduler(lr_scheduler, optimizer)
            return lr_scheduler
        if callable(lr_scheduler):
            return lr_scheduler(optimizer)
        raise TypeError("initialize(lr_scheduler=...): expected a torch LR scheduler or a callable")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)
    return None
