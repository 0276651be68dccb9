"""The all-to-all of Ulysses: every rank cuts a tensor into ``sp`` pieces along one dimension,
sends piece r to rank r, and joins what it receives along another dimension, in rank order.
With the heads cut and the sequence joined, a rank that held 1/sp of the tokens of every head
holds every token of 1/sp of the heads; the inverse exchange goes back. Its gradient is the
inverse exchange of the gradient, so autograd sees one differentiable operation."""

from __future__ import annotations

import torch

from zerotrain.comm import Communicator

NAME = "sequence_all_to_all"  # how Communicator.stats counts it


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, scatter: int, gather: int):
        ctx.comm, ctx.scatter, ctx.gather = comm, scatter, gather
        return _exchange(x, comm, scatter, gather)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return _exchange(grads[0], ctx.comm, ctx.gather, ctx.scatter), None, None, None


def _exchange(x: torch.Tensor, comm: Communicator, scatter: int, gather: int) -> torch.Tensor:
    world = comm.world_size
    if world == 1:
        return x
    if x.shape[scatter] % world:
        raise ValueError(
            f"sequence parallelism: dimension {scatter} of a {tuple(x.shape)} tensor does not "
            f"divide into the {world} sequence-parallel ranks"
        )
    send = torch.stack(x.chunk(world, dim=scatter))  # [world, *piece], contiguous
    received = torch.empty_like(send)
    comm.all_to_all(received, send, name=NAME)
    return torch.cat(received.unbind(0), dim=gather)


def sequence_all_to_all(
    x: torch.Tensor, comm: Communicator, *, scatter: int, gather: int
) -> torch.Tensor:
    """``x`` cut along dimension ``scatter`` over the ranks of ``comm``, the pieces received
    joined along ``gather`` (rank order); differentiable. Dimensions count from the front."""
    scatter, gather = scatter % x.dim(), gather % x.dim()
    return _AllToAll.apply(x, comm, scatter, gather)
