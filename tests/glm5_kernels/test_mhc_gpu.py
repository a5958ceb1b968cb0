"""The mHC boundary kernels on the GPU at GLM-5.3-Flash's shape (4 streams x 4096) — the
Triton one in its one-launch form (grid barrier per token block) and the CuTe DSL one
(a cluster per token group), also with comb deferred (`cute_deferred`: each boundary hands
its comb on as mix logits and a ready word, the next balances it before its PDL wait):
every boundary against the references at token counts on and off the token blocks with
NaN-poisoned outputs; the barrier reused by hundreds of launches in a row and by CUDA-graph
replays, bit for bit the same each time; a deferred chain bit for bit the plain CuTe one.

The references run on the CPU: there the BF16 matmul of the post accumulates in FP32 and
rounds once, as transformers specifies; cuBLAS may reduce in BF16
(allow_bf16_reduced_precision_reduction), a rounding the reference does not define."""

import pytest
import torch
from mhc_cases import (
    FP32,
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
from glm5_kernels.mhc.boundary import MAX_CLUSTERS, POST
from glm5_kernels.norm import rms_norm_ref

pytestmark = pytest.mark.gpu

# 16 / 29 / 47 / 64: two / three / four / five tokens a cluster where 14 clusters fit (H100)
TOKENS = [1, 2, 3, 8, 13, 16, 29, 47, 64]


def _boundary(c, kind):
    if kind != "triton":
        pytest.importorskip("cutlass", reason="the CuTe DSL (glm5-kernels[cute]) is not installed")
    return MhcBoundary(c, device="cuda", cute_tokens=TOKENS if kind != "triton" else (),
                       defer_tokens=TOKENS if kind == "cute_deferred" else ())  # fmt: skip


@pytest.fixture(scope="module", params=["triton", "cute", "cute_deferred"])
def setup(request):
    c = config(4096)
    gen = torch.Generator("cuda").manual_seed(5)
    op = _boundary(c, request.param)
    return c, op, site_weights(c, "cuda", gen), gen, request.param


def _prepare(op, kind, tokens):
    """Compile what `tokens` run, in the test that runs them (the quick selection runs a few
    of them: compiling every TOKENS' kernels up front cost it most of a minute)."""
    op.prepare(tokens)
    if kind != "triton":  # built for these token counts, not fallen back to Triton
        assert op.cute_tokens == frozenset(TOKENS)
        assert {key[3] for key in op._cute} >= {op.cute_tb(m) for m in tokens}
        assert op.defer_tokens == (frozenset(TOKENS) if kind == "cute_deferred" else frozenset())


def _poisoned(op, c, m, kind, head=False):
    """poisoned_out, with a pending comb whose ready words already say READY (a stale word:
    the producer must clear it before any consumer can look)."""
    out = poisoned_out(c, m, "cuda", head=head)
    if kind != "cute_deferred" or head:
        return out
    from glm5_kernels.mhc.cute_mhc import READY

    ready = torch.full((op.cute_groups(m),), READY, dtype=torch.int32, device="cuda")
    return out[0], out[1], PendingComb(out[2], ready), out[3]


def _post_pre_matches(op, c, inputs, weights, out):
    """op.post_pre of `inputs` (x, streams, post, comb) into `out` against the reference."""
    got = op.post_pre(*inputs, *weights, out=out)
    got = [t.cpu() for t in (got[0], got[1], op.resolve_comb(got[2]), got[3])]
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}
    want = hc_fused_post_pre_ref(*(t.cpu() for t in (*inputs, *weights)), **eps,
                                 norm_eps=c.norm_eps)  # fmt: skip
    assert_streams(got[0], want[0])
    assert_mix(got[1], got[2], want[1], want[2])
    assert_normed(got[3], want[3])


@pytest.mark.parametrize("m", TOKENS)
def test_boundaries_match_reference(setup, m):
    c, op, (fn, scale, base, norm), gen, kind = setup
    _prepare(op, kind, [m])
    assert op.cute_tokens or op.plans[m].fused, "the one-launch form is what the GPU runs"
    x, streams, post, comb = boundary_inputs(c, m, "cuda", gen)
    eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}

    cpu = [t.cpu() for t in (x, streams, post, comb, fn, scale, base, norm)]
    xc, sc, pc, cc, fc, scc, bc, nc = cpu

    got = op.expand_pre(x, fn, scale, base, norm, out=_poisoned(op, c, m, kind))
    assert isinstance(got[2], PendingComb) == (kind == "cute_deferred")
    got = [t.cpu() for t in (got[0], got[1], op.resolve_comb(got[2]), got[3])]
    expanded = hc_expand_ref(xc, c.hc)
    assert torch.equal(got[0], expanded)
    r_post, r_comb, collapsed = hc_pre_ref(expanded, fc, scc, bc, **eps)
    assert_mix(got[1], got[2], r_post, r_comb)
    assert_normed(got[3], rms_norm_ref(collapsed, nc, c.norm_eps))

    _post_pre_matches(op, c, (x, streams, post, comb), (fn, scale, base, norm),
                      _poisoned(op, c, m, kind))  # fmt: skip

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
        assert torch.equal(op.resolve_comb(a), op.resolve_comb(b))

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


