"""The engine's dataloader: DistributedSampler's order, resumable mid-epoch at any world size.

[Note: data position]
The sampler orders an epoch like torch's ``DistributedSampler`` (the same permutation for the
same seed and epoch; rank r takes every world-size-th index) and keeps ``start``, the number of
positions of that order already delivered to all ranks together. The loader advances ``start``
by ``batch_size * world_size`` per batch it yields and moves to the next epoch when one ends.
``(epoch, start)`` is therefore a global position: a checkpoint restores it exactly, and a run
resumed with another world size continues with the samples not yet seen.
"""

from __future__ import annotations

from collections.abc import Sized

import torch
from torch.utils.data import DataLoader, Sampler


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


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` whose position (epoch and
    samples delivered) is saved in checkpoints; see [Note: data position].

    Iterating continues from the current position; when an epoch is exhausted the next
    iteration starts the next epoch (so ``set_epoch`` calls are not needed, and harmless).
    """

    # Narrower than DataLoader's: this loader is always given a ResumableDistributedSampler.
    sampler: ResumableDistributedSampler  # pyrefly: ignore[bad-override-mutable-attribute]

    # A generator over DataLoader's iterator (it moves the position), not a _BaseDataLoaderIter.
    def __iter__(self):  # pyrefly: ignore[bad-override]
        sampler = self.sampler
        if self.batch_size is None:  # DataLoader's unbatched mode: the position counts batches
            raise ValueError("ResumableDataLoader: batch_size must be set, not None")
        step = self.batch_size * sampler.world_size
        for batch in super().__iter__():
            sampler.start = min(sampler.start + step, sampler.num_samples_total)
            yield batch
        sampler.set_epoch(sampler.epoch + 1)

    def state_dict(self) -> dict:
        state = {"epoch": self.sampler.epoch, "start": self.sampler.start}
        if self.generator is not None:  # seeds worker processes
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch = int(state["epoch"])
        self.sampler.start = min(int(state["start"]), self.sampler.num_samples_total)
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
