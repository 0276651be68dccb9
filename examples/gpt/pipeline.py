"""The GPT of model.py as a pipeline: DeepSpeed's PipelineModule over the same weights.

Embeddings, blocks, final norm, and the LM head, which is the token embedding (tied) on the
last stage: a TiedLayerSpec keeps the two copies one parameter across the first and last stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gpt.model import GPT
from torch import nn

from zerotrain.pipe import PipelineModule, TiedLayerSpec


class Embeddings(nn.Module):
    """Token plus position embeddings of ``gpt`` (its own modules: the same weights)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.token = gpt.token_embedding
        self.position = gpt.position_embedding
        self.dropout = gpt.dropout

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.token(idx) + self.position(positions))


def _lm_head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    return x @ embeddings.token.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """As GPT.forward's: cross-entropy in fp32 whatever the model's dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def pipeline_gpt(gpt: GPT, stages: int, pipe: Any = None, **options: Any) -> PipelineModule:
    """``gpt`` cut into ``stages`` (its blocks spread evenly) with its weights. Every rank built
    ``gpt`` whole; each keeps only its stage's layers registered. ``pipe``: the module with the
    PipelineModule and TiedLayerSpec classes (default zerotrain.pipe; ``deepspeed.pipe`` builds
    DeepSpeed's, for a comparison); ``options`` go to PipelineModule."""
    module = PipelineModule if pipe is None else pipe.PipelineModule
    tied = TiedLayerSpec if pipe is None else pipe.TiedLayerSpec
    shared = "token.weight"  # what DeepSpeed keeps one parameter (zerotrain: all of it)
    layers = [
        tied("embed", Embeddings, gpt, tied_weight_attr=shared),
        *gpt.blocks,
        gpt.ln_final,
        tied("embed", Embeddings, gpt, forward_fn=_lm_head, tied_weight_attr=shared),
    ]
    return module(
        layers, num_stages=stages, loss_fn=lm_loss, partition_method="type:Block", **options
    )
