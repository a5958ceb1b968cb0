"""Shared by the mHC boundary tests (CPU interpreter and GPU): the model's constants, weights
with a trained checkpoint's statistics, a boundary's inputs, and the tolerances.

Tolerances, from the rounding: the streams round exactly as the reference does, but the
kernel sums comb^T @ streams' four products in its own order (and may fuse a multiply-add),
so a value may land on the neighbouring BF16 (one ulp: <= 2^-7 relative). post and comb are
FP32 through the same formulas from mix logits summed over H*D columns in another order:
rtol 1e-5 / atol 1e-6, as the references' own check against transformers. The normed input
rounds three times (collapse, normalize, weight), each may land one ulp over, and its 1/rms
comes from the Gram matrix of the unrounded collapse: the collapse's own rounding (relative
error ~U(+-2^-9)) moves sum(c^2) by ~2^-8 / sqrt(D) relative, which tips about
2 * that / ulp ~ 2.5 / sqrt(D) of the values to the neighbouring BF16 (3.5 % measured on the
H200 at D = 4096). And where the collapse sum_h pre_h s_h cancels to near zero, the FP32
sums' order moves it by ~2^-22 of the terms (~ the row's RMS), many ulps of a tiny value. So:
<= 3 ulps + 2^-16 x the row's RMS anywhere, and at most 4 / sqrt(D) of the values off.
"""

import math

import torch

from glm5_kernels.mhc import MhcConfig

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def config(hidden: int) -> MhcConfig:
    return MhcConfig(hc=4, hidden=hidden, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20,
                     norm_eps=1e-5)  # fmt: skip


def site_weights(c: MhcConfig, device, gen, fn_dtype=torch.float32, norm_dtype=torch.bfloat16):
    """A sublayer's mix weights (fn, scale, base) and its input norm's weight."""
    fn = torch.randn(c.mix, c.hc * c.hidden, generator=gen, device=device)
    fn = (fn * 0.5 / math.sqrt(c.hc * c.hidden)).to(fn_dtype)
    scale = 0.5 + torch.rand(3, generator=gen, device=device)
    base = 0.5 * torch.randn(c.mix, generator=gen, device=device)
    norm = (1.0 + 0.1 * torch.randn(c.hidden, generator=gen, device=device)).to(norm_dtype)
    return fn, scale, base, norm


def boundary_inputs(c: MhcConfig, m: int, device, gen):
    """A sublayer output, the streams before it and the post / comb of its pre."""
    x = torch.randn(m, c.hidden, generator=gen, device=device).bfloat16()
    streams = (2 * torch.randn(m, c.hc, c.hidden, generator=gen, device=device)).bfloat16()
    post = 2 * torch.rand(m, c.hc, generator=gen, device=device)
    comb = torch.rand(m, c.hc, c.hc, generator=gen, device=device)
    comb = comb / comb.sum(1, keepdim=True)
    return x, streams, post, comb


def poisoned_out(c: MhcConfig, m: int, device, head=False, given=False):
    nan = float("nan")
    full = lambda *shape, dtype=torch.float32: torch.full(shape, nan, dtype=dtype, device=device)  # noqa: E731
    return (
        None if head or given else full(m, c.hc, c.hidden, dtype=torch.bfloat16),
        None if head else full(m, c.hc),
        None if head else full(m, c.hc, c.hc),
        full(m, c.hidden, dtype=torch.bfloat16),
    )


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's BF16 ulp (2^(exponent - 7))."""
    want = want.float()
    exp = torch.floor(torch.log2(want.abs().clamp(min=2.0**-126)))
    return (got.float() - want).abs() / torch.exp2(exp - 7)


def assert_streams(got, want):
    assert not got.isnan().any(), "streams: an element was not written"
    assert ulps(got, want).max() <= 1, f"streams: {ulps(got, want).max()} ulps"


def assert_mix(post, comb, want_post, want_comb):
    assert not post.isnan().any() and not comb.isnan().any(), "post / comb: not written"
    torch.testing.assert_close(post, want_post, **FP32)
    torch.testing.assert_close(comb, want_comb, **FP32)


def assert_normed(got, want):
    assert not got.isnan().any(), "normed: an element was not written"
    want = want.float()
    exp = torch.floor(torch.log2(want.abs().clamp(min=2.0**-126)))
    floor = 2.0**-16 * want.square().mean(-1, keepdim=True).sqrt()
    err = (got.float() - want).abs()
    worst = ((err - floor).clamp(min=0) / torch.exp2(exp - 7)).max()
    assert worst <= 3, f"normed: {worst} ulps beyond 2^-16 of the row's RMS"
    u = ulps(got, want)
    off, bound = (u > 0).float().mean().item(), 4 / got.shape[-1] ** 0.5
    assert off <= bound, f"normed: {off:.3f} of the values off, more than {bound:.3f}"
