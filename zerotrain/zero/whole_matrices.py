"""Whole matrices from ZeRO's flat shards, for an optimizer whose update needs them (Muon).

[Note: whole matrices on shards]
Muon's Newton-Schulz iteration needs each weight matrix whole; ZeRO packs parameters into flat
buckets cut into equal shards, so a matrix may be spread over several ranks. The ways out:
- gather every matrix on every rank (an all-gather of the updates): each rank then runs every
  matrix's Newton-Schulz, N times the work of one, and receives (N-1)/N of the updates;
- partition by parameter (each matrix's elements all on one rank): whole matrices for free, but
  a second bucket layout with uneven shards, which every reduction, gather, store and
  checkpoint would have to know;
- ours: keep the layout; give every matrix one *owner* rank, chosen greedily to balance
  Newton-Schulz's cost (rows x cols x min(rows, cols) multiply-adds per iteration) over the
  ranks. The ranks holding pieces of a matrix send them to its owner (one all-to-all for every
  matrix of the step), the owner orthogonalises its matrices (batched by shape on a GPU) and sends each
  holder its piece back (a second all-to-all). A rank sends about what it holds of the matrices
  others own and receives the same back, at most 2·Ψ_muon/N elements, less than a gradient
  reduce-scatter; Newton-Schulz's work is divided by N. Where the optimizer's part is the whole
  bucket (stage 0) every rank holds every matrix: nothing goes to the owners, and each owner
  sends its results to every rank, so the work is still divided by N.
Everything else in the step stays element-wise on the shards. The matrices are exchanged in
rounds of :data:`ROUND_NUMEL` elements, so what is in flight at once stays bounded whatever the
model's size (the whole update at once was 0.45 GiB more peak RSS than AdamW on a 100M GPT on 2
ranks; bench/precision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from zerotrain.comm import Communicator
from zerotrain.optim.muon import orthogonalize_all
from zerotrain.ranges import intersect
from zerotrain.zero.layout import FlatBucket

__all__ = ["ROUND_NUMEL", "ShardedMatrices"]

ROUND_NUMEL = 1 << 25
"""Matrix elements exchanged and orthogonalised per round (32M: 128 MiB in fp32). A round's
transients (the pieces sent and received, the whole matrices a rank owns, their results) are
bounded by it rather than by every matrix of the model; each round costs two all-to-alls."""


@dataclass(frozen=True)
class _Matrix:
    tensor: int  # the optimizer tensor (= bucket) it lies in, among the group's
    offset: int  # its first element in the bucket
    shape: torch.Size
    owner: int  # the rank that orthogonalises it

    @property
    def numel(self) -> int:
        return self.shape.numel()


class ShardedMatrices:
    """The matrices of one optimizer group's buckets, each rank's tensors holding its part of
    every bucket (``sharded``: its shard; else the whole bucket), made whole over ``comm``
    (see [Note: whole matrices on shards]). ``position_of`` maps ``id`` of each of the group's
    tensors to its bucket's position in ``buckets``: one tensor per bucket, or several, a
    store's sub-groups (those use :meth:`bucket_runs` and :meth:`orthogonalize_buckets`).
    Implements zerotrain.optim.muon's ``MatrixLayout``."""

    round_numel: int = ROUND_NUMEL

    def __init__(
        self,
        position_of: dict[int, int],
        buckets: list[FlatBucket],
        sharded: bool,
        comm: Communicator,
    ):
        self._position_of = position_of
        self._buckets = buckets
        self._sharded = sharded
        self._comm = comm
        load = [0] * comm.world_size
        matrices = []
        for i, bucket in enumerate(buckets):
            for slot in bucket.slots:
                if len(slot.shape) != 2:
                    raise ValueError(
                        f"Muon: parameter {slot.name!r} of shape {tuple(slot.shape)} is in a "
                        "use_muon group; Muon orthogonalises 2-D matrices (give it a group "
                        "with use_muon False, which steps it with AdamW)"
                    )
                rows, cols = slot.shape
                owner = min(range(comm.world_size), key=lambda r: (load[r], r))
                load[owner] += rows * cols * min(rows, cols)
                matrices.append(_Matrix(i, slot.offset, slot.shape, owner))
        self._matrices = matrices

    def position(self, tensor: Tensor) -> int:
        """The position in the group's buckets of the bucket ``tensor`` holds (part of)."""
        return self._position_of[id(tensor)]

    def _held(self, tensor: int, rank: int) -> tuple[int, int]:
        """Bucket positions ``[start, end)`` rank ``rank``'s tensor holds."""
        bucket = self._buckets[tensor]
        return bucket.shard_range(rank) if self._sharded else (0, bucket.numel_padded)

    def _piece(self, matrix: _Matrix, rank: int) -> tuple[int, int]:
        """Bucket positions of ``matrix`` that rank ``rank`` holds (empty: ``lo >= hi``)."""
        start, end = self._held(matrix.tensor, rank)
        return intersect(matrix.offset, matrix.offset + matrix.numel, start, end)

    def bucket_runs(self, position: int) -> list[tuple[int, int, torch.Size]]:
        """The matrix runs of what this rank holds of bucket ``position``, relative to its
        first held element."""
        base = self._held(position, self._comm.rank)[0]
        out = []
        for matrix in self._matrices:
            if matrix.tensor == position:
                lo, hi = self._piece(matrix, self._comm.rank)
                if lo < hi:
                    out.append((lo - base, hi - base, matrix.shape))
        return out

    def runs(self, tensor: Tensor) -> list[tuple[int, int, torch.Size]]:
        position = self.position(tensor)
        start, end = self._held(position, self._comm.rank)
        if tensor.numel() != end - start:
            raise RuntimeError(
                "ShardedMatrices.runs: the tensor is a piece of its bucket's part (a store's "
                "sub-group); ask bucket_runs for the bucket's runs"
            )
        return self.bucket_runs(position)

    def orthogonalize(self, updates: dict[Tensor, Tensor], fn: Callable[[Tensor], Tensor]) -> None:
        self.orthogonalize_buckets({self.position(t): u.view(-1) for t, u in updates.items()}, fn)

    def orthogonalize_buckets(
        self, flats: dict[int, Tensor], fn: Callable[[Tensor], Tensor]
    ) -> None:
        """``orthogonalize`` over flat updates keyed by bucket position (one at least), each
        laid out like what this rank holds of the bucket (a missing one: a zero update). Every
        rank of the group calls it alike."""
        rank = self._comm.rank
        flats = dict(flats)
        some = next(iter(flats.values()))  # one at least: ZeRO gives every bucket a gradient
        for index in range(len(self._buckets)):
            if index not in flats:
                start, end = self._held(index, rank)
                flats[index] = torch.zeros(end - start, dtype=some.dtype, device=some.device)
        for matrices in self._rounds:
            self._round(matrices, flats, fn, some)

    @property
    def _rounds(self) -> list[list[_Matrix]]:
        """The matrices in rounds of at most :data:`ROUND_NUMEL` elements (or one matrix), in
        order: what one round's exchanges and results hold at once is bounded."""
        rounds: list[list[_Matrix]] = [[]]
        size = 0
        for matrix in self._matrices:
            if rounds[-1] and size + matrix.numel > self.round_numel:
                rounds.append([])
                size = 0
            rounds[-1].append(matrix)
            size += matrix.numel
        return rounds

    def _round(
        self,
        matrices: list[_Matrix],
        flats: dict[int, Tensor],
        fn: Callable[[Tensor], Tensor],
        some: Tensor,
    ) -> None:
        """Orthogonalise ``matrices`` in place in ``flats`` (every rank calls it alike). The
        whole matrices are made on the communicator's device: with CPU offload some of this
        rank's pieces are in host memory and others on the GPU, and Newton-Schulz runs there."""
        rank, world = self._comm.rank, self._comm.world_size
        wire = self._comm.device

        def local(matrix: _Matrix, lo: int, hi: int) -> Tensor:
            """This rank's update of ``matrix`` at bucket positions ``[lo, hi)``."""
            base = self._held(matrix.tensor, rank)[0]
            return flats[matrix.tensor][lo - base : hi - base]

        # to the owners: what this rank holds of each matrix another rank owns (stage 0: the
        # owners hold them whole already)
        mine = [m for m in matrices if m.owner == rank]
        from_holders: list[list[Tensor]] = [[] for _ in range(world)]
        if self._sharded:
            to_owners: list[list[Tensor]] = [[] for _ in range(world)]
            for matrix in matrices:
                lo, hi = self._piece(matrix, rank)
                if matrix.owner != rank and lo < hi:
                    to_owners[matrix.owner].append(local(matrix, lo, hi))
            expected = [
                [self._piece(m, q) for m in mine] if q != rank else [] for q in range(world)
            ]
            from_holders = self._exchange(to_owners, expected, some)
        whole = {}
        for matrix in mine:
            values = torch.empty(matrix.numel, dtype=some.dtype, device=wire)
            for q in range(world) if self._sharded else (rank,):
                lo, hi = self._piece(matrix, q)
                if lo < hi:
                    piece = local(matrix, lo, hi) if q == rank else from_holders[q].pop(0)
                    values[lo - matrix.offset : hi - matrix.offset] = piece
            whole[id(matrix)] = values.view(matrix.shape)
        del from_holders
        results = self._orthogonalized(mine, whole, fn)
        del whole

        # back to the holders: each its piece of every matrix this rank owns
        to_holders: list[list[Tensor]] = [[] for _ in range(world)]
        for matrix in mine:
            result = results[id(matrix)].view(-1)
            for q in range(world):
                lo, hi = self._piece(matrix, q)
                if lo < hi and q != rank:
                    to_holders[q].append(result[lo - matrix.offset : hi - matrix.offset])
        expected = [
            [self._piece(m, rank) for m in matrices if m.owner == q] if q != rank else []
            for q in range(world)
        ]
        from_owners = self._exchange(to_holders, expected, some)
        for matrix in matrices:
            lo, hi = self._piece(matrix, rank)
            if lo < hi:
                if matrix.owner == rank:
                    piece = results[id(matrix)].view(-1)[lo - matrix.offset : hi - matrix.offset]
                else:
                    piece = from_owners[matrix.owner].pop(0)
                local(matrix, lo, hi).copy_(piece)

    @staticmethod
    def _orthogonalized(
        mine: list[_Matrix], whole: dict[int, Tensor], fn: Callable[[Tensor], Tensor]
    ) -> dict[int, Tensor]:
        """``fn`` of each matrix this rank owns."""
        results = orthogonalize_all([whole[id(m)] for m in mine], fn)
        return {id(m): result for m, result in zip(mine, results, strict=True)}

    def _exchange(
        self, send: list[list[Tensor]], receive: list[list[tuple[int, int]]], like: Tensor
    ) -> list[list[Tensor]]:
        """Send ``send[q]`` (pieces, in order) to each rank q; receive from each rank q pieces
        of the lengths ``hi - lo`` of ``receive[q]``'s non-empty ranges, returned per rank in
        order, on the communicator's device. Every rank calls it (one collective), whatever
        it sends."""
        world = self._comm.world_size
        lengths = [[hi - lo for lo, hi in ranges if lo < hi] for ranges in receive]
        if world == 1:
            return [[] for _ in range(world)]
        wire = self._comm.device  # offloaded pieces are in host memory: NCCL sends from the GPU
        empty = torch.empty(0, dtype=like.dtype, device=wire)
        input = torch.cat([empty, *(p.to(wire) for pieces in send for p in pieces)])
        output = torch.empty(sum(map(sum, lengths)), dtype=like.dtype, device=wire)
        self._comm.all_to_all(
            output,
            input,
            [sum(sizes) for sizes in lengths],
            [sum(p.numel() for p in pieces) for pieces in send],
            name="muon_matrices",
        )
        out, position = [], 0
        for sizes in lengths:
            pieces = []
            for size in sizes:
                pieces.append(output[position : position + size])
                position += size
            out.append(pieces)
        return out
