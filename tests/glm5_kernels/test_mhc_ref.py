"""mHC references against transformers' Glm5NextTextHyperConnection / HyperHead and the real
decoder layer (whose post-mixing is inline code), plus Sinkhorn properties under hypothesis.

Tolerances: measured bit-identical on this CPU, but transformers runs F.linear on a 3-D input
where we run a 2-D matmul, and another BLAS or thread count may sum in another order (~1e-7
relative, amplified a little through 20 Sinkhorn divisions): fp32 rtol 1e-5 / atol 1e-6.
Model-dtype (BF16) outputs may then differ by one BF16 rounding (an ulp is up to 2^-7 relative).
"""

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextDecoderLayer,
    Glm5NextTextHyperConnection,
    Glm5NextTextHyperHead,
)

from glm5_kernels.mhc import (
    hc_expand_ref,
    hc_fused_post_pre_ref,
    hc_head_ref,
    hc_mix_ref,
    hc_post_ref,
    hc_pre_ref,
)
from glm5_kernels.norm import rms_norm_ref

FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2**-7, "atol": 1e-6}


def _tol(dtype):
    return FP32 if dtype == torch.float32 else BF16


def _config(hidden=64, **kw):
    return Glm5NextTextConfig(
        hidden_size=hidden,
        hc_mult=4,
        linear_num_heads=4,
        linear_head_dim=16,
        num_hidden_layers=4,
        intermediate_size=96,
        **kw,
    )


def _randomize_hc(hc, gen):
    """Realistic, non-trivial mixing: fn ~ N(0, 0.02) as trained init, but scale and base random
    (the init's ones/zeros would make comb start near uniform and Sinkhorn trivially converged)."""
    with torch.no_grad():
        hc.fn.copy_(0.02 * torch.randn(hc.fn.shape, generator=gen))
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(0.5 + 3 * torch.rand(3, generator=gen))


def _hc_kwargs(config):
    return {
        "rms_eps": config.rms_norm_eps,
        "hc_eps": config.hc_eps,
        "sinkhorn_iters": config.hc_sinkhorn_iters,
    }


def _params(hc):
    return hc.fn, hc.scale, hc.base


CASES = [
    pytest.param(t, d, dtype, id=f"T{t}-D{d}-{str(dtype)[6:]}")
    for t, d in [(1, 64), (3, 64), (17, 200)]
    for dtype in (torch.float32, torch.bfloat16)
] + [pytest.param(2, 4096, torch.bfloat16, id="T2-D4096-bfloat16-flash")]


