"""Checkpoints: sharded, atomic, verified, loadable at any world size and ZeRO stage.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the training-time entry points;
``load_consolidated`` puts a checkpoint into a plain PyTorch model, and ``zerotrain checkpoint
consolidate|inspect`` works on checkpoints from the command line. The layout is described in
[Note: checkpoint layout] (manifest.py) and docs/checkpoints.md; which folders every tool
accepts in [Note: the folders a checkpoint tool accepts] (locate.py).
"""

from zerotrain.checkpoint.export import (
    consolidate,
    inspect_checkpoints,
    load_consolidated,
    read_state_dict,
)
from zerotrain.checkpoint.locate import NoCheckpoint, find_checkpoints, resolve
from zerotrain.checkpoint.manifest import CheckpointError, Manifest, ShardReader, scan

__all__ = [
    "CheckpointError",
    "Manifest",
    "NoCheckpoint",
    "ShardReader",
    "consolidate",
    "find_checkpoints",
    "inspect_checkpoints",
    "load_consolidated",
    "read_state_dict",
    "resolve",
    "scan",
]
