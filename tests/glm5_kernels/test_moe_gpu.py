"""The MoE stage on the GPU at the real GLM-5.3-Flash shapes (288 experts, top-8, hidden 4096,
TP 1, 4 and 8 ranks' moe_intermediate: at TP 8 gate_up splits K at 1-2 tokens and down
takes two column tiles a CTA): every routing case at token counts on and off the
grids, both paths, FP32 and UE8M0 scales, NaN-poisoned outputs; CUDA-graph capture after
prepare() and the error for an unprepared token count."""

import pytest
import torch
from gemm_cases import padded, poisoned
from moe_cases import (
    assert_output_close,
    assert_routing,
    assert_rows_close,
    assert_same_sum,
    moe_weights,
    routings,
)
from moe_routing import recording

from glm5_kernels.gemm import Router
from glm5_kernels.moe import GroupedExperts, MegaExperts, MoeLayer

pytestmark = pytest.mark.gpu

E, D, K, LIMIT, SCALING = 288, 4096, 8, 10.0, 2.5
TOKENS = [1, 2, 3, 4, 8, 13, 16, 32, 47, 64]


@pytest.fixture(scope="module", params=[(4, False), (1, False), (4, True), (8, False)],
                ids=["tp4", "tp1", "tp4-ue8m0", "tp8"])  # fmt: skip
def stage(request):
    tp, e8m0 = request.param
    gen = torch.Generator("cuda").manual_seed(tp)
    w = moe_weights(E, D, 2048 // tp, "cuda", gen, e8m0)
    bias = torch.randn(E, generator=gen, device="cuda") * 0.1
    ops = {
        cls: cls(
            *w[:4],
            bias=bias,
            shared=w[4],
            top_k=K,
            routed_scaling=SCALING,
            swiglu_limit=LIMIT,
            ue8m0=e8m0,
        )
        for cls in (MegaExperts, GroupedExperts)
    }
    yield w, e8m0, bias, ops
    del w, ops
    torch.cuda.empty_cache()


def test_real_shapes(stage):
    w, e8m0, bias, ops = stage
    gen = torch.Generator("cuda").manual_seed(17)
    for m in TOKENS:
        x = padded(torch.randn(m, D, generator=gen, device="cuda").bfloat16())
        cases = routings(m, E, "cuda", gen, bias)
        if m not in (1, 8, 47, 64):
            cases = {"random": cases["random"]}
        for name, (logits, b) in cases.items():
            ref = None
            for op in ops.values():
                op.bias = b
                rows = op(x, logits)
                assert_routing(logits, b, K, SCALING, rows.ids, rows.weights)
                if ref is None:  # the same routing for both paths: one reference
                    ref = assert_rows_close(rows.rows, rows.route_row, x, rows.ids,
                                            rows.weights, w, LIMIT, e8m0)  # fmt: skip
                else:
                    got = torch.stack([rows.rows[:m]] + [rows.rows[rows.route_row[:, j].long()]
                                                         for j in range(K)], 1)  # fmt: skip
                    assert (got.double() - ref).norm() <= 1.5e-2 * ref.norm(), (m, name)
                out = op.finalized(x, logits, out=poisoned(m, D, torch.bfloat16, "cuda"))
                assert_output_close(out, ref, rows.weights)
                assert_same_sum(out, rows.finalize())
            for op in ops.values():
                op.bias = bias


def test_graph_capture_and_unprepared_tokens(stage):
    w, e8m0, bias, ops = stage
    gen = torch.Generator("cuda").manual_seed(5)
    router_w = (torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16()
    layer = MoeLayer(Router(router_w), {1: ops[MegaExperts], 8: ops[MegaExperts],
                                        32: ops[GroupedExperts]})  # fmt: skip
    layer.prepare([1, 8, 32])
    xs = {m: torch.randn(m, D, generator=gen, device="cuda").bfloat16() for m in (1, 8, 32)}
    eager = {m: layer(x) for m, x in xs.items()}
    graphs = {}
    for m, x in xs.items():
        graphs[m] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[m]):
            y = layer(x)
        graphs[m].replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager[m]), m
    fresh = GroupedExperts(*w[:4], bias=bias, shared=w[4], top_k=K, routed_scaling=SCALING,
                           swiglu_limit=LIMIT, ue8m0=e8m0)  # fmt: skip
    x = xs[8]
    logits = torch.zeros(8, E, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="M=8 was not prepared"), torch.cuda.graph(graph):
        fresh.finalized(x, logits)


