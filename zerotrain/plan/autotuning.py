"""DeepSpeed's ``autotuning`` section, served by the planner: what each key asks of a tuner, and
what the planner does with it.

[Note: DeepSpeed's autotuning section]
DeepSpeed's autotuner (``deepspeed --autotuning tune``) runs the user's script once per
experiment and keeps the config with the best measured metric; the planner prices every
candidate instead, and runs only ``--verify K`` of them. So the keys that bound the space or
say what "best" is act, and the keys that steer DeepSpeed's experiments are answered with what
the planner does in their place:
- ``metric``: ``throughput`` (samples a second, DeepSpeed's default) and ``latency`` (seconds a
  step) rank alike here, since every candidate trains the same global batch; ``flops`` ranks by
  the FLOPs a second the hardware does, recomputation included (DeepSpeed's FLOPS per GPU), so
  a checkpointed config scores its extra forward.
- ``min/max_train_micro_batch_size_per_gpu``: the micro-batches weighed. ``min/max_train_batch_size``:
  the global batch must lie between them (the planner does not choose the global batch: it
  changes what the model learns).
- ``start_profile_step`` / ``end_profile_step``: a ``--verify`` trial runs ``end_profile_step``
  steps and times those from ``start_profile_step`` on.
- ``results_dir``: where the chosen config is written (``ds_config_optimal.json``, DeepSpeed's
  name) when ``--out`` is not given.
- ``mp_size``: the tensor-parallel degree the model trains at, held in every candidate (as a
  ``tensor_parallel.autotp_size`` of the base would be).
- ``fast: false`` also tunes DeepSpeed's bucket sizes and overlap switches, which the planner
  leaves at zerotrain's defaults; the tuner's own keys (``tuner_*``, ``num_tuning_micro_batch_sizes``),
  ``exps_dir``, ``overwrite``, ``arg_mappings``, ``metric_path`` and ``model_info*`` steer
  DeepSpeed's experiments or describe a model the planner builds itself: each is named in a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["METRICS", "Autotuning", "read_autotuning"]

METRICS = ("throughput", "latency", "flops")

# keys with no effect on a plan, and what the planner does in their place
_NOTES = {
    "fast": "fast: false also tunes DeepSpeed's bucket sizes and overlap switches; the planner "
    "keeps zerotrain's defaults for those",
    "tuner_type": "the planner prices every candidate instead of sampling them; --verify K runs "
    "the K fastest",
    "tuner_early_stopping": "the planner prices every candidate; nothing stops early",
    "tuner_num_trials": "the planner prices every candidate; --verify K says how many run",
    "num_tuning_micro_batch_sizes": "the planner prices every micro-batch in the limits",
    "exps_dir": "the planner writes no experiment files",
    "overwrite": "the planner writes no experiment files",
    "arg_mappings": "the planner runs its own trial script, not yours",
    "metric_path": "the planner's trials report to it directly",
    "model_info": "the planner builds the model on the meta device and counts it",
    "model_info_path": "the planner builds the model on the meta device and counts it",
}
_KNOWN = {
    "enabled",
    "metric",
    "min_train_micro_batch_size_per_gpu",
    "max_train_micro_batch_size_per_gpu",
    "min_train_batch_size",
    "max_train_batch_size",
    "start_profile_step",
    "end_profile_step",
    "results_dir",
    "mp_size",
    *_NOTES,
}


@dataclass(frozen=True)
class Autotuning:
    """What a config's ``autotuning`` section asks of the planner (DeepSpeed's defaults where a
    key is absent)."""

    metric: str = "throughput"
    min_micro_batch: int = 1
    max_micro_batch: int = 1024
    min_global_batch: int = 1
    max_global_batch: int | None = None
    start_profile_step: int = 2
    """The first timed step of a ``--verify`` trial (1-based; the first step builds the state)."""
    end_profile_step: int = 3
    results_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    """One line per key that does not act, saying why."""

    def check_global_batch(self, global_batch: int) -> None:
        """ValueError where ``global_batch`` lies outside the section's limits."""
        top = self.max_global_batch
        if global_batch < self.min_global_batch or top is not None and global_batch > top:
            limits = f"{self.min_global_batch}..{top if top is not None else ''}"
            raise ValueError(
                f"--global-batch {global_batch} lies outside autotuning's train batch limits "
                f"({limits}, min/max_train_batch_size); give a global batch between them"
            )

    def allows_micro_batch(self, micro_batch: int) -> bool:
        return self.min_micro_batch <= micro_batch <= self.max_micro_batch


def read_autotuning(base: dict) -> Autotuning:
    """The ``autotuning`` section of ``base`` (absent: DeepSpeed's defaults); ValueError naming
    the key where a value is not one the section takes."""
    raw = base.get("autotuning")
    if raw is None:
        return Autotuning()
    if not isinstance(raw, dict):
        raise ValueError(f"autotuning: must be a section (a JSON object), got {raw!r}")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ValueError(f"autotuning.{unknown[0]}: not a key of DeepSpeed's autotuning section")
    metric = str(raw.get("metric", "throughput")).lower()
    if metric not in METRICS:
        raise ValueError(f"autotuning.metric: must be one of {', '.join(METRICS)}; got {metric!r}")
    _count(raw, "mp_size", 1, low=1)  # held as a fixed key (candidates.fixed_keys)
    # DeepSpeed's defaults (steps 3-5) where the section says either, else the trial's own (2-3)
    profiling = bool({"start_profile_step", "end_profile_step"} & set(raw))
    start = _count(raw, "start_profile_step", 3 if profiling else 2, low=2)
    end = _count(raw, "end_profile_step", max(start, 5) if profiling else 3, low=start)
    results = raw.get("results_dir")
    notes = [f"autotuning.{key}: no effect; {_NOTES[key]}" for key in raw if key in _NOTES]
    if raw.get("fast", True) is not False:  # fast mode is what the planner does
        notes = [n for n in notes if not n.startswith("autotuning.fast:")]
    out = Autotuning(
        metric=metric,
        min_micro_batch=_count(raw, "min_train_micro_batch_size_per_gpu", 1, low=1),
        max_micro_batch=_count(raw, "max_train_micro_batch_size_per_gpu", 1024, low=1),
        min_global_batch=_count(raw, "min_train_batch_size", 1, low=1),
        max_global_batch=_count(raw, "max_train_batch_size", None, low=1),
        start_profile_step=start,
        end_profile_step=end,
        results_dir=str(results) if results is not None else None,
        notes=notes,
    )
    if out.min_micro_batch > out.max_micro_batch:
        raise ValueError(
            "autotuning.min_train_micro_batch_size_per_gpu: above "
            "max_train_micro_batch_size_per_gpu; make the minimum the smaller"
        )
    return out


def _count(raw: dict, key: str, default: Any, *, low: int) -> Any:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
            f"autotuning.{key}: must be a whole number of at least {low}, got {value!r}"
        )
    return value
