"""Training text for the GPT example, tokenized as bytes.

The default corpus needs no download: the Python standard library's own source files, which
every Python installation carries (a few tens of MB of code and docstrings). The corpus is
deterministic for a given Python version: the files are read in sorted order.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from zerotrain.progress import progress

__all__ = [
    "TokenWindows",
    "decode",
    "encode",
    "load_corpus",
    "stdlib_corpus",
    "train_val_datasets",
]

DEFAULT_MAX_BYTES = 8 * 2**20
# Third-party packages can live under the stdlib directory; they differ between installations.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens: each UTF-8 byte is one token id in 0..255. Returns a 1D uint8 tensor."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of `encode`; byte sequences that are not valid UTF-8 become U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _concatenate(files: list[Path], max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    with progress("corpus read", total=max_bytes, unit="B") as advance:
        for path in files:
            if size >= max_bytes:
                break
            chunk = path.read_bytes()[: max_bytes - size]
            chunks.append(chunk)
            size += len(chunk)
            advance(len(chunk))
    return b"".join(chunks)


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The standard library's *.py files, sorted by path, concatenated up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        # pruned, not filtered: site-packages can hold far more than the library (4 s of torch)
        subdirectories[:] = [d for d in subdirectories if d not in _NOT_STDLIB]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(
            f"no *.py files under the standard library directory {root}; pass --data PATH"
        )
    return _concatenate(files, max_bytes)


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Bytes of the text file `path`, of every file under the directory `path` (sorted by
    path), or of the standard library's sources when `path` is None; at most `max_bytes`."""
    if path is None:
        return stdlib_corpus(max_bytes)
    path = Path(path)
    if path.is_file():
        return _concatenate([path], max_bytes)
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if files:
            return _concatenate(files, max_bytes)
        raise FileNotFoundError(f"--data {path}: the directory holds no files")
    raise FileNotFoundError(f"--data {path}: no such file or directory")


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of a token stream: item i is (x, y), two int64 tensors of
    `block_size` tokens, with y the next token after each token of x."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"TokenWindows: {tokens.numel()} tokens are too few for one window of "
                f"block_size {block_size} (+1 for the shifted targets)"
            )
        self.tokens = tokens  # 1D uint8: a quarter of the memory of int64 for the whole corpus
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"TokenWindows: index {index} out of range [0, {len(self)})")
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def train_val_datasets(
    block_size: int,
    path: str | Path | None = None,
    val_fraction: float = 0.05,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[TokenWindows, TokenWindows]:
    """Train and validation windows over the corpus of `load_corpus(path)`.

    The validation split is the last `val_fraction` of the token stream, so no window of it
    overlaps a training window.
    """
    tokens = encode(load_corpus(path, max_bytes))
    n_val = max(block_size + 1, int(tokens.numel() * val_fraction))
    if tokens.numel() - n_val < block_size + 1:
        raise ValueError(
            f"the corpus has {tokens.numel()} bytes: too little for a train and a validation "
            f"split of windows of {block_size} tokens"
        )
    return (
        TokenWindows(tokens[:-n_val], block_size),
        TokenWindows(tokens[-n_val:], block_size),
    )
