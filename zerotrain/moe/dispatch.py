"""Tokens to their experts and back over the expert-parallel group, as the gate routed them.

[Note: dispatch by units]
A *unit* is what one rank sends another for one token: the token's hidden state, and for each
of its choices that the receiving rank's experts take, the local expert and the weight. Without
deduplication every kept choice is a unit of its own. With it (HierMoE's token deduplication),
a token whose two top-2 choices are experts of the same rank goes there once, as one unit of
two slots: that saves a hidden state on the way there and one on the way back.

Units are sent grouped by destination rank (all-to-all with the counts exchanged first, so only
routed tokens travel: no capacity padding, and no capacity at all when nothing is dropped). The
receiver runs each local expert on the rows whose slots name it, multiplies the outputs by the
slots' weights (which came with the units) and sums a unit's slots, so one vector per unit goes
back; the sender adds it to the token's output. That is DeepSpeed's combine, sum over choices of
weight x expert(token), with the products formed where the expert ran. Every local expert runs,
on no rows if none were routed to it, so every expert parameter gets a gradient in every
backward. The all-to-alls are differentiable (backward: the same exchange reversed), and are
counted as ``all_to_all`` (the hidden states) and ``all_to_all_metadata`` (the units per rank,
and each unit's slots: a weight and an expert, as fp32, k of them with deduplication, one
without).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerotrain.comm import Communicator
from zerotrain.moe.gating import Routing

METADATA = "all_to_all_metadata"  # the counts and the slots, counted apart from hidden states
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (local expert, rows) -> outputs


class _AllToAll(torch.autograd.Function):
    """``Communicator.all_to_all`` with its reverse as the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, out_splits: list[int], in_splits: list[int], name):
        ctx.comm, ctx.splits, ctx.name = comm, (out_splits, in_splits), name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, name=name)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (grad,) = grads
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, name=ctx.name)
        return back, None, None, None, None


def exchange(
    x: torch.Tensor,
    comm: Communicator | None,
    out_splits: list[int],
    in_splits: list[int],
    name: str = "all_to_all",
) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``x`` to rank r, rank r's rows back (differentiable; ``comm``
    None: this rank alone), counted as ``name``."""
    if comm is None or comm.world_size == 1:
        return x
    return _AllToAll.apply(x, comm, out_splits, in_splits, name)


def dispatch_combine(
    x: torch.Tensor,
    routing: Routing,
    experts: ExpertFn,
    num_local: int,
    comm: Communicator | None,
    dedup: bool = False,
) -> torch.Tensor:
    """Each token's output, the sum over its kept choices of weight x expert(token): ``x`` (S,
    d) on every rank of ``comm`` (None: this rank alone, every expert local), expert e on rank
    e // ``num_local`` (see [Note: dispatch by units])."""
    tokens, k = routing.experts.shape
    ep = 1 if comm is None else comm.world_size
    choice = torch.arange(k, device=x.device).expand(tokens, k)[routing.kept]
    token = torch.arange(tokens, device=x.device)[:, None].expand(tokens, k)[routing.kept]
    expert = routing.experts[routing.kept]
    dest = expert // num_local
    width = k if dedup else 1
    # units sorted by destination, then token (then choice)
    key = dest * tokens + token if dedup else (dest * tokens + token) * k + choice
    units, unit_of = torch.unique(key, return_inverse=True)
    unit_dest = units // (tokens if dedup else tokens * k)
    unit_token = units // (1 if dedup else k) % tokens
    slot = choice if dedup else torch.zeros_like(choice)
    ids = torch.full((len(units), width), -1.0, device=x.device)
    ids[unit_of, slot] = (expert % num_local).float()
    weights = routing.weights.new_zeros(len(units), width)
    weights = weights.index_put((unit_of, slot), routing.weights[routing.kept])

    send = torch.bincount(unit_dest, minlength=ep)
    recv = send
    if comm is not None and ep > 1:
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, name=METADATA)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    rows = exchange(x[unit_token], comm, recv_splits, send_splits)
    slots = exchange(torch.cat([weights, ids], dim=1), comm, recv_splits, send_splits, METADATA)
    slot_weights, slot_experts = slots[:, :width], slots[:, width:].detach().long()

    out_rows = rows.new_zeros(rows.shape)
    for local in range(num_local):
        row, column = (slot_experts == local).nonzero(as_tuple=True)
        y = experts(local, rows[row])
        weighted = y * slot_weights[row, column, None].to(y.dtype)
        out_rows = out_rows.index_add(0, row, weighted.to(out_rows.dtype))
    back = exchange(out_rows, comm, send_splits, recv_splits)
    return x.new_zeros(x.shape).index_add(0, unit_token, back.to(x.dtype))
