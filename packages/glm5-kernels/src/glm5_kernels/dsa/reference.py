"""DSA indexer with k-pools (GLM-5.3-Flash), the executable spec of vLLM's stock numerics.

A pool is `kpool` consecutive tokens. Its key is a per-channel softmax-weighted sum of the
tokens' indexer keys, weighted by their gate scores plus a learned per-slot bias:
    p[s, d] = softmax_s(gate[s, d] + ape[s, d]);   pooled[d] = bf16(sum_s p[s, d] k[s, d])
Stored keys are Hadamard-rotated and FP8 with one power-of-two scale per 128-vector:
    y = bf16(H128 x / sqrt(128))
    scale = 2^ceil(log2(max(amax|y|, 1e-4) / 448));  q = e4m3(y / scale)
The rotation is orthonormal, so q.k survives it while spreading outliers over all channels
before the coarse FP8 rounding. Queries get the same per (token, head); a query scores a pool
    logit = sum_h w_h relu(q_h . k_p),   w_h = (x W_w^T)_h * q_scale_h * hd^-0.5 * H^-0.5
(`q_scale` folded into the head weight, as DeepGEMM's FP8 MQA logits expect).

The cache page of `S = block_size / kpool` pools is S*hd FP8 bytes of keys followed by S FP32
scales (not interleaved): [blocks, S, hd + 4] uint8 viewed per block as one row.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

FP8_MAX = 448.0


@functools.cache
def _hadamard(n: int, device: str) -> Tensor:
    """Sylvester H_n / sqrt(n) [n, n] FP32 (symmetric, natural order, H @ H = I)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


def rotate_quant_fp8_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] (D a power of two) -> (q [..., D] float8_e4m3fn, scale [...] fp32)."""
    y = (x.float() @ _hadamard(x.shape[-1], str(x.device))).to(torch.bfloat16).float()
    amax = y.abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (y / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def kpool_compress_ref(keys: Tensor, gates: Tensor, ape: Tensor) -> Tensor:
    """keys, gates [..., kpool, hd], ape [kpool, hd] -> pooled [..., hd] BF16."""
    p = torch.softmax(gates.float() + ape.float(), dim=-2)
    return (p * keys.float()).sum(-2).to(torch.bfloat16)


def pack_kpool_pages_ref(q: Tensor, scale: Tensor) -> Tensor:
    """q [B, S, hd] float8_e4m3fn, scale [B, S] fp32 -> pages [B, S, hd + 4] uint8."""
    b, s, hd = q.shape
    row = torch.cat(
        [q.view(torch.uint8).reshape(b, s * hd), scale.contiguous().view(torch.uint8)], 1
    )
    return row.view(b, s, hd + 4)


def unpack_kpool_pages_ref(pages: Tensor) -> tuple[Tensor, Tensor]:
    """pages [B, S, hd + 4] uint8 -> (q [B, S, hd] float8_e4m3fn, scale [B, S] fp32)."""
    b, s, width = pages.shape
    hd = width - 4
    row = pages.reshape(b, s * width)
    q = row[:, : s * hd].reshape(b, s, hd).view(torch.float8_e4m3fn)
    scale = row[:, s * hd :].contiguous().view(torch.float32)
    return q, scale


def index_logits_fp8_ref(
    q: Tensor, q_scale: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor
) -> Tensor:
    """q [..., H, hd] fp8, q_scale [..., H], weights [..., H] fp32 (x W_w^T),
    k [..., P, hd] fp8, k_scale [..., P] -> logits [..., P] fp32."""
    heads, hd = q.shape[-2:]
    w = weights.float() * q_scale * (hd**-0.5 * heads**-0.5)
    s = torch.einsum("...hd,...pd->...hp", q.float(), k.float()) * k_scale[..., None, :]
    return torch.einsum("...h,...hp->...p", w, torch.relu(s))
