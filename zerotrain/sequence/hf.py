"""transformers models with long sequences, their code untouched: Ulysses attention registered
in transformers' attention-function registry (DeepSpeed's ``UlyssesSPAttentionHF``), the
causal-LM loss averaged over the tokens of the sample (loss.py), and the MLPs and the loss
tiled (tiled.py).

[Note: the registration]
As DeepSpeed does, the registration replaces the entry of the model's own attention
implementation (``sdpa``, ``eager``, ``flash_attention_2``...) in ``ALL_ATTENTION_FUNCTIONS``,
so the model keeps every setup branch of that implementation and needs no new name; the
replacement runs Ulysses for the attention modules of the registered shape (query and
key/value heads, head size) and the original for any other. A module of the registered model
(it holds the registered config object) of another shape is an error, not a silent fallback
to attention over the rank's share alone. The original is kept and put back by
``unregister_from_transformers``. Eager attention gets the whole
sequence's causal mask (DeepSpeed refuses eager); every core attention gets no other mask
(``shard_batch`` refuses masks that cannot be dropped).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.sequence.attention import UlyssesAttention, check_heads
from zerotrain.sequence.batch import IGNORE_INDEX
from zerotrain.sequence.groups import SequenceParallelGroups
from zerotrain.sequence.loss import token_mean
from zerotrain.sequence.tiled import TiledFusedLogitsLoss, TiledMLP

_MASKED_CORES = ("eager", "paged|eager")  # core attentions that read the mask they are given
MISSING_SHIFT_LABELS = (
    "sequence parallelism: the loss needs `shift_labels`, the labels shifted before the sequence "
    "was cut (labels cut first lose the target of each share's last token); cut batches with "
    "shard_batch or UlyssesSPDataLoaderAdapter"
)


@dataclass
class _Registration:
    """Ulysses in the registry for one attention implementation."""

    original: Callable | None  # the registry's entry before (None for eager, which has none)
    ours: Callable
    comm: Communicator  # the sequence-parallel group it exchanges over
    shape: tuple[int, int, int]  # query heads, key/value heads, head size, per rank
    configs: set[int]  # ids of the configs whose modules are ours: a mismatch is an error
    by_engine: bool  # made by initialize (undone by the next engine), not by the caller


_registered: dict[str, _Registration] = {}


def _model_config(model_or_path: Any) -> Any:
    if hasattr(model_or_path, "config"):
        return model_or_path.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_or_path)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_shape(config: Any, sp: int, heads_split: int = 1) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) each attention call of ``config``'s model
    sees on a rank holding 1/``heads_split`` of the heads; ``ValueError`` when ``sp`` ranks
    cannot share them (attention.check_heads)."""
    text = _text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    heads, kv_heads = heads // heads_split, kv_heads // heads_split
    check_heads(heads, kv_heads, sp)
    return heads, kv_heads, head_dim


