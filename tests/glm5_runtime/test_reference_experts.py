"""The reference backbone's two capturable MoE expert paths (one gather of each token's k
experts, or every expert once on all tokens) against glm5-kernels' `experts_ref`: BF16
activations and dequantized BF16 weights, like vLLM's BF16-dequantized FP8 experts."""

import pytest
import torch

from glm5_kernels.moe import experts_ref
from glm5_kernels.quant import quantize_fp8_block_ref
from glm5_runtime.reference.stages import _experts_by_slot, _experts_dense


@pytest.mark.parametrize("tokens, experts, k", [(1, 16, 16), (3, 8, 2), (37, 16, 4)])
def test_capturable_expert_paths_match_the_reference(tokens, experts, k):
    gen = torch.Generator().manual_seed(tokens * experts + k)
    d, inter = 256, 128 + 64  # I off the 128 grid: partial scale blocks
    x = torch.randn(tokens, d, generator=gen).bfloat16()
    w13, s13 = quantize_fp8_block_ref(torch.randn(experts, 2 * inter, d, generator=gen) / 16)
    w2, s2 = quantize_fp8_block_ref(torch.randn(experts, d, inter, generator=gen) / 16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    limit = 1.5
    want = experts_ref(x, w13, w2, ids, weights, limit, s13, s2)
    for path in (_experts_by_slot, _experts_dense):
        out = path(x, w13, w2, ids, weights, limit, s13, s2)
        assert out.dtype == torch.float32 and out.shape == want.shape
        # BF16 activations, weights and intermediate against FP32: ~2^-8 relative (4e-3).
        err = ((out - want).norm() / want.norm()).item()
        assert err < 1e-2, (path.__name__, err)
    # The two capturable paths differ only in matmul grouping (FP32 accumulation order).
    by_slot = _experts_by_slot(x, w13, w2, ids, weights, limit, s13, s2)
    dense = _experts_dense(x, w13, w2, ids, weights, limit, s13, s2)
    assert ((dense - by_slot).norm() / by_slot.norm()).item() < 1e-5
