"""The vLLM-kernel stock (`glm5_runtime.vllm_stock`) on CPU: vLLM 0.33's own Triton kernels,
copied out of the installed wheel (`vllm_files.copy_files`) and run by Triton's interpreter,
against the reference on the same inputs (tests/vllm_stock_checks.py: the checks and their
bounds): the token quantization, the routed experts (both block assignments, the SwiGLU clamp,
UE8M0 scales), the KDA core (decode, verify), the mHC pre (vLLM's pre gate and collapse), and
every such call of whole tiny decode and verify steps (TP 1 and 2), whose hidden states stay
within the stock model's own rounding
noise: each token's row within 2x the worst row of the reference BF16 model against itself
in FP32, every expert routed and every pool selected so that no discrete choice can differ.

The interpreter narrows and multiplies BF16 as a GPU does here (`exact_interpreter`): vLLM's
code runs unchanged with a GPU's roundings."""

import os
from functools import partial

import pytest
import torch
from vllm_stock_checks import (
    Recorder,
    check_experts,
    check_mhc_pre,
    exact_interpreter,
    experts_case,
    kda_case,
    mhc_case,
    rel,
    vllm_quant,
)

from glm5_kernels.mhc import hc_pre_ref
from glm5_runtime import vllm_mhc, vllm_stock
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.stages import _fake_quant, stock_experts
from glm5_runtime.vllm_files import FILES, MANIFEST, copy_files, problems
from glm5_runtime.vllm_stock import BLOCK, VllmKernels, VllmStock, _align, _placed

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs vLLM's Triton kernels on Triton's interpreter (TRITON_INTERPRET=1)",
    ),
]

LIMIT = 10.0


@pytest.fixture(scope="module", autouse=True)
def exact_roundings():
    with exact_interpreter():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-files")
    copy_files(path)
    return path


@pytest.fixture(scope="module")
def kernels(folder):
    return VllmKernels(folder)


def test_files_are_the_wheels_and_an_edit_is_named(folder, tmp_path):
    """The folder holds FILES and their manifest; a file edited or gone is named."""
    assert problems(folder) == []
    copy = tmp_path / "copy"
    copy_files(copy)
    edited, gone = FILES["fused_moe"], FILES["conv"]
    with open(copy / edited, "a") as f:
        f.write("# edited\n")
    (copy / gone).unlink()
    assert problems(copy) == [f"{edited}: not the file the manifest names (edited?)",
                              f"{gone}: missing"]  # fmt: skip
    (copy / MANIFEST).unlink()
    assert "vllm_files.json" in problems(copy)[0]


@pytest.mark.parametrize("tokens, top_k, experts, block", [(1, 8, 288, 16), (5, 4, 16, 16),
                                                          (64, 8, 288, 64)])  # fmt: skip
def test_align_is_vllms_block_assignment(tokens, top_k, experts, block):
    """The torch `moe_align_block_size` op: each expert's routes (all of them, once) in
    whole blocks of one expert, padded with the sentinel; blocks past the end skipped."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.int()
    n = ids.numel()
    capacity = n + experts * (block - 1) if n >= experts else n * block
    sorted_ids = torch.full((capacity,), -7, dtype=torch.int32)
    expert_ids = torch.full((-(-capacity // block),), -7, dtype=torch.int32)
    padded = torch.zeros(1, dtype=torch.int32)
    _align(ids, experts, block, sorted_ids, expert_ids, padded)
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    total = int(((counts + block - 1) // block * block).sum())
    assert padded.item() == total
    used = sorted_ids[:total].view(-1, block)
    real = used[used < n]
    assert sorted(real.tolist()) == list(range(n))  # every route once
    assert (sorted_ids[total:] == n).all()
    for b, rows in enumerate(used):  # a block is one expert's routes, then padding
        routes = rows[rows < n].long()
        assert (ids.flatten()[routes] == expert_ids[b]).all() and len(routes) > 0
        assert (rows[len(routes) :] == n).all()
    assert (expert_ids[: total // block].diff() > 0).all()  # experts in order
    assert (expert_ids[total // block :] == -1).all()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_token_quantization_is_vllms_rule(kernels, ue8m0):
    """vLLM's per_token_group_quant_fp8 (its Triton path) is `vllm_quant`, code for code; the
    reference's quantizer (amax / 448) differs from it at e4m3 midpoints."""
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    q, scale = kernels.moe.per_token_group_quant_fp8(x, 128, use_ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 2)
    values = (q.float().view(6, 2, 128) * scale[..., None]).view(6, 256)
    assert torch.equal(values, vllm_quant(x, ue8m0))
    if not ue8m0:  # UE8M0 scales are powers of two in both: the same codes
        assert not torch.equal(values, _fake_quant(x, ue8m0))


