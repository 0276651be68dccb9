"""Pipeline parallelism with DeepSpeed's API: ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec`` (module.py), ``split_model`` for an ordinary model cut at named modules
(split.py), and the engine ``initialize`` returns for them (engine.py)."""

from __future__ import annotations

from zerotrain.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec, stage_options
from zerotrain.pipe.split import split_model

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "split_model", "stage_options"]
