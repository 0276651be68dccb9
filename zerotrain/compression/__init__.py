"""Communication compression: how gradients (and, at stages 1-3, parameters) travel between
data-parallel ranks in fewer bytes. Operators (quantize.py, sparse.py, lowrank.py), the
codecs that the ZeRO reductions use (codec.py: the base and the replicated-state ones;
encoded.py: the all-to-all ones) and :func:`make_codec`, which chooses among them."""

from zerotrain.comm import Communicator
from zerotrain.compression.codec import (
    BucketShape,
    GradientCodec,
    GradientCompression,
    LowRankCodec,
    SparseCodec,
)
from zerotrain.compression.encoded import OneBitCodec, QuantizedCodec
from zerotrain.compression.gather import ParameterCompression, ParameterGather

METHODS = ("none", "powersgd", "acp_sgd", "topk", "gtopk", "int8", "int4")


def make_codec(
    options: GradientCompression | None, comm: Communicator, buckets: list[BucketShape]
) -> GradientCodec:
    """The codec for ``options`` over ``comm`` (uncompressed: none given, or one rank)."""
    if options is None or options.method == "none" or comm.world_size == 1:
        return GradientCodec(comm, buckets)
    if options.method in ("powersgd", "acp_sgd"):
        return LowRankCodec(comm, buckets, options)
    if options.method in ("topk", "gtopk"):
        return SparseCodec(comm, buckets, options)
    if options.method in ("int8", "int4"):
        return QuantizedCodec(comm, buckets, options)
    if options.method == "onebit":  # the 1-bit optimizers' (zerotrain/optim/onebit.py)
        return OneBitCodec(comm, buckets, options)
    raise ValueError(
        f"comm_compression.gradients.method: unknown {options.method!r}; one of {METHODS}"
    )


__all__ = [
    "METHODS",
    "BucketShape",
    "GradientCodec",
    "GradientCompression",
    "ParameterCompression",
    "ParameterGather",
    "make_codec",
]
