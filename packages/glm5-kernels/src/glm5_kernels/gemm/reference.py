"""Skinny GEMMs of decode, the executable spec (FP64 accumulation).

    linear:      y[M, N] = x[M, K] @ w[N, K]ᵀ                    (BF16 weights; router: FP32 out)
    fp8 linear:  y = Σ_kb  (x_q[:, kb] @ w_q[kb]ᵀ) · sx[:, kb] · sw[nb, kb]

FP8 activations are quantized per token in 1×128 groups exactly as vLLM's
per_token_group_quant_fp8 does for DeepGEMM / block-FP8 linears:

    sx = max(amax(|x_g|), 1e-10) / 448   (UE8M0: rounded up to a power of two)
    x_q = e4m3(clamp(x_g / sx, ±448))

Weights are e4m3 with one scale per 128×128 block (`weight_scale_inv`: FP32, or UE8M0 bytes
as torch.float8_e8m0fnu). The FP8 MLP (dense layers, shared expert) is vLLM's sequence:
gate_up → BF16 → clamped SwiGLU → BF16 → quantize → down.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from glm5_kernels.quant.reference import pow2_ceil

__all__ = [
    "fp8_linear_ref",
    "fp8_mlp_ref",
    "linear_ref",
    "quantize_tokens_fp8_ref",
    "swiglu_ref",
    "weight_scales_fp32",
]

FP8_MAX = 448.0
GROUP = 128
EPS = 1e-10


def linear_ref(x: Tensor, w: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [M, K], w [N, K] -> [M, N] in out_dtype (default x.dtype), FP64 accumulation."""
    return (x.double() @ w.double().T).to(out_dtype or x.dtype)


def quantize_tokens_fp8_ref(x: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """x [M, K] (K % 128 == 0) -> x_q [M, K] float8_e4m3fn, sx [M, K/128] fp32."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    sx = g.abs().amax(-1).clamp_min(EPS) / FP8_MAX
    if ue8m0:
        sx = pow2_ceil(sx)
    q = (g / sx[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), sx


def weight_scales_fp32(scale: Tensor) -> Tensor:
    """weight_scale_inv in either format -> fp32 (UE8M0 bytes decode to 2^(e - 127))."""
    return scale.float()


def fp8_linear_ref(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    ue8m0: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """x [M, K] BF16, w [N, K] e4m3, w_scale [⌈N/128⌉, K/128] -> [M, N] out_dtype."""
    n, k = w.shape
    xq, sx = quantize_tokens_fp8_ref(x, ue8m0)
    xd = xq.double().reshape(-1, k // GROUP, GROUP) * sx.double()[..., None]
    s = weight_scales_fp32(w_scale).double().repeat_interleave(GROUP, 0)[:n]
    wd = w.double().reshape(n, k // GROUP, GROUP) * s[..., None]
    return (xd.reshape(-1, k) @ wd.reshape(n, k).T).to(out_dtype)


def swiglu_ref(gate_up: Tensor, limit: float) -> Tensor:
    """gate_up [..., 2I] -> [..., I] fp32: silu(min(gate, limit)) * clamp(up, ±limit)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    # Asymmetric on purpose (as trained): silu is already bounded below, so only its top is cut.
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def fp8_mlp_ref(
    x: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    limit: float,
    ue8m0: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """x [M, D] BF16, w13 [2I, D] (gate rows then up rows), w2 [D, I] e4m3 -> [M, D]
    out_dtype (BF16 as the stock sequence stores it; FP64: the down product exact)."""
    h = fp8_linear_ref(x, w13, w13_scale, ue8m0)
    a = swiglu_ref(h, limit).to(torch.bfloat16)
    return fp8_linear_ref(a, w2, w2_scale, ue8m0, out_dtype)
