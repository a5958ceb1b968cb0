"""FP8 E4M3 128x128 block quantization: the round-trip error bound, UE8M0 scales, zero blocks,
and agreement with transformers' own Fp8Quantize / Fp8Dequantize conversion ops.

The bound. e4m3fn has 3 mantissa bits, so within a binade [2^e, 2^(e+1)) its values are 2^(e-3)
apart and round-to-nearest errs by at most half of that: |x - e4m3(x)| <= 2^(e-4). The largest
binade in use is [256, 448] (448 = 1.75 * 2^8 is the max finite value): half-ulp 16. Smaller
|x| (down to the subnormals, spaced 2^-9) have smaller absolute errors. So in scaled units a
block's worst error is <= 16 when its amax maps to >= 256, and <= 8 when it maps below 256.
  * fp32 scale = amax/448: amax maps to 448, so max|w - ŵ| / amax <= 16/448 = 1/28.
  * UE8M0 scale = 2^ceil(log2(amax/448)) in [amax/448, 2*amax/448): amax maps to x_max in
    (224, 448]; if x_max >= 256 the error ratio is <= 16/x_max <= 1/16, otherwise <= 8/224 = 1/28.
    So max|w - ŵ| / amax <= 1/16 (the brief's 2^-3 holds with 2x margin).
Slack: fp32 rounding of w/scale and q*scale adds ~2^-24 relative, hence the (1 + 1e-5).
"""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

from glm5_kernels.quant import dequantize_fp8_block_ref, quantize_fp8_block_ref

BOUND = {False: 1 / 28, True: 1 / 16}
SLACK = 1 + 1e-5


