"""DeepSpeed's ``PipelineModule``: a model given as a sequence of layers, cut into stages.

[Note: pipeline stages]
Every rank builds the same list of layer specifications and cuts it, by ``partition_method``,
into ``num_stages x stages_per_rank`` contiguous stages; it builds only the layers of its own
stages (a ``LayerSpec`` is built there and nowhere else, so a model larger than one rank's memory
never exists whole). Ranks are numbered with the pipeline axis outermost (see [Note: mesh
layout] in comm/mesh.py): rank r is at pipeline position ``p = r // (world_size // num_stages)``
(with sites, which the mesh puts outside the pipeline, ``initialize`` moves a rank to its
position within its site: :meth:`PipelineModule.place`) and runs one stage per *chunk*: more
than one for the schedules that loop each micro-batch through the ranks several times. With
``stage_placement="loop"`` (interleaved 1F1B) chunk c is stage ``p + c num_stages``; with
``"v"`` (ZBV, two chunks) the second pass runs backwards through the ranks, so rank p runs
stages p and ``2 num_stages - 1 - p``: the first rank holds the first and the last stage. A
built layer is registered under its index in the whole list (``"3"``), a tied one once under
``tied_modules.<key>``, so state dict keys are DeepSpeed's and do not depend on the layout.

[Note: tied layers across stages]
A tied key whose layers fall on several stages (the input embedding on the first, the output
projection that reuses its weight on the last) is built on each of them, and kept one
parameter: at start every copy takes the first stage's values, and at each step the reduced
gradients of the copies are summed over the group of those stages' ranks (the same position
on the other axes) before the optimizer, so every copy takes the same update (DeepSpeed's
PipelineModule does the same). ZeRO keeps each tied parameter in a bucket of its own, which
is then laid out alike on every stage.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerotrain.comm import Communicator, Mesh
from zerotrain.config import ConfigError

# the stage placement each schedule that runs several stages per rank needs (pipeline.schedule)
MULTI_STAGE_PLACEMENT = {"interleaved_1f1b": "loop", "zbv": "v"}


def stage_options(schedule: str) -> dict[str, Any]:
    """The ``PipelineModule`` arguments that ``schedule`` runs with (the fewest stages per rank
    it takes): none for 1F1B and GPipe, two stages per rank placed as it needs otherwise."""
    placement = MULTI_STAGE_PLACEMENT.get(schedule)
    return {} if placement is None else {"stages_per_rank": 2, "stage_placement": placement}


def rank_of_stage(stage: int, num_stages: int, placement: str = "loop") -> int:
    """The pipeline position (of ``num_stages``) that runs ``stage`` under ``placement`` (see
    [Note: pipeline stages])."""
    chunk, offset = divmod(stage, num_stages)
    return num_stages - 1 - offset if placement == "v" and chunk % 2 else offset


class LayerSpec:
    """A layer built only on the stage that runs it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type[nn.Module], *args: Any, **kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec: typename must be an nn.Module class, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer that several positions of the sequence share (an input embedding reused as the
    output projection): built once per stage, under ``tied_modules.<key>``; ``forward_fn(module,
    x)`` runs it at a position (default: ``module(x)``)."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **kwargs: Any,
    ):
        # every parameter of the tied module is shared (tied_weight_attr is accepted for
        # DeepSpeed's signature; naming a subset is not supported)
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)


