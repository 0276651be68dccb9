"""How updated parameters travel: the backend's all-gather, or a block-quantized one.

[Note: quantized parameter all-gather]
ZeRO++'s qwZ (arXiv:2306.10209 §4.1): each rank quantizes its shard of a bucket per block
(int8 or int4, one fp32 scale per block; quantize.py) and the ranks all-gather codes and
scales, then dequantize every piece, their own too, into the whole parameters. Every rank so
holds the same parameters, and the fp32 masters that the optimizer steps are never quantized:
the quantization error of one step does not carry into the next (it is not error feedback's
kind of loss, which would be summed over steps). Used wherever ZeRO gathers parameters: after
the step at stages 1-2, around each use at stage 3.

Blocks end where a parameter does (``pieces``: each rank's shard cut at the parameters'
bounds, from the bucket's layout). A block spanning a LayerNorm gain (about 1) and the end of
a matrix (about 0.02) would take the gain's scale, and at int4 (steps of 1/7 of it) the
matrix's rows there would come back as zeros: units that output exactly zero, whose
downstream weights get exactly zero gradients. Exact Adam leaves such weights still; 1-bit
Adam (zerotrain/optim/onebit.py) sends their zero as ± its block's scale, and with the
variance it froze near zero moved them by about 0.5 a step (docs/compression.md has the
losses). A shard so has a few more blocks than ``numel / block_size``, and every rank sends as
many scales as the rank with the most, so that the messages are equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from zerotrain.comm import Communicator
from zerotrain.compression import quantize
from zerotrain.compression.codec import Pending
from zerotrain.compression.encoded import all_gather_encoded


@dataclass(frozen=True, kw_only=True)
class ParameterCompression:
    """The ``comm_compression.parameters`` section, as a policy."""

    method: str = "none"  # int8 | int4
    block_size: int = 256


class ParameterGather:
    """All-gathers a bucket's shards into its whole flat buffer (see [Note: quantized
    parameter all-gather])."""

    def __init__(self, comm: Communicator, options: ParameterCompression | None = None):
        self.comm = comm
        on = options is not None and options.method != "none" and comm.world_size > 1
        self.compression = options if on else None  # what it can quantize with
        self.options = self.compression  # what it quantizes with now (None: exact)
        self.gathered: Counter[int] = Counter()  # shard numel -> gathers (auto counts them)
        # (pieces, block size, device) -> each rank's block lengths (None: all of block_size)
        self._blocks: dict[tuple, list[torch.Tensor | None]] = {}

    @property
    def lossy(self) -> bool:
        """Whether the gathered values may differ from the shards (each rank's own piece too):
        the masters must then be a copy of their own."""
        return self.compression is not None

    def quantize(self, on: bool) -> None:
        """Gather quantized from now on, or exactly (``comm_compression.auto``); every rank
        switches at the same point."""
        self.options = self.compression if on else None

    def all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        exact: bool = False,
        pieces: Sequence[Sequence[int]] | None = None,
    ) -> Pending:
        """Every rank's ``shard`` into ``output`` (asynchronous); ``shard`` may be ``output``'s
        own piece. ``exact``: uncompressed whatever the policy, as frozen parameters travel
        (ZeRO++ quantizes the trained ones; DeepSpeed's quantized frozen weights are refused),
        and not counted among the gathers a policy may quantize. ``pieces``: per rank, the
        lengths of the parameters' pieces its shard holds, in order, where quantization blocks
        end (see [Note: quantized parameter all-gather]); None: one piece."""
        if exact:
            return self.comm.all_gather(output, shard, async_op=True)
        self.gathered[shard.numel()] += 1
        options = self.options
        if options is None:
            return self.comm.all_gather(output, shard, async_op=True)
        bits = 8 if options.method == "int8" else 4
        numel, block_size = shard.numel(), options.block_size
        blocks = self._rank_blocks(pieces, block_size, shard.device)
        count = max(quantize.num_blocks(numel, block_size) if b is None else len(b) for b in blocks)
        # before ``shard`` is overwritten
        mine = quantize.quantize(shard.float(), bits, block_size, blocks[self.comm.rank])
        scales = torch.cat([mine.scales, mine.scales.new_zeros(count - len(mine.scales))])

        def decode(
            codes: torch.Tensor, scales: torch.Tensor, rank_blocks: torch.Tensor | None
        ) -> torch.Tensor:
            q = quantize.Quantized(codes, scales, numel, bits)
            return quantize.dequantize(q, block_size, blocks=rank_blocks)

        name = f"{options.method}_param_all_gather"
        decoders = [partial(decode, rank_blocks=b) for b in blocks]
        return all_gather_encoded(self.comm, output, mine.codes, scales, decoders, name)

    def _rank_blocks(
        self, pieces: Sequence[Sequence[int]] | None, block_size: int, device: torch.device
    ) -> list[torch.Tensor | None]:
        """Each rank's block lengths for its ``pieces`` (None where they are all ``block_size``
        from the shard's start, the last one partial: the quantizer's fast path)."""
        if pieces is None:
            return [None] * self.comm.world_size
        key = (tuple(map(tuple, pieces)), block_size, device)
        if key not in self._blocks:
            self._blocks[key] = [
                None
                if all(n % block_size == 0 for n in mine[:-1])
                else quantize.piece_blocks(mine, block_size, device)
                for mine in pieces
            ]
        return self._blocks[key]
