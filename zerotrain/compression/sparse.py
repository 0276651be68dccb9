"""Top-k sparsification and gTop-k's tree merge of sparse vectors.

[Note: gTop-k with exact sums]
gTop-k (Shi et al., arXiv:1901.04359) finds k coordinates for all ranks in log2(N) rounds
of recursive doubling: in round i each rank swaps its k-sparse vector with the rank whose
number differs in bit i, adds the two, and keeps the k largest magnitudes, so every rank
ends with the same k-sparse vector having sent 2k log2(N) numbers instead of the N·k an
all-gather of every rank's top-k costs. A value one merge drops can belong to a coordinate
another merge keeps: the paper's sum at such a coordinate then lacks that rank's value,
while the rank's error feedback counts it as sent. Here the merge only chooses the
coordinates; their sums are then taken exactly, by an all-reduce of each rank's accumulated
value at those k coordinates, and everything else stays in the rank's residual. What was sent
plus what is kept is then exactly what came in, at the cost of k more numbers each way. A world
that is not a power of two first folds the ranks above the largest power into their partners
below it, and sends them the chosen coordinates at the end.
"""

from __future__ import annotations

import math

import torch

from zerotrain.comm import Communicator

# Choosing among candidates: torch.topk over n elements costs about as much for k = 1% of them
# as for 25% (65-110 ms for 4.8M fp32 on one CPU thread). A threshold from a strided sample
# (a prime stride meets every column of rows a power of two long) keeps about 1.2·k candidates
# in one compare, and whenever at least k pass it, every one of the k largest is among them:
# 9 ms at 1%, 23 ms at 10%. Fewer than k (a threshold the sample put too high) fall back to
# the whole vector.
SAMPLE_STRIDE = 127
MIN_SAMPLE = 256  # below it (vectors under ~32k elements) the whole topk is as cheap


def top_k(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest magnitudes of ``values`` (1-D), ascending (among equal
    magnitudes at the k-th, any)."""
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    magnitudes = values.abs()
    candidates = _candidates(magnitudes, k)
    if candidates is None:
        chosen = torch.topk(magnitudes, k, sorted=False).indices
    else:
        chosen = candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    return chosen.sort().values


def _candidates(magnitudes: torch.Tensor, k: int) -> torch.Tensor | None:
    """Positions holding all of the ``k`` largest ``magnitudes`` and few others, or None where
    a sample does not narrow them down (a short vector; k over a quarter of it, where the
    candidates would be most of it; a threshold that fewer than k pass)."""
    n = len(magnitudes)
    sample = magnitudes[::SAMPLE_STRIDE]
    if len(sample) < MIN_SAMPLE or 4 * k > n:
        return None
    rank = min(len(sample), math.ceil(1.2 * len(sample) * k / n) + 8)
    threshold = torch.topk(sample, rank, sorted=False).values.min()
    # "not below" rather than "at least": a NaN passes, as torch.topk ranks it first, so it
    # travels and every rank skips the step (a NaN the sample missed was dropped before)
    candidates = (~(magnitudes < threshold)).nonzero().squeeze(1)
    return candidates if len(candidates) >= k else None


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest magnitudes of the sum of two sparse vectors, each (indices, values);
    the same result whichever is ``a`` (callers pass the lower rank's first)."""
    indices = torch.cat([a[0], b[0]])
    unique, inverse = torch.unique(indices, return_inverse=True)
    summed = torch.zeros(len(unique), dtype=a[1].dtype, device=a[1].device).index_add_(
        0, inverse, torch.cat([a[1], b[1]])
    )
    keep = top_k(summed, k)
    return unique[keep], summed[keep]


def pack(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One fp32 message: the values, then the indices as int32 bit patterns."""
    return torch.cat([values.float(), indices.to(torch.int32).view(torch.float32)])


def unpack(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = len(message) // 2
    return message[half:].view(torch.int32).long(), message[:half]


def tree_indices(comm: Communicator, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """gTop-k's coordinates: every rank's k-sparse (indices, values), the same k on every rank,
    merged by recursive doubling (see [Note: gTop-k with exact sums]); the same ascending
    indices on every rank. Collective over ``comm``."""
    rank, world = comm.rank, comm.world_size
    power = 1 << (world.bit_length() - 1)
    extra = world - power
    mine = (indices, values)
    k = len(indices)

    def swap(partner_of: dict[int, int], message: torch.Tensor, size: int) -> torch.Tensor | None:
        """One round: rank r sends to ``partner_of[r]``; returns what this rank received."""
        in_splits, out_splits = [0] * world, [0] * world
        if rank in partner_of:
            in_splits[partner_of[rank]] = len(message)
        senders = [r for r, p in partner_of.items() if p == rank]
        for r in senders:
            out_splits[r] = size
        output = torch.empty(sum(out_splits), dtype=torch.float32, device=message.device)
        send = message if rank in partner_of else message[:0]
        comm.all_to_all(output, send, out_splits, in_splits, name="gtopk_exchange")
        return output if senders else None

    # fold the ranks above the largest power of two into those below it
    got = swap({power + i: i for i in range(extra)}, pack(*mine), 2 * k)
    if got is not None:
        mine = merge(mine, unpack(got), k)
    bit = 1
    while bit < power:  # every rank takes part in each round's all-to-all; the folded send none
        got = swap({r: r ^ bit for r in range(power)}, pack(*mine), 2 * k)
        if got is not None:
            other = unpack(got)
            mine = merge(mine, other, k) if rank < rank ^ bit else merge(other, mine, k)
        bit <<= 1
    # the chosen coordinates back to the folded ranks
    got = swap({i: power + i for i in range(extra)}, pack(*mine), 2 * k)
    if got is not None:
        mine = unpack(got)
    return mine[0]
