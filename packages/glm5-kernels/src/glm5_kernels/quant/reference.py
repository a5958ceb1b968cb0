"""FP8 E4M3 weights with 128x128 block scales, the executable spec.

For each block b of w [..., N, K]:  scale_b = amax(|w_b|) / 448,  q_b = e4m3(w_b / scale_b),
and w ≈ q * scale (scale broadcast over its block). 448 is the largest finite e4m3fn value.
With ue8m0=True each scale is rounded UP to a power of two (DeepGEMM's UE8M0 scale format, an
8-bit exponent); rounding up keeps |w / scale| <= 448, so nothing saturates. All-zero blocks
get scale 1.

Error bound (derived in tests/glm5_kernels/test_quant_ref.py): per block, max|w - deq| / amax(|w_b|)
<= 1/28 with fp32 scales and <= 1/16 with UE8M0 scales (half an e4m3 ulp at the top binade).
"""

import torch
from torch import Tensor

__all__ = ["dequantize_fp8_block_ref", "pow2_ceil", "quantize_fp8_block_ref"]

FP8_MAX = 448.0


def _blocked(x: Tensor, block: int) -> Tensor:
    """[..., N, K] -> [..., nN, block, nK, block], zero-padded (zeros never change an amax)."""
    *lead, n, k = x.shape
    nn, nk = -(-n // block), -(-k // block)
    x = torch.nn.functional.pad(x, (0, nk * block - k, 0, nn * block - n))
    return x.reshape(*lead, nn, block, nk, block)


def pow2_ceil(s: Tensor) -> Tensor:
    """Positive s -> the smallest power of two >= s, elementwise (UE8M0 scales)."""
    # frexp is exact (s = m * 2^e, m in [0.5, 1)); log2/ceil can round a near-power-of-two down
    # and the resulting scale would push |w / scale| past 448.
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def quantize_fp8_block_ref(
    w: Tensor, block: int = 128, ue8m0: bool = False
) -> tuple[Tensor, Tensor]:
    """w [..., N, K] float -> q [..., N, K] float8_e4m3fn, scale [..., ⌈N/b⌉, ⌈K/b⌉] fp32."""
    *lead, n, k = w.shape
    wb = _blocked(w.float(), block)
    amax = wb.abs().amax(dim=(-3, -1))  # [..., nN, nK]
    # An all-zero block would get scale 0 and 0/0 = NaN; it gets scale 1 instead (a power of two,
    # as transformers' Fp8Quantize does). No floor on small non-zero amax (DeepGEMM clamps amax at
    # 1e-4): a floor would break the relative error bound for small-magnitude blocks.
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if ue8m0:
        scale = pow2_ceil(scale)
    # The clamp only guards against a fp32 division landing a hair above 448 (e4m3fn has no inf:
    # an overflowing cast would give NaN).
    qb = (wb / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = qb.reshape(*lead, wb.shape[-4] * block, wb.shape[-2] * block)[..., :n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def dequantize_fp8_block_ref(
    q: Tensor, scale: Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """q [..., N, K] fp8, scale [..., ceil(N/b), ceil(K/b)] fp32 -> w [..., N, K] in dtype."""
    n, k = q.shape[-2:]
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (q.float() * s[..., :n, :k]).to(dtype)
