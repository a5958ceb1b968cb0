"""Skinny GEMMs on CPU: the references against exact arithmetic, the Triton kernels under the
interpreter at small off-grid sizes (every split-K and SwiGLU path), tile plans, bad input.
The real GLM-5.3-Flash shapes run on the GPU (test_gemm_gpu.py)."""

import os
from dataclasses import replace

import pytest
import torch
from gemm_cases import (
    assert_linear_close,
    assert_mlp_close,
    bf16_inputs,
    fp8_inputs,
    mlp_weights,
    poisoned,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5_kernels.gemm import (
    DenseMlp,
    Fp8Linear,
    Projection,
    Router,
    fp8_linear_ref,
    linear_ref,
    plan,
    quantize_tokens_fp8_ref,
    swiglu_ref,
)
from glm5_kernels.gemm.shapes import flash_shapes
from glm5_kernels.moe import SharedExpert

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)


# --- references ---------------------------------------------------------------------------


def test_token_quantization_matches_its_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=gen).bfloat16()
    x[1, 128:256] = 0  # an all-zero group takes the 1e-10 floor, not a division by zero
    for ue8m0 in (False, True):
        q, s = quantize_tokens_fp8_ref(x, ue8m0)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
        amax = x.float().reshape(5, 3, 128).abs().amax(-1)
        if ue8m0:
            assert torch.equal(s, 2.0 ** torch.ceil(torch.log2(s)))  # powers of two
            assert (s >= amax / 448).all() and (s < 2 * amax.clamp_min(1e-10) / 448).all()
        else:
            torch.testing.assert_close(s, amax.clamp_min(1e-10) / 448, rtol=0, atol=0)
        deq = q.float().reshape(5, 3, 128) * s[..., None]
        # e4m3 rounds to 3 mantissa bits: half an ulp is 1/16 of the value's binade.
        err = (deq - x.float().reshape(5, 3, 128)).abs()
        assert (err <= amax[..., None] / 16 + 2.0**-9 * s[..., None]).all()
        assert torch.equal(q[1, 128:256].float(), torch.zeros(128))


def test_fp8_linear_ref_is_the_dequantized_product():
    gen = torch.Generator().manual_seed(1)
    x, w, s = fp8_inputs(3, 200, 256, "cpu", gen)
    xq, sx = quantize_tokens_fp8_ref(x)
    xd = (xq.double().reshape(3, 2, 128) * sx.double()[..., None]).reshape(3, 256)
    wd = w.double() * s.double().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)
    exact = xd @ wd.T
    y = fp8_linear_ref(x, w, s, out_dtype=torch.float64)
    torch.testing.assert_close(y, exact, rtol=1e-12, atol=0)
    # ... and close to the unquantized product: FP8 activations cost ~2^-5 relative per term.
    full = linear_ref(x, w.float() * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1))
    assert (y.float() - full.float()).norm() <= 0.05 * full.float().norm()


def test_e8m0_scales_read_as_powers_of_two():
    s = torch.tensor([[0.25, 1.0], [2.0**-20, 8.0]])
    e = s.to(torch.float8_e8m0fnu)
    assert torch.equal(e.float(), s)
    assert torch.equal(e.view(torch.uint8).int(), torch.log2(s).int() + 127)


# --- kernels under the interpreter -------------------------------------------------------


