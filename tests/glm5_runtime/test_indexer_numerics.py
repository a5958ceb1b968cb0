"""vLLM's indexer numerics in the reference (FP32 key norm, Hadamard + FP8 pool keys in
vLLM's page layout, FP8 queries) against transformers' (BF16 pool keys)."""

import torch
import torch.nn.functional as F

from glm5_kernels.dsa import kpool_compress_ref
from glm5_kernels.dsa.reference import _hadamard
from glm5_runtime.reference import ReferenceModel, geometry, random_state_dict
from glm5_runtime.reference.stages import _pages

G = geometry("tiny", index_head_dim=128)  # vLLM's Hadamard size


def models():
    sd = random_state_dict(G, seed=21)
    kw = dict(max_requests=1, max_context=96, block_size=16, dtype=torch.float32)
    return (
        ReferenceModel.from_state_dict(G, sd, indexer_numerics="vllm", **kw),
        ReferenceModel.from_state_dict(G, sd, indexer_numerics="hf", **kw),
    )


def indexer_inputs(model, layer, T, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, G.hidden_size, generator=gen)
    q_resid = torch.randn(1, T, G.q_lora_rank, generator=gen)
    r = model.add()
    return x, q_resid, model.step([r], T)


def test_pool_pages_hold_the_rotated_fp8_pool_keys():
    vllm, _ = models()
    layer = G.mla_layers[0]
    x, q_resid, step = indexer_inputs(vllm, layer, 37, 0)
    rank = vllm.ranks[0]
    n = f"layers.{layer}.self_attn.indexer"
    rank.indexer(layer, x, q_resid, step)
    # The keys and gate scores the indexer pools, computed here from the weights.
    k = F.layer_norm(
        F.linear(x, rank.w[f"{n}.wk.weight"]),
        (128,),
        rank.w[f"{n}.k_norm.weight"],
        rank.w[f"{n}.k_norm.bias"],
        1e-6,
    )[0]
    gate = F.linear(x, rank.w[f"{n}.index_kpool_compress_gate"])[0]
    keys, scales = _pages(rank.c.kpool[layer])
    kp, per_block = G.index_kpool, rank.c.kpool[layer].shape[1]
    for pool in range(37 // kp):  # every complete pool
        span = slice(pool * kp, (pool + 1) * kp)
        want = kpool_compress_ref(k[span], gate[span], rank.w[f"{n}.index_kpool_compress_ape"])
        want = want.double() @ _hadamard(128, "cpu").double()
        block, at = divmod(int(step.slots[0, pool * kp]) // kp, per_block)
        got = keys[block, at].view(torch.float8_e4m3fn).double() * scales[block, at]
        # FP8 in the top binade (1/14 of the amax) plus the BF16 rounding of the rotation.
        assert (got - want).abs().max() <= want.abs().max() * (1 / 14 + 2**-8)
    # The incomplete pool (token 36 onwards) has not been written: its scale is still zero.
    block, at = divmod(int(step.slots[0, 36]) // kp, per_block)
    assert scales[block, at] == 0


def test_vllm_numerics_select_the_pools_transformers_numerics_select():
    vllm, hf = models()
    layer = G.mla_layers[0]
    agree = total = 0
    for seed in range(4):
        picks = []
        for model in (vllm, hf):
            x, q_resid, step = indexer_inputs(model, layer, 60, seed)
            picks.append(model.ranks[0].indexer(layer, x, q_resid, step))
            model.release(0)
        rows_a, rows_b = (p[0].sort(-1).values for p in picks)
        agree += (rows_a == rows_b).all(-1).sum().item()
        total += rows_a.shape[0]
    # FP8 keys flip only near-ties between pools: nearly every query picks the same set.
    print(f"same selection on {agree}/{total} queries")
    assert agree / total > 0.9, agree / total
