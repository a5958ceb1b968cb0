"""MoE: sigmoid top-k routing, clamped SwiGLU, routed experts and the dense MLP."""

from glm5_kernels.moe.reference import dense_mlp_ref, experts_ref, route_ref, swiglu_ref

__all__ = ["dense_mlp_ref", "experts_ref", "route_ref", "swiglu_ref"]
