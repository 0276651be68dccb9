"""The config's ``comm_compression`` section as the shard groups take it: how gradients and
parameters travel between data-parallel ranks (each direction's options, ``auto``'s policies,
hpZ's partition). Read by ``initialize`` (zerotrain/policies.py) for the groups it builds, and
by the estimator and the planner for what the groups will keep and send."""

from __future__ import annotations

from dataclasses import replace

from zerotrain.compression import GradientCompression, ParameterCompression
from zerotrain.compression.auto import AutoOptions, Policy, candidate_policies
from zerotrain.config import ZeroTrainConfig
from zerotrain.config.compression import AUTO_DEFAULT_METHOD
from zerotrain.zero.host import local_ranks

__all__ = [
    "auto_compression",
    "compression_policies",
    "gradient_compression",
    "parameter_compression",
    "secondary_partition",
]


def _ranks_per_node(cfg: ZeroTrainConfig) -> int:
    """The ranks of a node for hpZ and the gradients' hierarchy: as configured, or torchrun's."""
    return cfg.comm_compression.hierarchical_partition_size or local_ranks()


def secondary_partition(cfg: ZeroTrainConfig) -> int:
    """The ranks of each hpZ partition (0: no hpZ)."""
    return _ranks_per_node(cfg) if cfg.comm_compression.hierarchical_partition else 0


def gradient_compression(cfg: ZeroTrainConfig) -> GradientCompression | None:
    """The `comm_compression.gradients` section as the reductions take it (None: off). A
    1-bit optimizer adds its exact steps (zerotrain/zero/group.py, from the optimizer built)."""
    section = cfg.comm_compression.gradients
    return None if section.method == "none" else _gradient_options(cfg)


def _gradient_options(cfg: ZeroTrainConfig) -> GradientCompression:
    """`comm_compression.gradients` as a policy, with ``hierarchical``'s ranks per node."""
    options = cfg.comm_compression.gradients.model_dump()
    ranks_per_node = _ranks_per_node(cfg) if options.pop("hierarchical") else 0
    return GradientCompression(**options, ranks_per_node=ranks_per_node)


def parameter_compression(cfg: ZeroTrainConfig) -> ParameterCompression | None:
    """The `comm_compression.parameters` section as the parameter gathers take it."""
    section = cfg.comm_compression.parameters
    if section.method == "none":
        return None
    return ParameterCompression(**section.model_dump())


def compression_policies(cfg: ZeroTrainConfig) -> tuple[Policy, ...]:
    """The ways ``cfg``'s gradients and parameters may travel compressed: ``auto``'s policies
    (uncompressed first), else the one configured; none where nothing is compressed."""
    auto = auto_compression(cfg)
    if auto is not None:
        return auto.policies
    gradients, parameters = gradient_compression(cfg), parameter_compression(cfg)
    if gradients is None and parameters is None:
        return ()
    return (Policy(gradients, parameters),)


def auto_compression(cfg: ZeroTrainConfig) -> AutoOptions | None:
    """`comm_compression.auto`: the policies to choose among (None: auto is off). The
    configured methods, each on or off; with none configured, the stage's defaults (see the
    `auto` key's docs)."""
    section = cfg.comm_compression
    if not section.auto:
        return None
    gradients, parameters = gradient_compression(cfg), parameter_compression(cfg)
    if gradients is None and parameters is None:
        stage = cfg.zero_optimization.stage
        # int8, not PowerSGD, whose rank 4 ended the demo GPT 12.1% above uncompressed
        # under AdamW (docs/compression.md): auto changes the speed, not how well it trains
        gradients = replace(_gradient_options(cfg), method=AUTO_DEFAULT_METHOD)
        if stage > 0:
            parameters = replace(
                ParameterCompression(**section.parameters.model_dump()), method=AUTO_DEFAULT_METHOD
            )
    return AutoOptions(
        policies=candidate_policies(gradients, parameters),
        recheck_steps=section.auto_recheck_steps,
    )