@pytest.mark.parametrize(
    "tokens, experts, top_k, ue8m0",
    [(1, 16, 4, False), (3, 8, 4, False), (2, 8, 2, True)],
    ids=["naive-blocks", "aligned-blocks", "aligned-ue8m0"],
)
def test_fused_experts_are_the_fp8_reference(kernels, tokens, experts, top_k, ue8m0):
    """vLLM's TritonExperts sequence (tokens x top-k x 4 <= experts: one token a block, else
    moe_align_block_size's blocks) against the reference's FP8 numerics, the SwiGLU limit in
    play (gate_up ~ 10): without the clamp the reference is far off."""
    gen = torch.Generator().manual_seed(tokens)
    case = experts_case(tokens, experts, top_k, 128, 128, gen, ue8m0=ue8m0, scale=10.0)
    config = kernels.moe.get_default_config(tokens, experts, 128, 128, top_k, "fp8_w8a8", BLOCK)
    sorted_ids, *_ = kernels.moe._prepare_expert_assignment(
        case[5].int(), config, tokens, top_k, experts, None, block_shape=BLOCK
    )
    assert (sorted_ids is None) == (tokens * top_k * 4 <= experts)
    out = vllm_stock.fused_experts(kernels, *case, LIMIT, ue8m0)
    check_experts(*case, LIMIT, ue8m0, out)
    unclamped = stock_experts(case[0], case[1], case[3], case[5], case[6], 1e9, case[2], case[4],
                              partial(vllm_quant, ue8m0=ue8m0))  # fmt: skip
    assert rel(out, unclamped) > 2.0**-3


@pytest.mark.parametrize("requests, q", [(3, 1), (2, 3)], ids=["decode", "verify"])
def test_kda_core_is_the_reference(kernels, monkeypatch, requests, q):
    """vLLM's Glm5Next KDA decode core over vLLM's cache layouts, pre-filled with junk where
    nothing is read: conv, recurrence (a verify resumes from the accepted token and keeps
    every token's state), gated norm."""
    args, step = kda_case(requests, q, torch.Generator().manual_seed(q))
    recorder = Recorder(kernels, monkeypatch)
    recorder.step = step
    vllm_stock.kda_core(kernels, **{k: v.clone() if torch.is_tensor(v) else v
                                    for k, v in args.items()}, placed=_placed(step, q))  # fmt: skip
    assert recorder.calls["kda"] == 1


@pytest.mark.parametrize("tokens, d", [(1, 64), (6, 256)])
def test_mhc_pre_is_the_reference(kernels, tokens, d):
    """vLLM's pre gate (mhc_pre_mix_triton, from the unnormalized mix GEMM) and collapse
    (hc_collapse_triton) with the post gate and Sinkhorn around them: the reference's pre
    within FP32 noise, the collapse within its own roundings; gates from the wrong columns
    of the base are far outside."""
    gen = torch.Generator().manual_seed(tokens)
    case = mhc_case(tokens, gen, d=d)
    g = geometry("tiny")
    kw = dict(rms_eps=g.rms_norm_eps, hc_eps=g.hc_eps, sinkhorn_iters=g.hc_sinkhorn_iters)
    out = vllm_mhc.mhc_pre(kernels.mhc, *case, **kw)
    check_mhc_pre(kernels.mhc, *case, *kw.values(), out)
    streams, fn, scale, base = case
    ref = hc_pre_ref(streams, fn, scale, base, **kw)
    assert rel(out[2], ref[2]) <= 2.0**-8  # the collapses: a BF16 rounding apart at most
    with pytest.raises(AssertionError):  # the base's post columns in place of its pre ones
        shifted = torch.cat([base[4:8], base[:4], base[8:]])
        check_mhc_pre(kernels.mhc, streams, fn, scale, shifted, *kw.values(), out)


