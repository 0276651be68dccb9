"""What a training run reports about itself: step metrics, monitors and the FLOPs profiler.

- :mod:`~zerotrain.observability.metrics`: one :class:`StepRecord` per optimizer step and the
  throughput line.
- :mod:`~zerotrain.observability.monitor`: the step scalars to TensorBoard, CSV or wandb.
- :mod:`~zerotrain.observability.flops_profiler`: DeepSpeed's ``FlopsProfiler`` (also under
  DeepSpeed's path, ``zerotrain.profiling.flops_profiler``).

Observability sits above the engine's parts and reads them only through their public queries:
it may import ``zerotrain.comm`` (byte counts) and ``zerotrain.config``; ``zerotrain.comm`` and
``zerotrain.zero`` never import it. The communication log itself (``comms_logger``) lives in
``zerotrain.comm.log``, beside the collectives it counts.
"""

from zerotrain.observability.flops_profiler import FlopCounter, FlopsProfiler, StepContext
from zerotrain.observability.metrics import StepMetrics, StepRecord
from zerotrain.observability.monitor import Monitor, MonitorMaster

__all__ = [
    "FlopCounter",
    "FlopsProfiler",
    "Monitor",
    "MonitorMaster",
    "StepContext",
    "StepMetrics",
    "StepRecord",
]
