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

[Note: chunks in flight]
With ``moe.overlap_chunks`` C > 1 (FSMoE's pipelining), a layer's tokens are cut into C parts
by position. Every part's tokens are sent at once (asynchronous all-to-alls, in part order on
every rank); then each part's experts run as soon as its tokens arrived, and its outputs start
back while the next part's experts run. Backward mirrors it without extra code: each exchange
is a start and a wait (:class:`Exchange`), the wait's backward starts the reverse exchange and
the start's backward completes it, so autograd runs other parts' expert backwards in between.
Autograd runs the graph in one order on every rank, which keeps the collectives in one order.
The units are those of one exchange, so the bytes are the same, plus a count per part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from zerotrain.comm import Communicator, PendingOp
from zerotrain.moe.gating import Routing

METADATA = "all_to_all_metadata"  # the counts and the slots, counted apart from hidden states
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (local expert, rows) -> outputs


class _Transfer:
    """One all-to-all in flight and its reverse in backward: what the start and the wait of
    an :class:`Exchange` share."""

    def __init__(self, comm: Communicator, out_splits: list[int], in_splits: list[int], name: str):
        self.comm, self.out_splits, self.in_splits, self.name = comm, out_splits, in_splits, name
        self.op: PendingOp | None = None
        self.back: torch.Tensor | None = None  # the reverse exchange's buffer, in backward


