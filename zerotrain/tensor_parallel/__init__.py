"""Tensor parallelism: a model's attention and MLP layers split over a group of ranks
(Megatron-LM, arXiv:1909.08053), composed with ZeRO over the data-parallel group.

``initialize`` applies it when the config's ``tensor_parallel.autotp_size`` is above 1 (see
plan.py for which layers and how); the parameters it splits stay plain tensors, so every ZeRO
stage shards the tensor-parallel pieces like any other parameter.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from zerotrain.comm import Communicator, Mesh
from zerotrain.comm.split import Split, split_of
from zerotrain.config import ZeroTrainConfig
from zerotrain.config.errors import ConfigError
from zerotrain.tensor_parallel.plan import (
    Colwise,
    Divide,
    Rowwise,
    Style,
    apply_plan,
    check_matched,
    is_split,
    parse_style,
    resolve_plan,
    shards_sequence,
)
from zerotrain.zero.init import is_init_partitioned

__all__ = [
    "Colwise",
    "Divide",
    "Rowwise",
    "Style",
    "Split",
    "TensorParallel",
    "is_split",
    "parallelize",
    "parse_style",
    "split_of",
]


class TensorParallel:
    """A model split over the tensor-parallel group ``comm`` by ``plan``; ``summed``: the
    parameters whose gradients are summed over ``comm`` (sequence parallelism's)."""

    def __init__(
        self, comm: Communicator, plan: dict[str, Style], summed: list[nn.Parameter] | None = None
    ):
        self.comm = comm
        self.plan = plan
        self.summed = summed or []

    @property
    def size(self) -> int:
        return self.comm.world_size

    def full_state(
        self, state: dict[str, torch.Tensor], module: nn.Module
    ) -> dict[str, torch.Tensor]:
        """``state`` (keys of ``module.state_dict()``) with every split tensor whole again
        (collective over the group: the split keys are gathered in the module's order; one
        missing from ``state`` on this rank, a frozen value kept on another, takes part with
        the model's own piece and stays out)."""
        out = dict(state)
        for key, tensor in module.state_dict(keep_vars=True).items():
            shard = split_of(tensor)
            if shard is not None:
                whole = shard.full(state.get(key, tensor.detach()), self.comm)
                if key in state:
                    out[key] = whole
        return out


def from_config(
    model: nn.Module, cfg: ZeroTrainConfig, mesh: Mesh, stages: Communicator | None
) -> TensorParallel | None:
    """Split ``model`` over the mesh's tensor-parallel axis as the config's
    ``tensor_parallel`` section says (None: autotp_size 1, nothing split). ``stages``: a
    PipelineModule's pipeline stages (see :func:`parallelize`)."""
    section = cfg.tensor_parallel
    if section.autotp_size == 1:
        for key in ("tp_plan", "sequence_parallel"):
            if getattr(section, key) not in (None, False):
                raise ConfigError(
                    f"tensor_parallel.{key}: given, but autotp_size is 1 (nothing is split); "
                    f"set autotp_size to the tensor-parallel degree or remove {key}"
                )
        return None
    if cfg.lora_fa.enabled:
        raise ConfigError(
            "tensor_parallel.autotp_size: LoRA-FA adapters (lora_fa.enabled) with tensor "
            "parallelism are not supported; use one of them"
        )
    if cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        raise ConfigError(
            "tensor_parallel.autotp_size: Muon orthogonalises whole matrices, and tensor "
            "parallelism splits them over ranks, which zerotrain does not gather for it yet; "
            "use Muon with ZeRO, pipeline or expert parallelism, or another optimizer"
        )
    options = {"sequence_parallel": section.sequence_parallel, "check_inputs": section.check_inputs}
    return parallelize(model, mesh.axis("tp"), section.tp_plan, stages, **options)


def parallelize(
    model: nn.Module,
    comm: Communicator,
    plan: Mapping[str, object] | None = None,
    stages: Communicator | None = None,
    sequence_parallel: bool = False,
    *,
    check_inputs: bool = True,
) -> TensorParallel:
    """Split ``model`` in place over the tensor-parallel group ``comm`` as ``plan`` says (None:
    the automatic plan). Every value is first broadcast from the group's first rank, so that
    the peers cut the same tensors. ``stages``: the pipeline stages of a PipelineModule, each
    holding some of the layers; the plan must match somewhere, not on every stage (decided
    together, so that every rank raises alike). ``sequence_parallel``: see sequence.py."""
    if any(is_init_partitioned(p) for p in model.parameters()):
        raise ConfigError(
            "tensor_parallel.autotp_size: the model was built under zerotrain.zero.Init, whose "
            "partitioned parameters tensor parallelism cannot split; build it without "
            "zero.Init (ZeRO stage 3 still partitions it at initialize)"
        )
    sharding = shards_sequence(plan)
    if sharding and not sequence_parallel:
        raise ConfigError(
            f"tensor_parallel.tp_plan: {sharding[:3]} run on a share of the sequence (torch's "
            "sequence-parallel styles); set tensor_parallel.sequence_parallel: true, or give "
            "ColwiseParallel() / RowwiseParallel() with their default layouts"
        )
    resolved, unmatched = resolve_plan(model, plan)
    matched_any = bool(resolved)
    if stages is not None:
        reports = stages.all_gather_object((matched_any, unmatched))
        matched_any = any(matched for matched, _ in reports)
        unmatched = sorted(set.intersection(*(set(names) for _, names in reports)))
    check_matched(model, matched_any, unmatched, automatic=plan is None)
    for tensor in [*model.parameters(), *model.buffers()]:
        comm.broadcast(tensor.data, src=comm.root)
    summed = apply_plan(model, resolved, comm, sequence_parallel)
    if check_inputs:
        model.register_forward_pre_hook(
            functools.partial(_same_inputs, comm=comm), with_kwargs=True, prepend=True
        )
    return TensorParallel(comm, resolved, summed)


def _same_inputs(module: nn.Module, args: tuple, kwargs: dict, *, comm: Communicator) -> None:
    """The ranks of a tensor-parallel group must run the same batch: each computes a slice of
    the same layers, and the group's collectives would otherwise exchange messages of
    different sizes (gloo aborts the process in C++: "Received data size doesn't match") or,
    with equal shapes, train on different data without a word. One gather of two int64s per
    forward compares the inputs' shapes and dtypes and the sum of their integer tensors (token
    ids); a mismatch is an error on every rank of the group, naming what each got
    (``tensor_parallel.check_inputs: false`` turns it off)."""
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(leaf)]
    signature = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in leaves]
    content = torch.zeros((), dtype=torch.int64, device=comm.device)
    for tensor in leaves:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            content = content + tensor.to(comm.device).sum(dtype=torch.int64)
    shapes = torch.tensor(zlib.crc32(repr(signature).encode()), device=comm.device)
    mine = torch.stack([shapes, content])
    everyone = torch.empty(comm.world_size * 2, dtype=torch.int64, device=comm.device)
    comm.all_gather(everyone, mine, name="tp_input_check")
    if bool((everyone.view(-1, 2) == mine).all()):
        return
    described = comm.all_gather_object((signature, int(content)))
    got = "; ".join(
        f"rank {rank}: {sig}, integer sum {total}" for rank, (sig, total) in enumerate(described)
    )
    raise ValueError(
        f"tensor parallelism: the {comm.world_size} ranks of a tensor-parallel group got "
        f"different inputs ({got}); each group's ranks must run the same batch (shard the data "
        "over the data-parallel ranks only, as the dataloader initialize returns does: "
        "engine.dp_world_size shards, not the world size)"
    )
