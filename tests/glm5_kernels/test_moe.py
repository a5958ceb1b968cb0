"""The MoE stage on CPU: its kernels under the Triton interpreter at small off-grid sizes
against the references (routing ties, a hot expert, tokens all on the same experts, groups
cut at 16 tokens, FP32 and UE8M0 scales), the unfinalized rows and both finalizations, and
every bad input. The real GLM-5.3-Flash shapes run on the GPU (test_moe_gpu.py)."""

import os
from dataclasses import replace

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

from glm5_kernels.moe import GroupedExperts, MegaExperts, MoeRows, moe_rows_ref

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

E, D, I, K = 12, 256, 128, 4
LIMIT, SCALING = 7.0, 2.5


@pytest.fixture(scope="module", params=[False, True], ids=["fp32-scales", "ue8m0"])
def weights(request):
    gen = torch.Generator().manual_seed(3)
    return moe_weights(E, D, I, "cpu", gen, e8m0=request.param), request.param


def _op(cls, weights, bias, **kw):
    w, e8m0 = weights
    return cls(*w[:4], bias=bias, shared=w[4], top_k=K, routed_scaling=SCALING,
               swiglu_limit=LIMIT, ue8m0=e8m0, **kw)  # fmt: skip


@interpreter
@pytest.mark.parametrize(
    "cls, m",
    [(MegaExperts, 1), (MegaExperts, 5), (MegaExperts, 19), (GroupedExperts, 19)],
    ids=["per-route-1", "per-route-5", "per-route-19", "grouped-19"],
)
def test_stage_matches_reference(cls, m, weights):
    """Every routing case: ids and weights, each route's row, and both finalizations.
    (Up to 16 tokens GroupedExperts runs MegaExperts' very plan: one case of it, above.)"""
    gen = torch.Generator().manual_seed(m)
    bias = torch.randn(E, generator=gen) * 0.1
    x = padded(torch.randn(m, D, generator=gen).bfloat16())
    op = _op(cls, weights, bias)
    cases = routings(m, E, "cpu", gen, bias)
    if m == 1:
        cases = {"random": cases["random"], "ties": cases["ties"]}
    for name, (logits, b) in cases.items():
        op.bias = b
        rows = op(x, logits)
        assert isinstance(rows, MoeRows)
        assert_routing(logits, b, K, SCALING, rows.ids, rows.weights)
        w = weights[0]
        ref = assert_rows_close(rows.rows, rows.route_row, x, rows.ids, rows.weights, w,
                                LIMIT, weights[1])  # fmt: skip
        out = op.finalized(x, logits, out=poisoned(m, D, torch.bfloat16, "cpu"))
        assert_output_close(out, ref, rows.weights)
        assert torch.equal(out, rows.finalize()), name  # the same sum, in the same order


@interpreter
def test_swiglu_clamp_bites(weights):
    """Activations past the clamp: the gate_up values (~N(0, 1)) against a limit of 1, so a
    third of them are clamped. The rows must match the clamped reference within the MLP
    bound, and the clamp must matter far beyond that bound (the unclamped reference is
    10x the bound away), so rows computed without it fail."""
    m, limit = 3, 1.0
    gen = torch.Generator().manual_seed(31)
    w, e8m0 = weights
    x = torch.randn(m, D, generator=gen).bfloat16()
    op = MegaExperts(*w[:4], bias=torch.zeros(E), shared=w[4], top_k=K, routed_scaling=SCALING,
                     swiglu_limit=limit, ue8m0=e8m0)  # fmt: skip
    rows = op(x, torch.randn(m, E, generator=gen))
    ids = rows.ids.long()
    ref = assert_rows_close(rows.rows, rows.route_row, x, ids, rows.weights, w, limit, e8m0)
    free = moe_rows_ref(x, ids, *w[:4], w[4], float("inf"), e8m0)
    assert (free - ref).norm() > 10 * 1.5e-2 * ref.norm()  # the clamp bites


@interpreter
def test_groups_are_cut_at_16_tokens(weights):
    """GroupedExperts: a hot expert's 19 tokens span two groups (its weights read twice);
    MegaExperts: one group per expert."""
    m = 19
    grouped, mega = _op(GroupedExperts, weights, torch.zeros(E)), _op(MegaExperts, weights,
                                                                      torch.zeros(E))  # fmt: skip
    assert grouped.plans[m].chunk == 16 and grouped.plans[m].bm == 16
    assert mega.plans[m].chunk == m and mega.plans[m].bm == 32
    assert mega.plans[m].groups == 1 + min(E, m * K)
    assert grouped.plans[m].groups == 2 + min(E, m * K) + m * K // 16


