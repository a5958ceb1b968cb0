"""The reference backbone's two capturable MoE expert paths (one gather of each token's k
experts, or every expert once on all tokens) against glm5-kernels' `experts_ref`: BF16
activations and dequantized BF16 weights, like vLLM's BF16-dequantized FP8 experts.

Both paths round the same intermediates to x.dtype (gate_up, the SwiGLU output, each
expert's down_proj output) but reach them through differently grouped matmuls, whose FP32
accumulation order differs by CPU (oneDNN's AMX / AVX-512 BF16 kernels, ATen's AVX2 loops).
A different order can move an FP32 sum across a BF16 rounding boundary: on AVX2-only x86,
0-2 of each route slot's 14,208 gate_up elements land a BF16 ulp apart, 5e-5 of the output
(normwise) once carried through down_proj. So each path is checked to lie inside the
interval that any FP32 accumulation order and those roundings allow (`_interval`),
elementwise, not within a bound fitted to one machine; the FP32 case runs the same paths
without BF16 intermediates."""

import pytest
import torch
import torch.nn.functional as F

from glm5_kernels.moe import experts_ref
from glm5_kernels.quant import quantize_fp8_block_ref
from glm5_kernels.quant.reference import dequantize_fp8_block_ref
from glm5_runtime.reference.stages import _experts_by_slot, _experts_dense

U32 = 2.0**-24  # FP32 unit roundoff: |fl(v) - v| <= U32 |v| for one round-to-nearest op
TINY = torch.finfo(torch.float32).tiny  # per-op slack for flush-to-zero (VDPBF16PS, AMX)
SILU_SLOPE = 1.1  # max |silu'(z)| = 1.0998 (at z = 2.40): silu's Lipschitz constant
FP32_SWIGLU_U32 = 16  # FP32 silu(g) * u, in U32: exp (<= 4 ulp = 8 U32), add, divide, mul


def _sum_error(n: int, magnitude):
    """Bound on an FP32 dot product of n terms (products exact or rounded once), in any
    summation order or blocking: Higham's gamma_n * sum |terms|, plus flushed subnormals."""
    return n * U32 / (1 - n * U32) * magnitude + n * TINY


def _rounded(t, dtype):
    """float64 -> the dtype through FP32, as the paths round their FP32 sums: monotone, so
    an FP32 value in [lo, hi] rounds into [_rounded(lo), _rounded(hi)]."""
    return t.float().to(dtype).double()


def _box(lo, hi):
    return (lo + hi) / 2, (hi - lo) / 2


def _interval(x, w13, w2, ids, weights, limit):
    """x [T,D], w13 [E,2I,D], w2 [E,D,I] as the paths see them (x.dtype), ids [T,k], weights
    [T,k] fp32 >= 0 -> (lo, hi) [T,D] float64: any path that accumulates each matmul in FP32
    (any order) and rounds gate_up, the SwiGLU output and down_proj's output to x.dtype
    lands in [lo, hi]. Interval arithmetic in float64, rounding each bound as a path would:
    where no rounding boundary lies in an interval, every path rounds to the same value."""
    d, inter, k = x.shape[1], w2.shape[2], ids.shape[1]
    xd = x.double()[:, :, None]
    lo = torch.zeros(x.shape, dtype=torch.float64)
    hi = torch.zeros_like(lo)
    magnitude = torch.zeros_like(lo)
    for j in range(k):
        up, down = w13[ids[:, j]].double(), w2[ids[:, j]].double()  # [T,2I,D], [T,D,I]
        a = (up @ xd).squeeze(-1)
        rho = _sum_error(d, (up.abs() @ xd.abs()).squeeze(-1))
        a, a_rad = _box(_rounded(a - rho, x.dtype), _rounded(a + rho, x.dtype))
        (g, v), (g_rad, v_rad) = a.chunk(2, -1), a_rad.chunk(2, -1)
        # SwiGLU over that box: the clamps are 1-Lipschitz and silu SILU_SLOPE-Lipschitz, so
        # |s'v' - sv| <= |s' - s| |v'| + |s| |v' - v|; then FP32 evaluation and one rounding.
        silu, vc = F.silu(g.clamp(max=limit)), v.clamp(-limit, limit)
        h = silu * vc
        h_rad = SILU_SLOPE * g_rad * (vc.abs() + v_rad) + silu.abs() * v_rad
        h_rad = h_rad + FP32_SWIGLU_U32 * U32 * (h.abs() + h_rad)
        h, h_rad = _box(_rounded(h - h_rad, x.dtype), _rounded(h + h_rad, x.dtype))
        # down_proj: h's box carried through |w2|, FP32 accumulation, one rounding.
        y = (down @ h[:, :, None]).squeeze(-1)
        y_rad = (down.abs() @ h_rad[:, :, None]).squeeze(-1)
        y_rad = y_rad + _sum_error(inter, (down.abs() @ (h.abs() + h_rad)[:, :, None]).squeeze(-1))
        y_lo, y_hi = _rounded(y - y_rad, x.dtype), _rounded(y + y_rad, x.dtype)
        w = weights[:, j : j + 1].double()
        lo += w * y_lo
        hi += w * y_hi
        magnitude += w * torch.maximum(y_lo.abs(), y_hi.abs())
    # The weighted FP32 sum over the k slots: one product and one addition each, any order.
    slack = _sum_error(k + 1, magnitude)
    return lo - slack, hi + slack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens, experts, k", [(1, 16, 16), (3, 8, 2), (37, 16, 4)])
def test_capturable_expert_paths_match_the_reference(tokens, experts, k, dtype):
    gen = torch.Generator().manual_seed(tokens * experts + k)
    d, inter = 256, 128 + 64  # I off the 128 grid: partial scale blocks
    x = torch.randn(tokens, d, generator=gen).to(dtype)
    w13, s13 = quantize_fp8_block_ref(torch.randn(experts, 2 * inter, d, generator=gen) / 16)
    w2, s2 = quantize_fp8_block_ref(torch.randn(experts, d, inter, generator=gen) / 16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    limit = 1.5
    want = experts_ref(x, w13, w2, ids, weights, limit, s13, s2)
    # Both paths multiply x by the FP8 weights dequantized to x.dtype, elementwise alike.
    w13_x, w2_x = (dequantize_fp8_block_ref(w, s, dtype=dtype) for w, s in ((w13, s13), (w2, s2)))
    lo, hi = _interval(x, w13_x, w2_x, ids, weights, limit)
    outs = {}
    for path in (_experts_by_slot, _experts_dense):
        out = outs[path.__name__] = path(x, w13, w2, ids, weights, limit, s13, s2)
        assert out.dtype == torch.float32 and out.shape == want.shape
        # BF16 activations, weights and intermediate against FP32: ~2^-8 relative (4e-3).
        err = ((out - want).norm() / want.norm()).item()
        assert err < 1e-2, (path.__name__, err)
        outside = ((lo - out.double()).clamp(min=0) + (out.double() - hi).clamp(min=0)).max()
        assert outside.item() == 0, (path.__name__, outside.item())
    # Hence the two paths differ by at most the interval's width: a rounding flipped by the
    # accumulation order fits, a wrong route or a weight off by a percent does not.
    gap = (outs["_experts_dense"] - outs["_experts_by_slot"]).double().abs()
    assert (gap <= hi - lo).all(), (gap / (hi - lo)).max().item()
