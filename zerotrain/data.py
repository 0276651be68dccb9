"""The engine's dataloader: DistributedSampler's order, resumable mid-epoch at any world size.

[Note: data position]
The sampler orders an epoch like torch's ``DistributedSampler`` (the same permutation for the
same seed and epoch; rank r takes every world-size-th index) and keeps ``start``, the number of
positions of that order already delivered to all ranks together. The loader advances ``start``
by ``batch_size * world_size`` per batch it yields and moves to the next epoch when one ends.
``(epoch, start)`` is therefore a global position: a checkpoint restores it exactly, and a run
resumed with another world size continues with the samples not yet seen. Training across
sites with a work split ([Note: a site's share of the batch] in zerotrain/zero/work_split.py)
takes each micro-step's ``G`` positions of the same order as one run, site by site, each rank
the piece its site's share gives it (:class:`SiteShareBatches`); ``start`` advances by ``G``.
"""

from __future__ import annotations

import math
from collections.abc import Sized

import torch
from torch.utils.data import DataLoader, Sampler

from zerotrain.zero.work_split import WorkSplit


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler`` (``drop_last=False``) that can start mid-epoch."""

    def __init__(self, dataset: Sized, world_size: int, rank: int, shuffle: bool, seed: int):
        self.num_samples_total = len(dataset)
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0  # positions of this epoch's order already delivered, all ranks together

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning, unless it is the current epoch)."""
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def _remaining(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        else:
            order = list(range(self.num_samples_total))
        rest = order[self.start :]
        if rest:  # pad with the epoch's first samples, as DistributedSampler does, so that
            # every rank gets as many and a resumed epoch ends as an uninterrupted one does
            padding = -len(rest) % self.world_size
            rest += (order * (padding // len(order) + 1))[:padding]
        return rest

    def __iter__(self):
        return iter(self._remaining()[self.rank :: self.world_size])  # eager: fixes `start`

    def __len__(self) -> int:
        return -(-(self.num_samples_total - self.start) // self.world_size)


class SiteShareBatches(Sampler[list[int]]):
    """The batches of a rank of training across sites with a work split: micro-step k of
    ``order`` (a :class:`ResumableDistributedSampler` of world size ``split.global_batch``,
    rank 0: the whole order, padded to whole micro-steps) gives this rank positions
    ``split.positions(step, data_rank)`` of its ``G``, ``step`` the optimizer step it is for
    (``accumulation`` micro-steps each, counted from the split's steps when iteration
    starts)."""

    def __init__(
        self,
        order: ResumableDistributedSampler,
        split: WorkSplit,
        data_rank: int,
        accumulation: int,
    ):
        self.order, self.split = order, split
        self.data_rank, self.accumulation = data_rank, accumulation

    def __iter__(self):
        rest, width = self.order._remaining(), self.order.world_size
        first_step = self.split.steps
        for k, start in enumerate(range(0, len(rest), width)):
            lo, hi = self.split.positions(first_step + k // self.accumulation, self.data_rank)
            yield rest[start + lo : start + hi]

    def __len__(self) -> int:
        return len(self.order)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` (or :class:`SiteShareBatches`
    over one) whose position (epoch and samples delivered) is saved in checkpoints; see
    [Note: data position].

    Iterating continues from the current position; when an epoch is exhausted the next
    iteration starts the next epoch (so ``set_epoch`` calls are not needed, and harmless).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shares = self.batch_sampler if isinstance(self.batch_sampler, SiteShareBatches) else None
        # the position in the epoch's order: a ResumableDistributedSampler's
        order = self.sampler if shares is None else shares.order
        assert isinstance(order, ResumableDistributedSampler), "see the class docstring"
        self.order = order
        # positions of the order a batch takes (None: DataLoader's unbatched mode)
        self.positions_per_batch: int | None = None
        if shares is not None:  # a micro-step's global batch
            self.positions_per_batch = order.world_size
            # decisions on the shares wait for the batches fetched ahead
            ahead = self.num_workers * (self.prefetch_factor or 0)
            shares.split.lead = max(shares.split.lead, math.ceil(ahead / shares.accumulation) + 1)
        elif self.batch_size is not None:
            self.positions_per_batch = self.batch_size * order.world_size

    # A generator over DataLoader's iterator (it moves the position), not a _BaseDataLoaderIter.
    def __iter__(self):  # pyrefly: ignore[bad-override]
        order, step = self.order, self.positions_per_batch
        if step is None:  # DataLoader's unbatched mode: the position counts batches
            raise ValueError("ResumableDataLoader: batch_size must be set, not None")
        for batch in super().__iter__():
            order.start = min(order.start + step, order.num_samples_total)
            yield batch
        order.set_epoch(order.epoch + 1)

    def state_dict(self) -> dict:
        state = {"epoch": self.order.epoch, "start": self.order.start}
        if self.generator is not None:  # seeds worker processes
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.order.epoch = int(state["epoch"])
        self.order.start = min(int(state["start"]), self.order.num_samples_total)
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])


class RepeatingLoader:
    """Iterates ``loader`` forever, starting it again whenever it is exhausted (DeepSpeed's
    ``deepspeed.utils.RepeatingLoader``)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
