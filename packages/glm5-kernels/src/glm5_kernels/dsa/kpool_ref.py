"""The indexer's pool write of a step, as the reference backbone and `KpoolWrite` define it.

Every token's raw key (after the key norm) and gate score go to its request's ring at
`pos % ring`. A token that completes a pool (`(pos + 1) % kpool == 0`) compresses the pool:
its members from this step come from the step's own rows, earlier ones from the ring (which
holds them: ring >= kpool + drafts, so a rejected draft never overwrites an accepted
member; a pool a rejected draft completed is rebuilt when an accepted token completes it).
The pooled key is Hadamard-rotated and cast to FP8 with a power-of-two scale
(`rotate_quant_fp8_ref`) into the pool's slot of vLLM's pages; so are the step's queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm5_kernels.dsa.reference import kpool_compress_ref, rotate_quant_fp8_ref


def index_keys_ref(k_sums: Tensor, gate_sums: Tensor, weight: Tensor, bias: Tensor,
                   eps: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The pool write's key and gate score [..., hd] BF16 from one projection's FP32 sums
    (`KpoolWrite(key_norm=...)`'s inputs): each rounded to BF16, as a BF16 GEMM outputs them,
    and the key LayerNormed in FP32 and rounded again, as vLLM's key norm does."""
    k = k_sums.to(torch.bfloat16).float()
    k = F.layer_norm(k, k.shape[-1:], weight.float(), bias.float(), eps).to(torch.bfloat16)
    return k, gate_sums.to(torch.bfloat16)


def pool_sources_ref(k: Tensor, gate: Tensor, tail: Tensor, positions: Tensor,
                     tail_rows: Tensor, kpool: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """k, gate [R, T, hd], tail [rows, 2, ring, hd], positions [R, T], tail_rows [R] (-1:
    a padding request, whose ring is left as it is) -> the members of each token's pool
    (keys, gate scores) [R, T, kpool, hd], read before this step's rows are written to the
    ring (the newest min(T, ring) of them)."""
    r, t = positions.shape
    ring = tail.shape[2]
    entries = torch.stack([k, gate], dim=2)  # [R, T, 2, hd]
    members = (positions // kpool)[..., None] * kpool + torch.arange(kpool, device=k.device)
    start = positions[:, :1, None]
    rows = torch.arange(r, device=k.device)[:, None, None]
    mine = entries[rows, (members - start).clamp(0, t - 1)]  # [R, T, kpool, 2, hd]
    own = tail_rows.long().clamp(min=0)  # a padding request reads row 0, writes it back
    kept = tail[own[:, None, None], :, members % ring]  # [R, T, kpool, 2, hd]
    source = torch.where((members >= start)[..., None, None], mine, kept.to(mine.dtype))
    last = min(t, ring)  # only the newest `ring` tokens of a long prefill stay
    at = (own[:, None], slice(None), positions[:, -last:] % ring)
    live = (tail_rows >= 0)[:, None, None, None]
    tail[at] = torch.where(live, entries[:, -last:].to(tail.dtype), tail[at])
    keys, scores = source.unbind(-2)
    return keys, scores


def kpool_write_ref(k: Tensor, gate: Tensor, q: Tensor, tail: Tensor, pages: Tensor,
                    ape: Tensor, block_table: Tensor, positions: Tensor, tail_rows: Tensor,
                    block_size: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """k, gate [R, T, hd] BF16, q [R, T, H, hd] BF16, tail [rows, 2, ring, hd] and pages
    [blocks, S, hd + 4] uint8 (both written in place), ape [kpool, hd], block_table [R, B],
    positions [R, T], tail_rows [R] (-1: a padding request: no ring or pool write) -> the
    rotated FP8 queries [R, T, H, hd] and their scales [R, T, H]. kpool = block_size / S."""
    blocks, s, width = pages.shape
    kpool = block_size // s
    keys, scores = pool_sources_ref(k, gate, tail, positions, tail_rows, kpool)
    fp8, scale = rotate_quant_fp8_ref(kpool_compress_ref(keys, scores, ape))  # every row's
    # Rows that complete no pool (and padding requests') write to the null block 0, where
    # vLLM skips the write (no data-dependent shapes: the reference runs inside CUDA graphs).
    done = ((positions + 1) % kpool == 0) & (tail_rows >= 0)[:, None]
    first = (positions + 1 - kpool).clamp(min=0)  # a completed pool's first token
    column = (first // block_size).clamp(max=block_table.shape[1] - 1)
    block = torch.where(done, block_table.long().gather(1, column.long()), 0)
    slot = torch.where(done, (first % block_size) // kpool, 0).long()
    flat = pages.view(blocks, s * width)
    hd = width - 4
    flat[:, : s * hd].view(blocks, s, hd)[block, slot] = fp8.view(torch.uint8)
    flat[:, s * hd :].view(torch.float32)[block, slot] = scale
    return rotate_quant_fp8_ref(q)
