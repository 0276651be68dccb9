"""What checkpoints need from a training state: the engine provides it; checkpoint/ never
imports the engine (dependencies run one way: zero -> checkpoint -> engine).

The sharded state itself is read and written piecewise through the shard group: which
elements of which parameter each master tensor holds (``group.master_pieces``), and the
tensors behind them (``group.store.state_tensor``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from zerotrain.comm import Communicator
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.tensor_parallel import TensorParallel
    from zerotrain.zero import ZeroOptimizer


class TrainingState(Protocol):
    """The members of :class:`zerotrain.engine.ZeroTrainEngine` that save and load use."""

    comm: Communicator
    module: nn.Module
    optimizer: ZeroOptimizer  # its shard group holds the sharded state
    tensor_parallel: TensorParallel | None  # the split parameters are saved as their pieces
    expert_comm: Communicator | None  # ranks holding other experts (None: each holds all)
    lr_scheduler: Any  # anything with state_dict / load_state_dict, or None
    training_dataloader: Any  # resumable when it has state_dict / load_state_dict
    zerotrain_config: ZeroTrainConfig  # the checkpoint section: tag validation, retention
    global_steps: int
    global_samples: int
    micro_steps: int

    @property
    def world_size(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def training_counters(self) -> dict[str, Any]:
        """Steps, samples, skipped steps, the last gradient norm, the loss scaler."""
        ...

    def restore_training_counters(self, counters: dict[str, Any], loss_scaler: bool) -> None:
        """Resume the counters (the loss scaler's state only if ``loss_scaler``)."""
        ...
