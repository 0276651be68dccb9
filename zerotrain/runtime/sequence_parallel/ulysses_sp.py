"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Arctic Long Sequence
Training's pieces under their DeepSpeed names (zerotrain/sequence implements them)."""

from zerotrain.sequence.batch import UlyssesSPDataLoaderAdapter
from zerotrain.sequence.hf import UlyssesSPAttentionHF
from zerotrain.sequence.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
