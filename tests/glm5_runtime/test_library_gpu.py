"""The library stock (`glm5_runtime.library`) and the bench's graph measurements on the GPU.

Library ops against FP64 references of the same numerics: a block-FP8 linear is
`fp8_linear_ref` (per-token 1x128 activation quantization, FP32-or-better accumulation, a BF16
output): the only difference is the accumulation order and the one BF16 rounding of the
output, 2^-9 relative per element, so 2^-8 bounds the relative L2 error. The experts are
`fp8_mlp_ref` per route, weighted and summed: the same quantizations, but where a gate_up
output lands one BF16 ulp apart, SwiGLU and the FP8 re-quantization may move that element by
one FP8 step (2^-4 relative); few elements do, so the relative L2 bound is 2^-6."""

import pytest
import torch

from glm5_kernels.gemm import fp8_linear_ref, fp8_mlp_ref
from glm5_kernels.gemm.library import fp8_linear_library, router_library, supports
from glm5_kernels.kda import kda_recurrence_ref
from glm5_kernels.quant import quantize_fp8_block_ref
from glm5_runtime.bench import BETWEEN, StageMarks, graph_nodes
from glm5_runtime.library import LibraryStock, _fla_kda, _recurrence, experts_library
from glm5_runtime.reference import ReferenceModel, geometry

pytestmark = pytest.mark.gpu

