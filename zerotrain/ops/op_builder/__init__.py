"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, each telling whether zerotrain serves
its op (see [Note: op builders as capability probes] in builder.py).

Served: ``fused_adam``, ``cpu_adam``, ``async_io`` (NVMe offload), ``fused_lamb``. Every other
DeepSpeed op is listed with ``is_compatible()`` False, so a client's probe skips it as it would
on a machine where DeepSpeed could not build it.
"""

from __future__ import annotations

from zerotrain.ops.op_builder.builder import (
    CUDAOpBuilder,
    OpBuilder,
    OpNotAvailable,
    TorchCPUOpBuilder,
)

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "GDSBuilder",
    "InferenceBuilder",
    "InferenceCoreBuilder",
    "InferenceCutlassBuilder",
    "OpBuilder",
    "OpNotAvailable",
    "QuantizerBuilder",
    "RaggedOpsBuilder",
    "RaggedUtilsBuilder",
    "RandomLTDBuilder",
    "SparseAttnBuilder",
    "SpatialInferenceBuilder",
    "StochasticTransformerBuilder",
    "TorchCPUOpBuilder",
    "TransformerBuilder",
]

# served by zerotrain


class FusedAdamBuilder(CUDAOpBuilder):
    NAME = "fused_adam"
    SERVED_BY = (
        "zerotrain.ops.adam.FusedAdam (deepspeed.ops.adam.FusedAdam: torch's fused Adam kernel "
        'on CPU and CUDA) and the config\'s optimizer type "Adam"'
    )


class CPUAdamBuilder(TorchCPUOpBuilder):
    NAME = "cpu_adam"
    SERVED_BY = (
        "zerotrain.ops.adam.DeepSpeedCPUAdam (deepspeed.ops.adam.DeepSpeedCPUAdam) and the "
        'optimizer step on the host under zero_optimization.offload_optimizer.device "cpu"'
    )


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    SERVED_BY = (
        'NVMe offload (offload_optimizer / offload_param device "nvme", the aio section): '
        "zerotrain.zero.swap's swap files, read and written on a thread pool"
    )


class FusedLambBuilder(CUDAOpBuilder):
    NAME = "fused_lamb"
    SERVED_BY = (
        "zerotrain.ops.lamb.FusedLamb (deepspeed.ops.lamb.FusedLamb) and the config's "
        'optimizer type "Lamb"'
    )


# not served: zerotrain has no implementation of what these ops are for


class CPUAdagradBuilder(TorchCPUOpBuilder):
    NAME = "cpu_adagrad"
    MISSING = "DeepSpeedCPUAdagrad, the Adagrad optimizer"


class CPULionBuilder(TorchCPUOpBuilder):
    NAME = "cpu_lion"
    MISSING = "DeepSpeedCPULion, the Lion optimizer"


class FusedLionBuilder(CUDAOpBuilder):
    NAME = "fused_lion"
    MISSING = "FusedLion, the Lion optimizer"


class GDSBuilder(AsyncIOBuilder):
    NAME = "gds"
    SERVED_BY = None
    MISSING = "GPUDirect Storage"


class InferenceBuilder(CUDAOpBuilder):
    NAME = "transformer_inference"
    MISSING = "DeepSpeed-Inference kernels"


class QuantizerBuilder(CUDAOpBuilder):
    NAME = "quantizer"
    MISSING = "CUDA quantization kernels"


class FPQuantizerBuilder(CUDAOpBuilder):
    NAME = "fp_quantizer"
    MISSING = "FP8/FP6 quantization kernels"


class SparseAttnBuilder(CUDAOpBuilder):
    NAME = "sparse_attn"
    MISSING = "block-sparse attention"


class TransformerBuilder(CUDAOpBuilder):
    NAME = "transformer"
    MISSING = "DeepSpeedTransformerLayer's fused kernels"


class StochasticTransformerBuilder(TransformerBuilder):
    NAME = "stochastic_transformer"


class SpatialInferenceBuilder(CUDAOpBuilder):
    NAME = "spatial_inference"
    MISSING = "diffusion inference kernels"


class RandomLTDBuilder(CUDAOpBuilder):
    NAME = "random_ltd"
    MISSING = "random layer-token drop"


class EvoformerAttnBuilder(CUDAOpBuilder):
    NAME = "evoformer_attn"
    MISSING = "DS4Science Evoformer attention"


class InferenceCoreBuilder(CUDAOpBuilder):
    NAME = "inference_core_ops"
    MISSING = "DeepSpeed-FastGen (inference v2) kernels"


class InferenceCutlassBuilder(InferenceCoreBuilder):
    NAME = "cutlass_ops"


class RaggedOpsBuilder(InferenceCoreBuilder):
    NAME = "ragged_device_ops"


class RaggedUtilsBuilder(InferenceCoreBuilder):
    NAME = "ragged_ops"


ALL_OPS: dict[str, OpBuilder] = {
    builder.NAME: builder()
    for builder in (
        FusedAdamBuilder,
        CPUAdamBuilder,
        AsyncIOBuilder,
        FusedLambBuilder,
        CPUAdagradBuilder,
        CPULionBuilder,
        FusedLionBuilder,
        GDSBuilder,
        InferenceBuilder,
        QuantizerBuilder,
        FPQuantizerBuilder,
        SparseAttnBuilder,
        TransformerBuilder,
        StochasticTransformerBuilder,
        SpatialInferenceBuilder,
        RandomLTDBuilder,
        EvoformerAttnBuilder,
        InferenceCoreBuilder,
        InferenceCutlassBuilder,
        RaggedOpsBuilder,
        RaggedUtilsBuilder,
    )
}
"""DeepSpeed's ``ALL_OPS``: every op by its name, one builder each."""
