"""Checking a raw config: ``load_config`` and ``check_config``.

``load_config`` turns a dict, a ``.json``/``.yaml``/``.yml`` path or a ``ZeroTrainConfig``
into a validated config with its batch fields resolved for the data-parallel world size.

# [Note: how a config is checked]
``load_config`` runs three passes, so that one run reports every mistake with its key path:
1. ``_normalise`` walks the raw mapping: a key that is neither a field nor one of the DeepSpeed
   keys accepted without a field (deepspeed_keys.py, [Note: lenient where nothing is asked,
   strict where something is]) is a typo, answered with a did-you-mean; an accepted key whose
   value asks for a behaviour zerotrain lacks is refused naming it; an ``"auto"`` placeholder
   (HuggingFace's Trainer fills these in) is refused. Accepted keys and ``_comments`` are
   dropped from what pass 2 sees.
2. pydantic checks types and ranges; ``config_error`` (errors.py) rewrites each error as one
   ``key.path: must be ..., got ...`` line of a ``ConfigError``.
3. ``ZeroTrainConfig.resolve_batch`` derives the batch triple with DeepSpeed's arithmetic
   (batch.py).
Constructing the models directly skips pass 1 and raises pydantic's ValidationError.
"""

import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zerotrain.config.deepspeed_keys import is_comment
from zerotrain.config.errors import ConfigError, config_error, did_you_mean, show
from zerotrain.config.files import read_config_file
from zerotrain.config.params import TypedParamsSection
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.section import Section, canonical_choice, section_of
from zerotrain.optim.registry import PARAM_ALIASES, REFUSED_PARAMS

__all__ = ["check_config", "load_config"]


def _auto_problems(value: Any, path: str) -> list[str]:
    if _is_auto(value):
        return [
            f'{path}: "auto" must be resolved before passing the config to zerotrain '
            "(HuggingFace's Trainer does that for DeepSpeed); set a concrete value"
        ]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_problems(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _auto_problems(v, f"{path}.{i}")]
    return []


def _param_problems(
    section: type[TypedParamsSection], type_value: Any, params: dict[str, Any], path: str
) -> list[str]:
    canonical = canonical_choice(type_value, list(section._PARAMS))
    problems = _auto_problems(params, path)
    if canonical is None:  # the type itself is reported by pydantic
        return problems
    known = list(section._PARAMS[canonical].keys)
    for key in params:
        if key in known:
            continue
        owners = [name for name, spec in section._PARAMS.items() if key in spec.keys]
        if key in REFUSED_PARAMS:
            fix = REFUSED_PARAMS[key]
        elif owners:
            fix = f"not a parameter of {canonical}; only of {', '.join(owners)}"
        elif PARAM_ALIASES.get(key) in known:
            alias = PARAM_ALIASES[key]
            pair = " (both betas in one list: [beta1, beta2])" if alias == "betas" else ""
            fix = f"unknown key; did you mean '{alias}'{pair}? DeepSpeed's name for it"
        else:
            fix = f"unknown key{did_you_mean(str(key), known)}"
        problems.append(f"{path}.{key}: {fix}")
    return problems


@dataclass
class _Pass1:
    """What pass 1 of [Note: how a config is checked] found."""

    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # accepted; may be expected to act


def _normalise(data: dict[Any, Any], section: type[Section], found: _Pass1, path: str = ""):
    """Pass 1: ``data`` without comments and accepted DeepSpeed keys, for pydantic; unknown
    keys, refused values and "auto" placeholders go to ``found.problems``."""
    fields = section.model_fields
    kept: dict[Any, Any] = {}
    for raw_key, value in data.items():
        key, key_path = str(raw_key), f"{path}{raw_key}"
        if is_comment(key):
            continue
        name = section._RENAMED.get(key, key)
        if name not in fields:
            accepted = section._ACCEPTED.get(key)
            if accepted is None:
                known = [*fields, *section._RENAMED, *section._ACCEPTED]
                found.problems.append(f"{key_path}: unknown key{did_you_mean(key, known)}")
            elif accepted.idle is not None and not accepted.idle(value):
                found.problems.append(
                    f"`{key_path}: {show(value, limit=80)}` asks for {accepted.asks}, which "
                    f"zerotrain does not have yet; set it to {accepted.idle_values} or remove it"
                )
            elif accepted.warn:
                found.notes.append(f"{key_path}: ignored. {accepted.why}")
            continue
        subsection = section_of(fields[name].annotation)
        if subsection is not None and isinstance(value, dict):
            kept[raw_key] = _normalise(value, subsection, found, f"{key_path}.")
            continue
        if name == "params" and issubclass(section, TypedParamsSection) and isinstance(value, dict):
            found.problems += _param_problems(section, data.get("type"), value, key_path)
        elif _is_auto(value) and key_path in _AUTO_IS_A_VALUE:
            pass
        elif _is_auto(value) and _auto_left_by_huggingface(key_path, data):
            default = show(fields[name].get_default(call_default_factory=True))
            found.notes.append(
                f'{key_path}: "auto", which HuggingFace leaves unfilled here, takes the default '
                f"{default}, as in DeepSpeed"
            )
            continue
        else:
            found.problems += _auto_problems(value, key_path)
        kept[raw_key] = value
    return kept


