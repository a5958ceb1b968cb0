"""The executable spec of glm5-comm: each fused collective as torch.distributed + the
glm5-kernels references, on any backend (gloo on CPU, NCCL on GPUs) and any world size.

The one-shot all-reduce they all fuse: every rank's partial gathered, summed in FP32 in rank
order and rounded once to the partial's dtype, so every rank holds bit-identical rows (a
kernel reading its peers' mailboxes sums the same way). NCCL's ring rounds each partial sum
in BF16 instead; the difference is within one BF16 rounding per rank. World size 1 (or no
process group) is the math with no exchange.

An MoE layer's TP-partial output may come unfinalized (`MoeRows`: route rows, weights, the
shared expert's rows): the rank's part is then its FP32 weighted sum, never rounded before
the ranks' sum — the boundary weights and sums the rows in the same pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from glm5_kernels.mhc import MhcConfig, hc_fused_post_pre_ref, hc_head_ref, hc_post_ref
from glm5_kernels.moe import MoeRows
from glm5_kernels.norm import rms_norm_ref

__all__ = [
    "all_reduce_boundary_ref",
    "all_reduce_head_ref",
    "all_reduce_norm_ref",
    "all_reduce_ref",
    "embed_norm_ref",
    "logits_gather_ref",
    "moe_partial_ref",
]


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _gather(t: Tensor, group) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(_world(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def moe_partial_ref(rows: MoeRows) -> Tensor:
    """A rank's unfinalized MoE output -> its FP32 partial [M, D]: sum_j weights[:, j] *
    rows[route_row[:, j]] in route order (-1 rows contribute nothing), + the shared rows."""
    m = rows.route_row.shape[0]
    out = torch.zeros(m, rows.rows.shape[1], dtype=torch.float32, device=rows.rows.device)
    for j in range(rows.route_row.shape[1]):
        r = rows.route_row[:, j].long()
        out += rows.weights[:, j : j + 1] * (rows.rows[r.clamp(min=0)] * (r >= 0)[:, None])
    if rows.shared:
        out += rows.rows[:m]
    return out


def all_reduce_ref(partial: Tensor | MoeRows, group=None, dtype=torch.bfloat16) -> Tensor:
    """The ranks' partials [..., D] summed in FP32 in rank order, rounded once to `dtype`
    (a tensor partial: its own dtype)."""
    if isinstance(partial, MoeRows):
        partial = moe_partial_ref(partial)
    else:
        dtype = partial.dtype
    if _world(group) == 1:
        return partial.to(dtype)
    parts = _gather(partial, group)
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(dtype)


def all_reduce_boundary_ref(
    partial: Tensor | MoeRows,
    streams: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
    config: MhcConfig,
    group=None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sublayer's TP-partial output all-reduced, then the mHC boundary above it:
    (streams', post', comb', the next sublayer's normed input), as `hc_fused_post_pre_ref`."""
    x = all_reduce_ref(partial, group, streams.dtype)
    c = config
    return hc_fused_post_pre_ref(
        x, streams, post, comb, fn.float(), scale, base, norm_weight, rms_eps=c.rms_eps,
        hc_eps=c.hc_eps, sinkhorn_iters=c.sinkhorn_iters, norm_eps=c.norm_eps,
    )  # fmt: skip


def all_reduce_head_ref(
    partial: Tensor | MoeRows,
    streams: Tensor,
    post: Tensor,
    comb: Tensor,
    norm_weight: Tensor,
    config: MhcConfig,
    group=None,
) -> Tensor:
    """The last sublayer's partial all-reduced, its post, the streams' mean, the final norm."""
    x = all_reduce_ref(partial, group, streams.dtype)
    return rms_norm_ref(hc_head_ref(hc_post_ref(x, streams, post, comb)), norm_weight,
                        config.norm_eps)  # fmt: skip


def all_reduce_norm_ref(
    partial: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, group=None
) -> tuple[Tensor, Tensor]:
    """The MTP layer's boundaries (no mHC): the partial all-reduced and added to the
    residual (one rounding), then RMSNorm: (residual', normed)."""
    x = all_reduce_ref(partial, group)
    residual = (x.float() + residual.float()).to(residual.dtype)
    return residual, rms_norm_ref(residual, norm_weight, eps)


def embed_norm_ref(
    embed_partial: Tensor,
    positions: Tensor,
    hidden: Tensor,
    enorm_weight: Tensor,
    hnorm_weight: Tensor,
    eps: float,
    group=None,
) -> Tensor:
    """The MTP `eh_proj` input: the vocab-parallel embedding's partial rows (each token's row
    non-zero on the rank holding its id) all-reduced, zeroed at position 0, enorm'd, beside
    hnorm(hidden): [..., 2D]."""
    embedded = all_reduce_ref(embed_partial, group)
    embedded = embedded * (positions != 0)[..., None].to(embedded.dtype)
    e = rms_norm_ref(embedded, enorm_weight, eps)
    return torch.cat([e, rms_norm_ref(hidden, hnorm_weight, eps)], dim=-1)


def logits_gather_ref(shard: Tensor, group=None) -> Tensor:
    """Vocab-sharded logits [..., V/world] -> full rows [..., V], the ranks' slices in order."""
    if _world(group) == 1:
        return shard
    return torch.cat(_gather(shard, group), dim=-1)