def register_attention(
    config: Any,
    core_attn_implementation: str,
    comm: Communicator,
    *,
    disable_in_eval: bool = False,
    heads_split: int = 1,
    by_engine: bool = False,
) -> None:
    """Ulysses over ``comm`` for the attention modules of ``config``'s shape (see [Note: the
    registration]), each holding 1/``heads_split`` of the heads (tensor parallelism's share);
    ``ValueError`` when the heads cannot be shared."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    shape = attention_shape(config, comm.world_size, heads_split)
    if core_attn_implementation in _registered:
        raise RuntimeError(
            f"sequence parallelism: Ulysses is already registered for "
            f"{core_attn_implementation!r} in this process; call "
            "UlyssesSPAttentionHF.unregister_from_transformers() first"
        )
    original = ALL_ATTENTION_FUNCTIONS.get(core_attn_implementation)
    if original is None and core_attn_implementation != "eager":
        known = ", ".join(["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()])
        raise ValueError(
            f"sequence parallelism: no attention implementation {core_attn_implementation!r} "
            f"in transformers; the choices are {known}"
        )
    core = original or _model_eager
    ulysses = UlyssesAttention(
        core,
        comm,
        causal_mask=core_attn_implementation in _MASKED_CORES,
        layers=getattr(_text_config(config), "num_hidden_layers", 1),
    )
    configs = {id(config), id(_text_config(config))}  # the registered model's modules hold these

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        got = (query.shape[1], key.shape[1], query.shape[-1]) if query.dim() == 4 else None
        if id(getattr(module, "config", None)) in configs and got != shape:
            raise ValueError(
                f"sequence parallelism: {type(module).__name__} called attention with (query "
                f"heads, key/value heads, head size) {got}, but Ulysses was registered for "
                f"{shape} (the model's config over the tensor-parallel degree); a model whose "
                "layers differ in heads is not supported yet"
            )
        if got != shape or (disable_in_eval and not module.training):
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = attention
    _registered[core_attn_implementation] = _Registration(
        original, attention, comm, shape, configs, by_engine
    )


def _model_eager(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Eager attention is no registry entry: each model's file has its own
    ``eager_attention_forward``, the default the model falls back to."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def unregister_attention(core_attn_implementation: str | None = None) -> None:
    """Put back the original attention functions (one implementation's, or all)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = list(_registered) if core_attn_implementation is None else [core_attn_implementation]
    for name in names:
        if name not in _registered:
            raise ValueError(
                f"sequence parallelism: {name!r} is not registered; registered: "
                f"{sorted(_registered)}"
            )
        entry = _registered.pop(name)
        if ALL_ATTENTION_FUNCTIONS.get(name) is not entry.ours:
            continue
        if entry.original is None:
            del ALL_ATTENTION_FUNCTIONS[name]
        else:
            ALL_ATTENTION_FUNCTIONS[name] = entry.original


def unregister_engines() -> None:
    """Undo the registrations engines made (``initialize`` with sequence_parallel_size), not the
    caller's own: the next engine makes its own, or has none."""
    for name in [n for n, entry in _registered.items() if entry.by_engine]:
        unregister_attention(name)


class UlyssesSPAttentionHF:
    """DeepSpeed's registration of Ulysses attention with transformers (its signature)."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> SequenceParallelGroups | None:
        """Register Ulysses for the model (built, or a path or hub name whose config is read)
        and return the mpu to pass to ``initialize(mpu=...)``; None at size 1. Collective:
        every rank makes the sequence-parallel groups. The batch shapes (``micro_batch_size``,
        ``seq_length``) are read from each forward's tensors; a fixed ``seq_length`` must
        divide by the size, as in DeepSpeed."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable:
            if seq_length is None:
                raise ValueError(
                    "register_with_transformers: give seq_length, or seq_length_is_variable=True"
                )
            if seq_length % sequence_parallel_size:
                raise ValueError(
                    f"register_with_transformers: seq_length {seq_length} does not divide into "
                    f"sequence_parallel_size {sequence_parallel_size}"
                )
        config = _model_config(model_name_or_path)
        own = getattr(config, "_attn_implementation", None)
        if own is not None and own != core_attn_implementation:
            raise ValueError(
                f"register_with_transformers: core_attn_implementation "
                f"{core_attn_implementation!r}, but the model's attn_implementation is "
                f"{own!r}; make them the same, so the model calls the function registered"
            )
        attention_shape(config, sequence_parallel_size)  # refused before any group is made
        groups = SequenceParallelGroups.make(sequence_parallel_size)
        register_attention(
            config, core_attn_implementation, groups.comm, disable_in_eval=disable_in_eval
        )
        return groups

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation: str | None = None) -> None:
        unregister_attention(core_attn_implementation)


# -- the model transforms -------------------------------------------------------------------
def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (``get_base_model``), or ``model``."""
    inner = getattr(model, "get_base_model", None)
    return inner() if callable(inner) else model


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (or a peft wrapper of one): a base model under a head, a loss
    function to replace."""
    model = causal_lm_of(model)
    return (
        hasattr(model, "config")
        and hasattr(model, "get_output_embeddings")
        and hasattr(model, "base_model")
        and model.get_output_embeddings() is not None  # pyrefly: ignore[not-callable]
    )


def sequence_parallel_loss(comm: Communicator) -> Callable[..., torch.Tensor]:
    """transformers' causal-LM loss over a share of the sequence: summed over this rank's
    valid ``shift_labels``, divided by the valid labels of all of ``comm``'s ranks (see [Note:
    the loss under sequence parallelism])."""

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            raise ValueError(MISSING_SHIFT_LABELS)
        target = shift_labels.reshape(-1).to(logits.device)
        flat = logits.float().reshape(-1, vocab_size)
        loss_sum = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
        return token_mean(loss_sum, (target != ignore_index).sum(), comm)

    return loss_function


def _labels_from_shift_labels(module, args, kwargs):
    """transformers computes the loss only when ``labels`` is given; a cut batch carries
    ``shift_labels`` instead (DeepSpeed's adapter drops ``labels``), which the loss reads."""
    if kwargs.get("labels") is None and kwargs.get("shift_labels") is not None:
        kwargs["labels"] = kwargs["shift_labels"]
    return args, kwargs


