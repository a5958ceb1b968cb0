"""The mHC boundary kernels on the GPU at GLM-5.3-Flash's shape (4 streams x 4096) — the
Triton one in its one-launch form (grid barrier per token block) and the CuTe DSL one
(a cluster per token group): every boundary against the references at
token counts on and off the token blocks with NaN-poisoned outputs; the barrier reused by
hundreds of launches in a row and by CUDA-graph replays, bit for bit the same each time.

The references run on the CPU: there the BF16 matmul of the post accumulates in FP32 and
rounds once, as transformers specifies; cuBLAS may reduce in BF16
(allow_bf16_reduced_precision_reduction), a rounding the reference does not define."""

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
    hc_expand_ref,
    hc_fused_post_pre_ref,
    hc_head_ref,
    hc_post_ref,
    hc_pre_ref,
)
from glm5_kernels.norm import rms_norm_ref

pytestmark = pytest.mark.gpu

TOKENS = [1, 2, 3, 8, 13, 16, 29, 47, 64]  # 29: two tokens a cluster (cute_tb)


@pytest.fixture(scope="module", params=["triton", "cute"])
def setup(request):
    c = config(4096)
    gen = torch.Generator("cuda").manual_seed(5)
    if request.param == "cute":
        pytest.importorskip("cutlass", reason="the CuTe DSL (glm5-kernels[cute]) is not installed")
    op = MhcBoundary(c, device="cuda", cute_tokens=TOKENS if request.param == "cute" else ())
    return c, op, site_weights(c, "cuda", gen), gen, request.param


def _prepare(op, kind, tokens):
    """Compile what `tokens` run, in the test that runs them (the quick selection runs a few
    of them: compiling every TOKENS' kernels up front cost it most of a minute)."""
    op.prepare(tokens)
    if kind == "cute":  # built for these token counts, not fallen back to Triton
        assert op.cute_tokens == frozenset(TOKENS)
        assert {key[3] for key in op._cute} >= {op.cute_tb(m) for m in tokens}


@pytest.mark.parametrize("m", TOKENS)
def test_boundaries_match_reference(setup, m):
    c, op, (fn, scale, base, norm), gen, kind = setup
    _prepare(op, kind, [m])
    assert op.cute_tokens or op.plans[m].fused, "the one-launch form is what the GPU runs"
    x, streams, post, comb = boundary_inputs(c, m, "cuda", gen)
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}

    cpu = [t.cpu() for t in (x, streams, post, comb, fn, scale, base, norm)]
    xc, sc, pc, cc, fc, scc, bc, nc = cpu

    got = [t.cpu() for t in op.expand_pre(x, fn, scale, base, norm,
                                          out=poisoned_out(c, m, "cuda"))]  # fmt: skip
    expanded = hc_expand_ref(xc, c.hc)
    assert torch.equal(got[0], expanded)
    r_post, r_comb, collapsed = hc_pre_ref(expanded, fc, scc, bc, **eps)
    assert_mix(got[1], got[2], r_post, r_comb)
    assert_normed(got[3], rms_norm_ref(collapsed, nc, c.norm_eps))

    got = [t.cpu() for t in op.post_pre(x, streams, post, comb, fn, scale, base, norm,
                                        out=poisoned_out(c, m, "cuda"))]  # fmt: skip
    want = hc_fused_post_pre_ref(*cpu, **eps, norm_eps=c.norm_eps)
    assert_streams(got[0], want[0])
    assert_mix(got[1], got[2], want[1], want[2])
    assert_normed(got[3], want[3])

    got = op.head(x, streams, post, comb, norm, out=poisoned_out(c, m, "cuda", head=True))
    want = rms_norm_ref(hc_head_ref(hc_post_ref(xc, sc, pc, cc)), nc, c.norm_eps)
    assert_normed(got.cpu(), want)


@pytest.mark.parametrize("m", [1, 47])
def test_barrier_reused_and_captured(setup, m):
    """300 launches in a row and a captured chain replayed 50 times: every result equal to
    the first (the barrier's generation words carry over launches and replays)."""
    c, op, (fn, scale, base, norm), gen, kind = setup
    _prepare(op, kind, [m])
    x, streams, post, comb = boundary_inputs(c, m, "cuda", gen)
    first = op.post_pre(x, streams, post, comb, fn, scale, base, norm)
    for _ in range(300):
        again = op.post_pre(x, streams, post, comb, fn, scale, base, norm)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)

    def chain(x=x):
        s, p, k, h = op.expand_pre(x, fn, scale, base, norm)
        for _ in range(3):
            s, p, k, h = op.post_pre(h, s, p, k, fn, scale, base, norm)
        return op.head(h, s, p, k, norm)

    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(50):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