class PipelineModule(nn.Module):
    """``layers`` (modules, ``LayerSpec``s or plain callables such as ``lambda x: x.view(...)``)
    run in order, cut into ``num_stages`` pipeline stages (see [Note: pipeline stages]);
    ``loss_fn(output, label)`` gives the loss on the last stage. ``partition_method``:
    ``"parameters"`` balances the parameter counts, ``"uniform"`` the number of layers,
    ``"type:<regex>"`` the layers whose class name matches. A layer may return a tuple of
    tensors; across a cut, the next stage's first layer gets it as one tuple, and every micro-batch
    may have its own shapes (see comm/stage_messages.py). ``activation_checkpoint_interval``
    k > 0 recomputes every run of k layers in backward. ``stages_per_rank`` > 1 cuts the layers
    into that many stages per pipeline rank, for ``pipeline.schedule`` ``interleaved_1f1b``
    (``stage_placement="loop"``) or ``zbv`` (two, ``"v"``; see [Note: pipeline stages]). Train
    it with ``engine.train_batch()``."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable = checkpoint,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        stages_per_rank: int = 1,
        stage_placement: str = "loop",
    ):
        super().__init__()
        if topology is not None:
            raise ConfigError(
                "PipelineModule(topology=...): zerotrain builds the mesh itself; pass num_stages"
            )
        if num_stages is None or num_stages < 1:
            raise ConfigError(f"PipelineModule: num_stages must be at least 1, got {num_stages}")
        if seed_fn is not None or checkpointable_layers is not None:
            raise ConfigError(
                "PipelineModule: seed_fn and checkpointable_layers are not supported; leave "
                "them out (seed_layers seeds each layer with base_seed + its index)"
            )
        world = Communicator()
        if world.world_size % num_stages:
            hint = (
                "call zerotrain.init_distributed() before building it (it reads the ranks)"
                if not world.distributed
                else "choose a number of stages that divides it"
            )
            raise ConfigError(
                f"PipelineModule: num_stages {num_stages} does not divide the "
                f"{world.world_size} ranks; {hint}"
            )
        if stages_per_rank < 1:
            raise ConfigError(
                f"PipelineModule: stages_per_rank must be at least 1, got {stages_per_rank}"
            )
        if stage_placement not in ("loop", "v"):
            raise ConfigError(
                f"PipelineModule: stage_placement {stage_placement!r} is not 'loop' or 'v'"
            )
        if stage_placement == "v" and stages_per_rank != 2:
            raise ConfigError(
                f"PipelineModule: stage_placement 'v' places two stages per rank; got "
                f"stages_per_rank={stages_per_rank}"
            )
        self.num_stages = num_stages
        self.stages_per_rank = stages_per_rank
        self.stage_placement = stage_placement
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        # accepted: every message between stages carries its shapes, as DeepSpeed's
        # dynamic_shape=True sends them (see comm/stage_messages.py)
        self.dynamic_shape = dynamic_shape
        specs = list(layers)
        self.parts = partition(specs, num_stages * stages_per_rank, partition_method)
        # kept to build another stage's layers (place()); not where a layer is given as a
        # module: they would keep every stage's parameters alive
        self._specs = None if any(isinstance(s, nn.Module) for s in specs) else specs
        self._seeds = base_seed if seed_layers else None
        self._build_stages(specs, world.rank // (world.world_size // num_stages))

    def _build_stages(self, specs: list, stage_id: int) -> None:
        """Build the layers of pipeline position ``stage_id``'s stages (see [Note: pipeline
        stages])."""
        self.stage_id = stage_id  # the pipeline position
        # this rank's stages, one per chunk
        self.stages = [self.stage_of_chunk(stage_id, c) for c in range(self.stages_per_rank)]
        self.tied_modules = nn.ModuleDict()
        self._stages_of_key: dict[str, set[int]] = {}  # tied key -> the stages using it
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                self._stages_of_key.setdefault(spec.key, set()).add(stage_of(self.parts, index))
        self._runs: list[list[Callable[[Any], Any]]] = []  # per chunk
        for stage in self.stages:
            runs = []
            for index in self.stage_layers(stage):
                if self._seeds is not None:
                    torch.manual_seed(self._seeds + index)
                runs.append(self._build(index, specs[index]))
            self._runs.append(runs)

    def place(self, stage_id: int) -> None:
        """Run pipeline position ``stage_id``, the mesh's, where it is not the one the world
        rank gave at construction (training across sites puts the site axis outside the
        pipeline's: a site's ranks are consecutive). Its layers are built anew from their
        specifications, the others' dropped (every rank of such a layout calls it: where
        the layers were given as modules, every rank refuses alike)."""
        if self._specs is None:
            raise ConfigError(
                "PipelineModule: the sites section places each site's pipeline on the site's "
                "ranks, so a rank's stage is not the one built from its world rank, and the "
                "layers were given as modules, which cannot be built again; give them as "
                "LayerSpecs"
            )
        if stage_id == self.stage_id:
            return
        for name in list(self._modules):  # tied modules too: the new stages tie their own
            del self._modules[name]
        self._build_stages(self._specs, stage_id)

    def _build(self, index: int, spec: Any) -> Callable[[Any], Any]:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self.tied_modules[spec.key] = spec.build()
            module = self.tied_modules[spec.key]
            if spec.forward_fn is None:
                return module
            forward_fn = spec.forward_fn
            return lambda x: forward_fn(module, x)
        if isinstance(spec, LayerSpec):
            spec = spec.build()
        if isinstance(spec, nn.Module):
            self.add_module(str(index), spec)
            return spec
        if callable(spec):
            return spec
        raise ConfigError(
            f"PipelineModule: layer {index} is a {type(spec).__name__}; give modules, "
            "LayerSpecs or callables"
        )

    def forward(self, x: Any, chunk: int = 0) -> Any:
        """Run this rank's stage number ``chunk`` (0: its first; see [Note: pipeline stages])."""
        interval = self.activation_checkpoint_interval
        runs = self._runs[chunk]
        if interval <= 0 or not torch.is_grad_enabled():
            return _sequence(runs)(x)
        for first in range(0, len(runs), interval):
            part = runs[first : first + interval]
            x = self.activation_checkpoint_func(_sequence(part), x, use_reentrant=False)
        return x

    def chunks_of(self) -> dict[int, tuple[int, ...]]:
        """``id(parameter) -> the chunks of this rank whose forward uses it`` (one, but a tied
        layer's several uses on this rank)."""
        out: dict[int, tuple[int, ...]] = {}
        for name, module in self.named_children():
            if name == "tied_modules":
                continue
            chunk = self.stages.index(stage_of(self.parts, int(name)))
            out.update({id(p): (chunk,) for p in module.parameters()})
        for key, module in self.tied_modules.items():
            mine = [s for s in self._stages_of_key[key] if s in self.stages]
            chunks = tuple(sorted(self.stages.index(s) for s in mine))
            out.update({id(p): chunks for p in module.parameters()})
        return out

    @property
    def tied_stages(self) -> dict[str, list[int]]:
        """The tied keys whose layers run on several pipeline ranks, with those ranks (see
        [Note: tied layers across stages])."""
        ranks = {
            key: {self.rank_of(s) for s in stages} for key, stages in self._stages_of_key.items()
        }
        return {key: sorted(r) for key, r in sorted(ranks.items()) if len(r) > 1}

    def tie_parameter(self, name: str, param: nn.Parameter, stages: set[int]) -> None:
        """Make ``param``, which the layers of several ``stages`` hold (``name``: its name in
        the model they were cut from), one tied parameter: named ``tied_modules.<owner>.<attr>``
        (the owner's dots as ``_``) and kept equal over its stages' ranks as a TiedLayerSpec's
        (see [Note: tied layers across stages])."""
        owner, _, attr = name.rpartition(".")
        key = owner.replace(".", "_") or "model"
        if any(s in self.stages for s in stages):
            if key not in self.tied_modules:
                self.tied_modules[key] = nn.Module()
            self.tied_modules[key].register_parameter(attr, param)
        self._stages_of_key.setdefault(key, set()).update(stages)

    def tie_across_stages(self, mesh: Mesh) -> dict[int, Communicator]:
        """Make a group per tied key over the stages that hold it (one for each position on the
        other axes of ``mesh``; collective), give every copy the first stage's values, and
        return ``id(parameter) -> group`` for this rank's copies: their gradients are summed
        over it (see [Note: tied layers across stages])."""
        groups: dict[int, Communicator] = {}
        for key, stages in self.tied_stages.items():  # sorted: the same order on every rank
            # each pipeline (the stages at one position of the other axes): its tied stages
            rank_lists = [[ranks[s] for s in stages] for ranks in mesh.axis_ranks("pp")]
            comm = mesh.world.subgroups(rank_lists)
            if comm is None:
                continue
            for param in self.tied_modules[key].parameters():
                comm.broadcast(param.data, src=comm.root)
                groups[id(param)] = comm
        return groups

    def stage_layers(self, stage: int | None = None) -> list[int]:
        """Indices of the layers of ``stage`` (default: this rank's stages)."""
        if stage is None:
            return [i for s in self.stages for i in self.stage_layers(s)]
        return list(range(self.parts[stage], self.parts[stage + 1]))

    def stage_of_chunk(self, position: int, chunk: int) -> int:
        """The stage the rank at pipeline ``position`` runs as its ``chunk``."""
        if self.stage_placement == "v" and chunk % 2:
            return (chunk + 1) * self.num_stages - 1 - position
        return chunk * self.num_stages + position

    def rank_of(self, stage: int) -> int:
        """The pipeline position running ``stage``."""
        return rank_of_stage(stage, self.num_stages, self.stage_placement)


