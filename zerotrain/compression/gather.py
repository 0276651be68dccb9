"""How updated parameters travel: the backend's all-gather, or a block-quantized one.

[Note: quantized parameter all-gather]
ZeRO++'s qwZ (arXiv:2306.10209 §4.1): each rank quantizes its shard of a bucket per block
(int8 or int4, one fp32 scale per block; quantize.py) and the ranks all-gather codes and
scales, then dequantize every piece, their own too, into the whole parameters. Every rank so
holds the same parameters, and the fp32 masters that the optimizer steps are never quantized:
the quantization error of one step does not carry into the next (it is not error feedback's
kind of loss, which would be summed over steps). Used wherever ZeRO gathers parameters: after
the step at stages 1-2, around each use at stage 3.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

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

    @property
    def lossy(self) -> bool:
        """Whether the gathered values may differ from the shards (each rank's own piece too):
        the masters must then be a copy of their own."""
        return self.compression is not None

    def quantize(self, on: bool) -> None:
        """Gather quantized from now on, or exactly (``comm_compression.auto``); every rank
        switches at the same point."""
        self.options = self.compression if on else None

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, exact: bool = False) -> Pending:
        """Every rank's ``shard`` into ``output`` (asynchronous); ``shard`` may be ``output``'s
        own piece. ``exact``: uncompressed whatever the policy, as frozen parameters travel
        (ZeRO++ quantizes the trained ones; DeepSpeed's quantized frozen weights are refused),
        and not counted among the gathers a policy may quantize."""
        if exact:
            return self.comm.all_gather(output, shard, async_op=True)
        self.gathered[shard.numel()] += 1
        options = self.options
        if options is None:
            return self.comm.all_gather(output, shard, async_op=True)
        bits = 8 if options.method == "int8" else 4
        numel, block_size = shard.numel(), options.block_size
        mine = quantize.quantize(shard.float(), bits, block_size)  # before it is overwritten

        def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return quantize.dequantize(quantize.Quantized(codes, scales, numel, bits), block_size)

        name = f"{options.method}_param_all_gather"
        return all_gather_encoded(self.comm, output, mine.codes, mine.scales, decode, name)