# Keys whose "auto" is a value zerotrain resolves itself (not a placeholder to fill).
_AUTO_IS_A_VALUE = {
    "zero_optimization.offload_optimizer.ratio",
    "sites.compression.method",
    "sites.clusters",
}

# Keys that HuggingFace's Trainer never fills, so a public config's "auto" reaches DeepSpeed,
# which reads it as the key's default: the old section name, DeepSpeed's unprefixed stage-3
# names, and the stage-3 keys of a config below stage 3 (filled only at stage 3, used only there).
_AUTO_NEVER_FILLED = {
    "bfloat16.enabled",
    *(
        f"zero_optimization.{key}"
        for key in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
        )
    ),
}


def _without_auto(data: dict[Any, Any], path: str = "") -> dict[Any, Any]:
    kept: dict[Any, Any] = {}
    for key, value in data.items():
        key_path = f"{path}{key}"
        if isinstance(value, dict):
            kept[key] = _without_auto(value, f"{key_path}.")
        elif key_path in _AUTO_IS_A_VALUE or not _auto_problems(value, ""):
            kept[key] = value
    return kept


def has_auto(raw: dict[str, Any]) -> bool:
    """Whether ``raw`` holds HuggingFace's ``"auto"`` placeholders, which its Trainer fills."""
    return _without_auto(raw) != raw


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _auto_left_by_huggingface(key_path: str, section_data: dict[Any, Any]) -> bool:
    if key_path in _AUTO_NEVER_FILLED:
        return True
    below_stage_3 = section_data.get("stage", 0) in (0, 1, 2)
    return key_path.startswith("zero_optimization.stage3_") and below_stage_3


def load_config(
    config: dict[str, Any] | str | os.PathLike[str] | ZeroTrainConfig | None,
    *,
    world_size: int,
    sequence_parallel_size: int | None = None,
) -> ZeroTrainConfig:
    """Validate a DeepSpeed-style config and resolve its batch fields for ``world_size``
    data-parallel ranks. ``sequence_parallel_size``: the degree a sequence-parallel group made
    outside the config has (DeepSpeed's mpu); the config's key must agree or be left at 1.

    ``config`` is a dict, a path to a ``.json``/``.yaml``/``.yml`` file, an already typed
    ``ZeroTrainConfig`` (its batch fields are re-resolved, which checks them against this
    ``world_size``), or None (an empty config, which fails for want of a batch size). Raises
    ``ConfigError`` listing every problem, one ``key.path: problem and fix`` per line.
    """
    if isinstance(config, ZeroTrainConfig):
        return _with_sequence_parallel(config, sequence_parallel_size).resolve_batch(world_size)
    if config is None:
        raw: Any = {}
    elif isinstance(config, (str, os.PathLike)):
        raw = read_config_file(Path(config))
    else:
        raw = config
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config: must be a dict, a path or a ZeroTrainConfig, got {type(raw).__name__}"
        )
    cfg = _with_sequence_parallel(check_config(raw), sequence_parallel_size)
    return cfg.resolve_batch(world_size)


def _with_sequence_parallel(cfg: ZeroTrainConfig, given: int | None) -> ZeroTrainConfig:
    if given is None or given == cfg.sequence_parallel_size:
        return cfg
    if cfg.sequence_parallel_size != 1:
        raise ConfigError(
            f"sequence_parallel_size: {cfg.sequence_parallel_size}, but the mpu passed to "
            f"initialize has a sequence-parallel group of {given} ranks; make them agree"
        )
    return cfg.model_copy(update={"sequence_parallel_size": given})


def check_config(raw: dict[str, Any], *, unfilled: bool = False) -> ZeroTrainConfig:
    """Passes 1 and 2 of [Note: how a config is checked] on a raw mapping, without resolving the
    batch fields, so that one section can be checked on its own (``{"section": {...}}``).
    Accepted keys the user may expect to act (deepspeed_keys.py) are named in a warning.

    ``unfilled``: the config may still hold HuggingFace's ``"auto"`` placeholders (``zero.Init``
    sees it before the Trainer has filled them): each key whose value is or holds one is left
    out, and the rest is checked; the warnings are left to the check of the filled config."""
    if unfilled:
        raw = _without_auto(raw)
    found = _Pass1()
    data = _normalise(raw, ZeroTrainConfig, found)
    if found.problems:
        raise ConfigError("\n".join(found.problems))
    try:
        config = ZeroTrainConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc) from None
    for note in [] if unfilled else found.notes:
        warnings.warn(f"zerotrain config: {note}", stacklevel=3)
    return config