class _Start(torch.autograd.Function):
    """Launch the exchange (forward); complete the reverse one (backward)."""

    @staticmethod
    def forward(ctx, x, transfer: _Transfer):
        ctx.transfer = transfer
        out = x.new_empty((sum(transfer.out_splits), *x.shape[1:]))
        transfer.op = transfer.comm.all_to_all(
            out, x.contiguous(), transfer.out_splits, transfer.in_splits,
            async_op=True, name=transfer.name,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        transfer = ctx.transfer
        assert transfer.op is not None and transfer.back is not None  # _Wait's backward ran
        transfer.op.wait()
        back, transfer.op, transfer.back = transfer.back, None, None
        return back, None


class _Wait(torch.autograd.Function):
    """Complete the exchange (forward); launch the reverse one (backward), completed by the
    start's backward: what autograd runs in between overlaps it."""

    @staticmethod
    def forward(ctx, out, transfer: _Transfer):
        ctx.transfer = transfer
        assert transfer.op is not None  # launched by _Start
        transfer.op.wait()
        transfer.op = None  # its work holds the rows sent: free them now, not in the backward
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (grad,) = grads
        transfer = ctx.transfer
        transfer.back = grad.new_empty((sum(transfer.in_splits), *grad.shape[1:]))
        transfer.op = transfer.comm.all_to_all(
            transfer.back, grad.contiguous(), transfer.in_splits, transfer.out_splits,
            async_op=True, name=transfer.name,
        )  # fmt: skip
        return grad, None  # unused: the start's backward returns the reverse exchange's


class Exchange:
    """An all-to-all of rows, started now and completed by :meth:`wait` (differentiable:
    backward runs the reverse exchange, started and completed at the mirror places)."""

    def __init__(
        self,
        x: torch.Tensor,
        comm: Communicator | None,
        out_splits: list[int],
        in_splits: list[int],
        name: str = "all_to_all",
    ):
        self._transfer = None
        self._out = x  # this rank alone: nothing to send
        if comm is not None and comm.world_size > 1:
            self._transfer = _Transfer(comm, out_splits, in_splits, name)
            self._out = _Start.apply(x, self._transfer)

    def wait(self) -> torch.Tensor:
        """Rank r's rows, in rank order."""
        if self._transfer is None:
            return self._out
        return _Wait.apply(self._out, self._transfer)


def dispatch_combine(
    x: torch.Tensor,
    routing: Routing,
    experts: ExpertFn,
    num_local: int,
    comm: Communicator | None,
    dedup: bool = False,
    chunks: int = 1,
) -> torch.Tensor:
    """Each token's output, the sum over its kept choices of weight x expert(token): ``x`` (S,
    d) on every rank of ``comm`` (None: this rank alone, every expert local), expert e on rank
    e // ``num_local`` (see [Note: dispatch by units]); the tokens in ``chunks`` parts whose
    exchanges overlap the others' expert compute (see [Note: chunks in flight])."""
    tokens, k = routing.experts.shape
    ep = 1 if comm is None else comm.world_size
    choice = torch.arange(k, device=x.device).expand(tokens, k)[routing.kept]
    token = torch.arange(tokens, device=x.device)[:, None].expand(tokens, k)[routing.kept]
    expert = routing.experts[routing.kept]
    weight = routing.weights[routing.kept]
    bounds = [tokens * c // chunks for c in range(chunks + 1)]
    plans = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        mine = (token >= lo) & (token < hi)
        plans.append(
            _plan(
                token[mine], choice[mine], expert[mine], weight[mine], tokens, k, num_local, dedup
            )
        )
    send = torch.stack([torch.bincount(plan.dest, minlength=ep) for plan in plans], dim=1)
    recv = send  # (ranks, chunks): units to (from) each rank
    if comm is not None and ep > 1:
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, name=METADATA)
    sends, recvs = send.t().tolist(), recv.t().tolist()
    # every chunk's tokens and slots on their way, then each chunk's experts as it arrives
    arriving = [
        (
            Exchange(x[plan.token], comm, recv_splits, send_splits),
            Exchange(plan.slots, comm, recv_splits, send_splits, METADATA),
        )
        for plan, send_splits, recv_splits in zip(plans, sends, recvs, strict=True)
    ]
    returning = []
    for (rows, slots), send_splits, recv_splits in zip(arriving, sends, recvs, strict=True):
        out_rows = _run_experts(rows.wait(), slots.wait(), experts, num_local)
        returning.append(Exchange(out_rows, comm, send_splits, recv_splits))
    out = x.new_zeros(x.shape)
    for plan, back in zip(plans, returning, strict=True):
        out = out.index_add(0, plan.token, back.wait().to(x.dtype))
    return out


class _Plan(NamedTuple):
    token: torch.Tensor  # (U,) each unit's token, units sorted by destination rank
    dest: torch.Tensor  # (U,) its destination rank
    slots: torch.Tensor  # (U, 2 width): the slots' weights, then their local experts (-1: none)


def _plan(token, choice, expert, weight, tokens: int, k: int, num_local: int, dedup: bool) -> _Plan:
    """The units of some kept choices (see [Note: dispatch by units])."""
    dest = expert // num_local
    width = k if dedup else 1
    # units sorted by destination, then token (then choice)
    key = dest * tokens + token if dedup else (dest * tokens + token) * k + choice
    units, unit_of = torch.unique(key, return_inverse=True)
    unit_dest = units // (tokens if dedup else tokens * k)
    unit_token = units // (1 if dedup else k) % tokens
    slot = choice if dedup else torch.zeros_like(choice)
    ids = torch.full((len(units), width), -1.0, device=token.device)
    ids[unit_of, slot] = (expert % num_local).float()
    weights = weight.new_zeros(len(units), width).index_put((unit_of, slot), weight)
    return _Plan(unit_token, unit_dest, torch.cat([weights, ids], dim=1))


def _run_experts(
    rows: torch.Tensor, slots: torch.Tensor, experts: ExpertFn, num_local: int
) -> torch.Tensor:
    """Each received unit's output: its slots' experts on its row, weighted and summed."""
    width = slots.shape[1] // 2
    slot_weights, slot_experts = slots[:, :width], slots[:, width:].detach().long()
    out_rows = rows.new_zeros(rows.shape)
    for local in range(num_local):
        row, column = (slot_experts == local).nonzero(as_tuple=True)
        y = experts(local, rows[row])
        weighted = y * slot_weights[row, column, None].to(y.dtype)
        out_rows = out_rows.index_add(0, row, weighted.to(out_rows.dtype))
    return out_rows
