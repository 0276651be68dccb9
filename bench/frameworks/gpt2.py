"""The model and data both framework scripts train: a 4-layer GPT-2 from a config (no
download, no dropout) and 256 windows of 64 random token ids, the same on every rank."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, WINDOW, WINDOWS = 512, 64, 256


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=128,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=WINDOW,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def token_ids(index: int) -> torch.Tensor:
    """Window ``index`` of the data."""
    return torch.randint(0, VOCAB, (WINDOW,), generator=torch.Generator().manual_seed(index))
