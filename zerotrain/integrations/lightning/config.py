"""What the Fabric and Trainer strategies share: the zerotrain config they build, and how a
Lightning precision setting becomes zerotrain's."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import zerotrain
from zerotrain.comm import default_timeout
from zerotrain.config import ConfigError

CHECKPOINT_TAG = "checkpoint"  # the tag of the checkpoint inside a Lightning checkpoint path

_PRECISION_SECTIONS = {
    "32-true": {},
    "32": {},
    "bf16-mixed": {"bf16": {"enabled": True}},
    "16-mixed": {"fp16": {"enabled": True}},
}


def strategy_config(
    config: dict | str | Path | None,
    stage: int | None,
    offload_optimizer: bool,
    offload_parameters: bool,
) -> dict:
    """A copy of ``config`` (a dict or a JSON path) with ``stage`` and the offload switches
    filled in where it leaves them out."""
    if config is None:
        out: dict = {}
    elif isinstance(config, dict):
        out = json.loads(json.dumps(config))  # a copy the strategy may fill in
    else:
        out = json.loads(Path(config).read_text())
    zero = out.setdefault("zero_optimization", {})
    if stage is not None:
        zero.setdefault("stage", stage)
    if offload_optimizer:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if offload_parameters:
        zero.setdefault("offload_param", {"device": "cpu"})
    out.setdefault("train_micro_batch_size_per_gpu", 1)  # for the throughput line
    return out


def take_precision(config: dict, precision: str) -> None:
    """Lightning's ``precision=`` into ``config``: zerotrain does the casting (fp32 masters,
    loss scaling), so the strategy then drops Lightning's own precision plugin."""
    if precision not in _PRECISION_SECTIONS:
        raise ConfigError(
            f"zerotrain's Lightning strategy: precision={precision!r} is not supported; use "
            "'32-true', 'bf16-mixed' or '16-mixed' (zerotrain keeps fp32 master weights)"
        )
    for key, section in _PRECISION_SECTIONS[precision].items():
        config.setdefault(key, section)


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {
    "zerotrain": ("zerotrain, the config's stage", {}),
    "zerotrain_stage_1": ("zerotrain ZeRO-1", {"stage": 1}),
    "zerotrain_stage_2": ("zerotrain ZeRO-2", {"stage": 2}),
    "zerotrain_stage_3": ("zerotrain ZeRO-3", {"stage": 3}),
    "zerotrain_stage_2_offload": (
        "zerotrain ZeRO-2, optimizer in host memory",
        {"stage": 2, "offload_optimizer": True},
    ),
    "zerotrain_stage_3_offload": (
        "zerotrain ZeRO-3, optimizer and parameters in host memory",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
}
"""The strategy names registered with Fabric and the Trainer: description, constructor args."""


def register_all(strategy_registry: Any, strategy: type) -> None:
    """Register ``strategy`` under every name of :data:`REGISTERED`."""
    for name, (description, init) in REGISTERED.items():
        strategy_registry.register(name, strategy, description=description, **init)


class Configured:
    """The constructor both strategies share (a mixin ahead of Lightning's DDP strategy)."""

    config: dict

    def __init__(
        self,
        config: dict | str | Path | None = None,
        *,
        stage: int | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        **ddp_options: Any,
    ):
        """``config``: a zerotrain (DeepSpeed-style) config dict or JSON path; ``stage`` and the
        offload switches fill in its ``zero_optimization`` where the config leaves them out.
        The collective timeout is zerotrain's (:func:`zerotrain.comm.default_timeout`), not
        Lightning's 30 minutes, unless ``timeout=`` is passed."""
        ddp_options.setdefault("timeout", default_timeout())
        super().__init__(**ddp_options)
        self.config = strategy_config(config, stage, offload_optimizer, offload_parameters)

    def partitioned_init(self) -> AbstractContextManager:
        """Where the model is built: at stage 3 already partitioned (``zerotrain.zero.Init``)."""
        if zero_stage(self.config) == 3:
            return zerotrain.zero.Init(config_dict_or_path=self.config)
        return nullcontext()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's hook: the names of :data:`REGISTERED`."""
        register_all(strategy_registry, cls)
