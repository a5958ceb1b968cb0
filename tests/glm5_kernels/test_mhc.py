"""The mHC boundary kernel on CPU under the Triton interpreter (its two-launch form: the
interpreter runs programs one by one, so the one-launch grid barrier runs on the GPU,
test_mhc_gpu.py): every boundary against the references at token counts on and off the
token blocks, an off-grid hidden size cut into several column splits, FP32 and BF16 mix
weights, NaN-poisoned outputs and workspace; a chain of boundaries as a step runs them; the
real GLM-5.3-Flash shape; and every bad input in one error."""

import os

import pytest
import torch
from mhc_cases import (
    assert_mix,
    assert_normed,
    assert_streams,
    boundary_inputs,
    config,
    poisoned_out,
    site_weights,
)

from glm5_kernels.mhc import (
    MhcBoundary,
    PendingComb,
    hc_expand_ref,
    hc_fused_post_pre_ref,
    hc_head_ref,
    hc_post_ref,
    hc_pre_ref,
)
from glm5_kernels.mhc.boundary import MAX_CLUSTERS, _Plan, tokens_a_cluster
from glm5_kernels.mhc.reference import sinkhorn_ref
from glm5_kernels.norm import rms_norm_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)


def _ref_pre(c, streams, fn, scale, base, norm):
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}
    post, comb, collapsed = hc_pre_ref(streams, fn, scale, base, **eps)
    return post, comb, rms_norm_ref(collapsed, norm, c.norm_eps).bfloat16()


def _op(c, plan=None):
    op = MhcBoundary(c, max_tokens=32, device="cpu")
    # Rows past the token count or split count are never read; the sums are written first.
    op._part.fill_(float("nan"))
    op._sum.fill_(float("nan"))
    if plan is not None:
        op.plans = {m: plan for m in op.plans}
    return op


@pytest.mark.parametrize(
    "m, dtypes, plan",
    [
        (1, "fp32", None),
        (3, "fp32", None),
        (9, "bf16", None),
        (17, "fp32", None),
        (5, "fp32", _Plan(bd=32, splits=7, sr=2, fused=False)),
        (17, "fp32", _Plan(bd=64, splits=4, sr=4, fused=False)),
    ],
    ids=["1", "3", "9-bf16-fn", "17", "5-plan", "17-plan"],
)
def test_boundaries_match_reference(m, dtypes, plan):
    c = config(200)  # 200 columns: not a multiple of any column tile
    gen = torch.Generator().manual_seed(m)
    fn_dtype, norm_dtype = (
        (torch.float32, torch.bfloat16) if dtypes == "fp32" else (torch.bfloat16, torch.float32)
    )
    fn, scale, base, norm = site_weights(c, "cpu", gen, fn_dtype, norm_dtype)
    x, streams, post, comb = boundary_inputs(c, m, "cpu", gen)
    op = _op(c, plan)
    ref = (fn.float(), scale, base, norm)

    # expand_pre: the step's first boundary.
    got = op.expand_pre(x, fn, scale, base, norm, out=poisoned_out(c, m, "cpu"))
    expanded = hc_expand_ref(x, c.hc)
    assert torch.equal(got[0], expanded)
    want = _ref_pre(c, expanded, *ref)
    assert_mix(got[1], got[2], want[0], want[1])
    assert_normed(got[3], want[2])

    # pre of given streams.
    got = op.pre(streams, fn, scale, base, norm, out=poisoned_out(c, m, "cpu", given=True))
    assert got[0] is streams
    want = _ref_pre(c, streams, *ref)
    assert_mix(got[1], got[2], want[0], want[1])
    assert_normed(got[3], want[2])

    # post_pre: every other boundary.
    got = op.post_pre(x, streams, post, comb, fn, scale, base, norm, out=poisoned_out(c, m, "cpu"))
    want = hc_fused_post_pre_ref(x, streams, post, comb, *ref, rms_eps=c.rms_eps,
                                 hc_eps=c.hc_eps, sinkhorn_iters=c.sinkhorn_iters,
                                 norm_eps=c.norm_eps)  # fmt: skip
    assert_streams(got[0], want[0])
    assert_mix(got[1], got[2], want[1], want[2])
    assert_normed(got[3], want[3].bfloat16())

    # head: the last post, the streams' mean, the final norm.
    out = poisoned_out(c, m, "cpu", head=True)
    got = op.head(x, streams, post, comb, norm, out=out)
    assert got is out[3]
    want = rms_norm_ref(hc_head_ref(hc_post_ref(x, streams, post, comb)), norm, c.norm_eps)
    assert_normed(got, want.bfloat16())


