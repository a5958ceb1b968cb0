"""RMSNorm, the executable spec: y = weight * (x / sqrt(mean(x², -1) + eps)).

Transformers semantics (Glm5NextTextRMSNorm): the normalization runs in fp32, is cast back to
x.dtype *before* the weight multiply, so a BF16 model rounds twice (normalize, then scale).
"""

import torch
from torch import Tensor

__all__ = ["rms_norm_ref"]


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] any float, weight [D] -> [..., D] in promote(x.dtype, weight.dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    # Cast before the weight multiply: this is where transformers (and vLLM's RMSNorm) round.
    return weight * normed.to(x.dtype)
