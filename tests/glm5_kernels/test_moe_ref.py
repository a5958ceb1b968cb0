"""MoE references against transformers' Glm5NextTextTopkRouter, Glm5NextTextExperts and
Glm5NextTextMLP (fp32 modules, same random weights), with FP8 block-quantized weights too.

Tolerances: routing picks the same expert sets exactly (random logits have no ties) and
weights to 1e-6 (same fp32 formula). MLP/expert outputs: fp32 matmuls over D or I <= 4096 in
a different order / grouping than transformers' F.linear calls, ~1e-6 relative: rtol/atol 1e-5.
The swiglu_limit is lowered to 1.5 in the tiny configs so the clamps actually bite.
"""

import pytest
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextExperts,
    Glm5NextTextMLP,
    Glm5NextTextTopkRouter,
)

import glm5_kernels.moe.reference as moe_reference
from glm5_kernels.gemm import swiglu_ref
from glm5_kernels.moe import dense_mlp_ref, experts_ref, route_ref
from glm5_kernels.quant import dequantize_fp8_block_ref, quantize_fp8_block_ref

CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _config(hidden=64, experts=8, top_k=3, inter=32, limit=1.5, **kw):
    config = Glm5NextTextConfig(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        intermediate_size=2 * inter,
        hc_mult=4,
        linear_num_heads=4,
        linear_head_dim=16,
        num_hidden_layers=4,
        swiglu_limit=limit,
        **kw,
    )
    config._experts_implementation = "eager"  # the plain loop (what the module is when loaded)
    return config


def _fill(p, gen, std=None):
    with torch.no_grad():
        p.copy_(torch.randn(p.shape, generator=gen) * (std or p.shape[-1] ** -0.5))


ROUTE_CASES = [
    pytest.param(t, d, e, k, id=f"T{t}-E{e}-top{k}")
    for t, d, e, k in [(1, 64, 8, 3), (17, 64, 8, 3)]
] + [pytest.param(3, 4096, 288, 8, id="T3-E288-top8-flash")]


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize(("t", "d", "e", "k"), ROUTE_CASES)
def test_route_matches_topk_router(t, d, e, k, renormalize):
    config = _config(hidden=d, experts=e, top_k=k, norm_topk_prob=renormalize)
    gen = torch.Generator().manual_seed(t * e + k)
    router = Glm5NextTextTopkRouter(config)
    _fill(router.weight, gen)
    # A correction bias comparable to the score spread, so it changes choices (checked below).
    router.e_score_correction_bias.copy_(0.2 * torch.randn(e, generator=gen))
    h = torch.randn(t, d, generator=gen)
    with torch.no_grad():
        logits, want_w, want_ids = router(h)
    weights, ids = route_ref(
        logits, router.e_score_correction_bias, k, config.routed_scaling_factor, renormalize
    )
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (t, k)
    order = want_ids.argsort(-1)
    mine = ids.argsort(-1)
    assert torch.equal(ids.gather(1, mine), want_ids.gather(1, order))  # same expert sets
    torch.testing.assert_close(
        weights.gather(1, mine), want_w.gather(1, order), rtol=1e-6, atol=1e-6
    )
    # Rows come sorted by the biased choice score; weights come from the unbiased scores.
    scores = torch.sigmoid(logits)
    choice = (scores + router.e_score_correction_bias).gather(1, ids)
    assert (choice[:, :-1] >= choice[:, 1:]).all()
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.full((t,), 2.5), rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(weights, 2.5 * scores.gather(1, ids), rtol=0, atol=0)
    if t * e > 100:
        unbiased = torch.sort(scores, -1, descending=True).indices[:, :k]
        assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


def test_route_breaks_ties_toward_the_lower_id():
    logits = torch.zeros(2, 6)
    logits[1, 4] = 1.0
    weights, ids = route_ref(logits, torch.zeros(6), 3, 1.0)
    assert ids.tolist() == [[0, 1, 2], [4, 0, 1]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))


