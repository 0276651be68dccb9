"""What training costs in memory, before running: model states per ZeRO stage, and activations.

``zerotrain estimate`` (zerotrain/cli/estimate.py) prints this package's table. The model-state
formula it uses is :func:`zerotrain.zero.memory.model_state_bytes`, the one
``memory_breakdown()`` reports beside what it measures (see [Note: model states] there); zero
never imports the estimator.

- :mod:`~zerotrain.estimate.activations`: activation bytes of a transformer (Korthikanti et al.).
- :mod:`~zerotrain.estimate.model`: a model's parameters and stage 3's gather units.
- :mod:`~zerotrain.estimate.stages`: one :class:`TrainingJob`, bytes per device at each stage.
- :mod:`~zerotrain.estimate.report`: the table, its notes, JSON.
- :mod:`~zerotrain.estimate.plot`: the chart (matplotlib).
"""

from zerotrain.estimate.activations import (
    ActivationAssumptions,
    ActivationBytes,
    TransformerShape,
    activation_bytes,
)
from zerotrain.estimate.model import ParameterCount, count_parameters
from zerotrain.estimate.plot import figure, plot
from zerotrain.estimate.report import format_table, to_json
from zerotrain.estimate.stages import (
    StageEstimate,
    TrainingJob,
    estimate,
    stage3_gathered_numel,
)
from zerotrain.optim.state_bytes import OPTIMIZER_STATE_BYTES
from zerotrain.zero.memory import ModelStateBytes, model_state_bytes

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "ActivationAssumptions",
    "ActivationBytes",
    "ModelStateBytes",
    "ParameterCount",
    "StageEstimate",
    "TrainingJob",
    "TransformerShape",
    "activation_bytes",
    "count_parameters",
    "estimate",
    "figure",
    "format_table",
    "model_state_bytes",
    "plot",
    "stage3_gathered_numel",
    "to_json",
]
