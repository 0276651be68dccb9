"""The parameter all-gathers in flight, by bucket, and what must run before a bucket's shard is
read (see [Note: waiting for parameters] in zerotrain/zero/gather.py).

[Note: a step deferred to the next use]
A store that steps on the host (zerotrain/zero/offload.py) may leave buckets to be stepped
later, where the forward waits per bucket anyway (stage 3; stages 1-2 with
``overlap_param_gather``): the bucket's step then runs when its parameters are next gathered or
waited for, in the order the forward needs them, so on CUDA the host steps a later layer's
bucket while the device runs the earlier layers' forward. :class:`BucketGathers` holds the
deferred calls; every path that reads parameters (a gather, a wait, ``wait()`` before a
backward, a step or a checkpoint) runs them first, and they run in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerotrain.comm import Communicator
from zerotrain.compression.codec import Pending
from zerotrain.compression.gather import ParameterGather
from zerotrain.zero.hpz import SecondaryShards
from zerotrain.zero.layout import FlatBucket
from zerotrain.zero.param_home import ShardHome


class BucketGathers:
    """Parameter all-gathers in flight, by bucket (see [Note: waiting for parameters] in
    gather.py)."""

    def __init__(
        self,
        comm: Communicator,
        home: ShardHome | None = None,
        gather: ParameterGather | None = None,
    ):
        self.comm = comm
        self.home = home or ShardHome()  # stage 3: where the shards are lent from
        # the all-gather itself: the backend's, or quantized (comm_compression.parameters)
        self.gather = gather or ParameterGather(comm)
        self._ops: dict[int, Pending] = {}  # id(bucket) -> its all-gather
        # stage 3 with hierarchical_partition: each bucket's piece inside the node, which
        # serves its gathers after the first in a step (see [Note: the secondary partition])
        self.secondary: SecondaryShards | None = None
        # gathers in flight whose piece to keep: id(bucket) -> (bucket, the buffer gathered into)
        self._primary: dict[int, tuple[FlatBucket, torch.Tensor]] = {}
        # id(bucket) -> what must run before its shard is read: a deferred optimizer step (and,
        # stages 1-2, the gather itself); see [Note: a step deferred to the next use]
        self._before: dict[int, Callable[[], None]] = {}

    def defer(self, bucket: FlatBucket, before: Callable[[], None]) -> None:
        """Run ``before`` when ``bucket`` is next gathered or waited for (or at :meth:`flush`)."""
        self._before[id(bucket)] = before

    def _run_before(self, bucket: FlatBucket) -> None:
        before = self._before.pop(id(bucket), None)
        if before is not None:
            before()

    def flush(self) -> None:
        """Run every deferred call, in the order they were deferred (the same on every rank)."""
        while self._before:
            self._before.pop(next(iter(self._before)))()

    @property
    def deferred(self) -> int:
        return len(self._before)

    def issue(self, bucket: FlatBucket, shard: torch.Tensor | None = None) -> None:
        """Start gathering ``bucket.flat_param`` from every rank's ``shard`` (stage 3: the one
        the shard home lends, see [Note: lending a shard] in param_home.py)."""
        self._run_before(bucket)  # a deferred step writes the shard
        self._complete(bucket)  # never two gathers into one buffer at once
        if self.secondary is not None and self.secondary.holds(bucket):
            self._ops[id(bucket)] = self.secondary.all_gather(bucket)
            return
        flat_param = bucket.require_flat_param()
        if shard is None:
            shard = self.home.lend(bucket)
            if self.home.on_host:
                shard = _to_device(shard, flat_param)
            self.home.give_back(bucket)
        self._ops[id(bucket)] = self.gather.all_gather(
            flat_param, shard, exact=bucket.frozen, pieces=bucket.shard_pieces
        )
        if self.secondary is not None:
            self._primary[id(bucket)] = (bucket, flat_param)

    def _complete(self, bucket: FlatBucket) -> None:
        """Wait for ``bucket``'s gather if one is in flight; after a primary one (hpZ), keep
        the node's piece."""
        op = self._ops.pop(id(bucket), None)
        if op is not None:
            op.wait()
        gathered = self._primary.pop(id(bucket), None)
        if gathered is not None and self.secondary is not None:
            self.secondary.keep(*gathered)

    def forget_secondary(self, bucket: FlatBucket | None = None) -> None:
        """The primary shards of ``bucket`` (None: of all) changed: gather them anew."""
        if self.secondary is not None:
            self.secondary.forget(bucket)

    def read_ahead(self, buckets: list[FlatBucket]) -> None:
        """Stage 3: ``buckets`` are gathered soon (beyond the prefetch): start their reads."""
        for bucket in buckets:
            self.home.read_ahead(bucket)

    def wait(self, buckets) -> None:
        """Complete the gathers of ``buckets`` that are in flight (or deferred)."""
        for bucket in buckets:
            self._run_before(bucket)
            self._complete(bucket)

    def waiting(self, bucket: FlatBucket) -> bool:
        return id(bucket) in self._ops

    def __len__(self) -> int:
        return len(self._ops)


def _to_device(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host shard (``offload_param``) brought to the device for its all-gather; the copy is
    asynchronous from pinned memory and ordered before the gather on the current stream."""
    staged = torch.empty(shard.numel(), dtype=like.dtype, device=like.device)
    staged.copy_(shard, non_blocking=True)
    return staged
