"""Sparse MLA decode over the DSA-selected tokens (GLM-5.3-Flash's MLA layers), the spec of
`SparseMlaDecode`.

Absorbed MLA, NoPE: a query row's heads score the selected tokens' BF16 latents c [L] with
their absorbed query q_lat = W_uk^T q (BF16, as the attention kernel reads it), softmax with
the model's scale, attend in FP32 over the same latents, then the value-up per head
o_h = W_uv[h] (sum_w p_hw c_w) — exactly the reference backbone's MLA core, written over the
paged cache as vLLM lays it out: latents [blocks, block_size, L], a request's token t at
block_table[request, t // block_size], row t % block_size. Selected positions of -1 are
skipped; a row with none selected is zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sparse_mla_decode_ref"]


def sparse_mla_decode_ref(
    q_lat: Tensor,
    cache: Tensor,
    block_table: Tensor,
    request: Tensor,
    indices: Tensor,
    w_uv: Tensor,
    scale: float,
) -> Tensor:
    """q_lat [N, H, L] BF16 (query rows), cache [blocks, bs, L] BF16, block_table [R, B] int,
    request [N] (each row's request), indices [N, W] token positions (-1: none), w_uv
    [H, Vd, L] -> [N, H, Vd] BF16."""
    lat = q_lat.shape[2]
    bs = cache.shape[1]
    valid = indices >= 0
    pos = indices.clamp(min=0).long()
    blocks = block_table[request.long()[:, None], pos // bs].long()
    c = cache.reshape(-1, lat)[blocks * bs + pos % bs].float()  # [N, W, L]
    scores = torch.einsum("nhl,nwl->nhw", q_lat.float(), c) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no token selected: zero
    o = torch.einsum("nhw,nwl->nhl", p, c)
    return torch.einsum("nhl,hvl->nhv", o, w_uv.float()).to(q_lat.dtype)
