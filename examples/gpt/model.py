"""A small GPT: a decoder-only transformer for byte-level language modelling.

GPT-2's layout (Radford et al. 2019): pre-LayerNorm blocks of causal self-attention and a GELU
MLP, learned position embeddings, and an LM head tied to the token embedding (Press & Wolf,
arXiv:1608.05859). Attention runs through `F.scaled_dot_product_attention`, which picks the
fastest kernel available on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_config"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a `GPT`."""

    vocab_size: int = 256
    """Token ids are 0..vocab_size-1; 256 for the byte-level tokenizer of `gpt.data`."""
    block_size: int = 128
    """Longest sequence the model accepts (the number of learned positions)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 256
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches; 0.0 keeps runs deterministic."""
    bias: bool = False
    """Biases in the Linear layers. Off by default: the attention key bias has an analytically
    zero gradient (softmax is shift-invariant), so Adam would only move it by rounding noise."""
    num_experts: int = 0
    """Mixture-of-Experts: with more than 0, every other block's MLP (the 2nd, 4th, ...) is
    `zerotrain.moe.MoE` over this many copies of it."""
    moe_k: int = 1
    """Experts per token (top-1 or top-2 gating)."""
    ep_size: int = 1
    """Ranks the experts are spread over (expert parallelism)."""
    aux_loss_coef: float = 0.01
    """Weight of the MoE layers' load-balancing loss in the training loss."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_head ({self.n_head}) must divide n_embd ({self.n_embd})"
            )


# Parameter counts as measured by `GPT(gpt_config(name)).num_parameters()`.
PRESETS: dict[str, GPTConfig] = {
    # 0.22M parameters: for tests, a training step takes milliseconds.
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=64),
    # 4.83M parameters: loss falls visibly within 200 steps (a couple of minutes on 2 CPU cores).
    "demo": GPTConfig(block_size=128, n_layer=6, n_head=8, n_embd=256),
    # 31.7M parameters.
    "30m": GPTConfig(block_size=256, n_layer=10, n_head=8, n_embd=512),
    # 99.5M parameters: GPT-2 small's width and heads, 14 blocks (bench/offload.py).
    "100m": GPTConfig(block_size=256, n_layer=14, n_head=12, n_embd=768),
}


def gpt_config(name: str, **overrides: object) -> GPTConfig:
    """The preset `name` ("tiny", "demo", "30m" or "100m") with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier ones."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, 3 * width) -> 3 x (batch, n_head, seq, head_dim). Under tensor
        # parallelism qkv and n_head are this rank's share of the heads, hence no `width` here.
        q, k, v = (
            t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). With ``moe`` the
    MLP is a Mixture-of-Experts layer of `config.num_experts` MLPs, whose load-balancing loss
    goes to `aux_losses` while the model's forward collects them."""

    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp: nn.Module = MLP(config)
        # the GPT's list while its forward runs; None otherwise, so that a checkpointed block's
        # recomputation in the backward keeps no loss (and the graph behind it) alive
        self.aux_losses: list[torch.Tensor] | None = None
        if moe:
            from zerotrain.moe import MoE

            self.mlp = MoE(
                config.n_embd,
                self.mlp,
                num_experts=config.num_experts,
                ep_size=config.ep_size,
                k=config.moe_k,
                capacity_factor=1.25,
                min_capacity=4,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        out = self.mlp(self.ln_mlp(x))
        if isinstance(out, tuple):  # an MoE layer: (output, l_aux, exp_counts)
            out, l_aux, _ = out
            if self.aux_losses is not None:
                self.aux_losses.append(l_aux)
        return x + out


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``model(idx)`` returns logits of shape (batch, seq, vocab_size); ``model(idx, targets)``
    returns the mean cross-entropy loss, which is what a training loop passes to
    ``engine.backward``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config, moe=config.num_experts > 0 and i % 2 == 1) for i in range(config.n_layer)
        )
        self.ln_final = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied: one tensor, two uses
        self.apply(self._init_weights)
        # GPT-2 §2.3: scale the residual projections by 1/sqrt(number of residual layers) so the
        # residual stream's variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for token ids `idx` (batch, seq), or the mean loss against `targets`."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"GPT: sequence length {seq} exceeds block_size {self.config.block_size}"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        aux: list[torch.Tensor] = []
        collect = self.config.num_experts > 0
        for block in self.blocks:
            if collect:
                block.aux_losses = aux
            x = block(x)
        if collect:  # taken: a checkpointed block's recomputation keeps none alive
            for block in self.blocks:
                block.aux_losses = None
        logits = self.lm_head(self.ln_final(x))
        if targets is None:
            return logits
        # In fp32 whatever the model's dtype: log-softmax over the vocabulary in bf16/fp16
        # loses the small probabilities that carry most of the loss.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss + self.config.aux_loss_coef * sum(aux) if aux else loss


# Factories without arguments, for commands that take ``path/to/file.py:factory``
# (``zerotrain estimate --model``, ``zerotrain plan --model``).
def tiny() -> GPT:
    """The "tiny" preset (0.22M parameters)."""
    return GPT(gpt_config("tiny"))


def demo() -> GPT:
    """The "demo" preset (4.83M parameters)."""
    return GPT(gpt_config("demo"))


def gpt_30m() -> GPT:
    """The "30m" preset (31.7M parameters)."""
    return GPT(gpt_config("30m"))


def gpt_100m() -> GPT:
    """The "100m" preset (99.5M parameters)."""
    return GPT(gpt_config("100m"))


def moe_demo() -> GPT:
    """The "demo" preset with every other block's MLP a `zerotrain.moe.MoE` of 4 experts, each
    token routed to 2, spread over 2 ranks (ep_size 2: each rank builds and trains 2 of the 4;
    launch a multiple of 2 ranks)."""
    return GPT(gpt_config("demo", num_experts=4, moe_k=2, ep_size=2))
