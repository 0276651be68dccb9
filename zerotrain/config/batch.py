"""DeepSpeed's batch arithmetic: train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size, with any one of the three derived from the others."""

from typing import NamedTuple

from zerotrain.config.errors import ConfigError

__all__ = ["BatchSizes", "resolve_batch_sizes"]


class BatchSizes(NamedTuple):
    """The three batch keys of a config, all set (the field names of ZeroTrainConfig)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(
    total: int | None,
    micro: int | None,
    accum: int | None,
    *,
    world_size: int,
    data_parallel_size: int | None = None,
) -> BatchSizes:
    """The batch triple for ``world_size`` data-parallel ranks from the keys given (None where
    left out), by DeepSpeed's rules: any two, or ``total`` or ``micro`` alone (then ``accum`` is
    1). ``ConfigError`` showing the arithmetic when they cannot agree."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: must be a positive integer, got {world_size!r}")
    if data_parallel_size not in (None, world_size):
        raise ConfigError(
            f"data_parallel_size: {data_parallel_size}, but the mesh has {world_size} "
            "data-parallel ranks (the world size over tensor_parallel.autotp_size); set it to "
            f"{world_size} or remove it"
        )
    tb, mb, ga, ws = BatchSizes._fields + ("world_size",)
    if total is None:
        if micro is None:
            given = f"only {ga} is set" if accum is not None else "no batch size is set"
            raise ConfigError(f"{given}; set {tb} or {mb} (or both)")
        accum = accum or 1  # micro given, accum given or 1
        total = micro * accum * world_size
    elif micro is not None and accum is not None:
        if total != micro * accum * world_size:
            raise ConfigError(
                f"{tb} ({total}) != {mb} ({micro}) * {ga} ({accum}) * {ws} ({world_size}) = "
                f"{micro * accum * world_size}; fix one of them, or leave one out to derive it"
            )
    elif micro is not None:  # total and micro given
        accum = _derived(total, micro, world_size, known_name=mb, derived_name=ga)
    else:  # total given with accum, or alone (then accum is 1)
        accum = 1 if accum is None else accum
        micro = _derived(total, accum, world_size, known_name=ga, derived_name=mb)
    return BatchSizes(total, micro, accum)


def _derived(total: int, known: int, world_size: int, *, known_name: str, derived_name: str) -> int:
    """The batch key left out: ``total / (known * world_size)``; ``ConfigError`` unless exact."""
    tb, ws = BatchSizes._fields[0], "world_size"
    divisor = known * world_size
    if total % divisor:
        raise ConfigError(
            f"{tb} ({total}) is not divisible by {known_name} ({known}) * {ws} "
            f"({world_size}) = {divisor}, so {derived_name} cannot be derived; make "
            f"{tb} a multiple of {divisor} or set all three batch keys"
        )
    return total // divisor
