"""Shared by the CPU (interpreter) and GPU MoE-stage tests: weights, routings worth testing,
and the bounds the stage is held to.

Bounds. Routing: the ids exactly (ties to the lower id), the weights within 2^-20 relative
(a sigmoid and a sum of k FP32 values, a few ulps). Rows: against moe_rows_ref, which rounds
and quantizes as the kernels do; the GPU's FP8 MMA accumulates each 128-wide block with ~14
mantissa bits, so some BF16 gate_up values land an ulp away and a few SwiGLU codes move one
e4m3 step — the MLP bound of gemm_cases.assert_mlp_close (normwise <= 1.5e-2, elementwise
<= 2^-4 of the largest), applied to every route's row; the output the same against
moe_output_ref of those reference rows and the kernel's own weights."""

import torch
from moe_routing import assert_routing as assert_routing  # the kernels' and the steps' check

from glm5_kernels.moe import moe_output_ref, moe_rows_ref
from glm5_kernels.quant import quantize_fp8_block_ref


def moe_weights(e: int, d: int, i: int, device, gen: torch.Generator, e8m0: bool = False):
    """(w13, w13_scale, w2, w2_scale, shared): e experts and the shared expert, block-FP8."""

    def quantized(n: int, k: int, count: int):
        qs, ss = [], []
        for _ in range(count):  # one at a time: the real stacks are GBs in FP32
            w = torch.randn(n, k, generator=gen, device=device) / k**0.5
            q, s = quantize_fp8_block_ref(w, ue8m0=e8m0)
            qs.append(q)
            ss.append(s.to(torch.float8_e8m0fnu) if e8m0 else s)
        return torch.stack(qs), torch.stack(ss)

    q13, s13 = quantized(2 * i, d, e + 1)
    q2, s2 = quantized(d, i, e + 1)
    shared = (q13[e].clone(), s13[e].clone(), q2[e].clone(), s2[e].clone())
    routed = (t[:e].contiguous() for t in (q13, s13, q2, s2))
    return (*routed, shared)


def routings(m: int, e: int, device, gen: torch.Generator, bias: torch.Tensor):
    """name -> (router logits [m, e], correction bias [e]): random scores; exact ties (equal
    scores, and a bias equal on every third expert: the lower ids of those win); one expert
    every token picks, under a bias that puts every score + bias below -2 (the same routes
    as without it: a pick's removed expert must stay below every value, not just above
    -2); every token on the same experts."""
    rand = torch.randn(m, e, generator=gen, device=device) * 2
    hot = rand.clone()
    hot[:, e // 2] = 30.0
    tied = torch.zeros(e, device=device)
    tied[::3] = 0.25
    return {
        "random": (rand, bias),
        "ties": (torch.zeros(m, e, device=device), tied),
        "hot-expert": (hot, bias - 3.0),
        "same-experts": (rand[:1].expand(m, e).contiguous(), bias),
    }


def assert_rows_close(rows, route_row, x, ids, weights, w, limit, ue8m0):
    """The stage's unfinalized rows against moe_rows_ref, route by route."""
    m, k = ids.shape
    ref = moe_rows_ref(x, ids.long(), *w[:4], w[4], limit, ue8m0)
    assert (route_row >= 0).all() and route_row.unique().numel() == m * k, "routes share a row"
    got = torch.stack([rows[:m]] + [rows[route_row[:, j].long()] for j in range(k)], 1).double()
    assert not torch.isnan(got).any(), "NaN in a route row (never written)"
    assert (got - ref).norm() <= 1.5e-2 * ref.norm()
    assert (got - ref).abs().max() <= 2.0**-4 * ref.abs().max()
    return ref


def assert_output_close(out, ref_rows, weights):
    ref = moe_output_ref(ref_rows, weights).double()
    out = out.double()
    assert not torch.isnan(out).any()
    assert (out - ref).norm() <= 1.5e-2 * ref.norm()
    assert (out - ref).abs().max() <= 2.0**-4 * ref.abs().max()


def assert_same_sum(fused, finalized):
    """The down kernel's finalization against MoeRows.finalize (the same sum in the same
    order): equal, but where the GPU fuses a multiply-add the FP32 sum can differ by an ulp,
    and so cross a BF16 rounding boundary: <= 1 % of elements, each within 2^-7 of the
    largest."""
    assert not torch.isnan(fused).any()
    diff = (fused.double() - finalized.double()).abs()
    assert (diff > 0).double().mean() <= 0.01
    assert diff.max() <= 2.0**-7 * finalized.double().abs().max()
