"""``deepspeed.pipe``: importable, so that scripts which import it but train without
pipelining run; building a pipeline raises, as zerotrain has no pipeline engine yet."""

from __future__ import annotations

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

_MESSAGE = (
    "{name}: pipeline parallelism is not implemented in zerotrain yet; train the model as one "
    "nn.Module (e.g. nn.Sequential of the same layers) with ZeRO data parallelism"
)


class PipelineModule:
    """DeepSpeed's pipeline model; constructing it raises (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE.format(name="zerotrain.pipe.PipelineModule"))


class LayerSpec:
    """DeepSpeed's lazily built pipeline layer; constructing it raises."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE.format(name="zerotrain.pipe.LayerSpec"))


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's tied pipeline layer; constructing it raises."""
