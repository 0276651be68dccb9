"""How a parameter is split over the ranks of a model-parallel group (tensor parallelism's,
zerotrain/tensor_parallel), and put back whole: what checkpoints and the full state dict read.

[Note: fused blocks]
A fused projection (GPT-2's ``c_attn``: q, k and v side by side) is split per block, not as one
tensor: each of its ``chunks`` blocks is cut into ``size`` pieces and rank r holds piece r of
every block, so each rank keeps whole heads of q, k and v. With ``chunks`` 1 it is the plain
Megatron split along ``dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.comm import Communicator

_ATTRIBUTE = "_zerotrain_tp"  # the Split of a split parameter


@dataclass(frozen=True)
class Split:
    """``dim`` of the whole tensor, cut as [Note: fused blocks] says over ``size`` ranks."""

    dim: int
    chunks: int
    size: int

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole tensor ``full``."""
        blocks = full.chunk(self.chunks, self.dim)
        return torch.cat([b.chunk(self.size, self.dim)[rank] for b in blocks], self.dim)

    def full(self, local: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """The whole tensor from every rank's ``local`` piece (collective over ``comm``)."""
        flat = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather(flat, local.contiguous().view(-1))
        return self.join([piece.view(local.shape) for piece in flat.chunk(self.size)])

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from the pieces of ranks 0, 1, ... in order."""
        blocks = [piece.chunk(self.chunks, self.dim) for piece in pieces]
        return torch.cat(
            [torch.cat([b[c] for b in blocks], self.dim) for c in range(self.chunks)], self.dim
        )

    def whole_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape from a piece's."""
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    def to_list(self) -> list[int]:
        """``[dim, chunks, size]``, as a checkpoint manifest records it."""
        return [self.dim, self.chunks, self.size]


def split_parameter(param: nn.Parameter, shard: Split, rank: int) -> None:
    """Keep only ``rank``'s piece of ``param``, in place (the Parameter object stays, so
    optimizer groups built before still hold it), and record how it was split."""
    param.data = shard.local(param.data, rank).contiguous()
    setattr(param, _ATTRIBUTE, shard)


def split_of(param: torch.Tensor) -> Split | None:
    """How ``param`` is split over its model-parallel group; None: every peer holds it whole."""
    return getattr(param, _ATTRIBUTE, None)
