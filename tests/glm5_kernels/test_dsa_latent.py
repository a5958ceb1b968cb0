"""The MLA layer's input norms and latent write (`LatentWrite`) on CPU (Triton interpreted):
against `latent_write_ref` (torch's RMSNorms), rows at the real and off-grid widths, q_a |
kv_a as columns of the fused projection's wider rows, scattered slots, NaN-poisoned outputs
and untouched latent rows; one error naming every problem with a call."""

import os

import pytest
import torch

from glm5_kernels.dsa import LatentWrite, latent_write_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel's sum of squares and root differ from torch's in FP32's last bits, which
    can carry the normed value across a BF16 rounding boundary (1 ulp, 2^-8 relative), and
    the weight multiply rounds again: at most 2 ulps anywhere, at most 1 % of values off."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    assert (err <= 2 * 2**-8 * want.abs() + 1e-30).all(), err.max().item()
    assert (err > 0).float().mean().item() <= 0.01


def _case(n, q, ld, gen, extra=5):
    x = torch.randn(n, q + ld + extra, generator=gen).bfloat16() * 3  # q_a | kv_a | more
    q_norm = (1 + 0.1 * torch.randn(q, generator=gen)).bfloat16()
    kv_norm = (1 + 0.1 * torch.randn(ld, generator=gen)).bfloat16()
    return x, q_norm, kv_norm


@pytest.mark.parametrize("n, q, ld", [(1, 1536, 512), (5, 1536, 512), (3, 48, 32), (2, 100, 72)])
def test_matches_the_reference(n, q, ld):
    gen = torch.Generator().manual_seed(n * q + ld)
    x, q_norm, kv_norm = _case(n, q, ld, gen)
    # The slots as a column of a wider tensor (a draft step's are a column of its verify's).
    slots = torch.randperm(4 * n + 3, generator=gen)[: 2 * n].view(n, 2)[:, 1]
    latent = torch.full((4 * n + 3, ld), float("nan")).bfloat16()
    want_latent = latent.clone()
    want = latent_write_ref(x[:, :q], x[:, q : q + ld], q_norm, kv_norm, 1e-5, want_latent,
                            slots)  # fmt: skip
    op = LatentWrite(q_norm, kv_norm, 1e-5, max_rows=8)
    got = op(x[:, :q], x[:, q : q + ld], latent, slots)
    assert got.shape == (n, q) and not got.isnan().any()
    assert_bf16_close(got, want)
    assert_bf16_close(latent[slots], want_latent[slots])
    others = torch.ones(latent.shape[0], dtype=torch.bool)
    others[slots] = False
    assert latent[others].isnan().all()  # no slot but the rows' written


def test_padding_rows_write_nothing():
    """vLLM pads a step's rows with slot -1: their query rows are normed, no cache row is
    written (the last one least of all, where -1 would land)."""
    gen = torch.Generator().manual_seed(3)
    n, q, ld = 4, 48, 32
    x, q_norm, kv_norm = _case(n, q, ld, gen)
    slots = torch.tensor([5, -1, 2, -1])
    latent = torch.full((7, ld), float("nan")).bfloat16()
    want_latent = latent.clone()
    want = latent_write_ref(x[:, :q], x[:, q : q + ld], q_norm, kv_norm, 1e-5, want_latent,
                            slots)  # fmt: skip
    got = LatentWrite(q_norm, kv_norm, 1e-5, max_rows=8)(x[:, :q], x[:, q : q + ld], latent,
                                                         slots)  # fmt: skip
    assert_bf16_close(got, want)
    assert_bf16_close(latent[[5, 2]], want_latent[[5, 2]])
    assert latent[[0, 1, 3, 4, 6]].isnan().all() and want_latent[[0, 1, 3, 4, 6]].isnan().all()


def test_the_reference_is_the_models_rmsnorm():
    """The contract against torch's own RMSNorm module as transformers builds it (FP32
    variance, the normed row in the input dtype, then the weight)."""
    gen = torch.Generator().manual_seed(1)
    x, q_norm, kv_norm = _case(3, 48, 32, gen)
    latent = torch.zeros(4, 32).bfloat16()
    got = latent_write_ref(x[:, :48], x[:, 48:80], q_norm, kv_norm, 1e-5, latent,
                           torch.tensor([3, 0, 2]))  # fmt: skip

    def rms(h, w):
        v = h.float().pow(2).mean(-1, keepdim=True)
        return w * (h.float() * torch.rsqrt(v + 1e-5)).to(h.dtype)

    assert torch.equal(got, rms(x[:, :48], q_norm))
    assert torch.equal(latent[[3, 0, 2]], rms(x[:, 48:80], kv_norm))
    assert torch.equal(latent[1], torch.zeros(32).bfloat16())


def test_bad_calls_name_every_problem():
    op = LatentWrite(torch.ones(48).bfloat16(), torch.ones(32).bfloat16(), 1e-5, max_rows=2)
    x = torch.zeros(3, 80).bfloat16()
    with pytest.raises(ValueError) as e:
        op(x[:, :48], x[:, 48:80].clone(), torch.zeros(4, 16), torch.zeros(3, dtype=torch.int32))
    msg = str(e.value)
    for part in ("3 rows: this op takes 1..2", "the columns right after q_a's",
                 "latent: torch.float32", "latent (4, 16)", "slots: torch.int32"):  # fmt: skip
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=r"q_norm: torch\.float32"):
        LatentWrite(torch.ones(48), torch.ones(32).bfloat16(), 1e-5)
