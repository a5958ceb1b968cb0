"""Manifold-constrained hyper-connections (mHC), the executable spec.

The residual is H parallel streams [T, H, D]. Before each sublayer ("pre"):

    x̂       = streams.flatten(H*D) / sqrt(mean(streams², over H*D) + rms_eps)     (fp32, no weight)
    m       = x̂ @ fn.T                      split into  m_pre [H], m_post [H], m_comb [H, H]
    pre     = sigmoid(m_pre  * scale[0] + base[:H])   + hc_eps
    post    = 2 * sigmoid(m_post * scale[1] + base[H:2H])
    comb    = Sinkhorn(softmax_rows(m_comb * scale[2] + base[2H:]) + hc_eps)
    collapsed = sum_h pre[h] * streams[h]                                        (sublayer input)

Sinkhorn, exactly as transformers iterates it (the softmax already normalized rows, so it
starts with columns): c /= colsum + hc_eps; then (iters - 1) times: c /= rowsum + hc_eps,
c /= colsum + hc_eps. So comb's *columns* sum to 1 - O(hc_eps) exactly and its rows only to
the extent Sinkhorn has converged.

After the sublayer ("post"), with y its output:  streams'[i] = post[i] * y + sum_j comb[j, i] *
streams[j], i.e. post ⊗ y + combᵀ @ streams, in the model dtype (post, comb cast first).
The "boundary" between two sublayers is post, then the next pre, then the next RMSNorm.
"""

import torch
from torch import Tensor

from glm5_kernels.norm.reference import rms_norm_ref

__all__ = [
    "hc_expand_ref",
    "hc_fused_post_pre_ref",
    "hc_head_ref",
    "hc_mix_ref",
    "hc_post_ref",
    "hc_pre_ref",
]


def hc_mix_ref(
    streams: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """streams [T,H,D], fn [(2+H)H, HD], scale [3], base [(2+H)H] -> fp32 pre, post, comb.

    pre [T,H] (stream collapse), post [T,H] (output placement, in [0, 2]), comb [T,H,H] (mixer).
    """
    t, h, _ = streams.shape
    flat = streams.reshape(t, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    m_pre, m_post, m_comb = (flat @ fn.float().T).split([h, h, h * h], dim=-1)
    b_pre, b_post, b_comb = base.float().split([h, h, h * h])
    s_pre, s_post, s_comb = scale.float().unbind(0)

    pre = torch.sigmoid(m_pre * s_pre + b_pre) + hc_eps
    post = 2.0 * torch.sigmoid(m_post * s_post + b_post)
    comb = sinkhorn_ref(m_comb.view(t, h, h) * s_comb + b_comb.view(h, h), hc_eps, sinkhorn_iters)
    return pre, post, comb


def sinkhorn_ref(logits: Tensor, hc_eps: float, sinkhorn_iters: int) -> Tensor:
    """The mixer from its logits [T, H, H] (FP32): row softmax + hc_eps, then Sinkhorn in
    transformers' order (columns first, 2 * iters - 1 normalizations, eps in each)."""
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return comb


def hc_pre_ref(
    streams: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """streams [T,H,D] -> post [T,H] fp32, comb [T,H,H] fp32, collapsed [T,D] in streams.dtype."""
    pre, post, comb = hc_mix_ref(
        streams, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    # fp32 weights times model-dtype streams promotes to fp32: the sum over H runs in fp32.
    collapsed = (pre[..., None] * streams.float()).sum(1).to(streams.dtype)
    return post, comb, collapsed


def hc_post_ref(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """x [T,D], residual [T,H,D], post [T,H], comb [T,H,H] -> streams [T,H,D] in x.dtype."""
    # Deliberately in the model dtype with transformers' op order (cast post/comb, multiply,
    # matmul, add): this is the stock rounding a fused kernel is compared against.
    dtype = x.dtype
    return post.to(dtype)[..., None] * x[:, None, :] + comb.to(dtype).transpose(-1, -2) @ residual


def hc_fused_post_pre_ref(
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [T,D], residual [T,H,D], post, comb -> streams [T,H,D], post', comb' fp32, normed [T,D]."""
    streams = hc_post_ref(x, residual, post, comb)
    post2, comb2, collapsed = hc_pre_ref(
        streams, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    return streams, post2, comb2, rms_norm_ref(collapsed, norm_weight, norm_eps)


def hc_head_ref(streams: Tensor) -> Tensor:
    """streams [T,H,D] -> [T,D] streams.dtype; GLM-5.3-Flash's final collapse is a plain mean."""
    return streams.mean(1)


def hc_expand_ref(x: Tensor, H: int) -> Tensor:
    """x [T,D] -> [T,H,D] (contiguous copies): the embedding enters every stream."""
    return x[:, None, :].expand(-1, H, -1).contiguous()
