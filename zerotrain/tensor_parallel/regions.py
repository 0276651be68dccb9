"""The two conjugate operators at the edges of a tensor-parallel region (Megatron-LM,
arXiv:1909.08053, §3: ``f`` and ``g``).

A column-parallel layer reads a replicated input and writes a sharded output: its input passes
through :func:`copy_to_region` (identity forward; backward sums the input gradients, each rank
holding only its shard's contribution). A row-parallel layer reads a sharded input and writes
partial sums: its output passes through :func:`reduce_from_region` (forward sums the partials;
backward passes the replicated gradient through). Both run over the tensor-parallel
:class:`~zerotrain.comm.Communicator`, so the traffic is counted and bounded by its timeout.
"""

from __future__ import annotations

import torch

from zerotrain.comm import Communicator


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grad = grads[0].contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads[0], None


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``comm`` (the input of a column-parallel
    layer)."""
    return _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``x`` summed over ``comm``; its gradient unchanged (the output of a row-parallel layer)."""
    return _ReduceFromRegion.apply(x, comm)
