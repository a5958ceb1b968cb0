"""Skinny GEMMs on the GPU at every real GLM-5.3-Flash shape (TP 1 and TP 4 ranks), every
benchmarked token count plus off-grid ones, NaN-poisoned outputs, sentinels past the inputs;
CUDA-graph capture after prepare() and the error for an unprepared token count."""

import zlib
from dataclasses import replace

import pytest
import torch
from gemm_cases import (
    assert_linear_close,
    assert_mlp_close,
    bf16_inputs,
    fp8_inputs,
    mlp_weights,
    poisoned,
)

from glm5_kernels.gemm import DenseMlp, Fp8Linear, Projection, Router, fp8_linear_ref, linear_ref
from glm5_kernels.gemm.shapes import flash_shapes

pytestmark = pytest.mark.gpu

TOKENS = [1, 2, 3, 4, 8, 13, 16, 32, 47, 64]
CASES = [(tp, name, *spec) for tp in (1, 4) for name, spec in flash_shapes(tp).items()]


@pytest.mark.parametrize("tp, name, kind, n, k", CASES, ids=[f"tp{c[0]}-{c[1]}" for c in CASES])
def test_flash_shape(tp, name, kind, n, k):
    gen = torch.Generator("cuda").manual_seed(zlib.crc32(name.encode()) + tp)
    m_max = max(TOKENS)
    if kind == "mlp":
        weights = mlp_weights(k, n // 2, "cuda", gen)
        op = DenseMlp(*weights, swiglu_limit=10.0)
        x = torch.randn(m_max, k, generator=gen, device="cuda").bfloat16()
        for m in TOKENS:
            assert_mlp_close(op(x[:m]), x[:m], weights, 10.0, False)
        return
    if kind == "fp8":
        x, w, s = fp8_inputs(m_max, n, k, "cuda", gen)
        op = Fp8Linear(w, s)
        exact = fp8_linear_ref(x, w, s, out_dtype=torch.float64)
        abs_product = fp8_linear_ref(x.abs(), w.float().abs().to(w.dtype), s, False, torch.float64)
    else:
        x, w = bf16_inputs(m_max, n, k, "cuda", gen)
        op = Router(w) if kind == "router" else Projection(w)
        exact = linear_ref(x, w, torch.float64)
        abs_product = linear_ref(x.abs(), w.abs(), torch.float64)
    for m in TOKENS:
        y = op(x[:m].clone(), out=poisoned(m, n, op.out_dtype, "cuda"))
        bf16_out = op.out_dtype == torch.bfloat16
        assert_linear_close(y, exact[:m], abs_product[:m], k, bf16_out, fp8_mma=kind == "fp8")


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-act-scales", "ue8m0-act-scales"])
def test_e8m0_weight_scales(ue8m0):
    gen = torch.Generator("cuda").manual_seed(5)
    n, k = flash_shapes(4)["dense.down"][1:]
    x, w, s = fp8_inputs(16, n, k, "cuda", gen, e8m0=True)
    op = Fp8Linear(w, s, ue8m0=ue8m0)
    exact = fp8_linear_ref(x, w, s, ue8m0, torch.float64)
    abs_product = fp8_linear_ref(x.abs(), w.float().abs().to(w.dtype), s, ue8m0, torch.float64)
    assert_linear_close(op(x), exact, abs_product, k, True, fp8_mma=True)
    op.tiles[16] = replace(op.tiles[16], quantize_first=False)  # quantized inside the GEMM
    assert_linear_close(op(x), exact, abs_product, k, True, fp8_mma=True)
    weights = mlp_weights(4096, 512, "cuda", gen, e8m0=True)
    x = torch.randn(8, 4096, generator=gen, device="cuda").bfloat16()
    assert_mlp_close(DenseMlp(*weights, 10.0, ue8m0)(x), x, weights, 10.0, ue8m0)


def test_graph_capture_after_prepare():
    gen = torch.Generator("cuda").manual_seed(9)
    x, w = bf16_inputs(8, 4096, 4096, "cuda", gen)
    weights = mlp_weights(4096, 512, "cuda", gen)
    ops = [Projection(w), Router(w[:288].contiguous()), DenseMlp(*weights, 10.0)]
    for op in ops:
        op.prepare([8])
    eager = [op(x) for op in ops]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(x) for op in ops]
    for _ in range(3):  # the split-K counters must be back at zero for every replay
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, eager, strict=True):
            assert torch.equal(a, b)


