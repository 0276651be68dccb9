"""Pipeline parallelism with DeepSpeed's API: ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec`` (module.py) and the engine ``initialize`` returns for them (engine.py)."""

from __future__ import annotations

from zerotrain.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
