"""Low-rank gradient compression: PowerSGD and ACP-SGD's alternating variant.

[Note: PowerSGD and ACP-SGD]
A gradient matrix M (n x m, a parameter's gradient with its first dimension as rows) is sent
as two thin factors. PowerSGD (Vogels et al., arXiv:1905.13727, Algorithm 1) runs one step of
subspace iteration per training step: P = M Q, all-reduce P, orthonormalize it (P^), then
Q = M^T P^, all-reduce Q; every rank rebuilds P^ Q^T, and Q is kept as the next step's start
(warm start). Here Q is orthonormalized before P = M Q^ too, which the paper does not do: in
exact arithmetic M Q and M Q^ span the same columns, but warm-started steps turn Q's columns
towards the top singular vector, and P's basis then loses the others to rounding (measured:
the demo GPT trained no better than at rank 1). That is two all-reduces, the second waiting
for the first. ACP-SGD (Zhang, Shi et al., arXiv:2306.08881) halves it: each step compresses
one side only, alternating, with the other factor from the step before, orthonormalized: odd
steps send P = M Q^ and rebuild P Q^T, even steps send Q = M^T P^ and rebuild P^ Q^T. One
all-reduce per step, which can overlap the backward like an uncompressed bucket's. Both keep
each rank's error, M minus what was rebuilt, and add it to the next step's gradient (error
feedback), so what a step leaves out is sent later. The gradients come scaled by 1/N (each
rank's share of the average) and the rebuilt matrix is their sum, so a rank's error is its
share less 1/N of the rebuilt sum: the errors of all ranks add up to exactly what the
compression left out. Every rank orthonormalizes the same all-reduced factor and so rebuilds
the same matrix.

A matrix is compressed only when its factors are smaller than it: rank r < min(n, m) for
ACP-SGD (one factor of n·r or m·r elements per step), (n + m)·r < n·m for PowerSGD; any
other matrix, and vectors, travel whole: in the same all-reduce as the factors when the
gradients are fp32, in one of their own, in the gradients' dtype, when they are 16-bit.
"""

from __future__ import annotations

import torch


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``matrix``'s columns (Householder QR: orthonormal even when
    the columns are dependent or zero)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


def worth_compressing(rows: int, cols: int, rank: int, alternating: bool) -> bool:
    """Whether a ``rows`` x ``cols`` matrix at ``rank`` sends fewer elements than itself."""
    if alternating:
        return rank < min(rows, cols)
    return (rows + cols) * rank < rows * cols


class LowRankMatrix:
    """One matrix's factors and error, at ``offset`` in its bucket (see [Note: PowerSGD and
    ACP-SGD]); ``seed`` makes the starting factors the same on every rank. They start on the
    host and move to the gradients' device at their first use."""

    def __init__(self, offset: int, rows: int, cols: int, rank: int, seed: int):
        self.offset, self.rows, self.cols = offset, rows, cols
        self.numel = rows * cols
        self.rank, self.seed = rank, seed
        self.restart()
        self.error: torch.Tensor | None = None  # rows x cols, once error feedback starts

    def restart(self) -> None:
        """The starting factors (again)."""
        gen = torch.Generator().manual_seed(self.seed)
        self.p = torch.randn(self.rows, self.rank, generator=gen)
        self.q = torch.randn(self.cols, self.rank, generator=gen)

    def matrix(self, flat: torch.Tensor, feedback: bool) -> torch.Tensor:
        """This rank's gradient matrix from ``flat``, with the error kept from before."""
        m = flat[self.offset : self.offset + self.numel].view(self.rows, self.cols).float()
        if feedback and self.error is not None:
            m = m + self.error.to(m.device)
        return m

    def keep_error(
        self, m: torch.Tensor, rebuilt: torch.Tensor, world: int, feedback: bool
    ) -> None:
        """This rank's error: its matrix ``m`` (its share of the sum, with the error kept before)
        less its share of the ``rebuilt`` sum, so the errors of all ranks add up to what the
        sum lost."""
        if feedback:
            self.error = m - rebuilt / world

    def write(self, flat: torch.Tensor, rebuilt: torch.Tensor) -> None:
        flat[self.offset : self.offset + self.numel].copy_(rebuilt.view(-1))

    def tensors(self) -> list[torch.Tensor]:
        return [self.p, self.q] + ([self.error] if self.error is not None else [])
