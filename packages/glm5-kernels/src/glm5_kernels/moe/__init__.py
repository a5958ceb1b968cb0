"""MoE: sigmoid top-k routing, routed experts and the dense MLP (references; the clamped SwiGLU
is glm5_kernels.gemm's); the decode stage (`MegaExperts` / `GroupedExperts`, `MoeLayer`) and the
shared expert run apart from it (`SharedExpert`) on Triton."""

from glm5_kernels.moe.reference import (
    dense_mlp_ref,
    experts_ref,
    moe_output_ref,
    moe_rows_ref,
    route_ref,
)

__all__ = [
    "MAX_TOP_K",
    "GroupedExperts",
    "MegaExperts",
    "MoeLayer",
    "MoeRows",
    "SharedExpert",
    "dense_mlp_ref",
    "experts_ref",
    "moe_output_ref",
    "moe_rows_ref",
    "route_ref",
]


def __getattr__(name: str):
    # The stage ops (and Triton, where they run) load only when asked for.
    if name in ("MAX_TOP_K", "GroupedExperts", "MegaExperts", "MoeLayer", "MoeRows"):
        from glm5_kernels.moe import experts

        return getattr(experts, name)
    if name == "SharedExpert":
        from glm5_kernels.moe.shared_expert import SharedExpert

        return SharedExpert
    raise AttributeError(name)
