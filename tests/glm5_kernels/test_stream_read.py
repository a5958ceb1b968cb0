"""The streaming read the HBM bandwidth is measured with (`glm5_kernels.stream_read`): its
partial sums add up to the tensor's sum, at sizes off the block grid, into a poisoned buffer
of which only its own partials are written."""

import math

import pytest
import torch

from glm5_kernels.stream_read import stream_sum


@pytest.mark.parametrize(
    "n, programs, block", [(1, 4, 16), (1000, 4, 64), (4099, 7, 128), (65536, 16, 1024)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partials_add_up_to_the_sum(n, programs, block, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    out = torch.full((programs + 3,), float("nan"))
    parts = stream_sum(x, programs, block, out=out)
    assert 1 <= parts.numel() <= programs and torch.isnan(out[parts.numel() :]).all()
    want = x.double().sum()
    # FP32 accumulation of n terms of |x| <= max|x|: n * eps32 * sum|x| bounds the error.
    bound = n * 2**-24 * x.double().abs().sum() + 1e-30
    assert abs(parts.double().sum() - want) <= bound
    assert math.isfinite(parts.sum().item())


def test_a_strided_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        stream_sum(torch.randn(8, 8).t(), 2, 16)