def apply_sequence_parallel(model: nn.Module, comm: Communicator, heads_split: int = 1) -> None:
    """A causal LM's loss averaged over the tokens of the sample that ``comm``'s ranks hold
    between them, computed from ``shift_labels`` alone too; its attention registered for
    Ulysses over ``comm`` unless the caller registered it (DeepSpeed's way). ``heads_split``:
    the tensor-parallel degree that split the attention's heads."""
    model = causal_lm_of(model)
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    entry = _registered.get(implementation)
    if entry is None:
        register_attention(
            model.config, implementation, comm, heads_split=heads_split, by_engine=True
        )
    else:  # the caller's registration (DeepSpeed's way): it must serve this model as it is
        shape = attention_shape(model.config, comm.world_size, heads_split)
        if entry.comm.members() != comm.members() or entry.shape != shape:
            raise ValueError(
                f"sequence parallelism: Ulysses is registered for {implementation!r} over "
                f"ranks {entry.comm.members()} with heads {entry.shape}, but this engine's "
                f"sequence-parallel ranks are {comm.members()} and its heads {shape}; register "
                "for this model (UlyssesSPAttentionHF.register_with_transformers) or leave the "
                "registration to initialize"
            )
        entry.configs |= {id(model.config), id(_text_config(model.config))}
    model.loss_function = sequence_parallel_loss(comm)  # pyrefly: ignore[bad-argument-type]
    model.register_forward_pre_hook(_labels_from_shift_labels, with_kwargs=True)


def _is_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP") and all(
        hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")
    )


def tile_mlps(model: nn.Module, tile_tokens: int | None = None) -> int:
    """Run every gated MLP (Llama, Qwen, Mistral: gate/up/down projections) over tiles of
    ``tile_tokens`` positions of every row (None: the hidden size, as ALST) with
    :class:`TiledMLP`; the count tiled."""
    tiled = 0
    for module in model.modules():
        if not _is_mlp(module) or getattr(module, "_zerotrain_tiled", False):
            continue
        forward = module.forward
        tokens = tile_tokens or module.down_proj.out_features  # pyrefly: ignore[missing-attribute]

        def tiled_forward(x, *, _forward=forward, _tokens=tokens, _module=module):
            shards = math.ceil(x.shape[-2] / _tokens)
            if shards <= 1:
                return _forward(x)
            return TiledMLP.apply(lambda _, tile: _forward(tile), _module, x, shards)

        module.forward = tiled_forward
        module._zerotrain_tiled = True  # pyrefly: ignore[bad-argument-type]
        tiled += 1
    return tiled


def loss_tile_tokens(vocab: int, tile_tokens: int | None = None) -> int:
    """Tokens per tile of the tiled loss: ``tile_tokens``, or as many as make 64 MiB of fp32
    logits over ``vocab`` (None)."""
    return tile_tokens or max(1, (64 << 20) // (4 * vocab))


def tile_loss(model: nn.Module, comm: Communicator, tile_tokens: int | None = None) -> None:
    """The causal LM's loss computed over tiles of ``tile_tokens`` tokens (None: tiles of
    logits of at most 64 MiB in fp32; a tile's logits, their softmax and its gradient are live
    together) with :class:`TiledFusedLogitsLoss`, never holding the
    whole sequence's logits; given ``labels`` or ``shift_labels``, the model returns the loss
    and no logits. ``comm``: the sequence-parallel group the loss is averaged over."""
    if not is_causal_lm(model):
        raise ValueError(
            f"tiled loss: {type(model).__name__} is not a transformers causal LM (a base model "
            "under an output embedding); tile the loss yourself with TiledFusedLogitsLoss"
        )
    model = causal_lm_of(model)
    softcap = getattr(_text_config(model.config), "final_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"tiled loss: {type(model).__name__} caps its logits (final_logit_softcapping "
            f"{softcap}), which the tiled loss does not apply; leave tiled_compute.loss off"
        )
    head: nn.Linear = model.get_output_embeddings()  # pyrefly: ignore[not-callable]
    base: nn.Module = model.base_model  # pyrefly: ignore[bad-assignment]
    forward = model.forward
    vocab = head.out_features

    def tile_loss_of(_, x, y):
        logits = head(x).float()
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    def forward_with_tiled_loss(input_ids=None, labels=None, shift_labels=None, **kwargs: Any):
        if labels is None and shift_labels is None:
            return forward(input_ids=input_ids, **kwargs)
        if shift_labels is None:
            if comm.world_size > 1:  # labels cut before shifting lost each share's last target
                raise ValueError(MISSING_SHIFT_LABELS)
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # type: ignore[index]
        for key in ("num_items_in_batch", "logits_to_keep", "return_dict"):
            kwargs.pop(key, None)
        hidden = base(input_ids=input_ids, **kwargs).last_hidden_state
        tokens = loss_tile_tokens(vocab, tile_tokens)
        shards = math.ceil(hidden.shape[0] * hidden.shape[1] / tokens)
        y = shift_labels.to(hidden.device)
        loss_sum = TiledFusedLogitsLoss.apply(
            tile_loss_of, head, hidden, y, None, shards, None, "sum"
        )
        loss = token_mean(loss_sum, (y != IGNORE_INDEX).sum(), comm)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = forward_with_tiled_loss
