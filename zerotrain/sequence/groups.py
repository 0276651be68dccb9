"""The sequence-parallel group as DeepSpeed's ``mpu``: what
``UlyssesSPAttentionHF.register_with_transformers`` returns and ``initialize(mpu=...)`` takes.

A group is sp consecutive ranks (DeepSpeed's ``parallel_state_sp`` places them so, and so does
zerotrain's mesh: comm/mesh.py); the ranks holding the same parameters are the data-parallel
ranks times these (``get_sequence_data_parallel_*``). zerotrain passes the object explicitly;
only DeepSpeed's module-level lookups (``deepspeed.utils.groups._get_sequence_parallel_*``,
which Accelerate and the HF Trainer call) read the groups made last (:func:`latest`).
"""

from __future__ import annotations

from typing import Any

from zerotrain.comm import Communicator, get_world_group


def communicator_of(group: Any) -> Communicator:
    """``group`` as a Communicator (a torch process group, or one already; None: the world)."""
    return group if isinstance(group, Communicator) else Communicator(group)


class SequenceParallelGroups:
    """DeepSpeed's sequence-parallel ``mpu`` over ``comm`` (this rank's sequence-parallel
    group; ``replicas``: the ranks holding the same parameters, data-parallel x sequence-
    parallel). Its model-parallel getters answer the tensor-parallel degree (1 for the groups a
    registration makes): sequence parallelism splits no parameter, so ``initialize`` must not
    read an mpu's sequence-parallel size as tensor parallelism."""

    def __init__(
        self,
        comm: Communicator,
        replicas: Communicator,
        *,
        tensor_parallel: int = 1,
        by_engine: bool = False,
    ):
        """``tensor_parallel``: the degree an engine's layout split layers by (an mpu made
        before the engine has none); ``by_engine``: made by ``initialize``, not the caller."""
        self.comm = comm
        self.replicas = replicas
        self.tensor_parallel = tensor_parallel
        self.by_engine = by_engine

    @classmethod
    def make(cls, sequence_parallel_size: int) -> SequenceParallelGroups:
        """The groups of ``sequence_parallel_size`` consecutive ranks of the default process
        group (collective: every rank calls it)."""
        world = Communicator()
        sp = sequence_parallel_size
        if sp < 1 or world.world_size % sp:
            raise ValueError(
                f"sequence_parallel_size {sp} must be at least 1 and divide the world size "
                f"{world.world_size}"
            )
        ranks = range(world.world_size)
        comm = world.split([list(ranks[i : i + sp]) for i in range(0, len(ranks), sp)])
        made = cls(comm, world)
        remember(made)
        return made

    # -- DeepSpeed's parallel_state_sp -------------------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        return self.comm.group or get_world_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self.comm.world_size

    def get_sequence_parallel_rank(self) -> int:
        return self.comm.rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.replicas.group or get_world_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.replicas.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.replicas.rank

    def get_data_parallel_world_size(self) -> int:
        """The ranks that see different data: those holding the same parameters over the
        sequence-parallel degree."""
        return self.replicas.world_size // self.comm.world_size

    def get_model_parallel_world_size(self) -> int:
        return self.tensor_parallel

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor_parallel

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


_latest: SequenceParallelGroups | None = None


def remember(groups: SequenceParallelGroups | None) -> SequenceParallelGroups | None:
    """Record ``groups`` as the process's sequence-parallel groups for DeepSpeed's lookups
    (None: there are none)."""
    global _latest
    _latest = groups
    return groups


def latest() -> SequenceParallelGroups | None:
    """The groups made last (by a registration or an engine's layout), or None."""
    return _latest
