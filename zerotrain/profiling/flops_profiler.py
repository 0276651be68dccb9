"""DeepSpeed's ``deepspeed.profiling.flops_profiler`` path for
``zerotrain.observability.flops_profiler``."""

from zerotrain.observability.flops_profiler import FlopsProfiler

__all__ = ["FlopsProfiler"]
