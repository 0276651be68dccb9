"""The two conjugate operators at the edges of a tensor-parallel region (Megatron-LM,
arXiv:1909.08053, §3: ``f`` and ``g``).

A column-parallel layer reads a replicated input and writes a sharded output: its input passes
through :func:`copy_to_region` (identity forward; backward sums the input gradients, each rank
holding only its shard's contribution). A row-parallel layer reads a sharded input and writes
partial sums: its output passes through :func:`reduce_from_region` (forward sums the partials;
backward passes the replicated gradient through). With sequence parallelism (sequence.py) four
more move activations between a share of the sequence and the whole of it. All run over the
tensor-parallel :class:`~zerotrain.comm.Communicator`, so the traffic is counted and bounded by
its timeout.
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


# -- sequence parallelism ([Note: sequence parallelism] in sequence.py) ---------------------------
# Activations are [batch, sequence, ...]; a rank's share of the sequence is its contiguous
# 1/tp of dimension 1, ranks in order.
def _gather(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[b, s/tp, ...] pieces of every rank -> [b, s, ...]."""
    x = x.contiguous()
    pieces = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(pieces.view(-1), x.view(-1))
    return pieces.movedim(0, 1).flatten(1, 2)


def _local(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[b, s, ...] -> this rank's [b, s/tp, ...]."""
    return x.chunk(comm.world_size, dim=1)[comm.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> the sum of this rank's [b, s/tp, ...]."""
    pieces = torch.stack(x.chunk(comm.world_size, dim=1)).contiguous()
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out.view(-1), pieces.view(-1))
    return out


def check_sequence(x: torch.Tensor, comm: Communicator, where: str) -> None:
    if x.dim() < 2 or x.shape[1] % comm.world_size:
        raise ValueError(
            f"sequence parallelism: {where} got activations of shape {tuple(x.shape)}; their "
            f"sequence (dimension 1) must divide into the {comm.world_size} tensor-parallel "
            "ranks: pad the sequences to a multiple, or turn tensor_parallel.sequence_parallel "
            "off"
        )


class _SequenceRegion(torch.autograd.Function):
    """``forward(x, comm)`` in forward, ``backward(grad, comm)`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, forward, backward) -> torch.Tensor:
        ctx.comm, ctx.backward_op = comm, backward
        return forward(x, comm)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return ctx.backward_op(grads[0], ctx.comm), None, None, None


def gather_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Into a tensor-parallel region: the whole sequence for every rank; backward sums the
    ranks' gradients and keeps this rank's share (the column-parallel layers' input)."""
    return _SequenceRegion.apply(x, comm, _gather, _reduce_scatter)


def reduce_scatter_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Out of a tensor-parallel region: the row-parallel layer's partial sums summed, each rank
    keeping its share of the sequence; backward gathers the gradient."""
    return _SequenceRegion.apply(x, comm, _reduce_scatter, _gather)


def scatter_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Into the sequence-parallel part of the model: each rank keeps its share of a replicated
    activation; backward gathers the shares' gradients."""
    return _SequenceRegion.apply(x, comm, _local, _gather)


def gather_sequence(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Out of the sequence-parallel part of the model: the whole sequence, replicated; the
    gradient is the same on every rank, so backward keeps this rank's share."""
    return _SequenceRegion.apply(x, comm, _gather, _local)
