"""rms_norm_ref against transformers' Glm5NextTextRMSNorm (same random weight, fresh inputs)."""

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

from glm5_kernels.norm import rms_norm_ref

CASES = [
    pytest.param(t, d, dtype, id=f"T{t}-D{d}-{str(dtype)[6:]}")
    for t, d in [(1, 64), (3, 200), (17, 64), (2, 4096)]
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize(("t", "d", "dtype"), CASES)
def test_rms_norm_matches_transformers(t, d, dtype):
    gen = torch.Generator().manual_seed(1000 * t + d)
    norm = Glm5NextTextRMSNorm(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen))
    x = (3 * torch.randn(t, d, generator=gen)).to(dtype)
    got = rms_norm_ref(x, norm.weight, 1e-5)
    assert got.dtype == dtype
    # Same ops in the same order (fp32 reduce, cast, weight multiply): bit-identical.
    torch.testing.assert_close(got, norm(x), rtol=0, atol=0)


def test_rms_norm_rounds_before_the_weight_multiply():
    # The weight multiply runs in x.dtype: an fp32 weight over a BF16 activation promotes, but the
    # normalized activation itself is already rounded to BF16 (as transformers does).
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(64, generator=gen)
    got = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got / w, rms_norm_ref(x, torch.ones(64), 1e-5), rtol=1e-6, atol=0)
    unit = rms_norm_ref(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    torch.testing.assert_close(unit.float().square().mean(-1), torch.ones(5), rtol=1e-2, atol=0)
