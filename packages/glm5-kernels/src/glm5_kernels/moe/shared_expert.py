"""The MoE layer's shared expert on its own: the FP8 SwiGLU MLP every token runs beside its
routed experts, for a step that runs it apart from them (the `shared_expert` stage, or
`MoeLayer(shared_mlp=...)`). The MoE stage's experts ops can instead run it as one more
expert of their own launches (`MegaExperts(shared=...)`)."""

from __future__ import annotations

from glm5_kernels.gemm import DenseMlp

__all__ = ["SharedExpert"]


class SharedExpert(DenseMlp):
    """A `DenseMlp` at moe_intermediate_size over the layer's `shared_experts.gate_up_proj` /
    `down_proj` (the same layouts): x [M, D] BF16 -> [M, D] BF16 (TP-partial on a shard)."""
