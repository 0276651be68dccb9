"""Block-wise symmetric quantization to int8 or int4, and its inverse.

[Note: block-wise quantization]
A flat fp32 tensor is cut into blocks of ``block_size`` elements; each block keeps one fp32
scale, its largest magnitude over ``levels`` (127 for int8, 7 for int4), and every element
becomes ``round(x / scale)``, an integer in ``[-levels, levels]``. The error of an element is at
most half a step, ``scale / 2``: a block's error is bounded by its own largest value, so one large
gradient does not wash out the small ones elsewhere (ZeRO++, arXiv:2306.10209 §4.1, quantizes
per block for this reason). int4 codes are stored two to a byte (low nibble first). A value
that is an integer multiple of its block's scale, within the levels, comes back exactly.
"""

from __future__ import annotations

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


def quantize(flat: torch.Tensor, bits: int, block_size: int) -> Quantized:
    """``flat`` (1-D) quantized per block (see [Note: block-wise quantization])."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    values, numel = flat.to(torch.float32), flat.numel()
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


def dequantize(q: Quantized, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values ``q`` stands for (into ``out`` when given, 1-D of ``q.numel``, any
    float dtype: rounded once from fp32)."""
    codes = _unpack_int4(q.codes, q.numel) if q.bits == 4 else q.codes
    if out is None:
        out = torch.empty(q.numel, dtype=torch.float32, device=codes.device)
    whole = q.numel - q.numel % block_size
    blocks = whole // block_size
    torch.mul(
        codes[:whole].view(blocks, block_size),
        q.scales[:blocks, None],
        out=out[:whole].view(blocks, block_size),
    )
    if whole < q.numel:
        torch.mul(codes[whole:], q.scales[blocks], out=out[whole:])
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
