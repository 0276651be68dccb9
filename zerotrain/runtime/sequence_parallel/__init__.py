"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` path (zerotrain/sequence)."""

from zerotrain.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