def _block_amax(x, block=128):
    """amax(|x|) per 128x128 block: [..., N, K] -> [..., ceil(N/128), ceil(K/128)]."""
    *lead, n, k = x.shape
    x = torch.nn.functional.pad(x.abs(), (0, -k % block, 0, -n % block))
    return x.reshape(*lead, x.shape[-2] // block, block, x.shape[-1] // block, block).amax((-3, -1))


def _block_rel_error(w, deq):
    """max |w - deq| / amax(|w|) per block (0 for all-zero blocks)."""
    err, mag = _block_amax(w - deq), _block_amax(w)
    return torch.where(mag > 0, err / mag.clamp_min(1e-38), torch.zeros_like(err))


SHAPES = [(1, 1), (128, 128), (200, 300), (129, 257), (3, 200, 300), (2, 2, 130, 140)]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_error_bound(shape, ue8m0):
    gen = torch.Generator().manual_seed(sum(shape))
    # Per-row magnitudes over 6 decades, so blocks see very different amax.
    w = torch.randn(shape, generator=gen) * torch.exp(
        4 * torch.randn(*shape[:-1], 1, generator=gen)
    )
    q, scale = quantize_fp8_block_ref(w, ue8m0=ue8m0)
    nb = (-(-shape[-2] // 128), -(-shape[-1] // 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-2], *nb)
    assert not q.float().isnan().any()
    deq = dequantize_fp8_block_ref(q, scale)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    rel = _block_rel_error(w, deq)
    assert rel.max() <= BOUND[ue8m0] * SLACK, rel.max()
    if w.numel() > 1000:  # the bound is not vacuous: real rounding happened
        assert rel.max() > BOUND[ue8m0] / 4
    q_amax = _block_amax(q.float())
    if ue8m0:  # amax lands in (224, 448] (rounding may take (224, 232) down to 224)
        assert (q_amax >= 224).all() and (q_amax <= 448).all()
    else:  # each block's amax lands on ±448 exactly
        assert (q_amax == 448).all()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    log_mag=st.floats(-30, 30),
    ue8m0=st.booleans(),
)
def test_bound_and_fixed_point_for_any_shape_and_magnitude(seed, n, k, log_mag, ue8m0):
    """The bound at any magnitude 2^±30, and dequantized weights are a fixed point of the round
    trip. With UE8M0 exactly (a block whose amax rounded down to e4m3's 224 re-quantizes with
    half the scale and doubled q: both exact); with fp32 scales to an ulp (448 * scale rounds)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 2.0**log_mag
    q, scale = quantize_fp8_block_ref(w, ue8m0=ue8m0)
    deq = dequantize_fp8_block_ref(q, scale)
    assert _block_rel_error(w, deq).max() <= BOUND[ue8m0] * SLACK
    deq2 = dequantize_fp8_block_ref(*quantize_fp8_block_ref(deq, ue8m0=ue8m0))
    if ue8m0:
        assert torch.equal(deq2, deq)
    else:
        torch.testing.assert_close(deq2, deq, rtol=2**-22, atol=0)


@pytest.mark.parametrize("shape", [(200, 300), (4, 256, 384)], ids=["200x300", "4x256x384"])
def test_ue8m0_scales_are_powers_of_two_rounded_up(shape):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(shape, generator=gen) * torch.exp(
        3 * torch.randn(*shape[:-1], 1, generator=gen)
    )
    _, exact = quantize_fp8_block_ref(w)
    _, pow2 = quantize_fp8_block_ref(w, ue8m0=True)
    mantissa, _ = torch.frexp(pow2)
    assert (mantissa == 0.5).all()
    assert (pow2 >= exact).all() and (pow2 < 2 * exact).all()
    # Representable as UE8M0 (2^-127 .. 2^127): the cast to float8_e8m0fnu is exact.
    assert torch.equal(pow2.to(torch.float8_e8m0fnu).float(), pow2)


def test_exact_scale_and_power_of_two_boundary():
    """A block whose amax/448 is exactly a power of two keeps that scale under UE8M0 (no extra
    doubling), and values that are e4m3 numbers times the scale round-trip exactly."""
    values = torch.tensor([448.0, -448.0, 1.0, -0.5, 0.015625, 0.001953125, 0.0, 240.0])
    w = torch.zeros(130, 130)
    w[0, :8] = values * 2.0**-7
    w[129, 129] = 5.0  # a second block: 5/448 is not a power of two
    for ue8m0 in (False, True):
        q, scale = quantize_fp8_block_ref(w, ue8m0=ue8m0)
        assert scale[0, 0] == 2.0**-7
        assert scale[1, 1] == (2.0**-6 if ue8m0 else torch.tensor(5.0) / 448)
        assert torch.equal(dequantize_fp8_block_ref(q, scale)[0, :8], w[0, :8])


def test_zero_blocks_get_a_finite_scale():
    w = torch.zeros(200, 300)
    w[150:, 260:] = torch.randn(50, 40)  # only block (1, 2) is non-zero
    for ue8m0 in (False, True):
        q, scale = quantize_fp8_block_ref(w, ue8m0=ue8m0)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert (scale[0] == 1).all() and scale[1, 0] == 1 and scale[1, 1] == 1
        deq = dequantize_fp8_block_ref(q, scale, dtype=torch.bfloat16)
        assert deq.dtype == torch.bfloat16 and not deq.isnan().any()
        assert (deq.float()[:150] == 0).all() and (deq.float()[:, :256] == 0).all()
        assert (deq.float()[150:, 260:] != 0).any()


def _hf_quantizer(ue8m0):
    config = SimpleNamespace(weight_block_size=(128, 128), scale_fmt="ue8m0" if ue8m0 else None)
    return SimpleNamespace(quantization_config=config)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0"])
def test_matches_transformers_fp8_conversion(ue8m0):
    """transformers' Fp8Quantize (whole blocks only) computes w * (448 / amax) and stores
    1 / (448 / amax), we divide by amax / 448: scales agree to an fp32 ulp, q bit for bit except
    where the two roundings straddle an e4m3 midpoint (then 1 e4m3 ulp apart). Its dequantize
    equals ours exactly."""
    gen = torch.Generator().manual_seed(4)
    w = 0.02 * torch.randn(2, 256, 384, generator=gen)
    theirs = Fp8Quantize(_hf_quantizer(ue8m0))._quantize_one("experts.weight", w)
    hf_q, hf_scale = theirs["experts.weight"], theirs["experts.weight_scale_inv"].float()
    q, scale = quantize_fp8_block_ref(w, ue8m0=ue8m0)
    torch.testing.assert_close(scale, hf_scale, rtol=2**-23, atol=0)
    differ = q.view(torch.uint8) != hf_q.view(torch.uint8)
    assert differ.float().mean() < 1e-3
    assert ((q.view(torch.uint8).int() - hf_q.view(torch.uint8).int()).abs() <= 1).all()
    hf_deq = Fp8Dequantize(_hf_quantizer(ue8m0))._dequantize_one(q, scale, torch.float32)
    assert torch.equal(dequantize_fp8_block_ref(q, scale), hf_deq)
