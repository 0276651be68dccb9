"""Which layers tensor parallelism splits, and how: a plan, applied to a model in place.

[Note: tensor-parallel plans]
A plan maps module names (``fnmatch`` patterns over qualified names, as
``torch.distributed.tensor.parallel.parallelize_module`` takes them) to a style:
``"colwise"`` splits a linear layer's output features (``"colwise:3"``: a fused q/k/v, each third
split alone, see [Note: fused blocks] in comm/split.py), ``"rowwise"`` its input features, and
``"divide:a,b"`` divides integer attributes of a module (its head count) by the degree. Torch's
styles are accepted too (see [Note: torch's parallel styles]). Without
a plan, the automatic one splits the attention and MLP of every block it recognises by its
layers' names, column then row (Megatron-LM, arXiv:1909.08053): GPT-2's ``c_attn``/``c_fc``
then ``c_proj``, Llama-shaped ``q_proj``/``k_proj``/``v_proj`` then ``o_proj`` and
``gate_proj``/``up_proj`` then ``down_proj``, zerotrain's example GPT. Embeddings, norms and
the LM head stay whole on every tensor-parallel rank.

The layers keep their names and their Parameter objects (split in place), so state dict keys
and optimizer groups built before are unchanged. Parameters are plain tensors holding this
rank's piece: ZeRO shards them over the data-parallel group like any other.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.comm.split import Split, split_of, split_parameter
from zerotrain.config.errors import ConfigError
from zerotrain.tensor_parallel.regions import (
    copy_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from zerotrain.tensor_parallel.sequence import parallelize_sequence

_HEAD_COUNTS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class Colwise:
    """Split the output features (``chunks`` > 1: a fused projection, block by block)."""

    chunks: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Split the input features; the partial outputs are summed over the group."""