@interpreter
@pytest.mark.parametrize(
    "m, n, k, split",
    [(1, 100, 1100, True), (5, 300, 1000, True), (17, 64, 1040, True), (64, 90, 384, False)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_projection(m, n, k, split, out_dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = bf16_inputs(m, n, k, "cpu", gen)
    op = Projection(w, None if split else (), out_dtype=out_dtype)
    assert (op.tiles[m].split_k > 1) == split  # both the fixup and the direct store run
    y = op(x, out=poisoned(m, n, out_dtype, "cpu"))
    exact = linear_ref(x, w, torch.float64)
    abs_product = linear_ref(x.abs(), w.abs(), torch.float64)
    assert_linear_close(y, exact, abs_product, k, out_dtype == torch.bfloat16)
    # The split-K counters reset themselves: a second call (a graph replay) agrees exactly.
    assert torch.equal(op(x), y)
    assert not op._counts.any()


@interpreter
@pytest.mark.parametrize("m, n, k, split", [(1, 128, 1024, True), (5, 512, 128, False)])
def test_block_diagonal_projection(m, n, k, split):
    """Two projections in one launch (`blocks=2`): x [M, 2K] as two inputs side by side (a
    strided column slice, as the KDA gates' f_a | g_a in the fused input projection's
    output), each block of N/2 output columns from its own K columns; a tile may not straddle
    blocks (refused)."""
    gen = torch.Generator().manual_seed(m + n)
    wide = torch.randn(m, 2 * k + 96, generator=gen).bfloat16()
    x = wide[:, 32 : 32 + 2 * k]  # 16-byte aligned, rows strided
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    op = Projection(w, None if split else (), blocks=2)
    assert (op.tiles[m].split_k > 1) == split
    y = op(x, out=poisoned(m, n, torch.bfloat16, "cpu"))
    pairs = [(x[:, :k], w[: n // 2]), (x[:, k:], w[n // 2 :])]  # each block's input, weight
    exact = torch.cat([linear_ref(h, wb, torch.float64) for h, wb in pairs], dim=1)
    abs_product = torch.cat([linear_ref(h.abs(), wb.abs(), torch.float64) for h, wb in pairs], 1)
    assert_linear_close(y, exact, abs_product, k, True)
    with pytest.raises(ValueError, match=r"x: shape \(1, 128\), expected \[M, 256\]"):
        Projection(w[:256, :128].contiguous(), blocks=2)(x[:1, :128])
    with pytest.raises(ValueError, match="not a multiple of the column tiles"):
        Projection(w[:20].contiguous(), blocks=2)
    with pytest.raises(ValueError, match="blocks=3: must divide"):
        Projection(w, blocks=3)


@interpreter
@pytest.mark.parametrize("m, n, k, split", [(1, 100, 1100, True), (5, 300, 1000, False)])
def test_fp32_output_of_bf16_values(m, n, k, split):
    """bf16_values (the LM head's logits): the BF16 output's values, widened to FP32 by the
    kernel, bit for bit (the same sums, rounded once), through the split-K fixup and the
    direct store; refused for a BF16 output."""
    gen = torch.Generator().manual_seed(m + k)
    x, w = bf16_inputs(m, n, k, "cpu", gen)
    split_k = None if split else ()
    op = Projection(w, split_k, out_dtype=torch.float32, bf16_values=True)
    assert (op.tiles[m].split_k > 1) == split
    y = op(x, out=poisoned(m, n, torch.float32, "cpu"))
    assert y.dtype == torch.float32
    assert torch.equal(y, Projection(w, split_k)(x).float())
    assert not torch.equal(y, Projection(w, split_k, out_dtype=torch.float32)(x))  # rounded
    with pytest.raises(ValueError, match="bf16_values: for a float32 output"):
        Projection(w, bf16_values=True)


@interpreter
@pytest.mark.parametrize(
    "m, n1, n2, k, split", [(1, 128, 96, 1024, True), (5, 256, 64, 384, False)]
)
def test_projection_then_a_second_weight(m, n1, n2, k, split):
    """`then`: a second weight of the same input read in place as the output columns after
    the first's (the MLA q_b and the indexer's wq_b in one launch), through the split-K fixup
    and the direct store, wherever the two were allocated (the second before the first too);
    a first weight whose rows a column tile would straddle is refused."""
    gen = torch.Generator().manual_seed(m + n1)
    x = bf16_inputs(m, 1, k, "cpu", gen)[0]
    second, first = ((torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n in (n2, n1))
    split_k = None if split else ()
    op = Projection(first, split_k, then=second)
    assert (op.tiles[m].split_k > 1) == split and op.n == n1 + n2
    y = op(x, out=poisoned(m, n1 + n2, torch.bfloat16, "cpu"))
    w = torch.cat([first, second])
    assert_linear_close(y, linear_ref(x, w, torch.float64),
                        linear_ref(x.abs(), w.abs(), torch.float64), k, True)  # fmt: skip
    assert torch.equal(y, Projection(w, split_k)(x))  # the same sums, tile by tile
    with pytest.raises(ValueError, match="rows are not a multiple of the column tiles"):
        Projection(first[:40].contiguous(), then=second)
    with pytest.raises(ValueError, match="then: K=64, the weight's is"):
        Projection(first, then=second[:, :64].contiguous())


@interpreter
def test_router_is_fp32_and_splits():
    gen = torch.Generator().manual_seed(7)
    x, w = bf16_inputs(3, 288, 1024, "cpu", gen)
    router = Router(w)
    assert router.tiles[3].split_k > 1
    y = router(x)
    assert y.dtype == torch.float32
    exact = linear_ref(x, w, torch.float64)
    assert_linear_close(y, exact, linear_ref(x.abs(), w.abs(), torch.float64), 1024, False)


def _quantize_in_gemm(op, m):
    """Switch token count m to the fused path: activations quantized inside the GEMM."""
    op.tiles[m] = replace(op.tiles[m], quantize_first=False)


@interpreter
@pytest.mark.parametrize(
    "m, n, k", [(1, 100, 256), (6, 300, 1024), (40, 130, 384)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("fused", [False, True], ids=["quantize-first", "fused-quant"])
@pytest.mark.parametrize("e8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_fp8_linear(m, n, k, fused, e8m0):
    gen = torch.Generator().manual_seed(m + n + k)
    x, w, s = fp8_inputs(m, n, k, "cpu", gen, e8m0)
    op = Fp8Linear(w, s, ue8m0=e8m0)
    assert op.tiles[m].blocks == (2 if k % 256 == 0 else 1)  # both K step widths run
    if fused:
        _quantize_in_gemm(op, m)
    y = op(x, out=poisoned(m, n, torch.bfloat16, "cpu"))
    exact = fp8_linear_ref(x, w, s, e8m0, torch.float64)
    abs_product = fp8_linear_ref(x.abs(), w.float().abs().to(w.dtype), s, e8m0, torch.float64)
    assert_linear_close(y, exact, abs_product, k, True)


@interpreter
@pytest.mark.parametrize("fused", [False, True], ids=["quantize-first", "fused-quant"])
@pytest.mark.parametrize("e8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_swiglu_down_projection(fused, e8m0):
    """The down GEMM's input: clamped SwiGLU of a gate_up output, rounded to BF16."""
    gen = torch.Generator().manual_seed(3)
    m, n, i, limit = 5, 192, 256, 1.5
    h = (3 * torch.randn(m, 2 * i, generator=gen)).bfloat16()  # past the limit: clamps act
    _, w, s = fp8_inputs(m, n, i, "cpu", gen, e8m0)
    op = Fp8Linear(w, s, ue8m0=e8m0, swiglu_limit=limit)
    if fused:
        _quantize_in_gemm(op, m)
    y = op(h)
    a = swiglu_ref(h, limit).bfloat16()
    exact = fp8_linear_ref(a, w, s, e8m0, torch.float64)
    ref = exact.bfloat16().double()
    assert (y.double() - ref).norm() <= 5e-3 * ref.norm()


@interpreter
@pytest.mark.parametrize("cls", [DenseMlp, SharedExpert])
@pytest.mark.parametrize("e8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("d, i", [(256, 384), (1024, 256)], ids=["one-split", "gate_up-splits"])
def test_fp8_mlp(cls, e8m0, d, i):
    """Against the stock sequence; and where gate_up splits K (its partials then reach the
    SwiGLU quantization unreduced) the same bits as gate_up's own fixup followed by down."""
    gen = torch.Generator().manual_seed(11 + d)
    m = 3
    weights = mlp_weights(d, i, "cpu", gen, e8m0)
    mlp = cls(*weights[:4], swiglu_limit=7.0, ue8m0=e8m0)
    x = torch.randn(m, d, generator=gen).bfloat16()
    y = mlp(x, out=poisoned(m, d, torch.bfloat16, "cpu"))
    assert_mlp_close(y, x, weights, 7.0, e8m0)
    assert (mlp.gate_up.tiles[m].split_k > 1) == (d == 1024)
    assert torch.equal(y, mlp.down(mlp.gate_up(x)))


# --- plans ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    m=st.integers(1, 64),
    n=st.integers(1, 200_000),
    k=st.integers(1, 20_000),
    sms=st.sampled_from([4, 78, 132, 148]),
    fp8=st.booleans(),
)
def test_plan_covers_k_without_empty_splits(m, n, k, sms, fp8):
    t = plan(m, n, k, sms=sms, fp8=fp8)
    assert t.bm >= m and t.bm in (16, 32, 64)
    k_tiles = -(-k // t.bk)
    per_split = -(-k_tiles // t.split_k)
    per_split += -per_split % t.blocks  # as Fp8Linear launches it
    assert k_tiles % t.blocks == 0 and per_split % t.blocks == 0
    assert 1 <= t.split_k <= max(1, k_tiles // 4) and per_split * t.split_k >= k_tiles
    assert (t.split_k - 1) * per_split < k_tiles  # the last split holds work
    assert plan(m, n, k, sms=sms, fp8=fp8, split_k=False).split_k == 1
    # The pipeline fits an SM's shared memory (228 KB on SM90 / SM100) with room to spare.
    per_stage = (t.bn + t.bm) * t.bk * (t.blocks if fp8 else 2)
    assert t.stages >= 2 and t.stages * per_stage <= 200 << 10


def test_flash_shapes_are_fp8_aligned():
    for tp in (1, 2, 4, 8):
        for name, (kind, n, k) in flash_shapes(tp).items():
            if kind in ("fp8", "mlp"):
                assert k % 128 == 0 and n % 128 == 0, (tp, name)


# --- bad input -----------------------------------------------------------------------------


@interpreter
def test_bad_weights_name_every_problem():
    w = torch.zeros(64, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError) as e:
        Fp8Linear(w, torch.ones(1, 1, dtype=torch.float16), swiglu_limit=-1.0)
    msg = str(e.value)
    for part in ("K=200 is not a multiple of 128", "weight_scale_inv: dtype", "swiglu_limit"):
        assert part in msg
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        Projection(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="contiguous"):
        Projection(torch.zeros(16, 8, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="gate_up rows"):
        DenseMlp(
            torch.zeros(256, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1),
            torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), 7.0,
        )  # fmt: skip


@interpreter
def test_bad_inputs_name_every_problem():
    op = Projection(torch.zeros(32, 128, dtype=torch.bfloat16), max_tokens=8)
    with pytest.raises(ValueError) as e:
        op(torch.zeros(9, 64))
    msg = str(e.value)
    assert "expected [M, 128]" in msg and "torch.float32" in msg and "M=9 outside" in msg
    with pytest.raises(ValueError, match="columns must be contiguous"):
        op(torch.zeros(128, 4, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="out must be"):
        op(torch.zeros(2, 128, dtype=torch.bfloat16), out=torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"outside 1\.\.8"):
        op.prepare([0])
    assert op.supports(8) and not op.supports(9) and not op.supports(0)
    with pytest.raises(ValueError, match="max_tokens=65"):
        Projection(torch.zeros(32, 128, dtype=torch.bfloat16), max_tokens=65)
    fc = Fp8Linear(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 1))
    fc.tiles[2] = replace(fc.tiles[2], bn=256)  # spans two weight-scale blocks
    with pytest.raises(ValueError, match="BN=256 must divide 128"):
        fc(torch.zeros(2, 128, dtype=torch.bfloat16))
