"""The Lightning Trainer on zerotrain: a native strategy, with no DeepSpeed involved.

    trainer = Trainer(strategy=ZeroTrainStrategy(stage=3), accelerator="cpu", devices=2,
                      accumulate_grad_batches=4, gradient_clip_val=1.0, precision="bf16-mixed")
    trainer = Trainer(strategy="zerotrain_stage_2_offload", ...)   # registered names

The strategy is the Trainer's DDP strategy (launching, process group, data sharding) with the
LightningModule and the optimizer from its ``configure_optimizers`` set up by
:func:`zerotrain.initialize`; the engine is ``trainer.model``. The Trainer's own settings become
the config's where the config leaves them out, as for DeepSpeed's strategy:
``accumulate_grad_batches`` is ``gradient_accumulation_steps`` (the engine accumulates, so the
Trainer steps every batch), ``gradient_clip_val`` is ``gradient_clipping`` by norm (none when
unset, as with Lightning's other strategies), ``precision`` "bf16-mixed" / "16-mixed" is the
config's ``bf16`` / ``fp16``. A learning-rate scheduler from ``configure_optimizers`` stays
with Lightning (its interval and frequency). Checkpoints (``ModelCheckpoint``,
``trainer.save_checkpoint``, ``fit(ckpt_path=...)``) are zerotrain checkpoint directories: every
rank writes its shard, and the Trainer's own state rides along as the client state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, cast

from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig

import zerotrain
from zerotrain.engine import ZeroTrainEngine
from zerotrain.integrations.lightning.config import (
    CHECKPOINT_TAG,
    Configured,
    take_precision,
)


class _EnginePrecision(Precision):
    """Backward and step through the engine; zerotrain does the casting and the clipping."""

    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        # automatic optimization divided the loss by accumulate_grad_batches already: the
        # engine must not divide it again (manual optimization hands over the loss as is)
        kwargs.setdefault("scale_wrt_gas", not model.automatic_optimization)
        model.trainer.model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise RuntimeError(
                "zerotrain's Lightning strategy: training_step returned None (a skipped "
                "backward), which the engine's step does not support; return the loss"
            )
        return model.trainer.model.step()

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """The engine clips by the global norm (the config's ``gradient_clipping``)."""


class ZeroTrainStrategy(Configured, DDPStrategy):
    """The Lightning Trainer's strategy for zerotrain (see the module docstring)."""

    strategy_name = "zerotrain"

    def __init__(self, *args: Any, **kwargs: Any):
        """See :class:`~zerotrain.integrations.lightning.config.Configured`."""
        super().__init__(*args, **kwargs)
        self._engines: dict[int, ZeroTrainEngine] = {}  # id(LightningModule) -> its engine

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._take_trainer_settings(trainer)
        module = self.lightning_module
        built = self._engines.get(id(module))
        if built is not None:  # fit then validate (or fit again): the model is in its engine
            self.model = built
            if trainer.state.fn == TrainerFn.FITTING:
                self.optimizers = [cast(Any, built.optimizer)]  # a ZeroOptimizer, as torch's
            return
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise RuntimeError(
                    "zerotrain's Lightning strategy: configure_optimizers must return one "
                    f"optimizer and at most one scheduler, got {len(optimizers)} and "
                    f"{len(schedulers)}"
                )
            scheduler = schedulers[0] if schedulers else None
            engine, *_ = zerotrain.initialize(
                model=module,
                optimizer=optimizers[0],
                lr_scheduler=scheduler.scheduler if scheduler else None,
                config=self.config,
            )
            # the ZeRO optimizer at every stage; a ZeroOptimizer quacks as torch's
            self.optimizers = [cast(Any, engine.optimizer)]
            self.lr_scheduler_configs = self._scheduler_to_lightning(engine, scheduler)
        else:  # validate / test / predict: no optimizer
            engine, *_ = zerotrain.initialize(model=module, config=self.config)
        self.model = self._engines[id(module)] = engine
        self.barrier()

    def _take_trainer_settings(self, trainer) -> None:
        config = self.config
        config.setdefault("gradient_accumulation_steps", trainer.accumulate_grad_batches)
        config.setdefault("gradient_clipping", float(trainer.gradient_clip_val or 0.0))
        if trainer.gradient_clip_algorithm == "value":
            raise RuntimeError(
                "zerotrain's Lightning strategy clips by the global norm; "
                "gradient_clip_algorithm='value' is not supported"
            )
        take_precision(config, str(self.precision_plugin.precision))
        self.precision_plugin = _EnginePrecision()

    @staticmethod
    def _scheduler_to_lightning(
        engine: ZeroTrainEngine, scheduler: LRSchedulerConfig | None
    ) -> list[LRSchedulerConfig]:
        """The engine's scheduler (rebound to its optimizer), stepped by Lightning."""
        rebound = engine.lr_scheduler
        if rebound is None:
            return []
        engine.lr_scheduler = None  # Lightning steps it, at its interval
        if scheduler is None:
            return [LRSchedulerConfig(rebound, interval="step")]
        scheduler.scheduler = rebound
        return [scheduler]

    def setup_optimizers(self, trainer) -> None:
        """Built with the engine in :meth:`setup`."""
        self.optimizers, self.lr_scheduler_configs = [], []

    def _setup_model(self, model):  # pyrefly: ignore[bad-override] (no DDP wrapper here)
        return model

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @contextmanager
    def model_sharded_context(self):
        """At stage 3, ``configure_model`` builds the model already partitioned."""
        with self.partitioned_init():
            yield

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("zerotrain's Lightning strategy: storage_options is not supported")
        filepath = self.broadcast(str(filepath))
        client = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        self._engine().save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client = self._engine().load_checkpoint(
            str(checkpoint_path),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=False,  # Lightning restores its schedulers itself
            load_module_strict=self.lightning_module.strict_loading,
        )
        if client is None:
            raise RuntimeError(
                f"zerotrain's Lightning strategy: no checkpoint at {checkpoint_path}"
            )
        return client

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The engine loaded the weights in :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded the optimizer in :meth:`load_checkpoint`."""

    def _engine(self) -> ZeroTrainEngine:
        if not isinstance(self.model, ZeroTrainEngine):
            raise RuntimeError("zerotrain's Lightning strategy: the engine is not set up yet")
        return self.model


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "zerotrain" not in StrategyRegistry:
        ZeroTrainStrategy.register_strategies(StrategyRegistry)


_register()
