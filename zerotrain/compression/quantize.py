"""Block-wise symmetric quantization to int8 or int4, and its inverse.

[Note: block-wise quantization]
A flat fp32 tensor is cut into blocks of ``block_size`` elements; each block keeps one fp32
scale, its largest magnitude over ``levels`` (127 for int8, 7 for int4), and every element
becomes ``round(x / scale)``, an integer in ``[-levels, levels]``. The error of an element is at
most half a step, ``scale / 2``: a block's error is bounded by its own largest value, so one large
gradient does not wash out the small ones elsewhere (ZeRO++, arXiv:2306.10209 §4.1, quantizes
per block for this reason). int4 codes are stored two to a byte (low nibble first). A value
that is an integer multiple of its block's scale, within the levels, comes back exactly.

Given the lengths of the pieces a tensor is made of (``blocks``, from :func:`piece_blocks`),
each piece is cut into blocks from its own start, its last block partial: no block spans two
pieces, so one parameter's magnitudes never set another's scale (see [Note: quantized
parameter all-gather] in gather.py for what that costs otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LEVELS = {8: 127, 4: 7}


@dataclass
class Quantized:
    """``codes`` (int8, or two int4 codes per uint8 byte) and one fp32 ``scales`` entry per
    block of a flat tensor of ``numel`` elements."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of ``numel`` elements."""
    return numel if bits == 8 else -(-numel // 2)


def piece_blocks(pieces: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """The lengths of the blocks (int64, on ``device``) of a flat tensor made of consecutive
    pieces of the lengths ``pieces``, each cut into blocks of ``block_size`` from its own start
    (see [Note: block-wise quantization])."""
    lengths = []
    for numel in pieces:
        whole, rest = divmod(numel, block_size)
        lengths.append(torch.full((whole,), block_size, dtype=torch.int64))
        if rest:
            lengths.append(torch.tensor([rest]))
    return torch.cat(lengths).to(device)


def quantize(
    flat: torch.Tensor, bits: int, block_size: int, blocks: torch.Tensor | None = None
) -> Quantized:
    """``flat`` (1-D) quantized per block (see [Note: block-wise quantization]); ``blocks``: the
    blocks' lengths (:func:`piece_blocks`), else ``block_size`` each from the start."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    values, numel = flat.to(torch.float32), flat.numel()
    if blocks is not None:
        codes, scales = _quantize_blocks(values, blocks, LEVELS[bits])
        return Quantized(_pack_int4(codes) if bits == 4 else codes, scales, numel, bits)
    whole = numel - numel % block_size
    # the whole blocks in place; a copy padded with zeros only for the last, partial one (a
    # padded copy of everything cost twice the quantization itself)
    codes, scales = _quantize_rows(values[:whole].view(-1, block_size), LEVELS[bits])
    if whole < numel:
        tail = values.new_zeros(block_size)
        tail[: numel - whole] = values[whole:]
        tail_codes, tail_scale = _quantize_rows(tail.view(1, block_size), LEVELS[bits])
        codes = torch.cat([codes, tail_codes[: numel - whole]])
        scales = torch.cat([scales, tail_scale])
    if bits == 4:
        codes = _pack_int4(codes)
    return Quantized(codes, scales, numel, bits)


def _quantize_rows(rows: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes (flat) and the scales of blocks laid out as ``rows``. The codes need no
    clamp: no value's magnitude exceeds its block's largest, ``levels`` steps."""
    scales = rows.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (rows / safe[:, None]).round_().to(torch.int8).view(-1), scales


def _quantize_blocks(
    values: torch.Tensor, blocks: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_rows` over blocks of the lengths ``blocks``: the same codes and scales
    where they are all one size. ``unsafe``: the lengths are ours, and checking them would
    wait for the device."""
    scales = torch.segment_reduce(values.abs(), "max", lengths=blocks, unsafe=True) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    per_element = safe.repeat_interleave(blocks, output_size=len(values))
    return values.div(per_element).round_().to(torch.int8), scales


def dequantize(
    q: Quantized,
    block_size: int,
    out: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 values ``q`` stands for (into ``out`` when given, 1-D of ``q.numel``, any
    float dtype: rounded once from fp32); ``blocks`` as :func:`quantize` was given them (the
    scales beyond their number are ignored)."""
    codes = _unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes
    if out is None:
        out = torch.empty(q.numel, dtype=torch.float32, device=codes.device)
    if blocks is not None:
        scales = q.scales[: len(blocks)].repeat_interleave(blocks, output_size=q.numel)
        return torch.mul(codes, scales, out=out)
    whole = q.numel - q.numel % block_size
    rows = whole // block_size
    torch.mul(
        codes[:whole].view(rows, block_size),
        q.scales[:rows, None],
        out=out[:whole].view(rows, block_size),
    )
    if whole < q.numel:
        torch.mul(codes[whole:], q.scales[rows], out=out[whole:])
    return out


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    nibbles = (codes + 8).to(torch.uint8)  # [-7, 7] -> [1, 15]
    if len(nibbles) % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).view(-1)[:numel]


# -- 1-bit: signs and one scale ----------------------------------------------------------------
def sign_compress(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit Adam's compressor (arXiv:2102.02888 §3.2), per block: each element's sign (zero
    counts as +), packed 8 to a byte, and one fp32 scale per block of ``block_size``, the
    block's root mean square, so each decompressed block keeps its L2 norm. (DeepSpeed takes
    one scale per tensor; a gradient bucket holds tensors of very different magnitudes.)"""
    numel = values.numel()
    blocks = num_blocks(numel, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=values.device)
    padded[:numel] = values
    rows = padded.view(blocks, block_size)
    counts = torch.full((blocks,), float(block_size), device=values.device)
    counts[-1] = numel - (blocks - 1) * block_size  # the last block's real elements
    scales = (rows.square().sum(dim=1) / counts).sqrt()
    bits = (values >= 0).to(torch.uint8)
    pad = -numel % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    packed = (bits.view(-1, 8) << _SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)
    return packed, scales


def sign_decompress(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int
) -> torch.Tensor:
    """The vector :func:`sign_compress` stands for: ± its block's scale per element."""
    bits = (packed[:, None] >> _SHIFTS.to(packed.device)) & 1
    signs = bits.view(-1)[:numel].float() * 2 - 1
    return signs * scales.repeat_interleave(block_size)[:numel]


_SHIFTS = torch.arange(8, dtype=torch.uint8)
