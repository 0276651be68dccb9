"""The engine's resumable dataloader: DistributedSampler's order, resumed at any position."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from zerotrain.data import ResumableDataLoader, ResumableDistributedSampler


def _loaders(samples: int, world: int, batch: int, seed: int = 3):
    data = TensorDataset(torch.arange(samples))
    return [
        ResumableDataLoader(
            data,
            batch_size=batch,
            sampler=ResumableDistributedSampler(data, world, rank, shuffle=True, seed=seed),
            generator=torch.Generator().manual_seed(seed),
        )
        for rank in range(world)
    ]


@pytest.mark.parametrize("samples,world", [(10, 1), (10, 3), (7, 2), (2, 4)])
def test_order_is_distributed_samplers(samples: int, world: int) -> None:
    data = TensorDataset(torch.arange(samples))
    for epoch in (0, 1):
        for rank in range(world):
            ours = ResumableDistributedSampler(data, world, rank, shuffle=True, seed=5)
            theirs = DistributedSampler(data, world, rank, shuffle=True, seed=5)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _take(loaders, batches: int) -> list[int]:
    """Sample ids the ranks see in their next ``batches`` batches (in global order)."""
    iterators = [iter(loader) for loader in loaders]
    seen = []
    for _ in range(batches):
        for it in iterators:
            seen += next(it)[0].tolist()
    return seen


@pytest.mark.parametrize("world_before,world_after", [(2, 2), (2, 3), (3, 1)])
def test_resume_continues_with_the_unseen_samples(world_before: int, world_after: int) -> None:
    """After 2 batches per rank, a loader restored from the state (even with another world size)
    delivers exactly the samples of the epoch not yet seen, then starts the next epoch."""
    samples, batch = 24, 2
    before = _loaders(samples, world_before, batch)
    seen = _take(before, 2)
    state = before[0].state_dict()
    assert state["start"] == 2 * batch * world_before

    after = _loaders(samples, world_after, batch, seed=3)
    for loader in after:
        loader.load_state_dict(state)
    rest = [i for loader in after for b in loader for i in b[0].tolist()]
    assert set(rest) - set(seen) == set(range(samples)) - set(seen)  # every unseen sample
    # the remainder is padded by repeating, as DistributedSampler pads, to a multiple of world
    assert len(rest) == -(-(samples - len(seen)) // world_after) * world_after
    assert all(loader.sampler.epoch == 1 for loader in after)
    next_epoch = [b[0].tolist() for b in after[0]]
    assert next_epoch and after[0].sampler.epoch == 2


def test_user_set_epoch_restarts_only_a_new_epoch() -> None:
    (loader,) = _loaders(8, 1, 2)
    first = next(iter(loader))[0].tolist()
    loader.sampler.set_epoch(0)  # the current epoch: keeps the position
    assert loader.sampler.start == 2
    second = next(iter(loader))[0].tolist()
    assert set(first).isdisjoint(second)
    loader.sampler.set_epoch(4)
    assert loader.sampler.start == 0
