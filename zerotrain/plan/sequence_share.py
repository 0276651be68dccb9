"""One sequence-parallel rank's share of a training step, as the planner prices it: the model on
1/sp of each sample's tokens, with its attention over the whole sequence on 1/sp of the heads
(Ulysses, zerotrain/sequence), and the activations its all-to-alls carry.

[Note: a sequence-parallel rank's share]
The planner runs the model as rank 0 of a sequence-parallel group would, in its own process:
Ulysses applied to the model as training applies it (``apply_sequence_parallel``: the attention
registered in transformers' registry, the loss averaged over the sample's tokens), over a group
that is this rank alone (``AloneInGroup`` in zerotrain/plan/model_probe.py, world size sp): its
all-to-all keeps every piece where it is, so each exchange has a real rank's shapes and copies
and sends nothing; its all-reduces and its gather of the position ids hear only this rank. Fed
rank 0's share of a batch (``shard_batch``: s/sp tokens, their position ids and shifted
labels), the model probe ([Note: the model probe] in zerotrain/plan/model_probe.py) times its
forward and backward (every layer on s/sp tokens, attention on the whole sequence and 1/sp of
the heads, the exchanges' copies, the loss over the share) and counts its saved activations.
The cost model adds the wire: per attention layer and pass four all-to-alls (q, k, v and the
output forward, their gradients backward), the loss's all-reduces and the position check. The
registration is undone after the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.config.schema import TiledComputeConfig
from zerotrain.plan.model_probe import AloneInGroup, ModelProfile, profile_model

__all__ = ["SequenceShare", "profile_sequence_share", "sequence_shares", "tile_alone"]


@dataclass(frozen=True)
class SequenceShare:
    """A rank's share of a step at sequence-parallel degree ``degree``."""

    degree: int
    tokens: int
    """Tokens of each sample a rank holds: the sequence over the degree, rounded up (a length
    the degree does not divide is padded: zerotrain/sequence/batch.py)."""
    layers: int
    """Attention layers."""
    exchanged_elements: tuple[int, ...]
    """Per token a rank holds, the elements of each all-to-all of one attention layer's
    forward (q, k and v, with key/value heads repeated where fewer than the degree, and the
    output); its backward exchanges as many."""
    profile: ModelProfile | None = None
    """Rank 0's share of the step, timed and counted (see [Note: a sequence-parallel rank's
    share])."""


def tile_alone(model: nn.Module, tiles: TiledComputeConfig, degree: int = 1) -> None:
    """Tile ``model``'s MLPs and loss as ``tiles`` asks, as rank 0 of ``degree``
    sequence-parallel ranks alone would (its loss's all-reduce hears only it): how the model
    probe runs a config's ``tiled_compute``. ConfigError or ValueError where ``initialize``
    would refuse the tiles for this model."""
    from zerotrain.sequence.transform import apply_tiles

    apply_tiles(model, tiles, AloneInGroup(degree))  # pyrefly: ignore[bad-argument-type]


def sequence_shares(
    meta_model: nn.Module,
    degrees: list[int],
    seq_len: int,
    skipped: Callable[[int, str], object] | None = None,
) -> dict[int, SequenceShare]:
    """For each degree of ``degrees`` at which Ulysses can share ``meta_model``'s attention (a
    transformers causal LM whose heads the degree divides), a rank's share at ``seq_len``
    tokens a sample, without its profile; each other degree is passed to ``skipped`` with the
    reason."""
    from zerotrain.plan.model_probe import is_hf_causal_lm
    from zerotrain.sequence.attention import check_heads
    from zerotrain.sequence.hf import attention_shape, is_causal_lm

    shares = {}
    for degree in degrees:
        why, shape = None, None
        if not (is_hf_causal_lm(meta_model) and is_causal_lm(meta_model)):
            why = "Ulysses is planned for transformers causal LMs (their attention is registered)"
        elif seq_len < degree:
            why = f"a sample of {seq_len} tokens has fewer than {degree}"
        else:
            try:
                shape = attention_shape(meta_model.config, degree)
            except ValueError as error:
                why = str(error)
        if shape is None:
            if skipped is not None:
                skipped(degree, why or "")
            continue
        heads, kv_heads, head_dim = shape
        kv_heads *= check_heads(heads, kv_heads, degree)
        config: Any = meta_model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        q, kv = heads * head_dim, kv_heads * head_dim
        shares[degree] = SequenceShare(
            degree,
            tokens=-(-seq_len // degree),
            layers=text.num_hidden_layers,
            exchanged_elements=(q, kv, kv, q),
        )
    return shares


def profile_sequence_share(
    factory,
    share: SequenceShare,
    *,
    micro_batches: list[int],
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype,
    threads: int,
    tiles: TiledComputeConfig | None = None,
) -> SequenceShare:
    """``share`` with rank 0's share of the step profiled at each of ``micro_batches`` samples
    of ``seq_len`` tokens (see [Note: a sequence-parallel rank's share]), its MLPs and loss
    tiled as ``tiles`` asks."""
    from zerotrain.sequence.hf import apply_sequence_parallel, unregister_engines

    comm = AloneInGroup(share.degree)

    def ulysses(model: nn.Module) -> None:
        apply_sequence_parallel(model, comm)  # pyrefly: ignore[bad-argument-type]
        if tiles is not None:
            tile_alone(model, tiles, share.degree)

    try:
        profile = profile_model(
            factory,
            micro_batches=micro_batches,
            seq_len=seq_len,
            vocab_size=vocab_size,
            dtype=dtype,
            threads=threads,
            prepare=ulysses,
            sequence_parallel=share.degree,
        )
    finally:
        unregister_engines()  # apply_sequence_parallel's registration is an engine's
    return SequenceShare(
        share.degree, share.tokens, share.layers, share.exchanged_elements, profile
    )