@pytest.mark.parametrize("m", [1, 3, 29, 64])
def test_deferred_chain_is_the_cute_chain(m):
    """A step's chain of boundaries with every comb deferred (each balanced by the next
    boundary before its PDL wait) is the plain CuTe chain bit for bit — eager, and captured
    and replayed (the ready words cleared and set again every replay)."""
    c = config(4096)
    gen = torch.Generator("cuda").manual_seed(7)
    plain, deferred = _boundary(c, "cute"), _boundary(c, "cute_deferred")
    for op in (plain, deferred):
        op.prepare([m])
    fn, scale, base, norm = site_weights(c, "cuda", gen)
    x, _, _, _ = boundary_inputs(c, m, "cuda", gen)
    ys = [torch.randn(m, c.hidden, generator=gen, device="cuda").bfloat16() for _ in range(4)]

    def chain(op):
        """Every boundary's streams, post, normed input and the head's output (the next
        boundary's streams are where a comb enters), and every comb."""
        s, p, k, h = op.expand_pre(x, fn, scale, base, norm)
        seen, combs = [s, p, h], [op.resolve_comb(k)]
        for y in ys[:3]:
            s, p, k, h = op.post_pre(y + h, s, p, k, fn, scale, base, norm)
            assert isinstance(k, PendingComb) == (op is deferred)
            seen += [s, p, h]
            combs.append(op.resolve_comb(k))
        return [*seen, op.head(ys[3], s, p, k, norm)], combs

    (want, want_combs), (got, got_combs) = chain(plain), chain(deferred)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert not a.float().isnan().any() and torch.equal(a, b), i
    # The plain kernel's combs against torch's Sinkhorn of the deferred logits (the same
    # iteration, exact divisions there, approximate reciprocals here).
    for a, b in zip(got_combs, want_combs, strict=True):
        torch.testing.assert_close(a, b, **FP32)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(deferred)[0][-1]
    for _ in range(50):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want[-1])


def test_cute_plan_keeps_every_cluster_resident():
    """The CuTe plan asks the driver how many of its clusters this GPU runs at once and
    never launches more (one past them runs as a second wave: the H100's 16th of 16), with
    the fewest tokens a cluster that allows; the answer matches a second query of another
    build (every build is bounded to the same registers)."""
    from glm5_kernels.mhc import cute_mhc

    op = _boundary(config(4096), "cute")
    n = op.resident_clusters()
    assert 1 <= n <= MAX_CLUSTERS
    for m in range(1, 65):
        tb, groups = op.cute_tb(m), op.cute_groups(m)
        assert groups <= n and groups * tb >= m and (tb == 1 or -(-m // (tb - 1)) > n), m
    four = op._compile_cute(POST, False, True, 4, ("float32",) * 3 + ("bfloat16",))
    assert min(cute_mhc.resident_clusters(four, 4096 // cute_mhc.CLUSTER), MAX_CLUSTERS) == n


@pytest.mark.parametrize("m", [29, 64])
def test_one_cta_an_sm_matches_reference(m):
    """The build for one CTA an SM (`per_sm` 1: up to 255 registers a thread, what the
    benchmark's sweep times beside the plan's two) at 8 tokens a cluster: the post against
    the reference, NaN-poisoned outputs, and the driver's count of its resident clusters
    (an SM's worth of registers a CTA: at most one cluster a GPC)."""
    from glm5_kernels.mhc import cute_mhc

    c = config(4096)
    op = _boundary(c, "cute")
    op.cute_tb, op.cute_per_sm = (lambda _m: 8), (lambda _m: 1)
    gen = torch.Generator("cuda").manual_seed(m)
    fn, scale, base, norm = site_weights(c, "cuda", gen)
    x, streams, post, comb = boundary_inputs(c, m, "cuda", gen)
    _post_pre_matches(op, c, (x, streams, post, comb), (fn, scale, base, norm),
                      poisoned_out(c, m, "cuda"))  # fmt: skip
    assert {key[3:] for key in op._cute} == {(8, ("float32",) * 3 + ("bfloat16",), False, False, 1)}
    (wide,) = op._cute.values()
    n = cute_mhc.resident_clusters(wide, c.hidden // cute_mhc.CLUSTER)
    assert n is None or 1 <= n <= op.resident_clusters(), n
