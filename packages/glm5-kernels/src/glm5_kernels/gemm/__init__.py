"""Skinny GEMMs of decode (M <= 64): BF16 projections and router (split-K), block-FP8 linears
with fused activation quantization, and the FP8 SwiGLU MLP built on them (`DenseMlp`: the
dense layers' MLP; the MoE's shared expert is one, `glm5_kernels.moe.SharedExpert`)."""

from glm5_kernels.gemm.linear import (
    MAX_TOKENS,
    DenseMlp,
    Fp8Linear,
    Projection,
    Router,
    Tile,
    plan,
)
from glm5_kernels.gemm.reference import (
    fp8_linear_ref,
    fp8_mlp_ref,
    linear_ref,
    quantize_tokens_fp8_ref,
    swiglu_ref,
)

__all__ = [
    "MAX_TOKENS",
    "DenseMlp",
    "Fp8Linear",
    "Projection",
    "Router",
    "Tile",
    "fp8_linear_ref",
    "fp8_mlp_ref",
    "linear_ref",
    "plan",
    "quantize_tokens_fp8_ref",
    "swiglu_ref",
]
