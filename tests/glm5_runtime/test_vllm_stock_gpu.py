"""The vLLM-kernel stock (`glm5_runtime.vllm_stock`) on the GPU: vLLM 0.33's Triton kernels
compiled for it (swap-AB, PDL, the Triton SwiGLU) at GLM-5.3-Flash's TP-4 shapes (the mHC pre
at its replicated 4 x 4096 streams) against the reference on the same inputs
(tests/vllm_stock_checks.py: the checks and their bounds), and a whole step on them captured in
one CUDA graph replaying as it ran eagerly.

The kernels come from a folder of the vllm==0.33.0 wheel's files (vLLM is not installed on the
GPU host): `python benchmarks/vllm_files.py DIR` where it is, then GLM5_VLLM_FILES=DIR."""

import os

import pytest
import torch
from vllm_stock_checks import (
    Recorder,
    check_experts,
    check_mhc_pre,
    experts_case,
    kda_case,
    mhc_case,
)

from glm5_runtime import vllm_mhc, vllm_stock
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.vllm_files import problems
from glm5_runtime.vllm_stock import VllmKernels, VllmStock, _placed

pytestmark = pytest.mark.gpu

FOLDER = os.environ.get("GLM5_VLLM_FILES")


@pytest.fixture(scope="module")
def kernels():
    if not FOLDER or problems(FOLDER):
        pytest.skip(
            "GLM5_VLLM_FILES names no folder of vLLM 0.33's files (benchmarks/vllm_files.py "
            f"makes one where vllm==0.33.0 is installed): {problems(FOLDER or '.')}"
        )
    return VllmKernels(FOLDER)


@pytest.mark.parametrize("tokens", [1, 8, 64])  # one token a block at 1 and 8; aligned at 64
def test_fused_experts_at_the_tp4_shapes(kernels, tokens):
    """288 experts, top-8, D 4096, I 512 (a TP-4 rank): the reference's FP8 numerics, and a
    captured call replays bit for bit (no host sync, no shape from the routing)."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    case = experts_case(tokens, 288, 8, 4096, 512, gen, scale=4.0)
    out = vllm_stock.fused_experts(kernels, *case, 10.0)
    check_experts(*case, 10.0, False, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = vllm_stock.fused_experts(kernels, *case, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.parametrize("requests, q", [(8, 1), (4, 4)], ids=["decode", "verify"])
def test_kda_core_at_the_tp4_heads(kernels, monkeypatch, requests, q):
    """16 heads x 128 (a TP-4 rank): conv, recurrence and gated norm against the reference."""
    args, step = kda_case(requests, q, torch.Generator("cuda").manual_seed(q), h=16, kd=128)
    recorder = Recorder(kernels, monkeypatch)
    recorder.step = step
    fresh = {k: v.clone() if torch.is_tensor(v) else v for k, v in args.items()}
    vllm_stock.kda_core(kernels, **fresh, placed=_placed(step, q))
    assert recorder.calls["kda"] == 1


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_mhc_pre_at_the_flash_streams(kernels, tokens):
    """4 streams x 4096 (GLM-5.3-Flash's mHC, replicated on every rank): vLLM's pre gate and
    collapse with the torch post gate and Sinkhorn around them against the reference and
    FP64, and a captured call replays bit for bit."""
    g = geometry("flash")
    gen = torch.Generator("cuda").manual_seed(tokens)
    case = mhc_case(tokens, gen, h=g.hc_mult, d=g.hidden_size)
    kw = dict(rms_eps=g.rms_norm_eps, hc_eps=g.hc_eps, sinkhorn_iters=g.hc_sinkhorn_iters)
    out = vllm_mhc.mhc_pre(kernels.mhc, *case, **kw)
    check_mhc_pre(kernels.mhc, *case, *kw.values(), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = vllm_mhc.mhc_pre(kernels.mhc, *case, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(c, o) for c, o in zip(captured, out, strict=True))


def test_a_captured_vllm_step_replays_like_eager(kernels, monkeypatch):
    """A tiny model's decode step (hidden and experts whole FP8 blocks) on the vLLM stock:
    each vLLM call checked eagerly; the step captured in one graph, replayed from the same
    caches, gives the same hidden states and caches bit for bit."""
    g = geometry(
        "tiny", hidden_size=128, moe_intermediate_size=128, num_hidden_layers=2,
        layer_types=("linear_attention", "deepseek_sparse_attention"),
        mlp_layer_types=("sparse", "sparse"), indexer_types=("full", "full"),
    )  # fmt: skip
    model = ReferenceModel.random(g, seed=2, device="cuda", max_requests=4, max_context=32,
                                  fp8_activations=True)  # fmt: skip
    requests = [model.add() for _ in range(4)]
    ids = torch.randint(0, g.vocab_size, (4, 7), device="cuda")
    named = {f"{kind}[{layer}]": t for rank in model.ranks for kind, c in vars(rank.c).items()
             for layer, t in c.items()}  # fmt: skip
    caches = list(named.values())
    recorder = Recorder(kernels, monkeypatch)
    with torch.no_grad():
        model.forward(requests, ids[:, :6])
        step, tokens = model.step(requests, 1), ids[:, 6:]
        recorder.step = step
        before = [t.clone() for t in caches]
        with VllmStock(model, kernels):
            eager = model.backbone(tokens, step).clone()
            after = [t.clone() for t in caches]
            assert recorder.calls == {"kda": 1, "experts": 2, "mhc": 4}
            monkeypatch.undo()  # the checks run eagerly only
            for t, saved in zip(caches, before, strict=True):
                t.copy_(saved)
            model.backbone(tokens, step)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            for t, saved in zip(caches, before, strict=True):
                t.copy_(saved)
            with torch.cuda.graph(graph):
                hidden = model.backbone(tokens, step)
            for t, saved in zip(caches, before, strict=True):
                t.copy_(saved)
            graph.replay()
            torch.cuda.synchronize()
    assert torch.equal(hidden, eager)

    # Bit for bit (a NaN equals its own bits, as torch.equal's NaN != NaN would not say):
    # each cache the replay left otherwise than the eager step, how many bytes, whether NaN.
    # Not the pool pages' null block 0: every token that completes no pool writes its pool
    # there (where vLLM skips the write), several a step in an order no replay need keep,
    # and nothing reads it.
    def bits(name, t):
        return t[1:].view(torch.uint8) if name.startswith("kpool") else t.view(torch.uint8)

    differ = {
        name: (int((bits(name, t) != bits(name, a)).sum()), bool(a.isnan().any()))
        for (name, t), a in zip(named.items(), after, strict=True)
        if not torch.equal(bits(name, t), bits(name, a))
    }
    assert not differ, differ
