"""What checkpoints need from a training state: the engine provides it; checkpoint/ never
imports the engine (dependencies run one way: zero -> checkpoint -> engine).

The checkpoint sees named parts: the shard groups' state through zero/sharded_state.py (the
pieces of masters and per-element optimizer state by parameter name and range, the optimizer's
groups and scalars, each group's codec and step extensions), the model's untrained entries
through zero/model_state.py, the counters, scheduler, loader and RNG, and of parallelism only
the :class:`ModelLayout`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from zerotrain.comm import Communicator
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.zero import ZeroOptimizer


class ModelLayout(Protocol):
    """What the engine and checkpoints ask of the parallel layout (zerotrain/parallel builds
    it, see [Note: the parallel layout] there): they never name a parallel axis."""

    @property
    def split_rank(self) -> int:
        """Which piece of every split parameter (comm/split.py) this rank holds (0: none)."""
        ...

    @property
    def split_degree(self) -> int:
        """How many pieces a split parameter is cut into (1: none is split)."""
        ...

    @property
    def replica(self) -> int:
        """Which copy of the model this rank's belongs to, where several train apart (a site
        of training across sites); only copy 0's ranks write the model's pieces."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data (what the batch keys count)."""
        ...

    @property
    def sequence_shares(self) -> int:
        """How many ranks hold shares of each sample (1: every rank holds its whole)."""
        ...

    @property
    def whole_model_here(self) -> bool:
        """Whether this rank holds every entry of the model's state dict (whole or a piece):
        False where ranks hold different layers or experts, whose entries are other ranks'."""
        ...

    @property
    def frozen_on_every_rank(self) -> bool:
        """Whether :meth:`full_state` needs every rank's frozen values (it exchanges entries
        only some ranks hold), not one rank's."""
        ...

    def state_source(self, saved_world_size: int) -> int | None:
        """The rank of a checkpoint saved by ``saved_world_size`` ranks whose shard groups'
        state (codecs, step extensions) this rank continues from: its own (None: it had
        none), or, where the sites of training across sites changed in number but not in
        size, the first site's rank at this rank's place in its site."""
        ...

    def micro_batch(self, configured: int) -> int:
        """The samples this rank takes in its next micro-step: ``configured``, or its site's
        share where training across sites splits the batch by the sites' speeds."""
        ...

    def full_state(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state dict from this rank's ``own`` entries, tied keys sharing one
        tensor (collective over every rank)."""
        ...


class TrainingState(Protocol):
    """The members of :class:`zerotrain.engine.ZeroTrainEngine` that save and load use."""

    comm: Communicator
    module: nn.Module
    optimizer: ZeroOptimizer  # its shard group holds the sharded state
    layout: ModelLayout  # which ranks hold which parameters, and which piece
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
