"""DeepSpeed's ``deepspeed.profiling`` module path; the profiler itself is
``zerotrain.observability.flops_profiler``."""

from zerotrain.profiling import flops_profiler

__all__ = ["flops_profiler"]