def test_chain_of_boundaries():
    """A step's boundaries in sequence (embedding, 3 sublayers, head), each sublayer a fixed
    random map: the kernel's chain stays within the tolerances of the reference chain fed its
    own inputs, and close to the whole reference chain."""
    c, m = config(136), 2
    gen = torch.Generator().manual_seed(7)
    sites = [site_weights(c, "cpu", gen) for _ in range(3)]
    final = site_weights(c, "cpu", gen)[3]
    maps = [torch.randn(c.hidden, c.hidden, generator=gen) / c.hidden**0.5 for _ in sites]
    x = torch.randn(m, c.hidden, generator=gen).bfloat16()
    op = _op(c)
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}

    streams, post, comb, h = op.expand_pre(x, *sites[0])
    r_streams = hc_expand_ref(x, c.hc)
    r_post, r_comb, r_h = _ref_pre(c, r_streams, *sites[0])
    for i, w in enumerate(maps):
        y, r_y = (h.float() @ w).bfloat16(), (r_h.float() @ w).bfloat16()
        if i + 1 < len(maps):
            want = hc_fused_post_pre_ref(y, streams, post, comb, *sites[i + 1], **eps,
                                         norm_eps=c.norm_eps)  # fmt: skip
            streams, post, comb, h = op.post_pre(y, streams, post, comb, *sites[i + 1])
            assert_streams(streams, want[0])
            assert_mix(post, comb, want[1], want[2])
            assert_normed(h, want[3].bfloat16())
            r = hc_fused_post_pre_ref(r_y, r_streams, r_post, r_comb, *sites[i + 1], **eps,
                                      norm_eps=c.norm_eps)  # fmt: skip
            r_streams, r_post, r_comb, r_h = r
        else:
            got = op.head(y, streams, post, comb, final)
            want = rms_norm_ref(hc_head_ref(hc_post_ref(r_y, r_streams, r_post, r_comb)), final,
                                c.norm_eps)  # fmt: skip
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5)


def test_real_shape():
    """GLM-5.3-Flash: 4 streams of 4096 columns, 9 tokens (two token blocks)."""
    c, m = config(4096), 9
    gen = torch.Generator().manual_seed(11)
    fn, scale, base, norm = site_weights(c, "cpu", gen)
    x, streams, post, comb = boundary_inputs(c, m, "cpu", gen)
    got = _op(c).post_pre(x, streams, post, comb, fn, scale, base, norm)
    want = hc_fused_post_pre_ref(x, streams, post, comb, fn, scale, base, norm,
                                 rms_eps=c.rms_eps, hc_eps=c.hc_eps,
                                 sinkhorn_iters=c.sinkhorn_iters, norm_eps=c.norm_eps)  # fmt: skip
    assert_streams(got[0], want[0])
    assert_mix(got[1], got[2], want[1], want[2])
    assert_normed(got[3], want[3])


def test_bad_input_names_every_problem():
    c = config(64)
    gen = torch.Generator().manual_seed(0)
    fn, scale, base, norm = site_weights(c, "cpu", gen)
    x, streams, post, comb = boundary_inputs(c, 3, "cpu", gen)
    op = _op(c)
    with pytest.raises(ValueError) as e:
        op.post_pre(x, streams.float(), post[:, :2], comb.transpose(1, 2), fn.double(),
                    scale[:2], base, norm)  # fmt: skip
    msg = str(e.value)
    for name in ("streams:", "post:", "comb:", "fn:", "scale:"):
        assert name in msg, msg
    assert msg.count("MhcBoundary") == 1
    with pytest.raises(ValueError, match=r"40 tokens, outside 1\.\.32"):
        op.expand_pre(torch.zeros(40, 64, dtype=torch.bfloat16), fn, scale, base, norm)
    with pytest.raises(ValueError, match="out: aliases an input"):
        op.post_pre(x, streams, post, comb, fn, scale, base, norm,
                    out=(streams, torch.empty(3, 4), torch.empty(3, 4, 4),
                         torch.empty(3, 64, dtype=torch.bfloat16)))  # fmt: skip
    with pytest.raises(ValueError, match="hc=3, the kernel is built for 4 streams"):
        MhcBoundary(type(c)(3, 64, 1e-6, 1e-6, 20, 1e-5), device="cpu")


def test_prepare_compiles_the_weight_dtypes_it_was_shown(monkeypatch):
    """`check_weights` records each site's dtypes; `prepare` runs every boundary for each
    (so a first launch inside a CUDA-graph capture never compiles)."""
    c = config(64)
    gen = torch.Generator().manual_seed(1)
    op = _op(c)
    seen = []
    run = MhcBoundary._run

    def recorded(self, mode, x, s, p, k, fn, *rest):
        norm = rest[2]  # scale, base, norm, out[, exchange]
        seen.append((mode, fn is None, None if fn is None else fn.dtype, norm.dtype))
        return run(self, mode, x, s, p, k, fn, *rest)

    monkeypatch.setattr(MhcBoundary, "_run", recorded)
    op.prepare([2])
    assert {d for _, _, d, _ in seen} == {torch.float32, None}  # nothing shown: FP32 mix weights
    seen.clear()
    op.check_weights(*site_weights(c, "cpu", gen, torch.bfloat16, torch.float32))
    op.prepare([1, 3])
    assert sorted(set(seen), key=str) == sorted(
        {(1, False, torch.bfloat16, torch.float32), (2, False, torch.bfloat16, torch.float32),
         (2, True, None, torch.float32)}, key=str)  # fmt: skip
    assert len(seen) == 6  # three boundaries x two token counts


