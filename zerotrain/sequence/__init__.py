"""Long sequences: Ulysses sequence parallelism (Jacobs et al., arXiv:2309.14509) and tiled
compute that never holds a whole sequence's intermediate (ALST, arXiv:2506.13996).

- ``all_to_all.py``: the differentiable all-to-all that moves activations between a share
  of the sequence and a share of the heads;
- ``attention.py``: Ulysses attention around any core attention, and DeepSpeed's
  ``DistributedAttention`` (``layer.py`` is its DeepSpeed path) for custom models;
- ``groups.py``: the sequence-parallel group as DeepSpeed's ``mpu`` object;
- ``hf.py``: the registration with transformers' attention registry, and the causal-LM loss
  averaged over the sample's tokens;
- ``batch.py``: a batch cut along its sequence (DeepSpeed's ``UlyssesSPDataLoaderAdapter``);
- ``loss.py``: a loss averaged over the tokens the sequence-parallel ranks hold together;
- ``tiled.py``: ``TiledMLP`` and ``TiledFusedLogitsLoss``.

The parallel layout (zerotrain/parallel) makes the sequence axis of the mesh and applies the
model transforms; ZeRO shards over the data- and sequence-parallel ranks together.
"""

from zerotrain.sequence import layer
from zerotrain.sequence.all_to_all import sequence_all_to_all
from zerotrain.sequence.attention import DistributedAttention, UlyssesAttention
from zerotrain.sequence.batch import UlyssesSPDataLoaderAdapter, shard_batch
from zerotrain.sequence.groups import SequenceParallelGroups
from zerotrain.sequence.loss import token_mean
from zerotrain.sequence.tiled import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "DistributedAttention",
    "SequenceParallelGroups",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesAttention",
    "UlyssesSPDataLoaderAdapter",
    "layer",
    "sequence_all_to_all",
    "sequence_tiled_compute",
    "shard_batch",
    "token_mean",
]