def _sequence(runs: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def run_all(x: Any) -> Any:
        for run in runs:
            x = run(x)
        return x

    return run_all


def stage_of(parts: list[int], index: int) -> int:
    """The stage holding layer ``index`` for stage bounds ``parts``."""
    return next(s for s in range(len(parts) - 1) if parts[s] <= index < parts[s + 1])


def partition(specs: list[Any], num_stages: int, method: str) -> list[int]:
    """Stage bounds ``[0, ..., len(specs)]``: stage s runs layers ``parts[s]:parts[s + 1]``."""
    if len(specs) < num_stages:
        raise ConfigError(
            f"PipelineModule: {len(specs)} layers cannot fill {num_stages} stages; use fewer stages"
        )
    lowered = method.lower()
    if lowered == "uniform":  # the first (len % stages) stages take one layer more
        size, extra = divmod(len(specs), num_stages)
        return [s * size + min(s, extra) for s in range(num_stages + 1)]
    if lowered == "parameters":
        weights = [_parameter_count(spec) for spec in specs]
    elif lowered.startswith("type:"):
        pattern = re.compile(method[len("type:") :], re.IGNORECASE)
        weights = [int(bool(pattern.search(_class_name(spec)))) for spec in specs]
        if not any(weights):
            raise ConfigError(
                f"PipelineModule: partition_method {method!r} matches no layer class; the "
                f"layers are {sorted({_class_name(s) for s in specs})}"
            )
    else:
        raise ConfigError(
            f"PipelineModule: partition_method {method!r} is not one of 'parameters', "
            "'uniform', 'type:<regex>'"
        )
    return _balanced(weights, num_stages)


def _class_name(spec: Any) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    return type(spec).__name__


def _parameter_count(spec: Any) -> int:
    if isinstance(spec, LayerSpec):
        with torch.device("meta"):  # counted without allocating
            spec = spec.build()
    if isinstance(spec, nn.Module):
        return sum(p.numel() for p in spec.parameters() if p.requires_grad)
    return 0


def _balanced(weights: list[int], parts: int) -> list[int]:
    """Contiguous bounds splitting ``weights`` into ``parts`` non-empty runs with the smallest
    largest sum (ties: later cuts, as the uniform split), by dynamic programming over prefix sums."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest largest sum splitting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:  # ties: the latest cut, so earlier stages take more
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]