LINEAR_BOUND = 2.0**-8
EXPERTS_BOUND = 2.0**-6


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m, n, k", [(1, 512, 4096), (5, 4096, 512), (37, 6144, 4096)])
def test_fp8_linear_library_is_the_block_fp8_reference(m, n, k):
    gen = torch.Generator("cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w, s = quantize_fp8_block_ref(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
    out = fp8_linear_library(x, w, s)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel(out, fp8_linear_ref(x, w, s, out_dtype=torch.float64)) < LINEAR_BOUND


@pytest.mark.parametrize("k", [128, 256, 640])
def test_scaled_mm_block_refuses_what_it_would_get_wrong(k):
    """K / 128 not a multiple of 4: torch 2.11's block-scaled GEMM returns wrong numbers."""
    w, s = quantize_fp8_block_ref(torch.randn(256, k, device="cuda"))
    assert not supports(w)
    with pytest.raises(ValueError, match="K % 512"):
        fp8_linear_library(torch.randn(16, k, device="cuda").bfloat16(), w, s)


def test_router_library_is_fp32_logits():
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(3, 4096, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(288, 4096, generator=gen, device="cuda") / 64).bfloat16()
    logits = router_library(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (3, 288)
    assert rel(logits, x.double() @ w.double().T) < LINEAR_BOUND


@pytest.mark.parametrize("tokens", [1, 3, 5])  # 8 or 24 routes < 16 experts <= 40 routes
def test_experts_library_is_the_sum_of_routed_fp8_mlps(tokens):
    """Real TP-4 expert shapes (D 4096, I 512), 16 experts, top-8: both capturable paths
    (each route gathered; every expert once), against fp8_mlp_ref per route in FP64."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    e, k, d, i, limit = 16, 8, 4096, 512, 10.0
    x = torch.randn(tokens, d, generator=gen, device="cuda").bfloat16()
    w13, s13 = quantize_fp8_block_ref(torch.randn(e, 2 * i, d, generator=gen, device="cuda") / 64)
    w2, s2 = quantize_fp8_block_ref(torch.randn(e, d, i, generator=gen, device="cuda") / 23)
    ids = torch.stack([torch.randperm(e, generator=gen, device="cuda")[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen, device="cuda")
    want = torch.zeros(tokens, d, dtype=torch.float64, device="cuda")
    for t in range(tokens):
        for j in range(k):
            ex = ids[t, j].item()
            y = fp8_mlp_ref(x[t : t + 1], w13[ex], s13[ex], w2[ex], s2[ex], limit)
            want[t] += y[0].double() * weights[t, j].double()
    out = torch.full((tokens, d), float("nan"), device="cuda")
    graph = torch.cuda.CUDAGraph()  # capturable: no host sync, no data-dependent shape
    experts_library(x, w13, s13, w2, s2, ids, weights, limit)
    with torch.cuda.graph(graph):
        out.copy_(experts_library(x, w13, s13, w2, s2, ids, weights, limit))
    graph.replay()
    assert torch.isfinite(out).all()
    assert rel(out, want) < EXPERTS_BOUND


@pytest.mark.skipif(_fla_kda() is None, reason="fla is not installed (optional library)")
def test_fla_recurrence_is_the_reference():
    """fla's decode kernel in the reference's contract: 64 heads x 128 at TP 1, 1 token."""
    gen = torch.Generator("cuda").manual_seed(0)
    h, d = 64, 128
    q, k, v = (torch.randn(1, h, d, generator=gen, device="cuda").bfloat16() for _ in range(3))
    gate = -torch.rand(1, h, d, generator=gen, device="cuda") * 5
    beta = torch.rand(1, h, generator=gen, device="cuda")
    state = torch.randn(h, d, d, generator=gen, device="cuda")
    o, final, states = _recurrence(_fla_kda(), None, q, k, v, gate, beta, state, all_states=False)
    o_ref, final_ref, _ = kda_recurrence_ref(q, k, v, gate, beta, state)
    assert states is None
    # fla returns o in v's dtype (BF16: 2^-9 relative per element), the state in FP32
    # (summation order only).
    assert rel(o, o_ref) < 2.0**-8 and rel(final, final_ref) < 1e-4


def _tiny_model():
    """Tiny, but with every FP8 K a multiple of 512, so every FP8 op takes _scaled_mm; every
    expert routed (16 of 16), so no top-k choice flips between the two numerics; the
    reference's FP8 linears quantize their activations as the library's do."""
    g = geometry(
        "tiny", hidden_size=512, intermediate_size=512, moe_intermediate_size=512,
        num_experts_per_tok=16,
    )  # fmt: skip
    return ReferenceModel.random(
        g, seed=0, device="cuda", max_requests=4, max_context=64, fp8_activations=True
    )


def _caches(model):
    """Every cache tensor of every rank (a decode step updates them in place)."""
    return [t for rank in model.ranks for c in vars(rank.c).values() for t in c.values()]


def test_library_step_is_captured_and_near_the_reference_step():
    """The whole step on library kernels inside one CUDA graph: finite, near the reference
    step from the same caches (the experts' FP8 activation quantization is the difference:
    the 0.1 yardstick of the decode tests), its kernels counted, its stage split adding up to the
    marked replay, the model's own stages restored after."""
    model = _tiny_model()
    requests = [model.add() for _ in range(4)]
    ids = torch.randint(0, model.g.vocab_size, (4, 7), device="cuda")
    with torch.no_grad():
        model.forward(requests, ids[:, :6])
        step, tokens = model.step(requests, 1), ids[:, 6:]
        before = [t.clone() for t in _caches(model)]
        want = model.backbone(tokens, step).clone()

        def rewind():
            for t, saved in zip(_caches(model), before, strict=True):
                t.copy_(saved)

        with LibraryStock(model) as library:
            assert library.kernels["fp8_weights_on_the_reference_path"].startswith("0 of")
            rewind()
            model.backbone(tokens, step)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                out = model.backbone(tokens, step)
            graph.instantiate()
            nodes = graph_nodes(graph)
            out.fill_(float("nan"))
            rewind()
            graph.replay()
            marks = StageMarks(model)
            marked = torch.cuda.CUDAGraph()
            with marks, torch.cuda.graph(marked):
                marks.mark(BETWEEN)
                model.backbone(tokens, step)
                marks.mark("end")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            marked.replay()
            end.record()
            torch.cuda.synchronize()
    assert not any(set(vars(rank)) & {"linear", "router", "experts", "kda"} for rank in model.ranks)
    assert torch.isfinite(out).all()
    assert rel(out, want) < 0.1
    assert nodes is None or nodes["kernel"] > 0
    split = marks.split()
    assert {"kda", "mla", "moe", "dense_mlp", "embed", BETWEEN} <= set(split)
    assert all(ms >= 0 for ms in split.values())
    total = marks.marks[0][0].elapsed_time(marks.marks[-1][0])
    assert abs(sum(split.values()) - total) <= 1e-3 * total + 1e-3
    assert total <= start.elapsed_time(end)


def test_library_stock_refuses_a_gpu_without_block_fp8_mm(monkeypatch):
    import glm5_runtime.library as library

    monkeypatch.setattr(library, "block_fp8_supported", lambda device: None)
    with pytest.raises(RuntimeError, match="block-scaled _scaled_mm"):
        LibraryStock(_tiny_model())
