"""The indexer's selection, as the reference backbone and `IndexerTopk` both define it.

Each query row scores every pool of its request's block table (`index_logits_fp8_ref` on
vLLM's pages); pools that end after the row's position are invisible. The top `count =
min(index_topk / kpool, pools in the table)` pools by (score descending, pool index
ascending: a stable order, so ties go to the earlier pool) are selected, then laid out in
ascending pool order, each as its `kpool` token positions; a pick beyond the visible pools
(a context shorter than top-k) is -1 tokens. With `tail`, the request's incomplete last
pool's tokens (always selected; -1 past the position) follow, then -1 up to `width`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.dsa.reference import index_logits_fp8_ref, unpack_kpool_pages_ref


def select_tokens_ref(scores: Tensor, positions: Tensor, topk: int, kpool: int, tail: bool,
                      width: int) -> Tensor:  # fmt: skip
    """scores [..., P] FP32 of every pool in block-table order, positions [...] -> token
    positions [..., width] int64 (-1: none)."""
    pools = scores.shape[-1]
    ends = (torch.arange(pools, device=scores.device) + 1) * kpool - 1
    visible = ends <= positions[..., None]
    count = min(topk // kpool, pools)
    masked = scores.float().masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    chosen = order[..., :count].sort(dim=-1).values  # the set, in pool order
    ok = visible.gather(-1, chosen)
    tokens = chosen[..., None] * kpool + torch.arange(kpool, device=scores.device)
    tokens = tokens.masked_fill(~ok[..., None], -1).flatten(-2)
    if tail and kpool > 1:
        offsets = torch.arange(kpool - 1, device=scores.device)
        filled = (positions + 1) % kpool
        last = (positions + 1 - filled)[..., None] + offsets
        tokens = torch.cat([tokens, last.masked_fill(offsets >= filled[..., None], -1)], -1)
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[-1]), value=-1)


def index_topk_ref(q: Tensor, q_scale: Tensor, weights: Tensor, pages: Tensor,
                   block_table: Tensor, request: Tensor, positions: Tensor, *, topk: int,
                   kpool: int, tail: bool, width: int) -> Tensor:  # fmt: skip
    """q [N, H, hd] float8_e4m3fn (rotated), q_scale / weights [N, H] FP32, pages [blocks,
    S, hd + 4] uint8, block_table [R, B], request [N], positions [N] -> [N, width] int64."""
    keys, scales = unpack_kpool_pages_ref(pages)
    rows = block_table[request.long()].long()  # [N, B]
    n, hd = q.shape[0], q.shape[-1]
    pool_keys = keys[rows].reshape(n, -1, hd)
    pool_scales = scales[rows].reshape(n, -1)
    scores = index_logits_fp8_ref(q, q_scale, weights, pool_keys, pool_scales)
    return select_tokens_ref(scores, positions.long(), topk, kpool, tail, width)