def test_router_inside_the_routing_launch(stage):
    """`fused_router` at the real shapes: the router GEMM in the routing launch. Its logits
    within the FP32 sum's worst case of the exact product (D products of exact BF16 pairs,
    each addition rounding: D 2^-24 of the absolute product), the routing route_ref's from
    them, the output the four-launch path's on those logits exactly; captured in a CUDA
    graph, a replay on new tokens equals an eager call (the arrival counter reset)."""
    _, _, bias, ops = stage
    gen = torch.Generator("cuda").manual_seed(23)
    router_w = (torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16()
    router, op = Router(router_w), ops[MegaExperts]
    run = op._run
    for m in (1, 2, 3, 8, 13, 64):
        x = padded(torch.randn(m, D, generator=gen, device="cuda").bfloat16())
        seen = []
        op._run = recording(run, seen)
        try:
            out = op.finalized(x, out=poisoned(m, D, torch.bfloat16, "cuda"), gate=router)
        finally:
            del op._run
        ((logits, rows),) = seen
        exact = x.double() @ router_w.double().T
        bound = D * 2.0**-24 * (x.double().abs() @ router_w.double().abs().T)
        assert (logits.double() - exact).abs().le(bound).all(), m
        assert_routing(logits, bias, K, SCALING, rows.ids, rows.weights)
        # The experts on that routing: the four-launch path's exactly. (Not on the logits:
        # where two experts' values are within an ulp, the two kernels' sigmoids may order
        # them differently, as assert_routing allows.)
        assert torch.equal(out, op.routed(x, rows.ids, rows.weights, finalize=True)), m
    layer = MoeLayer(router, {8: op}, gated=[8])
    layer.prepare([8])
    xs = [torch.randn(8, D, generator=gen, device="cuda").bfloat16() for _ in range(2)]
    x = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for new in xs:
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, layer(new))


def test_shared_expert_beside_in_a_graph(stage):
    """MoeLayer(shared_mlp=...): the shared expert on a second stream, forked and joined
    inside the CUDA graph; equal to the shared expert as one more group within a BF16
    rounding, and the graph replays what the eager call computed."""
    from glm5_kernels.moe import SharedExpert

    w, e8m0, bias, ops = stage
    gen = torch.Generator("cuda").manual_seed(6)
    router = Router((torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16())
    apart = MegaExperts(*w[:4], bias=bias, shared=None, top_k=K, routed_scaling=SCALING,
                        swiglu_limit=LIMIT, ue8m0=e8m0)  # fmt: skip
    shared = SharedExpert(*w[4], swiglu_limit=LIMIT, ue8m0=e8m0)
    beside = MoeLayer(router, {1: apart, 8: apart}, shared_mlp=shared)
    together = MoeLayer(router, {1: ops[MegaExperts], 8: ops[MegaExperts]})
    beside.prepare([1, 8])
    together.prepare([1, 8])
    for m in (1, 8):
        x = torch.randn(m, D, generator=gen, device="cuda").bfloat16()
        eager = beside(x)
        assert_same_sum(eager, together(x))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = beside(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager), m


def test_routing_released_early_in_a_graph(stage):
    """The routing launch releasing gate_up right after its PDL wait (plan release_early):
    gate_up's CTAs wait at their own wait for the whole routing launch, so a captured
    layer replays the plain plan's output bit for bit, replay after replay on new tokens."""
    from dataclasses import replace

    _, _, _, ops = stage
    op = ops[MegaExperts]
    gen = torch.Generator("cuda").manual_seed(29)
    router = Router((torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16())
    for m in (1, 8):
        layer = MoeLayer(router, {m: op})
        layer.prepare([m])
        xs = [torch.randn(m, D, generator=gen, device="cuda").bfloat16() for _ in range(3)]
        want = [layer(x) for x in xs]
        plain = op.plans[m]
        op.plans[m] = replace(plain, release_early=True)
        try:
            assert torch.equal(layer(xs[0]), want[0]), m  # eager (and compiled) first
            x = xs[0].clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer(x)
            for new, expected in zip(xs, want, strict=True):
                x.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(y, expected), m
        finally:
            op.plans[m] = plain