@pytest.mark.parametrize(("t", "d", "dtype"), CASES)
def test_hc_pre_matches_hyper_connection(t, d, dtype):
    config = _config(hidden=d)
    gen = torch.Generator().manual_seed(t * 7919 + d)
    hc = Glm5NextTextHyperConnection(config)
    _randomize_hc(hc, gen)
    hc = hc.to(dtype)
    streams = torch.randn(t, 4, d, generator=gen).to(dtype)
    with torch.no_grad():
        post, comb, collapsed = hc(streams[None])
    got_post, got_comb, got_collapsed = hc_pre_ref(streams, *_params(hc), **_hc_kwargs(config))
    assert (got_post.dtype, got_comb.dtype, got_collapsed.dtype) == (post.dtype, comb.dtype, dtype)
    torch.testing.assert_close(got_post, post[0], **FP32)
    torch.testing.assert_close(got_comb, comb[0], **FP32)
    torch.testing.assert_close(got_collapsed, collapsed[0], **_tol(dtype))
    # Sanity that the case is non-trivial: comb is far from uniform, and collapsing with
    # hc_mix_ref's pre reproduces the collapsed stream.
    assert (got_comb - 0.25).abs().max() > 0.05
    pre, _, _ = hc_mix_ref(streams, *_params(hc), **_hc_kwargs(config))
    torch.testing.assert_close(
        (pre[..., None] * streams.float()).sum(1), got_collapsed.float(), **_tol(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("t", [1, 5])
def test_boundary_matches_decoder_layer(t, dtype):
    """Run a real KDA + dense-MLP decoder layer, capture what its sublayers saw, and rebuild
    every stage from the references: pre -> norm -> (attn) -> boundary -> (mlp) -> post."""
    config = _config()
    gen = torch.Generator().manual_seed(100 + t)
    layer = Glm5NextTextDecoderLayer(config, layer_idx=0)
    assert layer.block_type == "linear_attention"
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name or "o_norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(-2 - 3 * torch.rand(p.shape, generator=gen))
            elif p.ndim >= 2 and not name.endswith(".fn"):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        _randomize_hc(layer.attn_hc, gen)
        _randomize_hc(layer.ffn_hc, gen)
    layer = layer.to(dtype)

    seen = {}

    def capture(key):
        def hook(module, args, kwargs, output):
            seen[key] = (kwargs.get("hidden_states", args[0] if args else None), output)

        return hook

    layer.self_attn.register_forward_hook(capture("attn"), with_kwargs=True)
    layer.mlp.register_forward_hook(capture("mlp"), with_kwargs=True)
    streams0 = torch.randn(1, t, 4, 64, generator=gen).to(dtype)
    with torch.no_grad():
        out, _ = layer(streams0)

    kw = _hc_kwargs(config)
    eps = config.rms_norm_eps
    post_a, comb_a, collapsed = hc_pre_ref(streams0[0], *_params(layer.attn_hc), **kw)
    torch.testing.assert_close(
        rms_norm_ref(collapsed, layer.input_layernorm.weight, eps),
        seen["attn"][0][0],
        **_tol(dtype),
    )
    attn_out = seen["attn"][1][0]
    streams1, post_f, comb_f, normed_f = hc_fused_post_pre_ref(
        attn_out,
        streams0[0],
        post_a,
        comb_a,
        *_params(layer.ffn_hc),
        layer.post_attention_layernorm.weight,
        **kw,
        norm_eps=eps,
    )
    assert streams1.dtype == dtype and normed_f.dtype == dtype
    torch.testing.assert_close(normed_f, seen["mlp"][0][0], **_tol(dtype))
    final = hc_post_ref(seen["mlp"][1][0], streams1, post_f, comb_f)
    torch.testing.assert_close(final, out[0], **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_head_and_expand(dtype):
    gen = torch.Generator().manual_seed(3)
    streams = torch.randn(17, 4, 200, generator=gen).to(dtype)
    torch.testing.assert_close(
        hc_head_ref(streams), Glm5NextTextHyperHead()(streams[None])[0], rtol=0, atol=0
    )
    x = torch.randn(17, 200, generator=gen).to(dtype)
    expanded = hc_expand_ref(x, 4)
    assert expanded.shape == (17, 4, 200) and expanded.is_contiguous()
    assert all(torch.equal(expanded[:, h], x) for h in range(4))
    # Expand then head is the identity (a mean of equal streams).
    torch.testing.assert_close(hc_head_ref(expanded), x, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(1, 6),
    comb_scale=st.floats(0.0, 4.0),
    base_std=st.floats(0.0, 2.0),
    magnitude=st.floats(0.3, 100.0),
)
def test_sinkhorn_properties(seed, t, comb_scale, base_std, magnitude):
    """For any realistic input: comb is non-negative and its columns sum to 1 (the last Sinkhorn
    step normalizes columns: exact up to the hc_eps in the denominator). Its rows only sum to 1
    as far as 20 iterations converge: the L1 row error does not grow with more iterations, and is
    < 1e-3 for small logit spreads (base_std <= 0.3) — but NOT in general (base_std 1..2 leaves
    rows off by up to ~3e-2), so kernels must run exactly the same iterations. pre is in
    (hc_eps, 1 + hc_eps], post in [0, 2]; the mixing is invariant to the streams' magnitude
    (it sees them through an RMSNorm; rms_eps 1e-5 against a mean square >= 0.09 moves the
    logits by < 1e-4 relative)."""
    gen = torch.Generator().manual_seed(seed)
    h, d = 4, 32
    fn = 0.02 * torch.randn((2 + h) * h, h * d, generator=gen)
    base = base_std * torch.randn((2 + h) * h, generator=gen)
    scale = torch.tensor([1.0, 1.0, comb_scale])
    streams = torch.randn(t, h, d, generator=gen)
    kw = {"rms_eps": 1e-5, "hc_eps": 1e-6}
    pre, post, comb = hc_mix_ref(magnitude * streams, fn, scale, base, sinkhorn_iters=20, **kw)
    assert (comb >= 0).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, h), rtol=0, atol=1e-5)
    row_err = [
        (hc_mix_ref(streams, fn, scale, base, sinkhorn_iters=n, **kw)[2].sum(-1) - 1).abs().sum(-1)
        for n in (1, 2, 5, 20)
    ]
    for fewer, more in pairwise(row_err):
        assert (more <= fewer + 1e-5).all()
    if base_std <= 0.3:
        assert row_err[-1].max() < 1e-3
    assert (pre > 1e-6).all() and (pre <= 1 + 1e-6).all()
    assert (post >= 0).all() and (post <= 2).all()
    pre1, post1, comb1 = hc_mix_ref(streams, fn, scale, base, sinkhorn_iters=20, **kw)
    for a, b in [(pre, pre1), (post, post1), (comb, comb1)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sinkhorn_iteration_count_matters():
    """The iteration count is part of the spec: with a wide logit spread, stopping one
    iteration early (or starting with rows) changes comb by far more than the tolerances."""
    gen = torch.Generator().manual_seed(11)
    h, d = 4, 64
    fn = 0.02 * torch.randn((2 + h) * h, h * d, generator=gen)
    base = 2 * torch.randn((2 + h) * h, generator=gen)
    scale = torch.tensor([1.0, 1.0, 3.0])
    streams = torch.randn(3, h, d, generator=gen)
    kw = {"rms_eps": 1e-5, "hc_eps": 1e-6}
    _, _, c20 = hc_mix_ref(streams, fn, scale, base, sinkhorn_iters=20, **kw)
    _, _, c19 = hc_mix_ref(streams, fn, scale, base, sinkhorn_iters=19, **kw)
    assert (c20 - c19).abs().max() > 1e-4
