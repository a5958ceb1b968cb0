"""The vLLM-kernel stock's mHC (`glm5_runtime.vllm_stock`): vLLM 0.33's Triton mHC kernels
(`vllm/model_executor/kernels/mhc/triton.py`, loaded from the folder of the wheel's files) for
what of the reference's mHC they compute, the reference's torch for the rest.

What vLLM 0.33 holds. Its Glm5Next decoder layer runs `MHCPreOp` (layer 0's attention site),
`MHCFusedPostPreOp` (every other boundary) and `MHCPostOp` (the last layer), then
`hc_contract` (the streams' mean) before the final norm. On CUDA those ops dispatch to
TileLang kernels (`mhc_pre_tilelang`, `mhc_fused_post_pre_tilelang`, `mhc_post_tilelang`: a
JIT compiler vLLM pulls in, not Triton, and not on a GPU host without vLLM). Its Triton file
holds no whole pre, post, boundary or head: `kernels/mhc/__init__.py`'s `__all__` names
`mhc_pre_triton`, `mhc_post_triton`, `mhc_fused_post_pre_triton` and `hc_head_fused_triton`,
but triton.py defines none of them. It defines the pieces of the delayed pre that vLLM runs
around AITER's kernels on ROCm (`_mhc_delayed_pre_tail`) and DeepSeek-V4.1's collapse on CUDA:

- `mhc_pre_mix_triton`: the pre gate sigmoid(Σ_k gemm[k] * rstd * scale[0] + base[:H]) +
  hc_eps, rstd = rsqrt(Σ_k sqrsum[k] / (H*D) + rms_eps), from the *unnormalized* mix GEMM
  (split-k partials) and the rows' square sums, in FP32;
- `hc_collapse_triton`: Σ_h pre[h] * streams[h], FP32 products and sums (no FMA), one
  rounding to BF16;
- `rmsnorm_nw` and `hc_head_reduce_triton_kernel` / `_hc_head_triton`: DeepSeek-V4's learned
  head (gates sigmoid(RMSNorm(x) @ hc_fn * scale + base) + eps, then the collapse).

What runs here, per pre (`mhc_pre`: `hc_pre_ref`'s contract, streams [T, H, D] BF16 ->
post [T, H], comb [T, H, H] FP32, collapsed [T, D] BF16), as vLLM composes it around AITER:
the mix GEMM x @ fn.T over the FP32 streams and their square sums in torch (AITER's
`mhc_pre_gemm_sqrsum` is a HIP kernel; one split), the pre gate by `mhc_pre_mix_triton`, the
post gate and comb (softmax, Sinkhorn) in torch from the same GEMM scaled by rstd, as
vLLM's `mhc_pre_torch` computes them (AITER's `mhc_pre_big_fuse` is HIP; vLLM ships no
Triton Sinkhorn; the same iteration as the reference's, so its `sinkhorn_ref`), the collapse by
`hc_collapse_triton`. The RMSNorm after it is the
reference's (the stock's "norms").

Stays the reference's torch, and why:
- post (`hc_post_ref`, and the post half of every boundary): vLLM 0.33 has no Triton post
  (TileLang on CUDA). Its numerics contract differs too: vLLM's (`mhc_post_torch`) is FP32
  math with one BF16 rounding, the reference's transformers' order in BF16 (post and comb
  cast to BF16, the product, the matmul and the sum each rounded).
- head (`hc_head_ref`, the streams' mean): that is vLLM's own Glm5Next `hc_contract`
  (`x.mean(dim=1)`), torch in vLLM too; vLLM's Triton head is DeepSeek-V4's gated head,
  whose weights GLM-5.3-Flash has not.
- a model whose streams are not BF16 (the collapse kernel takes BF16 only).

Numerics against the reference (tests/vllm_stock_checks.py `check_mhc_pre`): all FP32 but
the collapse's BF16 store, the same math in another association: vLLM scales the GEMM by
rstd where the reference normalizes the streams first (a few FP32 ulps in the logits), and
the gate kernel multiplies by 1 / (H*D) where the reference divides. The FP32 hc weights are
copied once (`hc_weights`): vLLM holds them in FP32, where the reference casts per call."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from glm5_kernels.mhc.reference import sinkhorn_ref

__all__ = ["NAMES", "SOURCE", "hc_weights", "mhc_pre"]

# triton.py's definitions that run: the pre gate kernel and its launch, the collapse's
# kernel (the head's reduce-store, shared) and its launch.
NAMES = ("_hc_head_reduce_store_kernel", "hc_collapse_triton", "_mhc_pre_mix_kernel",
         "mhc_pre_mix_triton")  # fmt: skip
SOURCE = (
    "vllm:mhc_pre_mix_triton (pre gate) + vllm:hc_collapse_triton (stream collapse); "
    "torch: the mix GEMM and square sums, post gate, comb softmax + Sinkhorn (vLLM: AITER / "
    "TileLang, no Triton), hc_post (no Triton post in vLLM 0.33; TileLang on CUDA), the head "
    "mean (vLLM's Glm5Next hc_contract is torch's mean too)"
)


def hc_weights(model) -> dict[str, Tensor]:
    """Every layer's hc fn / scale / base in FP32 (vLLM's parameters' dtype), by name."""
    out = {}
    for layer in range(model.g.num_hidden_layers):
        for site in ("attn_hc", "ffn_hc"):
            for part in ("fn", "scale", "base"):
                name = f"layers.{layer}.{site}.{part}"
                out[name] = model._w(name).float().contiguous()
    return out


def mhc_pre(
    mhc: SimpleNamespace, streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *,
    rms_eps: float, hc_eps: float, sinkhorn_iters: int, post_mult: float = 2.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`hc_pre_ref`'s contract on vLLM's Triton gate and collapse (the module docstring):
    streams [T, H, D] BF16, fn [(2+H)H, HD], scale [3], base [(2+H)H] FP32 -> post [T, H],
    comb [T, H, H] FP32, collapsed [T, D] BF16. `mhc`: VllmKernels.mhc."""
    t, h, d = streams.shape
    flat = streams.reshape(t, h * d).float()
    gemm = flat @ fn.T  # [T, (2+H)H], one split
    sqrsum = flat.square().sum(-1)
    pre = mhc.mhc_pre_mix_triton(gemm[None], sqrsum[None], scale, base, h, h * d, rms_eps,
                                 hc_eps)  # fmt: skip
    mixes = gemm * torch.rsqrt(sqrsum[:, None] / (h * d) + rms_eps)
    post = torch.sigmoid(mixes[:, h : 2 * h] * scale[1] + base[h : 2 * h]) * post_mult
    logits = mixes[:, 2 * h :].view(t, h, h) * scale[2] + base[2 * h :].view(h, h)
    comb = sinkhorn_ref(logits, hc_eps, sinkhorn_iters)
    return post, comb, mhc.hc_collapse_triton(streams, pre)
