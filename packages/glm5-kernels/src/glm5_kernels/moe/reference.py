"""Routed mixture of experts with clamped SwiGLU, the executable spec.

Routing (sigmoid scores with a correction bias that only steers the choice, n_group = 1):

    s = sigmoid(logits);  ids = top-k(s + bias);  w = s[ids] / (Σ s[ids] + 1e-20) * routed_scaling

Expert e (and the dense / shared MLP, w13 = cat(gate_proj, up_proj) rows):

    [g, u] = x @ w13ᵀ;  a = silu(min(g, limit)) * clamp(u, -limit, limit);  y = a @ w2ᵀ
    out[t] = Σ_i w[t, i] * expert_{ids[t, i]}(x[t])

The clamped SwiGLU `a` is `swiglu_ref` and `moe_rows_ref`'s FP8 MLP is `fp8_mlp_ref`, both of
glm5_kernels.gemm: the MoE references build on the GEMM ones, never the reverse.

FP8 weights (128x128 block scales) are dequantized with glm5_kernels.quant; all math is fp32.
"""

import torch
from torch import Tensor

from glm5_kernels.gemm.reference import fp8_mlp_ref, swiglu_ref
from glm5_kernels.quant.reference import dequantize_fp8_block_ref

__all__ = [
    "dense_mlp_ref",
    "experts_ref",
    "moe_output_ref",
    "moe_rows_ref",
    "route_ref",
]


def route_ref(
    logits: Tensor, bias: Tensor, top_k: int, routed_scaling: float, renormalize: bool = True
) -> tuple[Tensor, Tensor]:
    """logits [T,E] fp32, bias [E] -> weights [T,k] fp32, ids [T,k] int64 (descending s + bias)."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    # A stable full sort instead of topk: ties go to the lower expert id, and the order within
    # a row is defined, so every implementation can be compared id-for-id.
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, ids


def _weight(w: Tensor, scale: Tensor | None) -> Tensor:
    return w.float() if scale is None else dequantize_fp8_block_ref(w, scale)


def dense_mlp_ref(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    limit: float,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
) -> Tensor:
    """x [T,D], w13 [2I,D], w2 [D,I] (fp8 when scales given) -> [T,D] in x.dtype."""
    a = swiglu_ref(x.float() @ _weight(w13, w13_scale).T, limit)
    return (a @ _weight(w2, w2_scale).T).to(x.dtype)


def experts_ref(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    ids: Tensor,
    weights: Tensor,
    limit: float,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
) -> Tensor:
    """x [T,D], w13 [E,2I,D], w2 [E,D,I], ids [T,k] int, weights [T,k] -> [T,D] fp32."""
    num_experts = w13.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    # Loop over the experts actually hit: dequantizing all 288 real experts is ~29 GB of fp32.
    # Ids outside [0, E) are skipped like transformers' expert-parallel sentinel id E.
    for e in ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.where(ids == e)
        w13_e = _weight(w13[e], None if w13_scale is None else w13_scale[e])
        w2_e = _weight(w2[e], None if w2_scale is None else w2_scale[e])
        y = swiglu_ref(xf[tok] @ w13_e.T, limit) @ w2_e.T
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out


def moe_rows_ref(
    x: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    shared: tuple[Tensor, Tensor, Tensor, Tensor],
    limit: float,
    ue8m0: bool = False,
) -> Tensor:
    """The decode stage's per-route rows with vLLM's block-FP8 numerics (tokens quantized per
    1x128 group, the gate_up output in BF16, SwiGLU stored in BF16 and quantized again), the
    down product exact (FP64): x [M, D] BF16, ids [M, k] -> rows [M, 1 + k, D] FP64, the shared
    expert's row first; a route whose id is outside [0, E) gets a zero row."""

    def expert(xs: Tensor, a13, s13, a2, s2) -> Tensor:
        return fp8_mlp_ref(xs, a13, s13, a2, s2, limit, ue8m0, out_dtype=torch.float64)

    m, k = ids.shape
    rows = torch.zeros(m, 1 + k, x.shape[1], dtype=torch.float64, device=x.device)
    rows[:, 0] = expert(x, *shared)
    for e in ids.unique().tolist():
        if 0 <= e < w13.shape[0]:
            tok, slot = torch.where(ids == e)
            rows[tok, 1 + slot] = expert(x[tok], w13[e], w13_scale[e], w2[e], w2_scale[e])
    return rows


def moe_output_ref(rows: Tensor, weights: Tensor) -> Tensor:
    """rows [M, 1 + k, D] (shared first), weights [M, k] -> BF16(Σ w·route) + BF16(shared)."""
    routed = (rows[:, 1:] * weights.double()[..., None]).sum(1)
    return (routed.to(torch.bfloat16).double() + rows[:, 0].to(torch.bfloat16).double()).to(
        torch.bfloat16
    )
