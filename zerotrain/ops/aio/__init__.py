"""``deepspeed.ops.aio``: the async I/O op's builder (NVMe offload; zerotrain.zero.swap)."""

from zerotrain.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
