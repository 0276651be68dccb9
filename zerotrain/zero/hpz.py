"""Stage 3's secondary partition inside each node (ZeRO++'s hpZ, arXiv:2306.10209 §4.3;
``comm_compression.hierarchical_partition``).

[Note: the secondary partition]
Stage 3 gathers a unit's parameters before its forward and, once released, again before its
backward: 3Ψ per step crosses the network (the gradients' reduce-scatter included), where
stages 1-2 send 2Ψ. hpZ keeps, after the first gather of a bucket in a step, this rank's piece
of the whole bucket among the L ranks of its node (a secondary shard of numel/L elements, not
numel/N), and serves every later gather of that bucket in the step from the node's secondary
shards: an all-gather inside the node, whose links are fast (NVLink, or shared memory), in
place of one across the nodes. The secondary shards hold the gathered values themselves
(dequantized, with a quantized gather), so every gather in a step yields the same parameters
as the first. An optimizer step, or anything else that writes the primary shards (a checkpoint
load), makes them stale (:meth:`SecondaryShards.forget`), and the next gather is a primary one
again. What it costs: numel/L more elements per bucket in the training dtype, per rank, counted
by ``memory_breakdown()["compression"]``, apart from the ZeRO formula's parameters.
"""

from __future__ import annotations

import torch

from zerotrain.comm import Communicator, PendingOp
from zerotrain.zero.layout import FlatBucket


class SecondaryShards:
    """Each bucket's piece among the ranks of this rank's node (``node``), while it is current
    (see [Note: the secondary partition])."""

    def __init__(self, node: Communicator):
        self.node = node
        self._buffers: dict[int, torch.Tensor] = {}  # id(bucket) -> its piece (kept allocated)
        self._current: set[int] = set()  # the buckets whose piece holds the values in use

    def holds(self, bucket: FlatBucket) -> bool:
        return id(bucket) in self._current

    def keep(self, bucket: FlatBucket, full: torch.Tensor) -> None:
        """After a primary gather of ``bucket`` into ``full``: copy this rank's node piece."""
        piece = full.view(self.node.world_size, -1)[self.node.rank]
        buffer = self._buffers.get(id(bucket))
        if buffer is None or buffer.shape != piece.shape or buffer.dtype != piece.dtype:
            buffer = self._buffers[id(bucket)] = torch.empty_like(piece)
        buffer.copy_(piece)
        self._current.add(id(bucket))

    def all_gather(self, bucket: FlatBucket) -> PendingOp:
        """Gather ``bucket.flat_param`` from the node's pieces (asynchronous)."""
        piece = self._buffers[id(bucket)]
        return self.node.all_gather(
            bucket.require_flat_param(), piece, async_op=True, name="hpz_all_gather"
        )

    def forget(self, bucket: FlatBucket | None = None) -> None:
        """``bucket``'s piece (None: every piece) is stale: its next gather is a primary one."""
        if bucket is None:
            self._current.clear()
        else:
            self._current.discard(id(bucket))

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())