def test_cute_tokens_fall_back_to_triton_with_one_warning(caplog):
    """The CuTe DSL kernel cannot run here (no CUDA device): asked for it, the boundary logs
    one warning naming why and every token count runs the Triton kernel, equal to the
    reference."""
    c = config(64)
    gen = torch.Generator().manual_seed(11)
    with caplog.at_level("WARNING", logger="glm5_kernels.mhc.boundary"):
        op = MhcBoundary(c, max_tokens=4, device="cpu", cute_tokens=range(1, 5))
    warnings = [r for r in caplog.records if "CuTe DSL" in r.getMessage()]
    assert len(warnings) == 1 and "CUDA device" in warnings[0].getMessage()
    assert op.cute_tokens == frozenset()
    assert op.resident_clusters() == MAX_CLUSTERS  # nothing asked of a driver
    fn, scale, base, norm = site_weights(c, "cpu", gen)
    x, streams, post, comb = boundary_inputs(c, 3, "cpu", gen)
    got = op.post_pre(x, streams, post, comb, fn, scale, base, norm, out=poisoned_out(c, 3, "cpu"))
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}
    want = hc_fused_post_pre_ref(x, streams, post, comb, fn, scale, base, norm, **eps,
                                 norm_eps=c.norm_eps)  # fmt: skip
    assert_streams(got[0], want[0])
    assert_mix(got[1], got[2], want[1], want[2])
    assert_normed(got[3], want[3])


def test_a_pending_comb_reaching_the_triton_kernel_is_balanced_first(caplog):
    """A deferred comb (a CuTe boundary's mix logits) given to a boundary that runs the
    Triton kernel — here, where the CuTe kernel cannot run, so deferring falls back with the
    same one warning — is balanced by torch first: the boundary equals the one given that
    comb as a tensor, bit for bit."""
    c = config(64)
    gen = torch.Generator().manual_seed(13)
    with caplog.at_level("WARNING", logger="glm5_kernels.mhc.boundary"):
        op = MhcBoundary(c, max_tokens=4, device="cpu", cute_tokens=range(1, 5),
                         defer_tokens=range(1, 5))  # fmt: skip
    assert len([r for r in caplog.records if "CuTe DSL" in r.getMessage()]) == 1
    assert op.defer_tokens == frozenset()
    fn, scale, base, norm = site_weights(c, "cpu", gen)
    x, streams, post, _ = boundary_inputs(c, 3, "cpu", gen)
    logits = torch.randn(3, c.hc, c.hc, generator=gen)
    pending = PendingComb(logits, torch.zeros(3, dtype=torch.int32))
    comb = op.resolve_comb(pending)
    assert torch.equal(comb, sinkhorn_ref(logits, c.hc_eps, c.sinkhorn_iters))
    assert op.resolve_comb(comb) is comb
    got = op.post_pre(x, streams, post, pending, fn, scale, base, norm)
    want = op.post_pre(x, streams, post, comb, fn, scale, base, norm)
    assert not isinstance(got[2], PendingComb)  # nothing deferred where the CuTe kernel is not
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_bad_pending_comb_is_named():
    c = config(64)
    gen = torch.Generator().manual_seed(14)
    op = _op(c)
    fn, scale, base, norm = site_weights(c, "cpu", gen)
    x, streams, post, comb = boundary_inputs(c, 3, "cpu", gen)
    # 3 tokens: one token a cluster, three ready words
    bad = PendingComb(comb[:, :2], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError) as e:
        op.post_pre(x, streams, post, bad, fn, scale, base, norm)
    msg = str(e.value)
    assert "comb.logits: (3, 2, 4)" in msg and "comb.ready: (2,) torch.int64" in msg, msg
    ready = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="out: aliases an input"):
        op.post_pre(x, streams, post, PendingComb(comb, ready), fn, scale, base, norm,
                    out=(torch.empty(3, 4, 64, dtype=torch.bfloat16), torch.empty(3, 4),
                         PendingComb(torch.empty(3, 4, 4), ready),
                         torch.empty(3, 64, dtype=torch.bfloat16)))  # fmt: skip


@pytest.mark.parametrize("clusters", [1, 8, 11, 14, 16, 20])
def test_cute_plan_keeps_every_cluster_resident(clusters):
    """Tokens a cluster where `clusters` run at once: the fewest that keep the clusters
    within them and within 16 (one token a cluster up to 16 tokens even on a GPU that
    holds more), every token covered."""
    fit = min(clusters, MAX_CLUSTERS)
    for m in range(1, 65):
        tb = tokens_a_cluster(m, clusters)
        assert -(-m // tb) <= fit and (tb == 1 or -(-m // (tb - 1)) > fit), m
    assert tokens_a_cluster(16, 20) == 1 and tokens_a_cluster(16, 14) == 2
