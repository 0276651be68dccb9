"""Lightning Fabric on zerotrain: a native strategy, with no DeepSpeed involved.

    fabric = Fabric(strategy=ZeroTrainStrategy(stage=3), accelerator="cpu", devices=2)
    fabric = Fabric(strategy="zerotrain_stage_2_offload", ...)   # registered names, below
    model, optimizer = fabric.setup(model, optimizer)            # zerotrain.initialize
    loss = model(batch); fabric.backward(loss); optimizer.step()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})

The strategy is Fabric's DDP strategy (its launching, process group and data sharding) with the
model and optimizer set up by :func:`zerotrain.initialize`: ``fabric.backward`` is
``engine.backward`` and ``optimizer.step()`` is ``engine.step()``, which counts micro-steps
against the config's ``gradient_accumulation_steps`` (call it every iteration, as with
DeepSpeed). Checkpoints are zerotrain's (``engine.save_checkpoint``: every rank writes its
shard; the rest of the state given to ``fabric.save`` is the client state). Precision comes from
``precision=``: ``"bf16-mixed"`` and ``"16-mixed"`` become the config's ``bf16`` / ``fp16``
sections (zerotrain's master weights and loss scaling), as DeepSpeed's strategy does.

Registered with Fabric at import (config.REGISTERED): ``zerotrain``,
``zerotrain_stage_1``/``_2``/``_3`` and ``zerotrain_stage_2_offload`` /
``zerotrain_stage_3_offload`` (optimizer, and at stage 3 parameters, in host memory).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from torch import nn

import zerotrain
from zerotrain.engine import ZeroTrainEngine
from zerotrain.integrations.lightning.config import (
    CHECKPOINT_TAG,
    Configured,
    take_precision,
    zero_stage,
)


class ZeroTrainStrategy(Configured, DDPStrategy):
    """Fabric's strategy for zerotrain (see the module docstring)."""

    strategy_name = "zerotrain"

    def __init__(self, *args: Any, **kwargs: Any):
        """See :class:`~zerotrain.integrations.lightning.config.Configured`."""
        super().__init__(*args, **kwargs)
        self._engine: ZeroTrainEngine | None = None  # the model set up last
        self._engine_of: dict[int, ZeroTrainEngine] = {}  # id(optimizer) -> its engine

    # -- precision -------------------------------------------------------------------------------
    def _take_precision(self) -> None:
        """Move Fabric's precision choice into the config; zerotrain then does the casting."""
        take_precision(self.config, str(self.precision.precision))
        self.precision = Precision()  # no autocast or casting of its own on top of zerotrain's

    # -- setup -----------------------------------------------------------------------------------
    @property
    def model(self) -> ZeroTrainEngine | None:
        """The engine of the model set up last (``None`` before ``fabric.setup``)."""
        return self._engine

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[ZeroTrainEngine, list, Any]:
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeroTrainStrategy: set up one optimizer with the model, got {len(optimizers)}"
            )
        engine, optimizer, scheduler = self._initialize(module, optimizers[0], scheduler)
        return engine, [optimizer], scheduler

    # pyrefly: ignore[bad-override] (an engine, not DDP's wrapper: Lightning's own DeepSpeed
    # strategy overrides DDPStrategy the same way)
    def setup_module(self, module: nn.Module) -> ZeroTrainEngine:
        """A model without an optimizer (evaluation, inference)."""
        return self._initialize(module, None, None)[0]

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise NotImplementedError(
            "ZeroTrainStrategy: set up the model and its optimizer together, "
            "`model, optimizer = fabric.setup(model, optimizer)`: zerotrain partitions the "
            "optimizer over the model's parameters"
        )

    def _initialize(self, module: nn.Module, optimizer, scheduler):
        self._take_precision()
        engine, _, _, scheduler = zerotrain.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=self.config
        )
        # the ZeRO optimizer at every stage (initialize returns DeepSpeed's choice: at stage 0
        # the torch optimizer), which save and load recognise as the engine's
        zero_optimizer = engine.optimizer
        self._engine = self._engine_of[id(zero_optimizer)] = engine
        return engine, zero_optimizer, scheduler

    def module_sharded_context(self) -> AbstractContextManager:
        """At stage 3, ``fabric.init_module()`` builds the model already partitioned."""
        return self.partitioned_init()

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if zero_stage(self.config) == 3:
            return self.module_sharded_context()
        return super().module_init_context(empty_init)

    # -- a training step -------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args, **kwargs) -> None:
        engine = module if isinstance(module, ZeroTrainEngine) else self._require_engine()
        engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """The step of the optimizer's engine (``engine.step()``: it steps at the accumulation
        boundary and counts micro-steps otherwise)."""
        if kwargs.get("closure") is not None:
            raise NotImplementedError("ZeroTrainStrategy: optimizer.step(closure) is not supported")
        engine = self._engine_of.get(id(optimizer))
        return (engine or self._require_engine()).step()

    def clip_gradients_norm(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            "ZeroTrainStrategy: clipping is the config's `gradient_clipping` (applied by the "
            "engine over the global norm of the sharded gradients), not fabric.clip_gradients"
        )

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "ZeroTrainStrategy: clipping by value is not supported; set `gradient_clipping` "
            "(by norm) in the config"
        )

    def _require_engine(self) -> ZeroTrainEngine:
        if self._engine is None:
            raise RuntimeError("ZeroTrainStrategy: no model set up yet; call fabric.setup(...)")
        return self._engine

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(
        self, path, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        """zerotrain's checkpoint directory at ``path``: the engine (model, optimizer, scheduler)
        and the rest of ``state`` as its client state."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                "ZeroTrainStrategy.save_checkpoint: storage_options and filter are not supported"
            )
        engine = self._engine_in(state)
        path = self.broadcast(str(path))
        client = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        client = self._convert_stateful_objects_in_state(client, filter={})
        engine.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client)

    def load_checkpoint(
        self, path, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the engine in ``state`` and, in place, the other entries that the client
        state holds; returns the client state entries ``state`` did not ask for."""
        if not isinstance(state, dict):
            raise ValueError(
                "ZeroTrainStrategy.load_checkpoint: pass the state as a dict holding the model, "
                "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        engine = self._engine_in(state)
        wants_optimizer = any(v is engine.optimizer for v in state.values())
        _, client = engine.load_checkpoint(
            str(path),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=wants_optimizer,
            load_module_strict=strict,
        )
        if client is None:
            raise RuntimeError(f"ZeroTrainStrategy: no zerotrain checkpoint at {path}")
        rest = {}
        for key, value in client.items():
            target = state.get(key)
            if target is engine or target is engine.optimizer:
                continue
            if key in state and hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            elif key in state:
                state[key] = value
            else:
                rest[key] = value
        return rest

    def _engine_in(self, state: dict[str, Any]) -> ZeroTrainEngine:
        engines = [v for v in state.values() if isinstance(_unwrap(v), ZeroTrainEngine)]
        if len(engines) != 1:
            raise ValueError(
                f"ZeroTrainStrategy: the checkpoint state must hold exactly one model set up by "
                f"fabric.setup, found {len(engines)}"
            )
        return _unwrap(engines[0])


def _unwrap(value: Any) -> Any:
    """Fabric's wrappers hold the engine as ``_forward_module``."""
    return getattr(value, "_forward_module", value)


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "zerotrain" not in STRATEGY_REGISTRY:
        ZeroTrainStrategy.register_strategies(STRATEGY_REGISTRY)


_register()