@interpreter
def test_given_routing(weights):
    """routed(): ids / weights from elsewhere, the same rows as routing in the kernel."""
    gen = torch.Generator().manual_seed(7)
    m = 6
    bias = torch.zeros(E)
    x = torch.randn(m, D, generator=gen).bfloat16()
    logits = torch.randn(m, E, generator=gen)
    op = _op(MegaExperts, weights, bias)
    routed_in_kernel = op(x, logits)
    given = op.routed(x, routed_in_kernel.ids, routed_in_kernel.weights)
    assert torch.equal(given.finalize(), routed_in_kernel.finalize())
    out = op.routed(x, routed_in_kernel.ids, routed_in_kernel.weights, finalize=True)
    assert torch.equal(out, routed_in_kernel.finalize())


def test_bad_weights_name_every_problem():
    gen = torch.Generator().manual_seed(1)
    w13, s13, w2, s2, shared = moe_weights(4, 256, 128, "cpu", gen)
    with pytest.raises(ValueError) as err:
        MegaExperts(w13, s13[:, :1], w2.float(), s2, bias=torch.zeros(5), shared=shared,
                    top_k=17, routed_scaling=1.0, swiglu_limit=-1.0)  # fmt: skip
    msg = str(err.value)
    for part in ("w13_scale: shape", "w2: dtype", "bias:", "top_k=17", "compiled maximum",
                 "swiglu_limit=-1.0"):  # fmt: skip
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="shared w2_scale: shape"):
        MegaExperts(w13, s13, w2, s2, bias=torch.zeros(4), shared=(*shared[:3], s2[0, :1]),
                    top_k=2, routed_scaling=1.0, swiglu_limit=7.0)  # fmt: skip


