"""What the parallel layout applies for long sequences: the sequence axis's checks against the
other axes, the loss and attention of a causal LM under sequence parallelism, and the tiled
MLPs and loss of the config's ``tiled_compute`` section."""

from __future__ import annotations

from typing import Any

from torch import nn

from zerotrain.comm import Communicator, Mesh
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.config.schema import TiledComputeConfig
from zerotrain.sequence.groups import (
    SequenceParallelGroups,
    communicator_of,
    latest,
    remember,
)
from zerotrain.sequence.hf import (
    apply_sequence_parallel,
    is_causal_lm,
    tile_loss,
    tile_mlps,
    unregister_engines,
)


def sequence_group_of(mpu: Any) -> Communicator | None:
    """The sequence-parallel group an mpu made before the engine (DeepSpeed's
    ``register_with_transformers`` returns one), or None."""
    if isinstance(mpu, SequenceParallelGroups):
        return mpu.comm
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_group"):
        return None
    return communicator_of(mpu.get_sequence_parallel_group())


def check_axes(cfg: ZeroTrainConfig, mesh_sizes: dict[str, int]) -> None:
    """Sequence parallelism with the axes it does not compose with yet, refused with the
    reason."""
    sp = mesh_sizes["sp"]
    if sp == 1:
        return
    refused = {
        "pp": "pipeline stages (each stage would exchange a share of the sequence per layer; "
        "not built yet)",
        "ep": "expert parallelism (the experts' token exchange over a share of the sequence "
        "is not built yet)",
    }
    for axis, why in refused.items():
        if mesh_sizes[axis] > 1:
            raise ConfigError(f"sequence_parallel_size: {sp} with {why}; use one of the two")
    if mesh_sizes["tp"] > 1 and cfg.tensor_parallel.sequence_parallel:
        raise ConfigError(
            f"sequence_parallel_size: {sp} with tensor_parallel.sequence_parallel, which cuts "
            "the sequence over the tensor-parallel ranks too; Ulysses already holds a share "
            "of it: set tensor_parallel.sequence_parallel to false"
        )


def apply_long_context(model: nn.Module, cfg: ZeroTrainConfig, mesh: Mesh) -> None:
    """Transform ``model`` in place: a causal LM's loss and attention for the sequence axis
    (when it has more than one rank), then the tiles the config asks for."""
    tiles = cfg.tiled_compute
    sp = mesh.axis("sp")
    # an earlier engine's registration and groups are not this one's
    unregister_engines()
    earlier = latest()
    if earlier is not None and earlier.by_engine:
        remember(None)
    if sp.world_size > 1:
        tp = mesh.sizes["tp"]
        groups = SequenceParallelGroups(sp, mesh.zero, tensor_parallel=tp, by_engine=True)
        remember(groups)  # DeepSpeed's lookups (utils/groups.py)
        if is_causal_lm(model):
            # tensor parallelism left each rank 1/tp of the heads; Ulysses shares those
            apply_sequence_parallel(model, sp, heads_split=tp)
    apply_tiles(model, tiles, sp)


def apply_tiles(model: nn.Module, tiles: TiledComputeConfig, sp: Communicator) -> None:
    """Transform ``model`` in place: its MLPs and its loss over the tiles ``tiles`` asks for,
    the loss averaged over the sequence-parallel group ``sp`` (the planner's model probe runs
    the model so too). ConfigError where it has no gated MLP to tile, ValueError where its loss
    cannot be tiled (not a transformers causal LM)."""
    if tiles.mlp and tile_mlps(model, tiles.mlp_tile_tokens) == 0:
        raise ConfigError(
            f"tiled_compute.mlp: {type(model).__name__} has no gated MLP (a module named *MLP "
            "with gate_proj, up_proj and down_proj) to tile; tile yours with "
            "zerotrain.sequence.TiledMLP, or set it to false"
        )
    if tiles.loss:
        tile_loss(model, sp, tiles.loss_tile_tokens)
