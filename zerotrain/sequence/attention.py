"""Ulysses attention: q, k and v arrive holding this rank's share of the sequence and every
head; an all-to-all makes them hold the whole sequence and a share of the heads, the core
attention (SDPA, eager, flash: any function of full sequences) runs unchanged on them, and a
second all-to-all brings the output back to the rank's share of the sequence.

[Note: Ulysses heads]
Rank r of sp gets query heads [r h/sp, (r+1) h/sp). With grouped-query attention (kv key/value
heads, each serving g = h/kv query heads) those query heads read key/value heads
[r kv/sp, (r+1) kv/sp) when sp divides kv, so the key/value heads are cut the same way. When
kv < sp (sp a multiple of kv), each key/value head is first repeated sp/kv times, as ALST does:
rank r then gets one copy of head r kv/sp (rounded down), the one its query heads read, and
the gradients of the copies add up in the repeat's backward. The query heads must divide by
sp: a head is not cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.sequence.all_to_all import sequence_all_to_all
from zerotrain.sequence.groups import communicator_of


def check_heads(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated before the exchange (see [Note: Ulysses
    heads]); ``ValueError`` naming the fix when the heads cannot be shared by ``sp`` ranks."""
    if heads % sp:
        raise ValueError(
            f"sequence parallelism: {heads} attention heads do not divide into "
            f"sequence_parallel_size {sp} (each rank attends with whole heads); choose a size "
            f"that divides {heads}"
        )
    if kv_heads % sp == 0:
        return 1
    if sp % kv_heads:
        raise ValueError(
            f"sequence parallelism: {kv_heads} key/value heads and sequence_parallel_size {sp} "
            "must divide one another (the key/value heads are cut, or repeated, over the ranks)"
        )
    return sp // kv_heads


class UlyssesAttention:
    """Around ``core(module, q, k, v, mask, **kwargs) -> (out, weights)`` with transformers'
    layouts: q, k, v ``[batch, heads, local sequence, head size]`` in, ``[batch, local
    sequence, heads, head size]`` out. ``comm``: the sequence-parallel group."""

    def __init__(
        self,
        core: Callable[..., tuple[torch.Tensor, Any]],
        comm: Communicator,
        *,
        causal_mask: bool = False,
        layers: int = 1,
    ):
        """``causal_mask``: the core needs the causal mask passed (eager attention adds it;
        SDPA and flash attention are causal without one). ``layers``: the attention layers of
        the model, whose position ids are checked on the first of every ``layers`` calls."""
        self.core = core
        self.comm = comm
        self.causal_mask = causal_mask
        self.layers = max(1, layers)
        self._calls = 0

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        sp = self.comm.world_size
        self._check_positions(kwargs.get("position_ids"))
        repeat = check_heads(query.shape[1], key.shape[1], sp)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        # [b, heads, s/sp, d] -> [b, heads/sp, s, d]
        query, key, value = (
            sequence_all_to_all(t, self.comm, scatter=1, gather=2) for t in (query, key, value)
        )
        groups = query.shape[1] // key.shape[1]
        saved_groups = getattr(module, "num_key_value_groups", None)
        if saved_groups is not None:  # eager and SDPA repeat key/value heads by it
            module.num_key_value_groups = groups  # pyrefly: ignore[bad-argument-type]
        try:
            out, weights = self.core(module, query, key, value, self._mask(query), **kwargs)
        finally:
            if saved_groups is not None:
                module.num_key_value_groups = saved_groups
        # [b, s, heads/sp, d] -> [b, s/sp, heads, d]
        return sequence_all_to_all(out, self.comm, scatter=1, gather=2), weights

    def _check_positions(self, position_ids: torch.Tensor | None) -> None:
        """That the ranks' position ids continue one another (0..s-1 over the whole sample,
        each row in order): the model rotates q and k by them before the exchange, and
        attention is causal over the joined sequence. Checked once per forward: every layer
        gets the same tensor, and every rank calls the layers alike, so a count of calls (not
        the tensor's identity, which ranks could see differently) says when on every rank."""
        if position_ids is None:
            raise ValueError(
                "sequence parallelism: the attention got no position_ids; pass them with the "
                "batch (ALST requires position ids: shard_batch and UlyssesSPDataLoaderAdapter "
                "make them), or each rank would number its share of the sequence from 0"
            )
        self._calls += 1
        if (self._calls - 1) % self.layers:
            return
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        ordered = bool((rows[:, 1:] - rows[:, :-1] == 1).all())
        ends = self.comm.all_gather_object(
            (tuple(rows.shape), ordered, rows[:, 0].tolist(), rows[:, -1].tolist())
        )
        if len({shape for shape, *_ in ends}) > 1:  # the exchange needs equal shares
            raise ValueError(
                "sequence parallelism: the sequence-parallel ranks hold shares of shapes "
                f"{[shape for shape, *_ in ends]} (batch, tokens); every rank must hold an equal "
                "share of the same samples (shard_batch cuts them so, padding the length)"
            )
        for rank, (_, ok, first, _) in enumerate(ends):
            previous_last = [-1] * len(first) if rank == 0 else ends[rank - 1][3]
            if not ok or any(f != p + 1 for f, p in zip(first, previous_last, strict=True)):
                raise ValueError(
                    f"sequence parallelism: the position ids of sequence-parallel rank {rank} "
                    f"(starting {first}) do not continue those before them; each sample must "
                    "be numbered 0..s-1 across the ranks (shard_batch and "
                    "UlyssesSPDataLoaderAdapter cut them so). Packed samples, whose positions "
                    "restart inside a row, are not supported with sequence parallelism yet"
                )

    def _mask(self, query: torch.Tensor) -> torch.Tensor | None:
        """The causal mask over the whole sequence where the core needs one. The model's own
        mask was made for the local share, which the whole sequence no longer matches."""
        if not self.causal_mask:
            return None
        length = query.shape[2]
        blocked = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
        mask = torch.zeros(length, length, dtype=query.dtype, device=query.device)
        return mask.masked_fill(blocked, torch.finfo(query.dtype).min)[None, None]


class DistributedAttention(nn.Module):
    """DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` for custom models:
    ``local_attention(q, k, v, *args, **kwargs)`` runs on the whole sequence and 1/sp of the
    heads. q, k, v hold this rank's share of the sequence at dimension ``gather_idx`` and all
    heads at ``scatter_idx`` (DeepSpeed's defaults 2 and 0: ``[sequence, batch, heads, head
    size]``; ``batch_dim_idx=0`` in ``forward`` reads ``[batch, sequence, heads, head
    size]``). ``sequence_process_group``: a torch process group or a Communicator."""

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ):
        super().__init__()
        self.local_attn = local_attention
        self.comm = communicator_of(sequence_process_group)
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        scatter, gather = self.scatter_idx, self.gather_idx
        if batch_dim_idx == 0 and (scatter, gather) == (2, 0):  # [b, s, h, d]
            gather = 1
        query, key, value = (
            sequence_all_to_all(t, self.comm, scatter=scatter, gather=gather)
            for t in (query, key, value)
        )
        context = self.local_attn(query, key, value, *args, **kwargs)
        return sequence_all_to_all(context, self.comm, scatter=gather, gather=scatter)