@dataclass(frozen=True)
class Divide:
    """Divide integer attributes of a module (a head count) by the tensor-parallel degree."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class SequenceSharded:
    """A module torch's plan runs on a share of the sequence (``SequenceParallel()`` on a norm,
    ``PrepareModuleInput`` gathering it for a split module): nothing of it is split, and
    sequence parallelism runs it so (see [Note: torch's parallel styles])."""


Style = Colwise | Rowwise | Divide | SequenceSharded

# The automatic plan: a module whose children include these names gets these styles (and
# its own attributes divided where it has them).
_AUTO_RULES: list[tuple[dict[str, Style], tuple[str, ...]]] = [
    ({"c_attn": Colwise(3), "c_proj": Rowwise()}, ("num_heads", "split_size")),  # GPT-2
    ({"c_fc": Colwise(), "c_proj": Rowwise()}, ()),
    (
        {"q_proj": Colwise(), "k_proj": Colwise(), "v_proj": Colwise(), "o_proj": Rowwise()},
        ("num_heads", "num_key_value_heads"),
    ),  # Llama-shaped
    ({"gate_proj": Colwise(), "up_proj": Colwise(), "down_proj": Rowwise()}, ()),
    ({"qkv": Colwise(3), "proj": Rowwise()}, ("n_head",)),  # zerotrain's example GPT
    ({"fc": Colwise(), "proj": Rowwise()}, ()),
]


def parse_style(value: object, where: str) -> Style:
    """A plan entry's style from its config string or torch ParallelStyle."""
    if type(value).__module__.startswith("torch.distributed"):
        return _torch_style(value, where)
    if isinstance(value, Colwise | Rowwise | Divide | SequenceSharded):
        return value
    text = value if isinstance(value, str) else ""
    name, _, arg = text.partition(":")
    if name == "colwise" and (not arg or (arg.isdigit() and int(arg) > 0)):
        return Colwise(int(arg) if arg else 1)
    if name == "rowwise" and not arg:
        return Rowwise()
    names = tuple(arg.split(","))
    if name == "divide" and all(n.isidentifier() for n in names):
        return Divide(names)
    raise ConfigError(
        f'{where}: {value!r} is not a tensor-parallel style; use "colwise", "colwise:N" (a '
        'fused projection of N blocks), "rowwise" or "divide:attr,..." (or torch\'s '
        "ColwiseParallel() / RowwiseParallel() / SequenceParallel() / PrepareModuleInput())"
    )


# [Note: torch's parallel styles]
# A plan written for torch's ``parallelize_module`` (torchtitan's) is taken as it is: each style
# is read by its layouts, and must describe what zerotrain runs. Column-parallel takes a whole
# or a sequence-sharded input and leaves its output split by features; row-parallel takes a
# feature-split input and gives a whole output (an all-reduce) or a sequence-sharded one (a
# reduce-scatter: sequence parallelism). ``SequenceParallel()`` on a norm and
# ``PrepareModuleInput`` gathering a sequence-sharded input mark what sequence parallelism runs
# anyway. Anything else (local DTensor outputs, vocabulary-parallel embeddings and heads, other
# dimensions) is an error naming the option; a plan that shards the sequence needs
# ``tensor_parallel.sequence_parallel`` (see shards_sequence).
_SEQUENCE = "shard1"  # the sequence dimension of (batch, sequence, hidden) activations


def _layouts(placements: object) -> tuple[str, ...]:
    """torch placements as text: ``Shard(dim=1)`` "shard1", ``Replicate()`` "replicate"."""
    items = placements if isinstance(placements, tuple | list) else (placements,)
    return tuple(_layout(p) for p in items)


def _layout(placement: object) -> str:
    if placement is None:
        return "none"
    kind = type(placement).__name__
    return f"shard{getattr(placement, 'dim', '?')}" if kind == "Shard" else kind.lower()


def _torch_style(value: object, where: str) -> Style:
    kind = type(value).__name__
    get = vars(value).get
    if kind == "ColwiseParallel":
        accepted = {
            "input_layouts": [("replicate",), (_SEQUENCE,)],
            "desired_input_layouts": [("replicate",)],
            "output_layouts": [("shard-1",)],
        }
        style: Style = Colwise()
    elif kind == "RowwiseParallel":
        accepted = {
            "input_layouts": [("shard-1",)],
            "output_layouts": [("replicate",), (_SEQUENCE,)],
        }
        style = Rowwise()
    elif kind == "SequenceParallel":
        accepted = {"sequence_sharding": [(_SEQUENCE,)]}
        style = SequenceSharded()
    elif kind == "PrepareModuleInput":
        given = _layouts(get("input_layouts") or ())
        desired = _layouts(get("desired_input_layouts") or ())
        pairs = list(zip(given, desired, strict=True))  # torch checks they pair up
        desired_kwargs = get("desired_input_kwarg_layouts") or {}
        for key, layout in (get("input_kwarg_layouts") or {}).items():
            pairs.append((_layouts(layout)[0], _layouts(desired_kwargs.get(key))[0]))
        if pairs and all(pair in ((_SEQUENCE, "replicate"), ("none", "none")) for pair in pairs):
            return SequenceSharded()
        raise ConfigError(
            f"{where}: PrepareModuleInput{pairs} (layout -> desired); zerotrain's tensor "
            "parallelism only gathers a sequence-sharded input (Shard(1) -> Replicate())"
        )
    else:
        raise ConfigError(
            f"{where}: torch's {kind} is not supported; use ColwiseParallel, RowwiseParallel, "
            "SequenceParallel or PrepareModuleInput (or zerotrain's string styles)"
        )
    if get("use_local_output") is False and kind != "SequenceParallel":
        raise ConfigError(
            f"{where}: {kind}(use_local_output=False) keeps DTensor outputs; zerotrain's tensor "
            "parallelism runs on plain tensors: leave use_local_output at True"
        )
    for option, allowed in accepted.items():
        got = _layouts(get(option))
        if got not in allowed:
            raise ConfigError(
                f"{where}: {kind}({option}={got}) is not supported (allowed: {allowed}); "
                "vocabulary-parallel embeddings and heads, and splits other than by features "
                "or by sequence (dimension 1), are not implemented: leave those layers whole"
            )
    return style


def shards_sequence(plan: Mapping[str, object] | None) -> list[str]:
    """The entries of a torch plan that run their module on a share of the sequence."""
    found = []
    for key, value in (plan or {}).items():
        get = vars(value).get if type(value).__module__.startswith("torch.distributed") else None
        if get is None:
            continue
        if type(value).__name__ in ("SequenceParallel", "PrepareModuleInput") or any(
            _layouts(get(option)) == (_SEQUENCE,) for option in ("input_layouts", "output_layouts")
        ):
            found.append(key)
    return found


def resolve_plan(
    model: nn.Module, plan: Mapping[str, object] | None
) -> tuple[dict[str, Style], list[str]]:
    """Module name -> style: ``plan``'s patterns matched against ``model``'s modules, or the
    automatic plan (see [Note: tensor-parallel plans]); and the patterns that matched nothing.
    A pipeline stage sees only its layers: :func:`check_matched` decides over every stage."""
    resolved: dict[str, Style] = {}
    if plan is not None:
        if not plan:
            raise ConfigError(
                "tensor_parallel.tp_plan: empty, so nothing would be split; name the layers to "
                "split, or leave tp_plan out for the automatic plan"
            )
        styles = {k: parse_style(v, f"tensor_parallel.tp_plan.{k}") for k, v in plan.items()}
        for name, _ in model.named_modules():
            hits = [
                style for pattern, style in styles.items() if fnmatch.fnmatchcase(name, pattern)
            ]
            if len(hits) > 1:
                raise ConfigError(
                    f"tensor_parallel.tp_plan: module {name!r} matches {len(hits)} patterns; "
                    "make the patterns name each module once"
                )
            if hits:
                resolved[name] = hits[0]
        unmatched = [k for k in styles if not any(fnmatch.fnmatchcase(n, k) for n in resolved)]
        return resolved, unmatched
    for name, module in model.named_modules():
        children = dict(module.named_children())
        for layers, attributes in _AUTO_RULES:
            if layers.keys() <= children.keys() and all(_is_linear(children[c]) for c in layers):
                prefix = f"{name}." if name else ""
                resolved.update({prefix + c: style for c, style in layers.items()})
                present = tuple(a for a in attributes if isinstance(getattr(module, a, None), int))
                if present:
                    resolved[name] = Divide(present)
                break
    return resolved, []


def check_matched(model: nn.Module, matched_any: bool, unmatched: list[str], automatic: bool):
    """ConfigError when the plan split nothing, or names patterns that matched nothing (over
    every pipeline stage: the caller gathers ``matched_any`` and ``unmatched``)."""
    if unmatched:
        raise ConfigError(
            f"tensor_parallel.tp_plan: {unmatched} match no module of "
            f"{type(model).__name__}; patterns are qualified module names such as "
            f"{_example_names(model)}"
        )
    if not matched_any and automatic:
        raise ConfigError(
            f"tensor_parallel.autotp_size: no layer of {type(model).__name__} matches the "
            "automatic plan (GPT-2, Llama-shaped and zerotrain's example GPT blocks); give "
            'tensor_parallel.tp_plan, e.g. {"blocks.*.attn.qkv": "colwise:3", '
            '"blocks.*.attn.proj": "rowwise"}'
        )


def apply_plan(
    model: nn.Module, plan: dict[str, Style], comm: Communicator, sequence_parallel: bool = False
) -> list[nn.Parameter]:
    """Split ``model``'s layers in place as ``plan`` says, over the tensor-parallel ``comm``
    (every rank must hold the same whole values: the caller broadcasts them first). With
    ``sequence_parallel`` the regions between the split modules run on a share of the sequence
    ([Note: sequence parallelism] in sequence.py); returns the parameters whose gradients are
    then summed over ``comm`` (none without it)."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules[name]
        if isinstance(style, SequenceSharded):
            continue  # sequence parallelism runs it on its share (parallelize_sequence)
        if isinstance(style, Divide):
            _divide(module, name, style.names, comm.world_size)
        elif isinstance(style, Colwise):
            _split_columns(module, name, style.chunks, comm, sequence_parallel)
        else:
            _split_rows(module, name, comm, sequence_parallel)
    _check_head_counts(model, plan, comm.world_size)
    if not sequence_parallel:
        return []
    split = [name for name, style in plan.items() if isinstance(style, Colwise | Rowwise)]
    return parallelize_sequence(model, split, comm)


# -- one style each ------------------------------------------------------------------------------
def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2): a linear layer whose weight is (in, out)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def feature_dims(module: nn.Module, name: str) -> tuple[int, int]:
    """(output, input) dimension of a linear layer's weight."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if _is_conv1d(module):
        return 1, 0
    raise ConfigError(
        f"tensor parallelism: {name!r} is a {type(module).__name__}; colwise and rowwise split "
        "nn.Linear and transformers' Conv1D only"
    )


def _check_divides(module_name: str, what: str, size: int, parts: int, tp: int) -> None:
    if size % parts:
        raise ConfigError(
            f"tensor parallelism: {module_name!r} has {size} {what}, which tp degree {tp}"
            + (f" x {parts // tp} fused blocks" if parts != tp else "")
            + f" does not divide; choose tensor_parallel.autotp_size dividing {size // (parts // tp)}"
            " or leave this layer out of the plan"
        )


def _param(module: nn.Module, name: str) -> nn.Parameter | None:
    return module._parameters.get(name)


def _split_columns(
    module: nn.Module, name: str, chunks: int, comm: Communicator, sequence_parallel: bool
) -> None:
    out_dim, _ = feature_dims(module, name)
    tp = comm.world_size
    weight, bias = _param(module, "weight"), _param(module, "bias")
    assert weight is not None  # a linear layer (feature_dims)
    size = weight.shape[out_dim]
    _check_divides(name, "output features", size, chunks * tp, tp)
    split_parameter(weight, Split(out_dim, chunks, tp), comm.rank)
    if bias is not None:
        split_parameter(bias, Split(0, chunks, tp), comm.rank)
    _set_features(module, out=size // tp)
    if not sequence_parallel:  # else the module around gathers the input (sequence.py)
        module.register_forward_pre_hook(lambda _, args: (copy_to_region(args[0], comm), *args[1:]))


def _split_rows(module: nn.Module, name: str, comm: Communicator, sequence_parallel: bool) -> None:
    _, in_dim = feature_dims(module, name)
    tp = comm.world_size
    weight = _param(module, "weight")
    assert weight is not None  # a linear layer (feature_dims)
    size = weight.shape[in_dim]
    _check_divides(name, "input features", size, tp, tp)
    split_parameter(weight, Split(in_dim, 1, tp), comm.rank)
    _set_features(module, in_=size // tp)
    conv1d = _is_conv1d(module)
    reduce = reduce_scatter_from_region if sequence_parallel else reduce_from_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, after the partial products are summed
        partial = torch.matmul(x, self.weight) if conv1d else F.linear(x, self.weight)
        out = reduce(partial, comm)
        return out if self.bias is None else out + self.bias

    module.forward = types.MethodType(forward, module)


def _set_features(module: nn.Module, *, out: int | None = None, in_: int | None = None) -> None:
    # keep the layer's description true (repr, code that reads out_features)
    if isinstance(module, nn.Linear):
        module.out_features = out or module.out_features
        module.in_features = in_ or module.in_features
    elif out is not None:
        module.__dict__["nf"] = out  # Conv1D's output width (an int attribute)


def _divide(module: nn.Module, name: str, attributes: tuple[str, ...], tp: int) -> None:
    for attribute in attributes:
        value = getattr(module, attribute, None)
        if not isinstance(value, int) or value % tp:
            raise ConfigError(
                f"tensor parallelism: {name or type(module).__name__}.{attribute} is {value!r}, "
                f"which tp degree {tp} does not divide; choose tensor_parallel.autotp_size "
                "dividing it"
            )
        module.__dict__[attribute] = value // tp  # a plain int attribute (nn.Module's
        # __setattr__ is typed for modules and tensors)


def _check_head_counts(model: nn.Module, plan: dict[str, Style], tp: int) -> None:
    """A module whose layers were split column-wise splits its heads: each rank must get whole
    heads, so a head count the degree does not divide is an error naming the module."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        split = any(isinstance(plan.get(prefix + c), Colwise) for c, _ in module.named_children())
        if not split or isinstance(plan.get(name), Divide):
            continue
        for attribute in _HEAD_COUNTS:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and value % tp:
                raise ConfigError(
                    f"tensor parallelism: {name!r} has {attribute} {value}, which tp degree "
                    f"{tp} does not divide, so its heads cannot be split; choose "
                    "tensor_parallel.autotp_size dividing it"
                )
        # a module that keeps the head count in its config (transformers' Llama) has head_dim:
        # each rank's piece of a split projection must hold whole heads
        head_dim = getattr(module, "head_dim", None)
        for child_name, child in module.named_children():
            style = plan.get(prefix + child_name)
            if isinstance(head_dim, int) and isinstance(style, Colwise):
                out_dim, _ = feature_dims(child, prefix + child_name)
                weight = _param(child, "weight")
                assert weight is not None  # a linear layer (feature_dims)
                width = weight.shape[out_dim] // style.chunks  # split already: a piece
                if width % head_dim:
                    raise ConfigError(
                        f"tensor parallelism: {prefix + child_name!r} would give each rank "
                        f"{width} of its outputs, not whole heads of {head_dim}: its head count "
                        f"is not divisible by tp degree {tp}; choose "
                        "tensor_parallel.autotp_size dividing the number of (key/value) heads"
                    )


def _example_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if _is_linear(m)][:3]


def is_split(param: torch.Tensor) -> bool:
    """Whether ``param`` holds only this rank's piece (else every tensor-parallel peer holds it
    whole)."""
    return split_of(param) is not None