def _tiny(dtype, tp: int):
    """Tiny, but with hidden and each rank's expert sizes whole FP8 blocks (vLLM's kernels
    take no other), every expert routed (4 of 4) and every pool selected (contexts below
    top-k x pool), so the vLLM and reference steps make the same discrete choices; FP8
    activations in the reference too."""
    g = geometry(
        "tiny", hidden_size=128, moe_intermediate_size=128 * tp, num_hidden_layers=2,
        layer_types=("linear_attention", "deepseek_sparse_attention"),
        mlp_layer_types=("sparse", "sparse"), indexer_types=("full", "full"),
        n_routed_experts=4, num_experts_per_tok=4, tp_size=tp,
    )  # fmt: skip
    return ReferenceModel.random(g, seed=5, max_requests=2, max_context=32, block_size=16,
                                 q=3, dtype=dtype, fp8_activations=True)  # fmt: skip


def _caches(model):
    return [t for rank in model.ranks for c in vars(rank.c).values() for t in c.values()]


def _worst_row(a, b) -> float:
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("tp", [1, 2])
def test_steps_with_the_vllm_stock_and_without(kernels, monkeypatch, tp):
    """A decode step, then a verify step, of a tiny model (every TP rank held) with VllmStock
    and without, from the same caches: every vLLM call checked on its own inputs, the hidden
    states within the reference's own rounding noise, the model's stages its own after."""
    model, fp32 = _tiny(torch.bfloat16, tp), _tiny(torch.float32, tp)
    requests = [model.add() for _ in range(2)]
    assert [fp32.add() for _ in range(2)] == requests
    ids = torch.randint(0, model.g.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    stock = VllmStock(model, kernels)
    assert stock.sources["experts"].startswith("vllm:fused_moe_kernel")
    assert stock.sources["kda"].startswith("vllm:causal_conv1d_update")
    assert stock.sources["mhc"].startswith("vllm:mhc_pre_mix_triton")
    assert stock.sources["mla"] == "torch"
    recorder = Recorder(kernels, monkeypatch)
    with torch.no_grad():
        model.forward(requests, ids[:, :5])  # the prefill: the reference's
        fp32.forward(requests, ids[:, :5])
        for tokens, verify in ((ids[:, 5:6], False), (ids[:, 6:9], True)):
            t = tokens.shape[1]
            saved = [c.clone() for c in _caches(model)]
            for c, s in zip(_caches(fp32), saved, strict=True):
                c.copy_(s)
            step = model.step(requests, t, verify=verify)
            want = model.backbone(tokens, step)
            noise = _worst_row(want, fp32.backbone(tokens, fp32.step(requests, t, verify)))
            for c, s in zip(_caches(model), saved, strict=True):
                c.copy_(s)
            recorder.step = step
            before = dict(recorder.calls)
            with stock:
                got = model.backbone(tokens, step)
            assert recorder.calls["kda"] - before["kda"] == tp  # one KDA layer a rank
            assert recorder.calls["experts"] - before["experts"] == 2 * tp  # two MoE layers
            assert recorder.calls["mhc"] - before["mhc"] == 4  # two pres a layer, once a step
            assert _worst_row(got, want) <= 2 * noise, (_worst_row(got, want), noise)
            for m in (model, fp32):  # the next step follows this one (backbone keeps no state)
                for r in requests:
                    m.lengths[r] += t
    assert not any(name in vars(rank) for rank in model.ranks for name in ("kda", "experts"))
    assert "_pre" not in vars(model)


def test_what_vllms_kernels_cannot_take_stays_the_reference(kernels):
    """Expert sizes that are not whole FP8 blocks (the tiny model's hidden 64): the experts
    stay the reference's, and `fallbacks` and `sources` say so."""
    model = ReferenceModel.random(geometry("tiny"), max_requests=1, max_context=16)
    stock = VllmStock(model, kernels)
    assert "multiples of 128" in stock.fallbacks["experts"]
    assert stock.sources["experts"] == "torch" and stock.sources["kda"].startswith("vllm:")
    with stock:
        assert "experts" not in vars(model.ranks[0]) and "kda" in vars(model.ranks[0])


def test_an_fp32_models_mhc_stays_the_reference(kernels):
    """vLLM's collapse takes BF16 streams only: an FP32 model's pre is the reference's, bit
    for bit, while the stock is entered; the stock's own is back off on exit."""
    model = ReferenceModel.random(geometry("tiny"), max_requests=1, max_context=16,
                                  dtype=torch.float32)  # fmt: skip
    streams = torch.randn(3, model.g.hc_mult, model.g.hidden_size)
    args = (streams, "layers.0.attn_hc", "layers.0.input_layernorm.weight")
    want = model._pre(*args)
    with VllmStock(model, kernels):
        assert "_pre" in vars(model)
        got = model._pre(*args)
    assert "_pre" not in vars(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
