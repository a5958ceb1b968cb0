"""Caches of the reference backbone, one set per TP rank, in vLLM 0.33's layouts.

KDA layers (addressed by state slot; slot 0 is vLLM's null slot):
  conv       [slots, W-2+q, conv_dim_local] BF16  raw q|k|v inputs (rank's channels): a W-1
                                              window at the accepted offset ("SD" layout)
  recurrent  [slots, heads_local, V, K]     FP32  delta-rule state (V before K, as vLLM)
MLA layers (paged by block table, slot = block * block_size + offset; block 0 is the null
block that takes writes vLLM skips):
  latent     [blocks, block_size, kv_lora]  BF16  normalized compressed KV (NoPE: no rope part)
  kpool      [blocks, block_size / kpool, hd + 4] uint8  vLLM's pages: per block S*hd FP8
                                              Hadamard-rotated pool keys, then S FP32 scales
             (indexer_numerics="hf": [blocks, block_size / kpool, hd] BF16, transformers'
             unrotated pool keys, for oracle checks)
  tail       [requests + 1, 2, ring, hd]    BF16  per request a ring of raw indexer key and
                                              gate score at pos % ring, ring = kpool *
                                              next_pow2(ceil((kpool + q - 1) / kpool)), so a
                                              pool still compresses after rejected drafts

KDA rollback is vLLM's: q recurrent slots per request (the state after each verified token;
accepting n resumes from slot n - 1) and one conv row of W-2+q columns in the request's first
slot, whose window starts at column n - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import Geometry


@dataclass
class RankCaches:
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    latent: dict[int, torch.Tensor] = field(default_factory=dict)
    tail: dict[int, torch.Tensor] = field(default_factory=dict)
    kpool: dict[int, torch.Tensor] = field(default_factory=dict)


def allocate(
    g: Geometry,
    *,
    num_slots: int,
    num_blocks: int,
    num_requests: int,
    block_size: int,
    device: torch.device | str,
    layers: list[int],
    mla_layers: set[int],
    dtype: torch.dtype = torch.bfloat16,
    q: int = 1,
    indexer_numerics: str = "vllm",
) -> RankCaches:
    """Zeroed caches of one rank for `layers` (ids; MTP layers count as MLA), with
    `num_blocks` paged blocks besides the null block 0 and a ring per request. `dtype`
    replaces BF16 (FP32 runs the whole reference at full precision for oracle checks)."""
    if indexer_numerics not in ("vllm", "hf"):
        raise ValueError(f"indexer_numerics={indexer_numerics!r}: expects 'vllm' or 'hf'")
    hd = g.index_head_dim
    if indexer_numerics == "vllm" and hd & (hd - 1):
        raise ValueError(f"index_head_dim={hd}: vLLM's Hadamard rotation needs a power of two")
    kp = g.index_kpool
    ring = kp * 2 ** math.ceil(math.log2(math.ceil((kp + q - 1) / kp)))
    if block_size % g.index_kpool:
        raise ValueError(
            f"block_size={block_size}: must be a multiple of index_kpool={g.index_kpool}"
        )
    tp = g.tp_size
    qkv = g.linear_num_heads * g.linear_head_dim // tp
    hk, kd, hd = g.linear_num_heads // tp, g.linear_head_dim, g.index_head_dim
    c = RankCaches()
    for layer in layers:
        if layer in mla_layers:
            c.latent[layer] = torch.zeros(
                1 + num_blocks, block_size, g.kv_lora_rank, dtype=dtype, device=device
            )
            c.tail[layer] = torch.zeros(num_requests + 1, 2, ring, hd, dtype=dtype, device=device)
            pools = block_size // g.index_kpool
            if indexer_numerics == "vllm":  # FP8 key bytes then FP32 scales per block
                c.kpool[layer] = torch.zeros(
                    1 + num_blocks, pools, hd + 4, dtype=torch.uint8, device=device
                )
            else:
                c.kpool[layer] = torch.zeros(1 + num_blocks, pools, hd, dtype=dtype, device=device)
        else:
            cols = g.linear_conv_kernel_dim - 2 + q
            c.conv[layer] = torch.zeros(num_slots, cols, 3 * qkv, dtype=dtype, device=device)
            c.recurrent[layer] = torch.zeros(
                num_slots, hk, kd, kd, dtype=torch.float32, device=device
            )
    return c
