"""Llama-shaped causal LMs built from a config (transformers' ``LlamaForCausalLM``, SDPA
attention, grouped-query heads), as factories ``zerotrain plan`` and ``zerotrain estimate``
take: ``--model examples/llama/model.py:small``. Untrained weights; for planning and timing
long-sequence jobs, such as sequence parallelism (docs/long-context.md)."""

from __future__ import annotations

from torch import nn

__all__ = ["PRESETS", "llama", "small", "tiny"]

PRESETS = {
    # 2 layers, 64 wide: tests
    "tiny": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
    # 4 layers, 256 wide, 8 query and 4 key/value heads (8.3M parameters): benchmarks on a CPU
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
    ),
}


def llama(preset: str) -> nn.Module:
    """A ``LlamaForCausalLM`` of the named preset, initialised from the current seed."""
    import transformers

    config = transformers.LlamaConfig(**PRESETS[preset], attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def tiny() -> nn.Module:
    return llama("tiny")


def small() -> nn.Module:
    return llama("small")