@interpreter
def test_bad_inputs_name_every_problem(weights):
    op = _op(MegaExperts, weights, torch.zeros(E))
    x = torch.zeros(3, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        op(x.float(), torch.zeros(3, E + 1))
    assert "x: (3, 256) torch.float32" in str(err.value) and "logits: (3, 13)" in str(err.value)
    with pytest.raises(ValueError, match="M=65 outside"):
        op(torch.zeros(65, D, dtype=torch.bfloat16), torch.zeros(65, E))
    ids = torch.tensor([[0, 1, 2, E], [0, 1, 2, 3], [-1, 1, 2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert ids \[-1, 12\] outside \[0, 12\)"):
        op.routed(x, ids, torch.ones(3, K))
    with pytest.raises(ValueError, match="expected contiguous \\[3, 4\\] int32 \\(top-k is 4\\)"):
        op.routed(x, torch.zeros(3, K + 1, dtype=torch.int32), torch.ones(3, K + 1))


@interpreter
@pytest.mark.parametrize(
    "change",
    [
        {"tiles_down": 1, "blocks": 2},
        {"tiles_down": 2, "blocks": 1},
        {"warps_route": 4},
        {"quantize_apart": False, "warps_route": 2},
    ],
    ids=["one-tile-per-cta", "one-block-per-step", "routing-on-4-warps", "quantized-inline"],
)
def test_every_tile_gives_the_same_rows(change, weights):
    """The plan's variants (column tiles per down CTA, K blocks per gate_up step, the
    routing's warps, the tokens quantized by the routing programs) change the FP32
    summation order at most: rows within the bound of the reference, finalized outputs
    within a BF16 rounding of each other."""
    m = 7
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(m, D, generator=gen).bfloat16()
    logits = torch.randn(m, E, generator=gen)
    op = _op(MegaExperts, weights, torch.zeros(E))
    want = op.finalized(x, logits)
    op.plans[m] = replace(op.plans[m], **change)
    rows = op(x, logits)
    assert_rows_close(rows.rows, rows.route_row, x, rows.ids, rows.weights, weights[0],
                      LIMIT, weights[1])  # fmt: skip
    assert_same_sum(op.finalized(x, logits), want)


def _at_hidden(d: int, m: int, seed: int):
    """A MegaExperts at hidden size d (FP32 scales) and m tokens with router logits:
    (op, weights, x, logits, the generator for more inputs)."""
    gen = torch.Generator().manual_seed(seed)
    w = moe_weights(E, d, I, "cpu", gen)
    op = MegaExperts(*w[:4], bias=torch.zeros(E), shared=w[4], top_k=K, routed_scaling=SCALING,
                     swiglu_limit=LIMIT)  # fmt: skip
    x = torch.randn(m, d, generator=gen).bfloat16()
    return op, w, x, torch.randn(m, E, generator=gen), gen


@interpreter
@pytest.mark.parametrize("m", [1, 3])
def test_tokens_quantized_apart_are_the_same_tokens(m):
    """The routing launch's tokens quantized by programs of their own (quantize_apart), at a
    hidden size of 9 groups (two quantizing programs a token, the second's last 7 groups
    past the end): the layer's rows and outputs bit-equal to the routing programs
    quantizing their own token, routed here or given."""
    op, _, x, logits, gen = _at_hidden(9 * 128, m, seed=40 + m)
    ids = torch.randint(0, E, (m, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(m, K, generator=gen)
    inline = replace(op.plans[m], quantize_apart=False)
    op.plans[m] = inline
    want = op(x, logits), op.routed(x, ids, weights, finalize=True)
    op.plans[m] = replace(inline, quantize_apart=True)
    got = op(x, logits), op.routed(x, ids, weights, finalize=True)
    for field in ("rows", "route_row", "ids", "weights"):
        assert torch.equal(getattr(got[0], field), getattr(want[0], field)), field
    assert torch.equal(got[1], want[1])


@interpreter
@pytest.mark.parametrize("m, split, blocks", [(1, 2, 2), (5, 4, 1)], ids=["1-split2", "5-split4"])
def test_gate_up_split_over_k(m, split, blocks):
    """gate_up with `split` CTAs per column tile (the last to arrive sums the FP32 partials
    in split order and applies the SwiGLU), at 4 K blocks: rows and output within the bound
    of the reference, the same bits launch after launch, the arrival counters back at zero;
    a split that does not tile K is one clear error."""
    op, w, x, logits, _ = _at_hidden(4 * 128, m, seed=50 + m)
    op.plans[m] = replace(op.plans[m], split_gate_up=split, blocks=blocks)
    rows = op(x, logits)
    ref = assert_rows_close(rows.rows, rows.route_row, x, rows.ids, rows.weights, w, LIMIT,
                            False)  # fmt: skip
    out = op.finalized(x, logits)
    assert_output_close(out, ref, rows.weights)
    assert torch.equal(op.finalized(x, logits), out)
    assert not op._gate_up_counts.any()
    op.plans[m] = replace(op.plans[m], split_gate_up=3)
    with pytest.raises(ValueError, match=r"gate_up split 3 x \d K blocks a step does not tile 4 "):
        op(x, logits)


@interpreter
def test_sentinel_ids_inside_capture_contribute_nothing(weights, monkeypatch):
    """Inside CUDA-graph capture (no host sync to check ids) an id outside [0, E) routes
    nowhere: its row is -1 and the sums skip it, as experts_ref skips expert-parallel ids."""
    import glm5_kernels.moe.experts as experts

    m = 3
    gen = torch.Generator().manual_seed(9)
    op = _op(MegaExperts, weights, torch.zeros(E))
    x = torch.randn(m, D, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1, 2, E], [4, 5, 6, 7], [-1, 9, 10, 11]], dtype=torch.int32)
    w = torch.rand(m, K, generator=gen)
    monkeypatch.setattr(experts, "capturing", lambda: True)
    rows = op.routed(x, ids, w)
    assert (rows.route_row[ids < 0] == -1).all() and (rows.route_row[ids >= E] == -1).all()
    valid = (ids >= 0) & (ids < E)
    assert rows.route_row[valid].unique().numel() == int(valid.sum())
    kept = torch.where(valid, w, 0.0)  # the same sum with those routes weighted 0
    want = op.routed(x, torch.where(valid, ids, 3), kept, finalize=True)
    assert_same_sum(op.routed(x, ids, w, finalize=True), want)


@interpreter
def test_shared_expert_beside_the_routed_ones(weights):
    """shared=None: routed rows only (route rows as the reference's), finalized without the
    shared expert; MoeLayer(shared_mlp=SharedExpert) adds it from its own kernels, equal to
    the shared expert as one more group within a BF16 rounding."""
    from glm5_kernels.gemm import Router
    from glm5_kernels.moe import MoeLayer, SharedExpert

    m = 5
    gen = torch.Generator().manual_seed(13)
    w, e8m0 = weights
    x = torch.randn(m, D, generator=gen).bfloat16()
    router = Router((torch.randn(E, D, generator=gen) / D**0.5).bfloat16())
    together = _op(MegaExperts, weights, torch.zeros(E))
    apart = MegaExperts(*w[:4], bias=torch.zeros(E), shared=None, top_k=K,
                        routed_scaling=SCALING, swiglu_limit=LIMIT, ue8m0=e8m0)  # fmt: skip
    assert apart.plans[m].groups == together.plans[m].groups - 1
    logits = router(x)
    rows = apart(x, logits)
    assert rows.rows.shape[0] == m * K and not rows.shared
    ref = moe_rows_ref(x, rows.ids.long(), *w[:4], w[4], LIMIT, e8m0)[:, 1:].double()
    got = torch.stack([rows.rows[rows.route_row[:, j].long()] for j in range(K)], 1).double()
    assert (got - ref).norm() <= 1.5e-2 * ref.norm()
    assert_same_sum(apart.finalized(x, logits), rows.finalize())
    shared = SharedExpert(*w[4], swiglu_limit=LIMIT, ue8m0=e8m0)
    beside = MoeLayer(router, {m: apart}, shared_mlp=shared)
    beside.prepare([m])
    assert_same_sum(beside(x), MoeLayer(router, {m: together})(x))
    with pytest.raises(ValueError, match="exactly one"):
        MoeLayer(router, {m: together}, shared_mlp=shared)


@interpreter
@pytest.mark.parametrize(
    "d, m, apart", [(256, 6, False), (256, 6, True), (1024, 1, True), (1024, 3, False)]
)
def test_router_inside_the_routing_launch(d, m, apart):
    """finalized(x, gate=Router): the router GEMM on the Router's split-K tiles inside the
    routing launch. Its logits (summed from the splits by the last program) equal the
    separate Router's bit for bit, the routing is route_ref's from them, and the output is
    the four-launch path's on those logits, exactly; the arrival counter is back at zero
    for the next launch (a graph replay). At d 1024 K splits in two (the partials' path);
    at d 256, m 6 some programs only quantize their token (the tiles' programs quantizing
    the first tokens, or programs after theirs every token: `apart`, the plan's default).
    Exact ties: a zero gate (at d 256: ties are the pick's, not the split's; the interpreter
    takes a minute a d-1024 gate). The launch again and the MoE layer's call at d 256 only
    (each a whole MoE under the interpreter: ~10 s at d 1024)."""
    from glm5_kernels.gemm import Router
    from glm5_kernels.moe import MoeLayer

    gen = torch.Generator().manual_seed(d + m)
    w = moe_weights(E, d, I, "cpu", gen)
    x = padded(torch.randn(m, d, generator=gen).bfloat16())
    bias = torch.randn(E, generator=gen) * 0.1
    # Every score + bias below -2: a pick's removed expert must stay below all of them.
    gates = {"random": ((torch.randn(E, d, generator=gen) / d**0.5).bfloat16(), bias - 3.0)}
    if d == 256:
        gates["ties"] = (torch.zeros(E, d, dtype=torch.bfloat16),
                         routings(m, E, "cpu", gen, bias)["ties"][1])  # fmt: skip
    for name, (gate_w, b) in gates.items():
        router = Router(gate_w)
        assert router.tiles[m].split_k == (2 if d == 1024 else 1), router.tiles[m]
        op = MegaExperts(*w[:4], bias=b, shared=w[4], top_k=K, routed_scaling=SCALING,
                         swiglu_limit=LIMIT)  # fmt: skip
        op.plans[m] = replace(op.plans[m], quantize_apart=apart)
        seen = []
        op._run = recording(op._run, seen)
        out = op.finalized(x, out=poisoned(m, d, torch.bfloat16, "cpu"), gate=router)
        ((logits, rows),) = seen
        assert torch.equal(logits, router(x)), name
        assert_routing(logits, b, K, SCALING, rows.ids, rows.weights)
        ref = assert_rows_close(rows.rows, rows.route_row, x, rows.ids, rows.weights, w, LIMIT,
                                False)  # fmt: skip
        assert_output_close(out, ref, rows.weights)
        assert torch.equal(out, op.finalized(x, logits.clone())), name
        assert op._arrivals.item() == 0
        if d == 1024:  # the launch again and the layer's call: at d 256 (not d's business)
            continue
        assert torch.equal(op.finalized(x, gate=router), out), name  # launched again
        layer = MoeLayer(router, {m: op}, gated=[m])
        layer.prepare([m])
        assert torch.equal(layer(x), out), name
    with pytest.raises(ValueError, match=rf"gate: a Router \[8, {d}\] .* expected \[12, {d}\]"):
        op.finalized(x, gate=Router(gate_w[:8]))
    with pytest.raises(ValueError, match=r"gated token counts \[2\]"):
        MoeLayer(router, {m: op}, gated=[2])