def test_capture_refuses_unprepared_token_count():
    w = torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda")
    op = Projection(w)
    x = torch.zeros(5, 256, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="M=5 was not prepared"), torch.cuda.graph(graph):
        op(x)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_a_pdl_chain_reads_what_its_predecessor_wrote(m):
    """Issue 29's ordering pitfall: under programmatic dependent launch each skinny GEMM warms
    L2 with its weights before its wait and releases its successor before its own stores,
    so a successor whose input loads were hoisted above the wait (a Triton pipelining
    hazard reported upstream) would read the previous replay's activations. Three chained
    projections (the last FP32, split-K and not) in one CUDA graph, replayed with a new
    input each time: every link equals the exact product of what the link before it wrote
    on that replay, and a stale read (last replay's input) would miss by O(1)."""
    from glm5_kernels.launch import use_pdl

    assert use_pdl(torch.device("cuda")), "PDL off here (GLM5_PDL=0 or before SM90)"
    gen = torch.Generator("cuda").manual_seed(m)
    shapes = [(6144, 4096), (4096, 6144), (288, 4096)]  # (N, K): wide, deep, router-like
    ops = [Projection((torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16(),
                      out_dtype=torch.float32 if i == 2 else torch.bfloat16)
           for i, (n, k) in enumerate(shapes)]  # fmt: skip
    for op in ops:
        op.prepare([m])
    x = torch.empty(m, 4096, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        links = [x]
        for op in ops:
            links.append(op(links[-1]))
    previous = None
    for _ in range(6):
        x.copy_(torch.randn(m, 4096, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for op, inp, out in zip(ops, links[:-1], links[1:], strict=True):
            exact = linear_ref(inp, op.weight, torch.float64)
            abs_product = inp.double().abs() @ op.weight.double().abs().T
            assert_linear_close(out, exact, abs_product, op.k, out.dtype == torch.bfloat16)
        if previous is not None:  # the inputs did change between replays
            assert not torch.equal(previous, links[1])
        previous = links[1].clone()


@pytest.mark.parametrize("tp", [4, 8])
def test_kda_gate_projections_in_one_launch(tp):
    """The KDA gates' f_b and g_b at the real shapes (head dim 128 in, the rank's heads x 128
    out each) as one two-block projection over f_a | g_a, adjacent columns of the fused
    input projection's output: each block within its bound of its own exact product."""
    from glm5_kernels.gemm.shapes import HIDDEN, KDA_HEAD_DIM, KDA_WIDTH

    gen = torch.Generator("cuda").manual_seed(tp)
    n, k = KDA_WIDTH // tp, KDA_HEAD_DIM
    w = (torch.randn(2 * n, k, generator=gen, device="cuda") / k**0.5).bfloat16()
    op = Projection(w, blocks=2)
    for m in TOKENS:
        wide = torch.randn(m, HIDDEN, generator=gen, device="cuda").bfloat16()
        x = wide[:, 256 : 256 + 2 * k]  # the in_proj output's f_a | g_a columns
        y = op(x, out=poisoned(m, 2 * n, torch.bfloat16, "cuda"))
        for b in range(2):
            xb, wb = x[:, b * k : (b + 1) * k], w[b * n : (b + 1) * n]
            exact = linear_ref(xb, wb, torch.float64)
            abs_product = linear_ref(xb.abs(), wb.abs(), torch.float64)
            assert_linear_close(y[:, b * n : (b + 1) * n], exact, abs_product, k, True)


@pytest.mark.parametrize("tp", [4, 8])
def test_q_b_and_wq_b_in_one_launch(tp):
    """The MLA q_b (the rank's heads x 256) and the indexer's wq_b (32 x 128) of one q_resid
    in one launch, each weight read in place (the second allocated first: a negative offset):
    the output equals
    one projection over the two stacked, bit for bit (the same tiles), and the stacked
    product within its bound; the LM head's FP32 logits of BF16 values (`bf16_values`) equal
    its BF16 output widened."""
    from glm5_kernels.gemm.shapes import (
        HIDDEN,
        INDEX_DIM,
        INDEX_HEADS,
        MLA_HEADS,
        NOPE,
        Q_LORA,
        VOCAB,
    )

    gen = torch.Generator("cuda").manual_seed(tp)
    k = Q_LORA
    wq_b = torch.randn(INDEX_HEADS * INDEX_DIM, k, generator=gen, device="cuda") / k**0.5
    q_b = torch.randn(MLA_HEADS * NOPE // tp, k, generator=gen, device="cuda") / k**0.5
    q_b, wq_b = q_b.bfloat16(), wq_b.bfloat16()
    both = Projection(q_b, TOKENS, then=wq_b)
    stacked = torch.cat([q_b, wq_b])
    whole = Projection(stacked, TOKENS)
    head_w = torch.randn(VOCAB // tp, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5
    head_w = head_w.bfloat16()
    head = Projection(head_w, TOKENS, out_dtype=torch.float32, bf16_values=True)
    head_bf16 = Projection(head_w, TOKENS)
    for m in TOKENS:
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        y = both(x, out=poisoned(m, both.n, torch.bfloat16, "cuda"))
        assert torch.equal(y, whole(x)), m
        exact = linear_ref(x, stacked, torch.float64)
        assert_linear_close(y, exact, linear_ref(x.abs(), stacked.abs(), torch.float64), k, True)
        h = torch.randn(m, HIDDEN, generator=gen, device="cuda").bfloat16()
        logits = head(h, out=poisoned(m, VOCAB // tp, torch.float32, "cuda"))
        assert torch.equal(logits, head_bf16(h).float()), m
