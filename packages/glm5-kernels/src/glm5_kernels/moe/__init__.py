"""MoE: sigmoid top-k routing, clamped SwiGLU, routed experts and the dense MLP; the decode
stage (`MegaExperts` / `GroupedExperts`, `MoeLayer`) on Triton."""

from glm5_kernels.moe.reference import (
    dense_mlp_ref,
    experts_ref,
    moe_output_ref,
    moe_rows_ref,
    route_ref,
    swiglu_ref,
)

__all__ = [
    "MAX_TOP_K",
    "GroupedExperts",
    "MegaExperts",
    "MoeLayer",
    "MoeRows",
    "dense_mlp_ref",
    "experts_ref",
    "moe_output_ref",
    "moe_rows_ref",
    "route_ref",
    "swiglu_ref",
]


def __getattr__(name: str):
    # The stage ops import the GEMM package (and Triton where it runs) only when asked for.
    if name in ("MAX_TOP_K", "GroupedExperts", "MegaExperts", "MoeLayer", "MoeRows"):
        from glm5_kernels.moe import experts

        return getattr(experts, name)
    raise AttributeError(name)
