"""Activation bytes per device of a transformer's training step (Korthikanti et al. 2022).

# [Note: activations]
Korthikanti et al. 2022 (arXiv:2205.05198) §4.1: one transformer layer (micro-batch b, sequence
s, hidden h, a heads, a 4h GeLU MLP, no tensor or sequence parallelism: zerotrain is purely
data-parallel) keeps sbh(34 + 5as/h) bytes for its backward with 16-bit activations, 1-byte
dropout masks and attention that stores its softmax:
  attention: LayerNorm output 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as²b, its dropout
  mask as²b and output 2as²b, output projection input 2sbh, dropout mask sbh (11sbh + 5as²b);
  MLP: input 2sbh, GeLU input 8sbh, second linear's input 8sbh, dropout mask sbh (19sbh);
  the two LayerNorms' inputs: 4sbh.
Here e bytes per activation element (2; 4 in fp32) and an MLP of width i (4h above) generalise
it, per layer:
  8e·sbh                                  the tensors above outside the MLP's hidden width, 8
                                          elements per token and channel
  + k·e·sbi                               the MLP's hidden tensors: a GeLU MLP (two h x i
                                          matrices) keeps k = 2, the activation's input and the
                                          second linear's; a gated one (SwiGLU, GeGLU: three)
                                          keeps k = 4, the gate's projection, its activation,
                                          the up projection and their product
  + 2·sbh                                 the two residual dropout masks (dropout > 0)
  + attention: eager   e·as²b (softmax output) + (1 + e)·as²b with dropout (mask, output)
               flash   4·asb, the fp32 log-sum-exp per row and head (fused SDPA kernels keep
                       no s×s matrix; their dropout keeps an RNG seed, no mask)
  + 2 LayerNorms × (mean, rstd) × sb × norm_stats_bytes: 4 on CUDA (fp32 statistics); the
    activation dtype's size on CPU; the paper leaves them out (16/(34h) of a layer at 4 bytes).
e = 2, i = 4h with GeLU, eager, dropout and no norm statistics give exactly sbh(34 + 5as/h).
Outside the layers: token ids and targets (int64, 16sb), the embedding dropout mask (sbh), the
final LayerNorm's input and statistics, the LM head's input (e·sbh each) and, with a vocabulary
size v, the loss's fp32 log-softmax (4sbv). O(s) terms (position ids) are left out.
Full activation checkpointing (every layer) keeps each layer's input, e·sbh, and recomputes one
layer at a time in the backward: L·e·sbh + outside + one layer's bytes at the peak.
Not counted: activation gradients during the backward, kernel temporaries, RMSNorm's and rotary
embeddings' own intermediates (Llama's RMSNorm keeps fp32 copies of its input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ActivationAssumptions", "ActivationBytes", "TransformerShape", "activation_bytes"]

# Tensors of the MLP's hidden width (s·b·i elements) a layer keeps ([Note: activations]).
_MLP_HIDDEN_TENSORS = {"gelu": 2, "swiglu": 4}


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The shape that activation memory depends on (Korthikanti et al.'s b, s, h, L, a, v)."""

    batch_size: int
    """Micro-batch per device (b)."""
    seq_len: int
    """Tokens per sample (s)."""
    hidden_size: int
    """Width of the residual stream (h)."""
    layers: int
    """Transformer layers (L)."""
    heads: int
    """Attention heads (a)."""
    vocab_size: int | None = None
    """Vocabulary (v): adds the loss's fp32 log-softmax, 4·s·b·v bytes; None leaves it out."""
    intermediate_size: int | None = None
    """Width of the MLP's hidden layer (i); None: 4h, the paper's."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """``gelu``: two h x i matrices with an element-wise activation between (GPT-2, BERT);
    ``swiglu``: gated, three h x i matrices (Llama, Mistral; GeGLU keeps the same bytes)."""

    @property
    def mlp_width(self) -> int:
        """i: :attr:`intermediate_size`, or 4h when it is not given."""
        return self.intermediate_size or 4 * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class ActivationAssumptions:
    """What the model keeps for its backward beyond Korthikanti et al.'s shape terms."""

    element_bytes: int = 2
    """Bytes per activation element: 2 in bf16/fp16 training, 4 in fp32."""
    attention: Literal["eager", "flash"] = "eager"
    """``eager`` keeps the s×s softmax (the paper's 5as/h term); ``flash`` (fused SDPA kernels)
    keeps an fp32 log-sum-exp per row and head instead."""
    dropout: bool = True
    """Dropout layers with p > 0 keep 1-byte masks (the paper's assumption)."""
    norm_stats_bytes: int = 4
    """Bytes of each LayerNorm mean and rstd per row: 4 on CUDA, the activation dtype's size on
    CPU, 0 to leave them out as the paper does."""


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """Activation bytes per device for one micro-batch (see [Note: activations])."""

    per_layer: float
    """What one layer keeps for its backward."""
    layer_input: float
    """One layer's input, e·sbh: all that a checkpointed layer keeps."""
    outside: float
    """Embeddings, final norm, LM head and loss."""
    layers: int

    @property
    def without_checkpointing(self) -> float:
        """Kept from the end of the forward to the backward."""
        return self.layers * self.per_layer + self.outside

    @property
    def checkpointed_kept(self) -> float:
        """Kept after the forward when every layer is checkpointed."""
        return self.layers * self.layer_input + self.outside

    @property
    def checkpointed_peak(self) -> float:
        """With every layer checkpointed, the peak: one layer recomputed in the backward."""
        return self.checkpointed_kept + self.per_layer


def activation_bytes(
    shape: TransformerShape, assumptions: ActivationAssumptions = ActivationAssumptions()
) -> ActivationBytes:
    """Korthikanti et al.'s per-layer sbh(34 + 5as/h), generalised as [Note: activations] says."""
    b, s, h, a = shape.batch_size, shape.seq_len, shape.hidden_size, shape.heads
    e, drop = assumptions.element_bytes, assumptions.dropout
    sbh, sb = s * b * h, s * b
    mlp_tensors = _MLP_HIDDEN_TENSORS.get(shape.mlp)
    if mlp_tensors is None:
        raise ValueError(
            f"TransformerShape.mlp: one of {', '.join(_MLP_HIDDEN_TENSORS)}, got {shape.mlp!r}"
        )
    if assumptions.attention == "eager":
        attention = a * s * s * b * (e + ((1 + e) if drop else 0))
    elif assumptions.attention == "flash":
        attention = 4 * a * s * b
    else:
        raise ValueError(
            f"ActivationAssumptions.attention: 'eager' or 'flash', got {assumptions.attention!r}"
        )
    norm_stats = 2 * sb * assumptions.norm_stats_bytes  # mean and rstd per row
    mlp_hidden = mlp_tensors * e * sb * shape.mlp_width
    per_layer = 8 * e * sbh + mlp_hidden + (2 * sbh if drop else 0) + attention + 2 * norm_stats
    outside = 16 * sb + (sbh if drop else 0) + 2 * e * sbh + norm_stats
    if shape.vocab_size:
        outside += 4 * sb * shape.vocab_size
    return ActivationBytes(
        per_layer=per_layer, layer_input=e * sbh, outside=outside, layers=shape.layers
    )
