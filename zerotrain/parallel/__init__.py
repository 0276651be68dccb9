"""The parallel layout: the mesh of parallel axes, the model transforms in their fixed order,
and everything that follows from them (see [Note: the parallel layout] in layout.py)."""

from zerotrain.parallel.layout import ParallelLayout, model_stages

__all__ = ["ParallelLayout", "model_stages"]