def test_swiglu_matches_transformers_gate():
    config = _config()
    gen = torch.Generator().manual_seed(0)
    gate_up = 4 * torch.randn(17, 2 * 32, generator=gen)  # |x| > 1.5 often: both clamps bite
    want = Glm5NextTextExperts(config)._apply_gate(gate_up)
    got = swiglu_ref(gate_up, 1.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.max() <= torch.nn.functional.silu(torch.tensor(1.5)) * 1.5 + 1e-6
    bf16 = swiglu_ref(gate_up.bfloat16(), 1.5)
    assert bf16.dtype == torch.float32  # math and result in fp32 whatever the input dtype


MLP_CASES = [
    pytest.param(t, d, i, id=f"T{t}-D{d}-I{i}") for t, d, i in [(1, 64, 32), (17, 200, 150)]
]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize(("t", "d", "inter"), MLP_CASES)
def test_dense_mlp_matches_transformers_mlp(t, d, inter, fp8):
    config = _config(hidden=d, inter=inter)
    gen = torch.Generator().manual_seed(t + d)
    mlp = Glm5NextTextMLP(config, intermediate_size=inter)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        _fill(lin.weight, gen)
    w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    w2 = mlp.down_proj.weight.detach()
    scales = (None, None)
    if fp8:  # the module gets the dequantized weights; the reference gets fp8 + scales
        (w13, s13), (w2, s2) = quantize_fp8_block_ref(w13), quantize_fp8_block_ref(w2)
        scales = (s13, s2)
        with torch.no_grad():
            gate, up = dequantize_fp8_block_ref(w13, s13).split(inter)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(dequantize_fp8_block_ref(w2, s2))
    x = torch.randn(t, d, generator=gen)
    with torch.no_grad():
        want = mlp(x)
    got = dense_mlp_ref(x, w13, w2, 1.5, *scales)
    torch.testing.assert_close(got, want, **CLOSE)
    got_bf16 = dense_mlp_ref(x.bfloat16(), w13, w2, 1.5, *scales)
    assert got_bf16.dtype == torch.bfloat16


def _experts(config, gen):
    experts = Glm5NextTextExperts(config)
    _fill(experts.gate_up_proj, gen)
    _fill(experts.down_proj, gen)
    return experts


def _routing(t, e, k, gen):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.1
    return ids, weights


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize(
    ("t", "d", "inter"),
    [(1, 64, 32), (3, 64, 32), (17, 200, 150)],
    ids=["T1-D64-I32", "T3-D64-I32", "T17-D200-I150"],
)
def test_experts_match_transformers_experts(t, d, inter, fp8):
    config = _config(hidden=d, inter=inter)
    gen = torch.Generator().manual_seed(7 * t + d)
    experts = _experts(config, gen)
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_block_ref(w13), quantize_fp8_block_ref(w2)
        scales = (s13, s2)
        assert s13.shape == (8, -(-2 * inter // 128), -(-d // 128))
        with torch.no_grad():
            experts.gate_up_proj.copy_(dequantize_fp8_block_ref(w13, s13))
            experts.down_proj.copy_(dequantize_fp8_block_ref(w2, s2))
    x = torch.randn(t, d, generator=gen)
    ids, weights = _routing(t, 8, 3, gen)
    with torch.no_grad():
        want = experts(x, ids, weights)
    got = experts_ref(x, w13, w2, ids, weights, 1.5, *scales)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **CLOSE)


def test_experts_dequantize_only_the_experts_hit(monkeypatch):
    """The real layer holds 288 experts (~10 GB dequantized): only hit experts are touched,
    each once per weight, and an out-of-range id (transformers' EP sentinel E) is skipped."""
    gen = torch.Generator().manual_seed(1)
    e, d, inter, t = 16, 64, 32, 5
    w13, s13 = quantize_fp8_block_ref(torch.randn(e, 2 * inter, d, generator=gen) / 8)
    w2, s2 = quantize_fp8_block_ref(torch.randn(e, d, inter, generator=gen) / 6)
    hit = torch.tensor([3, 11, 14])
    ids = hit[torch.randint(0, 3, (t, 2), generator=gen)]
    ids[0, 1] = e  # sentinel
    weights = torch.rand(t, 2, generator=gen)
    calls = []

    def counting(q, scale, *args, **kwargs):
        calls.append(q.shape)
        return dequantize_fp8_block_ref(q, scale, *args, **kwargs)

    monkeypatch.setattr(moe_reference, "dequantize_fp8_block_ref", counting)
    x = torch.randn(t, d, generator=gen)
    got = experts_ref(x, w13, w2, ids, weights, 10.0, s13, s2)
    assert len(calls) == 2 * len(ids[ids < e].unique())
    assert all(len(shape) == 2 for shape in calls)  # one expert at a time, never [E, ...]
    # The sentinel slot contributes nothing: same as giving it weight 0 on a real expert.
    ids0, weights0 = ids.clone(), weights.clone()
    ids0[0, 1], weights0[0, 1] = 3, 0.0
    torch.testing.assert_close(got, experts_ref(x, w13, w2, ids0, weights0, 10.0, s13, s2))


def test_flash_size_expert_fp8_round_trip():
    """One real GLM-5.3-Flash expert (w13 2x2048x4096, w2 4096x2048), UE8M0 FP8 like DeepGEMM,
    against transformers' Experts holding the dequantized weights; and the FP8 output moves from
    the unquantized expert's by its weights' quantization, to first order: each linear's output
    by its weight's relative error e (isotropic inputs), the gate's through SwiGLU at most
    doubled, so <= 2 e13 + e2 (e13, e2 measured here); and by a quarter of e2 at least (the
    errors do not cancel: the FP8 path is really taken)."""
    d, inter, t = 4096, 2048, 2
    config = _config(hidden=d, experts=1, top_k=1, inter=inter, limit=10.0)
    gen = torch.Generator().manual_seed(2048)
    experts = _experts(config, gen)
    (w13, s13), (w2, s2) = (
        quantize_fp8_block_ref(p.detach(), ue8m0=True)
        for p in (experts.gate_up_proj, experts.down_proj)
    )
    assert s13.shape == (1, 32, 32) and s2.shape == (1, 32, 16)
    x = torch.randn(t, d, generator=gen)
    ids, weights = torch.zeros(t, 1, dtype=torch.int64), torch.full((t, 1), 2.5)
    exact_w13, exact_w2 = experts.gate_up_proj.clone(), experts.down_proj.clone()
    with torch.no_grad():
        exact = experts(x, ids, weights)
        experts.gate_up_proj.copy_(dequantize_fp8_block_ref(w13, s13))
        experts.down_proj.copy_(dequantize_fp8_block_ref(w2, s2))
        want = experts(x, ids, weights)
    got = experts_ref(x, w13, w2, ids, weights, 10.0, s13, s2)
    torch.testing.assert_close(got, want, **CLOSE)
    rel = ((got - exact).norm() / exact.norm()).item()
    e13, e2 = (
        ((dequantize_fp8_block_ref(q, s) - p.detach()).norm() / p.detach().norm()).item()
        for q, s, p in ((w13, s13, exact_w13), (w2, s2, exact_w2))
    )
    assert e2 / 4 < rel <= 2 * e13 + e2, (rel, e13, e2)
